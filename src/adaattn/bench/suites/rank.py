"""rank: adaptive rank (mode='auto' with approximations lowrank/skip) on q, k, v captured from every
layer of the 32k GPT, against cuDNN, the oracle plan, FlexAttention's sliding window and a fixed
top-k block-sparse plan at the same tile density, and held-out bits per byte under it."""

from __future__ import annotations

import math

import torch

from ...problem import default_scale
from ... import stats
from ...api import attention
from ...adaptive import blocks, sites
from ...adaptive.rank_launch import rank_forward
from ...policy import Policy
from .. import accuracy, peers
from ..cases import Case, Peer
from ..dense import head_errors, random_qkv
from ..peers import Call
from ..workload import parse_layers
from . import options

NAME = "rank"
HELP = ("adaptive rank on q, k, v captured from every layer (--gpt-layers) of the 32k GPT (--weights), causal B=1, "
        "N 32k/64k/128k, the model's heads and replicated to 32 (--heads): cuDNN, adaattn exact, our tile kernel on the "
        "dense plan, mode=auto lowrank/skip at tolerances 1e-2,5e-2 (--tolerances), the oracle plan, FlexAttention "
        "sliding window and fixed top-k at the same density; held-out bits/byte at the shortest N under each tolerance (--gpt-parts kernels: without it); x cuDNN")
NEEDS_CUDA = True
SEQ_LENS = (32768, 65536, 131072)
TOLERANCES = (1e-2, 5e-2)
REPLICATED_HEADS = 32
PARTS = ("kernels", "heldout", "random")  # --gpt-parts; the default leaves out random (the full run nears 10 min)
DEFAULT_PARTS = ("kernels", "heldout")
RANDOM_HEADS, RANDOM_HEAD_DIM = 32, 64
VERIFIED_TO_SETTLE = 4  # verified calls a site makes before it is timed (its thresholds settle)
# 0, then 1e-4 .. 0.42 in steps of 10^(1/8) (x1.33): the oracle's density is the least on a fine grid
ORACLE_THRESHOLDS = (0.0,) + tuple(10 ** (-4 + i / 8) for i in range(30))
ERROR_ROWS = 4096  # errors of trained heads sit in few rows: 512 rows read 0.005-0.016 for a head at 0.012 over all rows
HELDOUT_WINDOWS = 4
HOW = {
    "cuDNN": "F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=...) pinned to CUDNN_ATTENTION",
    "adaattn": "adaattn.attention with the default (exact) policy",
    "dense kernel": "our tile-plan kernel (kernels/attention_rank.py) on the plan that keeps every tile exact",
    "auto T": "adaattn.attention(..., policy=Policy(mode='auto', approximations=('lowrank', 'skip'), tolerance=T)) "
    f"with a label per case; the site makes {VERIFIED_TO_SETTLE} verified calls before it is timed, and the timing "
    "includes the analysis and the verification at the policy's rate. density: the plan's exact tiles over visible "
    "tiles per head, as its last verified call measured; computed_density: 1 where the site runs exact",
    "oracle T": "the tile kernel on a plan whose exact tiles come from the true attention mass (blocks.true_block_mass) "
    "and whose other blocks are summarised; per head the largest threshold of ORACLE_THRESHOLDS whose error on the "
    "sampled rows is at most T (the least density meeting T on that grid); timed without any analysis",
    "flex T": "torch.compile(flex_attention) with a causal sliding-window block mask whose window gives the same tile "
    "density (128-row x 64-key tiles) as auto T's plan",
    "top-k T": "a fixed top-k block-sparse plan without verification: the first, local and own key blocks, plus per "
    "query block the key blocks of highest pooled score (mean query of the block . mean key of the block) up to auto "
    "T's density; other blocks skipped; the tile kernel, plan made before timing",
    "rel_error": f"against float64 on {ERROR_ROWS} query rows sampled evenly; head_errors per query head",
    "heldout": f"bits/byte of the model on {HELDOUT_WINDOWS} held-out windows of N bytes with each attention "
    "(models.gpt.parse_attention: sdpa, rank:T), after one warm-up pass that settles the sites",
}


