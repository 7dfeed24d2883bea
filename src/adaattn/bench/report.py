"""What a run leaves behind: the printed tables, the JSON record and the plot."""

from __future__ import annotations

import datetime
import json
import platform
import re
from pathlib import Path

import torch

from ..version import __version__, git_commit
from ..hardware import triton_version


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def environment(device: torch.device) -> dict:
    env = {
        "device_type": device.type,
        "device_name": device_name(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "cuda": torch.version.cuda,
        "adaattn": __version__,
        "git_commit": git_commit(),
    }
    if device.type == "cuda":
        env["gpu_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    return env


def start(device: torch.device, commit: str | None, what: str, timing_method: str) -> tuple[dict, datetime.datetime]:
    """The environment of a run (with `commit` where given) and its start time; prints the header line."""
    env = environment(device)
    if commit:
        env["git_commit"] = commit
    print(f"{what} on {env['device_name']}: torch {env['torch']}, triton {env['triton']}, "
          f"commit {(env['git_commit'] or 'unknown')[:12]}; timing: {timing_method}", flush=True)
    return env, datetime.datetime.now(datetime.timezone.utc)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(rows: list[dict], backward: bool = False) -> str:
    """One line per (shape, backend); 'x torch' is torch's time over this row's (>1: faster)."""
    what = "fwd+bwd" if backward else "fwd"
    head = (f"{'dtype':<8} {'B':>2} {'H':>3} {'Hkv':>3} {'D':>4} {'N':>6} {'causal':<6} "
            f"{'backend':<15} {'ms (' + what + ')':>13} {'TFLOP/s':>8} {'x torch':>7} {'rel err':>8} {'MiB':>8}  note")
    lines = [head, "-" * len(head)]
    torch_ms = {}
    for r in rows:
        if r["backend"] == "torch" and r["ms"] is not None:
            torch_ms[_shape_key(r)] = r["ms"]
    prev = None
    for r in rows:
        key = _shape_key(r)
        if prev is not None and key != prev:
            lines.append("")
        prev = key
        peer = torch_ms.get(key)
        ratio = None if peer is None or r["ms"] is None else peer / r["ms"]
        note = []
        if r.get("layer") is not None:
            note.append(f"{r.get('workload', '')} layer {r['layer']}".strip())
        if r.get("picked"):
            note.append(f"picked {r['picked']}")
        if r.get("error_within_2x_torch") is False:
            note.append("error above 2x torch's")
        if r.get("error"):
            note.append(r["error"][:90])
        lines.append(
            f"{r['dtype']:<8} {r['batch']:>2} {r['heads']:>3} {r['kv_heads']:>3} {r['head_dim']:>4} "
            f"{r['seq_len']:>6} {'yes' if r['causal'] else 'no':<6} {r['backend']:<15} "
            f"{_num(r['ms'], '.4f'):>13} {_num(r['tflops'], '.2f'):>8} {_num(ratio, '.2f'):>7} "
            f"{_num(r['rel_error'], '.1e'):>8} {_num(r['peak_mib'], '.1f'):>8}  {'; '.join(note)}"
        )
    return "\n".join(lines)


def format_overhead(rows: list[dict]) -> str:
    """Per-call µs of adaattn, the picked backend's run, SDPA pinned to that kernel and plain SDPA."""
    head = (f"{'shape':<31} {'picked':<11} {'adaattn':>8} {'run':>8} {'same-k':>8} {'sdpa':>8} "
            f"{'overhead vs same kernel':>24} {'vs plain sdpa':>19}")
    lines = [
        "dispatch overhead: wall us per call, median of interleaved loops (adaattn = adaattn.attention; "
        "run = picked backend's run called directly;",
        "same-k = SDPA inside sdpa_kernel(picked kernel) entered once, or the baseline named; sdpa = plain SDPA)",
        head, "-" * len(head),
    ]
    for r in rows:
        label = (f"B={r['batch']} H={r['heads']} N={r['seq_len']} D={r['head_dim']} {r['dtype']}"
                 f"{' causal' if r['causal'] else ''}")
        if r.get("error"):
            lines.append(f"{label:<31} {str(r.get('picked')):<11} error: {r['error'][:100]}")
            continue
        us = r["per_call_us"]
        same = us.get("sdpa same kernel", us[r["baseline"]])
        lines.append(
            f"{label:<31} {r['picked']:<11} {us['adaattn']:>8.1f} {us['backend.run']:>8.1f} {same:>8.1f} "
            f"{us['sdpa']:>8.1f} {r['overhead_us']:>+11.1f} us {r['overhead_pct']:>+7.1f}% "
            f"{r['vs_plain_sdpa_us']:>+7.1f} us {r['vs_plain_sdpa_pct']:>+6.1f}%"
        )
    return "\n".join(lines)


def _shape_key(r: dict) -> tuple:
    return (r["dtype"], r["batch"], r["heads"], r["kv_heads"], r["head_dim"], r["seq_len"], r["causal"],
            r.get("layer"))


def output_stem(env: dict, when: datetime.datetime) -> str:
    return f"bench-{when.strftime('%Y%m%d-%H%M%S')}-{slug(env['device_name'])}"


def write_json(path: Path, record: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def write_plot(path: Path, rows: list[dict], title: str) -> Path | None:
    """Time and peak memory against N, one line per backend, one row of panels per config.

    Returns None (after a note on stderr) where matplotlib does not import.
    """
    from .plot import pyplot, save_figure, size_ticks

    plt = pyplot()
    if plt is None:
        return None
    configs: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["dtype"], r["batch"], r["heads"], r["kv_heads"], r["head_dim"], r["causal"], r.get("layer"))
        configs.setdefault(key, []).append(r)
    with_memory = any(r["peak_mib"] is not None for r in rows)
    ncols = 2 if with_memory else 1
    fig, axes = plt.subplots(len(configs), ncols, figsize=(6 * ncols, 3.6 * len(configs)), squeeze=False)
    for ax_row, ((dtype, b, h, hkv, d, causal, layer), group) in zip(axes, configs.items()):
        label = f"{dtype} B={b} H={h}{'/' + str(hkv) if hkv != h else ''} D={d}{' causal' if causal else ''}"
        if layer is not None:
            label += f" {group[0].get('workload', '')} layer {layer}"
        backends = list(dict.fromkeys(r["backend"] for r in group))
        for name in backends:
            pts = sorted((r["seq_len"], r["ms"], r["peak_mib"]) for r in group if r["backend"] == name and r["ms"] is not None)
            if not pts:
                continue
            ax_row[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            if with_memory:
                ax_row[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=name)
        ax_row[0].set_title(f"time, {label}", fontsize=9)
        ax_row[0].set_ylabel("ms (median)")
        if with_memory:
            ax_row[1].set_title(f"peak memory above inputs, {label}", fontsize=9)
            ax_row[1].set_ylabel("MiB")
        for ax in ax_row:
            size_ticks(ax, sorted({r["seq_len"] for r in group}))
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    return save_figure(plt, fig, path, title)

