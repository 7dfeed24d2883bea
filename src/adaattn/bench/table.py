"""The table a suite prints last: one block per case, a row per peer with its spread and ratio."""

from __future__ import annotations


def size_label(n: int | float) -> str:
    """A size as people write it: 128, 1k, 4k, 64k, 1M (not 1e3 or 2^12)."""
    n = int(n)
    for unit, suffix in ((1 << 20, "M"), (1 << 10, "k")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _note(r: dict) -> str:
    parts = []
    if r.get("ran") and r["peer"] not in r["ran"]:
        parts.append("ran " + ",".join(r["ran"]))
    if r.get("head_levels"):
        parts.append("heads " + " ".join(f"{k}:{v}" for k, v in r["head_levels"].items()))
    if r.get("bits_per_byte") is not None:
        parts.append(f"{r['bits_per_byte']:.4f} bits/byte")
    if r.get("error"):
        parts.append(r["error"][:100])
    return "; ".join(parts)


def format_suite_table(rows: list[dict]) -> str:
    """Per case: a title naming the figure and the baseline, then per peer ms min / median / max
    over the timed repetitions, the figure at the median, the baseline's median over this row's
    (x BASE > 1: faster than the baseline), the relative error against float64, and a note."""
    lines = []
    case = None
    for r in rows:
        if r["case"] != case:
            case = r["case"]
            base = r["baseline"]
            if lines:
                lines.append("")
            lines.append(f"{case}  [{r['figure_unit']} at the median; x {base} = {base} time / this time]")
            head = (f"  {'peer':<16} {'min ms':>9} {'median ms':>10} {'max ms':>9} {r['figure_unit']:>9} "
                    f"{'x ' + base:>14} {'rel err':>8}  note")
            lines += [head, "  " + "-" * (len(head) - 2)]
        lines.append(
            f"  {r['peer']:<16} {_num(r['ms_min'], '.4f'):>9} {_num(r['ms'], '.4f'):>10} {_num(r['ms_max'], '.4f'):>9} "
            f"{_num(r['figure'], '.4g'):>9} {_num(r.get('x_baseline'), '.3f'):>14} {_num(r['rel_error'], '.1e'):>8}  "
            f"{_note(r)}"
        )
    return "\n".join(lines)