def cases(args, device):
    from ...models import load
    from ...models.pretrained import LONG_WEIGHTS

    weights = getattr(args, "weights", None) or LONG_WEIGHTS
    config = load(weights, "cpu").config  # small: only to read the sizes
    layers = parse_layers(getattr(args, "gpt_layers", None) or "all", config.n_layer)
    seq_lens = tuple(getattr(args, "seq_lens", None) or SEQ_LENS)
    taus = tuple(getattr(args, "tolerances", None) or TOLERANCES)
    wide = getattr(args, "heads", None) or REPLICATED_HEADS
    head_counts = [config.n_head] + ([wide] if wide != config.n_head else [])
    held: dict = {}
    oracles: dict = {}  # (n, layer, tau) -> per-head oracle thresholds of the model's own heads

    def inputs(n: int, layer: int, heads: int):
        def get():
            if n not in held:
                from ...models import capture

                held.clear()
                model = load(weights, device)
                cap = capture(model, seq_len=n, batch=1, layers=layers, dtype=torch.bfloat16)
                held[n] = {lc.layer: tuple(t.detach().to(torch.bfloat16).contiguous() for t in (lc.q, lc.k, lc.v))
                           for lc in cap.layers}
                held["bpb"] = cap.bits_per_byte
                del model, cap
            q, k, v = held[n][layer]
            if heads == q.shape[1]:
                return q, k, v
            return replicate(q, k, v, heads)

        return get

    parts = getattr(args, "gpt_parts", None) or DEFAULT_PARTS
    out = []
    for n in (seq_lens if "random" in parts else ()):
        out.append(_random_case(n, taus, options.seed(args), device))
    for n in (seq_lens if "kernels" in parts else ()):
        for heads in head_counts:
            for layer in layers:
                fields = {"workload": "gpt32k", "layer": layer, "seq_len": n, "heads": heads,
                          "kv_heads": config.n_kv_head if heads == config.n_head else heads,
                          "head_dim": config.head_dim, "dtype": "bf16", "causal": True,
                          "replicated": heads != config.n_head}
                flops = 4.0 * heads * config.head_dim * n * (n + 1) / 2
                series = f"rank H={heads} L{layer}"
                source = None if heads == config.n_head else (config.n_head, config.n_kv_head)
                out.append(Case(NAME, f"{series} N={n}", n, fields, "cuDNN", "TFLOP/s", flops,
                                _maker(inputs(n, layer, heads), taus, f"bench-rank N={n} H={heads} L{layer}",
                                       oracles, (n, layer), source),
                                series=series))
    if "heldout" not in parts or not seq_lens:
        return out
    out.append(_heldout_case(weights, min(seq_lens), taus, device))
    return out


def _random_case(n: int, taus, seed: int, device) -> Case:
    """torch.randn q, k, v (B=1, 32 heads, D=64, causal): attention with no structure to skip, where
    auto must decide exact and cost no more than the exact call (baseline: adaattn exact)."""
    fields = {"workload": "random", "layer": None, "seq_len": n, "heads": RANDOM_HEADS, "kv_heads": RANDOM_HEADS,
              "head_dim": RANDOM_HEAD_DIM, "dtype": "bf16", "causal": True, "replicated": False}
    flops = 4.0 * RANDOM_HEADS * RANDOM_HEAD_DIM * n * (n + 1) / 2

    def make():
        q, k, v = random_qkv(1, RANDOM_HEADS, RANDOM_HEADS, n, n, RANDOM_HEAD_DIM, torch.bfloat16, device, seed)
        call = Call(q, k, v, causal=True)
        idx = accuracy.sample_rows(n, 512)
        with torch.no_grad():
            ref = accuracy.sampled_reference(q, k, v, idx, True)
        rows = [peers.sdpa(call, "cuDNN"), peers.adaattn(call)]
        rows += [_auto(call, tau, f"bench-rank random N={n}")[0] for tau in taus]
        return rows, lambda out: accuracy.relative_error(out, ref, idx)

    return Case(NAME, f"rank random H={RANDOM_HEADS} N={n}", n, fields, "adaattn", "TFLOP/s", flops, make,
                series=f"rank random H={RANDOM_HEADS}", also=("cuDNN",))


def replicate(q, k, v, heads: int):
    """(q, k, v) of `heads` query heads, each a copy of a captured head (head h of h % Hq), with
    one kv head per query head (its own kv head's copy): the same attention, more heads."""
    hq, hkv = q.shape[1], k.shape[1]
    src = torch.arange(heads, device=q.device) % hq
    kv = src // (hq // hkv)
    return (q.index_select(1, src).contiguous(), k.index_select(1, kv).contiguous(),
            v.index_select(1, kv).contiguous())


