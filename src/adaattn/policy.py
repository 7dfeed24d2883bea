"""Policy: what the caller allows adaattn to do."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("exact", "auto")
# Names of the registered runners (the planner adds each one it registers), for checking
# Policy.backends: a name is known when it is a runner's or a prefix of one ("sdpa", "triton").
known_runners: set[str] = set()
PRECISIONS = ("native", "int8", "fp8")
APPROXIMATIONS = ("lowrank", "skip")


def mode_defaults(mode: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(precisions, approximations) a Policy of `mode` allows where it names neither: under
    "auto" every one the library has, under "exact" none. The CLI's defaults are these too."""
    return (PRECISIONS, APPROXIMATIONS) if mode == "auto" else (("native",), ())


@dataclass(frozen=True)
class Policy:
    """What a call may do beyond exact attention.

    mode:           "exact" (default) computes exact attention on the fastest exact backend;
                    "auto" allows the precisions and approximations listed, per head, under
                    `tolerance`. Policy(mode="auto") naming neither list allows every precision
                    and approximation the library has (mode_defaults); naming one or both allows
                    exactly those listed ("native" and no approximation where a list is not named).
                    The planner declines what does not pay.
    tolerance:      largest relative L2 error of one head's output, ||o - o_exact|| / ||o_exact||,
                    in (0, 1).
    precisions:     matrix precisions allowed: "native" (the input dtype), "int8" (the qk8 level:
                    INT8 Q.K^T), "fp8" (the fp8 level: FP8 P.V as well). Under mode="auto" the
                    exact level is always the fallback for heads that cannot meet `tolerance`.
    approximations: tile approximations allowed: "lowrank", "skip".
    verify:         fraction of calls in [0, 1] on which sampled exact rows check the error.
    backends:       restrict dispatch to these runner names; a prefix such as "sdpa" admits
                    every "sdpa.*" runner. None admits all. Approximate runners (triton.quant*)
                    run only under mode="auto", whatever this names.
    deterministic:  ask for bitwise-reproducible forward and backward.
    train_quantized: with mode="auto" and inputs that require grad, run the quantized forward
                    (its output is what the loss sees) with an exact backward; by default such
                    calls run exact.

    Raises ValueError/TypeError on construction for values outside those listed.
    """

    mode: str = "exact"
    tolerance: float = 1e-2
    precisions: tuple[str, ...] | None = None  # None: mode_defaults(mode) (see the docstring)
    approximations: tuple[str, ...] | None = None
    verify: float = 0.05
    backends: tuple[str, ...] | None = None
    deterministic: bool = False
    train_quantized: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Policy.mode must be one of {MODES}, got {self.mode!r}")
        tol = self.tolerance
        if isinstance(tol, bool) or not isinstance(tol, (int, float)):
            raise TypeError(f"Policy.tolerance must be a float, got {type(tol).__name__}")
        if not 0 < tol < 1:  # (NaN fails too)
            raise ValueError(f"Policy.tolerance must be in (0, 1) (a relative error, exclusive), got {tol!r}")
        precisions, approximations = mode_defaults(
            self.mode if self.precisions is None and self.approximations is None else "exact")
        if self.precisions is None:
            object.__setattr__(self, "precisions", precisions)
        if self.approximations is None:
            object.__setattr__(self, "approximations", approximations)
        object.__setattr__(self, "precisions", _names("precisions", self.precisions, PRECISIONS))
        object.__setattr__(
            self, "approximations", _names("approximations", self.approximations, APPROXIMATIONS)
        )
        if not self.precisions:
            raise ValueError("Policy.precisions must name at least one precision, got ()")
        if self.mode == "exact" and (self.precisions != ("native",) or self.approximations):
            raise ValueError(
                "Policy(mode='exact') allows only precisions=('native',) and approximations=(); "
                f"got precisions={self.precisions}, approximations={self.approximations}. "
                "Use mode='auto' to allow them."
            )
        ver = self.verify
        if isinstance(ver, bool) or not isinstance(ver, (int, float)):
            raise TypeError(f"Policy.verify must be a float in [0, 1], got {type(ver).__name__}")
        if not 0.0 <= ver <= 1.0:
            raise ValueError(f"Policy.verify must be a fraction in [0, 1], got {ver!r}")
        if self.backends is not None:
            if isinstance(self.backends, str):
                object.__setattr__(self, "backends", (self.backends,))
            if not isinstance(self.backends, (tuple, list)) or not all(
                isinstance(b, str) and b for b in self.backends
            ):
                raise TypeError(
                    f"Policy.backends must be None or a tuple of backend names, got {self.backends!r}"
                )
            if not self.backends:
                raise ValueError("Policy.backends must name at least one backend, or be None")
            object.__setattr__(self, "backends", tuple(self.backends))
            unknown = [b for b in self.backends if known_runners and not any(
                n == b or n.startswith(b + ".") for n in known_runners)]
            if unknown:
                raise ValueError(f"Policy.backends names unknown runners {unknown}; known: "
                                 f"{', '.join(sorted(known_runners))} (or a prefix such as 'sdpa', 'triton')")
        if not isinstance(self.deterministic, bool):
            raise TypeError(f"Policy.deterministic must be a bool, got {type(self.deterministic).__name__}")
        if not isinstance(self.train_quantized, bool):
            raise TypeError(f"Policy.train_quantized must be a bool, got {type(self.train_quantized).__name__}")

    def admits(self, backend_name: str) -> bool:
        """Whether `backends` allows the backend called `backend_name`."""
        if self.backends is None:
            return True
        return any(backend_name == b or backend_name.startswith(b + ".") for b in self.backends)


def _names(field: str, value: object, allowed: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"Policy.{field} must be a tuple of names from {allowed}, got {value!r}")
    for v in value:
        if v not in allowed:
            raise ValueError(f"Policy.{field} entries must be from {allowed}, got {v!r}")
    return tuple(dict.fromkeys(value))


EXACT = Policy()
