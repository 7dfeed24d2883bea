"""What the machine can do: versions, devices and their tensor-core precisions. Cached."""

from __future__ import annotations

import functools
import platform
from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    memory_gib: float
    shared_memory_per_block_kib: float | None
    tensor_core_precisions: tuple[str, ...]

    @property
    def arch(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True)
class Hardware:
    python: str
    torch: str
    triton: str | None
    cuda: str | None
    cudnn: int | None
    cpu: str
    cpu_threads: int
    devices: tuple[Device, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        d = asdict(self)
        for dev, src in zip(d["devices"], self.devices):
            dev["arch"] = src.arch
        return d


def tensor_core_precisions(capability: tuple[int, int]) -> tuple[str, ...]:
    """Matrix precisions the tensor cores of an NVIDIA GPU of this compute capability run."""
    major, minor = capability
    out: list[str] = []
    if major >= 7:
        out.append("fp16")
    if (major, minor) >= (7, 5):
        out.append("int8")
    if major >= 8:
        out[:0] = ["bf16", "tf32"]
    if (major, minor) >= (8, 9):
        out.append("fp8")
    return tuple(out)


def triton_version() -> str | None:
    try:
        import triton
    except Exception:
        return None
    return str(triton.__version__)


@functools.lru_cache(maxsize=1)
def detect() -> Hardware:
    """Detect once per process; later calls return the cached result."""
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cap = (p.major, p.minor)
            smem = getattr(p, "shared_memory_per_block_optin", None)
            devices.append(
                Device(
                    index=i,
                    name=p.name,
                    capability=cap,
                    sm_count=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1),
                    shared_memory_per_block_kib=None if smem is None else smem / 1024,
                    tensor_core_precisions=tensor_core_precisions(cap),
                )
            )
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Hardware(
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton_version(),
        cuda=torch.version.cuda,
        cudnn=cudnn,
        cpu=platform.processor() or platform.machine(),
        cpu_threads=torch.get_num_threads(),
        devices=tuple(devices),
    )


_devices: dict[int, Device] = {}


def device(index: int | None) -> Device | None:
    """The CUDA device with this index (None: the current one), or None without CUDA."""
    i = torch.cuda.current_device() if index is None else index
    dev = _devices.get(i)
    if dev is None:
        hw = detect()
        if i >= len(hw.devices):
            return None
        dev = _devices[i] = hw.devices[i]
    return dev


def _constant(fn):
    """torch.compiler.assume_constant_result without importing torch._dynamo (half a second of
    `import adaattn`): the decorator only sets this attribute. torch.compile calls such a function
    once while tracing and bakes the answer in, instead of tracing device queries."""
    fn._dynamo_marked_constant = True
    return fn


@_constant
def capability(index: int | None) -> tuple[int, int]:
    """Compute capability of a CUDA device, (0, 0) where there is none."""
    dev = device(index)
    return (0, 0) if dev is None else dev.capability


@_constant
def capability_at_least(index: int | None, major: int, minor: int = 0) -> bool:
    """Whether a CUDA device's compute capability is (major, minor) or newer. The comparison
    happens here, evaluated once under torch.compile (torch 2.11's dynamo fails on `>=`
    between traced tuples)."""
    return capability(index) >= (major, minor)


@_constant
def arch(device_type: str, index: int | None) -> str:
    """A short name for the device family dispatch keys on: "cpu", "sm80", "sm90", ..."""
    if device_type != "cuda":
        return device_type
    major, minor = capability(index)
    return f"sm{major}{minor}" if major else "cuda"


def max_shared_memory(index: int | None) -> int:
    """Shared memory one program (thread block) may use on this CUDA device, in bytes."""
    dev = device(index)
    if dev is None or dev.shared_memory_per_block_kib is None:
        return 48 * 1024
    return int(dev.shared_memory_per_block_kib * 1024)


_warp_specialisation: list[bool] = []
_gluon: list[bool] = []


@_constant  # called while torch.compile plans a call: evaluated, not traced (it imports triton)
def warp_specialisation_available() -> bool:
    """Triton accepts tl.range(..., warp_specialize=...) (3.6 and newer); imports triton."""
    if not _warp_specialisation:
        try:
            import inspect

            import triton.language as tl

            _warp_specialisation.append("warp_specialize" in inspect.signature(tl.range.__init__).parameters)
        except Exception:
            _warp_specialisation.append(False)
    return _warp_specialisation[0]


@_constant
def gluon_available() -> bool:
    """Triton's Gluon with Hopper wgmma, TMA and warp_specialize over (function, args) pairs
    (triton 3.6 and newer); imports triton."""
    if not _gluon:
        try:
            import inspect

            from triton.experimental.gluon import language as gl
            from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

            _gluon.append("functions_and_args" in inspect.signature(gl.warp_specialize).parameters)
        except Exception:
            _gluon.append(False)
    return _gluon[0]


def format_report(rep: dict) -> str:
    lines = [
        f"python {rep['python']}, torch {rep['torch']}, triton {rep['triton'] or 'not installed'}, "
        f"CUDA {rep['cuda'] or 'none'}, cuDNN {rep['cudnn'] or 'none'}",
        f"cpu: {rep['cpu']}, {rep['cpu_threads']} torch threads",
    ]
    if not rep["devices"]:
        lines.append("GPUs: none")
    for d in rep["devices"]:
        smem = d["shared_memory_per_block_kib"]
        lines.append(
            f"GPU {d['index']}: {d['name']}, compute capability {d['capability'][0]}.{d['capability'][1]} "
            f"({d['arch']}), {d['sm_count']} SMs, {d['memory_gib']} GiB"
            + (f", {smem:.0f} KiB shared memory per block" if smem else "")
        )
        lines.append(f"  tensor-core precisions: {', '.join(d['tensor_core_precisions']) or 'none'}")
    for where, table in rep["backends"].items():
        lines.append(f"backends for {where} (probe: B=1 H=8 N=1024 D=128):")
        for name, why in table.items():
            lines.append(f"  {name:<16} {'available' if not why else 'no: ' + ' '.join(why)}")
    return "\n".join(lines)