def _maker(inputs, taus, label, oracles: dict, where: tuple, source):
    """source None: the model's own heads (their oracle thresholds are kept in `oracles`);
    (Hq, Hkv) of the captured heads: replicated heads, which reuse those thresholds."""
    def make():
        q, k, v = inputs()
        n = q.shape[2]
        scale = default_scale(q.shape[-1])
        call = Call(q, k, v, causal=True)
        idx = accuracy.sample_rows(n, ERROR_ROWS)
        with torch.no_grad():
            ref = accuracy.sampled_reference(q, k, v, idx, True)

        def check(out):
            errs = head_errors(out, ref, idx)
            return accuracy.relative_error(out, ref, idx), {"head_errors": errs, "max_head_error": max(errs)}

        dense = blocks.dense_plan(1, q.shape[1], n, True, q.device)
        summaries = blocks.summarize(k, v)
        rows = [peers.sdpa(call, "cuDNN"), peers.adaattn(call),
                Peer("dense kernel", lambda: rank_forward(q, k, v, dense, None, scale),
                     info=lambda: {"computed_density": 1.0})]
        true_mass = None
        if source is not None and (*where, "mass") in oracles:  # replicated heads: the captured heads' mass
            src = (torch.arange(q.shape[1]) % source[0]).to(q.device)
            true_mass = oracles.pop((*where, "mass")).index_select(1, src)
        table = None
        for tau in taus:
            auto, density = _auto(call, tau, label)
            rows.append(auto)
            known = oracles.get((*where, tau)) if source is not None else None
            if known is not None:
                src = torch.arange(q.shape[1]) % source[0]
                thresholds = [known[h] for h in src.tolist()]
            else:
                if true_mass is None:
                    true_mass = blocks.true_block_mass(q, k, scale, True)
                if table is None:
                    table = oracle_table(q, k, v, summaries, true_mass, scale, ref, idx)
                thresholds = oracle_thresholds(table, tau)
                if source is None:
                    oracles[(*where, tau)] = thresholds
            if true_mass is None:
                true_mass = blocks.true_block_mass(q, k, scale, True)
            if source is None:
                oracles[(*where, "mass")] = true_mass
            rows.append(_oracle(q, k, v, summaries, true_mass, scale, tau, thresholds))
            rows.append(_flex(call, density, tau))
            rows.append(_topk(q, k, v, summaries, scale, density, tau))
        return rows, check

    return make


def _site(label: str, tau: float):
    for key, ctl in sites.controllers().items():
        if key.startswith(label + "|") and getattr(ctl, "tolerance", None) == tau and hasattr(ctl, "density"):
            return ctl
    return None


def _auto(call: Call, tau: float, label: str) -> tuple[Peer, float]:
    """The auto peer, its site settled; and the mean density of its plan."""
    policy = Policy(mode="auto", approximations=("lowrank", "skip"), tolerance=tau)
    q, k, v = call.q, call.k, call.v

    def forward():
        return attention(q, k, v, is_causal=True, enable_gqa=call.gqa, policy=policy, label=label)

    every = max(1, round(1.0 / policy.verify))
    with torch.no_grad():
        for _ in range(1 + every * (VERIFIED_TO_SETTLE - 1)):
            forward()
    ctl = _site(label, tau)
    density = ctl.density if ctl is not None and ctl.density else [1.0] * q.shape[1]
    mean = sum(density) / len(density)

    def info():
        with stats.collect() as records:
            forward()
        rec = records[-1].as_dict() if records else {}
        exact = ctl is None or ctl.runs_exact
        return {"ran_last": rec.get("backend"), "runs_exact": exact, "density": density,
                "stats_density": _floats(rec.get("decisions", {}).get("density")),
                "computed_density": 1.0 if exact else mean,
                "thresholds": None if ctl is None else ctl.theta.tolist(),
                "verified_errors": None if ctl is None else ctl.errors,
                "summarised": _floats(rec.get("decisions", {}).get("summarised")),
                "entropy_bits": _floats(rec.get("decisions", {}).get("entropy_bits")),
                "measured_ms": None if ctl is None else ctl.rank_ms,
                "exact_ms": None if ctl is None else ctl.exact_ms}

    return Peer(f"auto {tau:g}", forward, info=info), mean


def _floats(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return [float(t) for t in x.tolist()]
    return x


def _true_estimate(true_mass, hq, device):
    return blocks.Estimate(true_mass, torch.zeros(hq, device=device), torch.zeros(0, device=device))


def oracle_table(q, k, v, summaries, true_mass, scale, ref, idx) -> list[tuple[float, list[float]]]:
    """Per threshold of ORACLE_THRESHOLDS, each head's error on the sampled rows of the plan from
    the true mass (exact tiles in descending true mass, summaries for the rest)."""
    n, hq = q.shape[2], q.shape[1]
    est = _true_estimate(true_mass, hq, q.device)
    table = []
    for th in ORACLE_THRESHOLDS:
        plan = blocks.make_plan(est, torch.full((hq,), th, device=q.device), n, True, summaries=True)
        table.append((th, head_errors(rank_forward(q, k, v, plan, summaries, scale), ref, idx)))
    return table


def oracle_thresholds(table, tau) -> list[float]:
    """Per head the largest threshold of the table whose error is at most tau."""
    best = [table[0][0]] * len(table[0][1])
    for th, errs in table:
        best = [th if e <= tau else b for b, e in zip(best, errs)]
    return best


def _oracle(q, k, v, summaries, true_mass, scale, tau, best) -> Peer:
    n, hq = q.shape[2], q.shape[1]
    est = _true_estimate(true_mass, hq, q.device)
    plan = blocks.make_plan(est, torch.tensor(best, dtype=torch.float32, device=q.device), n, True, summaries=True)
    density = plan.density.tolist()
    return Peer(f"oracle {tau:g}", lambda: rank_forward(q, k, v, plan, summaries, scale),
                info=lambda: {"density": density, "computed_density": sum(density) / len(density),
                              "thresholds": best})


def window_density(n: int, window: int, query_block: int = blocks.QUERY_BLOCK,
                   key_block: int = blocks.KEY_BLOCK) -> float:
    """Tiles (query_block x key_block) a causal window of `window` keys (the row's own included)
    touches, over the causal tiles."""
    a = torch.arange(0, n, query_block, dtype=torch.int64)
    last = torch.clamp(a + query_block - 1, max=n - 1)
    first_key = torch.clamp(a - window + 1, min=0)
    touched = last // key_block - first_key // key_block + 1
    visible = last // key_block + 1
    return float(touched.sum()) / float(visible.sum())


def window_for(n: int, density: float) -> int:
    """The smallest window (a multiple of the key block) whose tile density reaches `density`."""
    lo, hi = 1, math.ceil(n / blocks.KEY_BLOCK)
    while lo < hi:
        mid = (lo + hi) // 2
        if window_density(n, mid * blocks.KEY_BLOCK) >= density:
            hi = mid
        else:
            lo = mid + 1
    return lo * blocks.KEY_BLOCK


def _window_mask(width: torch.Tensor):
    def keep(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < width)

    return keep


def _flex(call: Call, density: float, tau: float) -> Peer:
    n = call.q.shape[2]
    window = window_for(n, density)
    peer = peers.flex(call, _window_mask(torch.tensor(window, device=call.q.device)), name=f"flex {tau:g}")
    if peer.forward is not None:
        peer.info = lambda: {"window": window, "computed_density": window_density(n, window)}
    return peer


def topk_plan(q, k, summaries, scale: float, density: float) -> blocks.Plan:
    """Forced blocks (first, local, own) plus, per query block, the candidates of highest pooled
    score until the query block computes `density` of its visible tiles."""
    hq, n = q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    qb_size, kb_size = blocks.QUERY_BLOCK, blocks.KEY_BLOCK
    listable, forced, tail = blocks.block_layout(n, True, qb_size, kb_size, q.device)
    qp = blocks.block_means(q, qb_size)
    km = summaries.keys.float().repeat_interleave(g, 1)
    score = (qp @ km.transpose(-1, -2)) * scale
    cand = listable & ~forced
    score = torch.where(cand, score, float("-inf"))
    visible = (listable | tail).sum(-1)
    budget = (density * visible.float()).round().long() - forced.sum(-1) - tail.sum(-1)
    order = torch.argsort(score, -1, descending=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=q.device).expand_as(order))
    keep = cand & (rank < budget.clamp(min=0)[:, None])
    return blocks.plan_from_masks(keep | forced, None, n, True)


def _topk(q, k, v, summaries, scale, density: float, tau: float) -> Peer:
    plan = topk_plan(q, k, summaries, scale, density)
    got = plan.density.tolist()
    return Peer(f"top-k {tau:g}", lambda: rank_forward(q, k, v, plan, None, scale),
                info=lambda: {"density": got, "computed_density": sum(got) / len(got)})


def _heldout_case(weights, n: int, taus, device) -> Case:
    from .gpt import heldout_case

    return heldout_case(weights, n, HELDOUT_WINDOWS, ("sdpa", *(f"rank:{t:g}" for t in taus)), device, "32k", batch=1,
                        warm=2)


def summarize(rows: list[dict]) -> tuple[dict, str]:
    """Whole-model figures per (N, heads, tolerance): sums over layers, the oracle's bound,
    density against the oracle, errors against tolerance and against the baselines."""
    out: dict = {"whole_model": [], "layers": [], "heldout": []}
    lines = []
    ms = {}
    for r in rows:
        if r.get("layer") is not None and r.get("ms") is not None:
            ms[(r["seq_len"], r["heads"], r["layer"], r["peer"])] = r
    keys = sorted({(r["seq_len"], r["heads"]) for r in rows if r.get("layer") is not None})
    taus = sorted({float(r["peer"].split()[1]) for r in rows if r.get("peer", "").startswith("auto ")})
    for n, heads in keys:
        layers = sorted({key[2] for key in ms if key[:2] == (n, heads)})
        for tau in taus:
            t = f"{tau:g}"
            got = {p: [ms.get((n, heads, layer, p)) for layer in layers]
                   for p in ("cuDNN", "dense kernel", f"auto {t}", f"oracle {t}", f"flex {t}", f"top-k {t}")}
            if any(x is None for x in got["cuDNN"] + got[f"auto {t}"]):
                continue
            cudnn = sum(x["ms"] for x in got["cuDNN"])
            auto = sum(x["ms"] for x in got[f"auto {t}"])
            oracle_ok = all(x is not None for x in got[f"oracle {t}"])
            bound_ms = sum(min(c["ms"], o["ms"]) for c, o in zip(got["cuDNN"], got[f"oracle {t}"])) if oracle_ok else None
            entry = {"seq_len": n, "heads": heads, "tolerance": tau, "cudnn_ms": cudnn, "auto_ms": auto,
                     "x_cudnn": cudnn / auto, "oracle_bound_x_cudnn": None if bound_ms is None else cudnn / bound_ms}
            entry["of_oracle_bound"] = None if bound_ms is None else entry["x_cudnn"] / entry["oracle_bound_x_cudnn"]
            out["whole_model"].append(entry)
            lines.append(f"N={n} H={heads} tau={t}: whole model auto {entry['x_cudnn']:.2f}x cuDNN"
                         + ("" if bound_ms is None else f", oracle bound {entry['oracle_bound_x_cudnn']:.2f}x "
                            f"({entry['of_oracle_bound']:.2f} of it)"))
            for layer, a, o, f, k, d, c in zip(layers, got[f"auto {t}"], got[f"oracle {t}"], got[f"flex {t}"],
                                               got[f"top-k {t}"], got["dense kernel"], got["cuDNN"]):
                dens = _mean(a.get("density"))
                od = None if o is None else _mean(o.get("density"))
                sparse = not a.get("runs_exact", True)
                eff = (d["ms"] * dens / a["ms"]) if (d is not None and sparse and dens) else None
                lay = {"seq_len": n, "heads": heads, "tolerance": tau, "layer": layer, "density": dens,
                       "oracle_density": od, "x_oracle_density": None if not od else dens / od,
                       "computed_density": a.get("computed_density"), "max_head_error": a.get("max_head_error"),
                       "meets_tolerance": None if a.get("max_head_error") is None else a["max_head_error"] <= tau,
                       "x_cudnn": c["ms"] / a["ms"], "of_inverse_density": eff,
                       "flex_error": None if f is None else f.get("rel_error"),
                       "topk_error": None if k is None else k.get("rel_error"), "error": a.get("rel_error")}
                out["layers"].append(lay)
                lines.append(f"  L{layer}: density {dens:.3f} (oracle {_fmt(od)}, x{_fmt(lay['x_oracle_density'])}) "
                             f"max head err {_fmt(a.get('max_head_error'))} | {lay['x_cudnn']:.2f}x cuDNN"
                             f"{'' if eff is None else f', {eff:.2f} of 1/density'} | err ours {_fmt(a.get('rel_error'))}"
                             f" flex {_fmt(lay['flex_error'])} top-k {_fmt(lay['topk_error'])}")
    out["random"] = []
    for r in rows:
        if r.get("workload") == "random" and r.get("peer", "").startswith("auto ") and r.get("ms") is not None:
            paired = r.get("x_baseline_paired")
            dens = r.get("density")
            got = r.get("stats_density")
            e = {"seq_len": r["seq_len"], "peer": r["peer"], "runs_exact": r.get("runs_exact"),
                 "plan_density": None if not dens else sum(dens) / len(dens),
                 "stats_density": None if not got else sum(got) / len(got),
                 "over_exact": None if not paired else 1.0 / paired - 1.0, "ran_last": r.get("ran_last")}
            out["random"].append(e)
            lines.append(f"random N={e['seq_len']} {e['peer']}: {_fmt(e['over_exact'])} over exact (paired), "
                         f"stats density {_fmt(e['stats_density'])} (plan {_fmt(e['plan_density'])}), runs exact "
                         f"{e['runs_exact']}, ran {e['ran_last']}")
    for r in rows:
        if r.get("bits_per_byte") is not None:
            out["heldout"].append({"peer": r["peer"], "bits_per_byte": r["bits_per_byte"]})
    base = next((h["bits_per_byte"] for h in out["heldout"] if h["peer"] == "sdpa"), None)
    for h in out["heldout"]:
        h["vs_exact"] = None if base is None else h["bits_per_byte"] / base - 1
        lines.append(f"held-out {h['peer']}: {h['bits_per_byte']:.6f} bits/byte"
                     + ("" if h["vs_exact"] is None else f" ({100 * h['vs_exact']:+.4f}% vs exact)"))
    return out, "\n".join(lines)


def _mean(x):
    return None if not x else sum(x) / len(x)


def _fmt(x):
    return "-" if x is None else f"{x:.3g}"


def plot(path, summary: dict, title: str):
    """Three panels: whole-model speed-up over cuDNN against N (ours, and the oracle's bound),
    our density over the oracle's per layer, and the error of ours, FlexAttention's window and
    top-k at equal density per layer (the largest N). None where matplotlib does not import."""
    from ..plot import pyplot, save_figure, size_ticks

    plt = pyplot()
    if plt is None or not summary["whole_model"]:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    whole = summary["whole_model"]
    for heads in sorted({w["heads"] for w in whole}):
        for tau in sorted({w["tolerance"] for w in whole}):
            pts = sorted((w["seq_len"], w["x_cudnn"], w["oracle_bound_x_cudnn"]) for w in whole
                         if w["heads"] == heads and w["tolerance"] == tau)
            line = axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"ours H={heads} tau={tau:g}")
            axes[0].plot([p[0] for p in pts], [p[2] for p in pts], ls="--", marker="x", color=line[0].get_color(),
                         label=f"oracle bound H={heads} tau={tau:g}")
    xs = sorted({w["seq_len"] for w in whole})
    size_ticks(axes[0], xs)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_title("whole model (sum over layers): cuDNN time / this time", fontsize=9)
    layers = summary["layers"]
    heads0 = min(w["heads"] for w in whole)
    for tau in sorted({x["tolerance"] for x in layers}):
        for n in xs:
            pts = sorted((x["layer"], x["x_oracle_density"]) for x in layers if x["heads"] == heads0
                         and x["tolerance"] == tau and x["seq_len"] == n and x["x_oracle_density"] is not None)
            axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"N={n} tau={tau:g}")
    axes[1].axhline(1.5, color="grey", lw=0.8, ls="--")
    axes[1].set_title(f"our density / oracle density per layer (H={heads0}; target <= 1.5)", fontsize=9)
    axes[1].set_xlabel("layer")
    n_max = max(xs)
    for tau in sorted({x["tolerance"] for x in layers}):
        sel = sorted((x for x in layers if x["heads"] == heads0 and x["tolerance"] == tau and x["seq_len"] == n_max),
                     key=lambda x: x["layer"])
        for key, mark in (("error", "o"), ("flex_error", "s"), ("topk_error", "^")):
            axes[2].plot([x["layer"] for x in sel], [x[key] for x in sel], marker=mark,
                         label=f"{key.replace('_error', '') if key != 'error' else 'ours'} tau={tau:g}")
        axes[2].axhline(tau, color="grey", lw=0.8, ls=":")
    axes[2].set_yscale("log")
    axes[2].set_title(f"relative error at equal density per layer (N={n_max}, H={heads0})", fontsize=9)
    axes[2].set_xlabel("layer")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    return save_figure(plt, fig, path, title)
