"""Sparse decode on the 32k checkpoint's own keys and values (part of `--suite decode`).

Each layer of the shipped long-context GPT (models/weights/gpt_stdlib_32k.pt) runs once over
32768 held-out bytes; its post-RoPE keys, values and queries are replicated to B=16 sequences and
Hkv=8 KV heads (Hq=24, D=64) in a bf16 KVCache with page summaries. Per tolerance, decode steps
then walk the last STEPS positions (each appends its token, then attends): WARM steps verify every
call (the controller settles), MEASURED steps run under the policy's default sampling. Each
measured step (sparse="always": the selection itself, never the dense fallback) records the pages
read, the error against the exact step, the oracle's pages (the fewest pages that meet the
tolerance, chosen from the true scores, with the same forced pages),
and the error of a fixed-budget selection (Quest's min/max bound, top pages, as many as ours read,
no verification). The timed rows are one step at the final length: the dense split-KV kernel, the
sparse step as it runs by default (the site may have turned dense where selection did not pay)
and with sparse="always" (selection, kernel and merge; sampled verification included at its
default rate in both); and the dense and the "always" steps captured in CUDA graphs and replayed
(GPU time only, as a serving loop replays a decode step; no verification inside a graph).

Two more cases:
- random K/V of the same shape (no page matters more than another): the sparse policy must find
  that selection does not pay and run dense, within a few percent of the dense kernel;
- generation with the model itself, B=16 held-out windows: a 30000-byte prompt (exact prefill),
  then 256 decode steps teacher-forced on the held-out continuation, dense and under the sparse
  policy, each step's layers sharing one plan. Held-out bits per byte over those 256 positions,
  greedy generation from the same prompts (tokens agreeing with dense greedy); the timed rows are the whole model's decode attention (its 8 layers) at the final length,
  with the queries of the last step.
"""

from __future__ import annotations

import torch

from ...backends.reference import relative_errors
from ...problem import default_scale
from ...api import decode_attention, plan_decode
from ...kv import KVCache
from ...kv import sparse
from ... import stats
from ...policy import Policy
from ..cases import Case, Peer, graphed

TAUS = (1e-2, 5e-2)
WARM, MEASURED = 16, 16
BATCH, KV_HEADS = 16, 8
CONTEXT = 32768
PAGE = 64
_captured: dict = {}


def _capture(device, context):
    key = (str(device), context)
    if key not in _captured:
        from ...models import pretrained
        from ...models.capture import capture

        model = pretrained.load(pretrained.LONG_WEIGHTS, device=device)
        got = capture(model, seq_len=context, dtype=torch.bfloat16)
        keep = WARM + MEASURED
        _captured.clear()
        _captured[key] = [(lc.q[:, :, -keep:].clone(), lc.k.clone(), lc.v.clone()) for lc in got.layers]
        del model, got
        torch.cuda.empty_cache()
    return _captured[key]


def cases(device, context: int = CONTEXT) -> list[Case]:
    out = [_random_case(device, context), _generation_case(device)]
    for layer in range(8):
        kv_bytes = 2 * BATCH * KV_HEADS * context * 64 * 2
        series = f"sparse decode, 32k checkpoint, B={BATCH} Hq={3 * KV_HEADS} Hkv={KV_HEADS} D=64 bf16, KV={context}"
        out.append(Case("decode", f"{series} layer {layer}", layer,
                        {"batch": BATCH, "heads": 3 * KV_HEADS, "kv_heads": KV_HEADS, "head_dim": 64,
                         "dtype": "bfloat16", "q_len": 1, "kv_len": context, "layer": layer, "kv_bytes": kv_bytes,
                         "taus": list(TAUS)},
                        "kv bf16", "TB/s", kv_bytes, _make(device, layer, context), series=series))
    return out


def _replicate(x, reps, groups):
    """(1, H, N, D) -> (BATCH, H * reps, N, D): each GQA group of the H heads (`groups` of them)
    repeated `reps` times, so that KV head j of the copy serves the copies of its own query heads;
    the batch copied."""
    _, h, n, d = x.shape
    x = x.view(groups, h // groups, n, d).repeat_interleave(reps, 0).reshape(1, h * reps, n, d)
    return x.expand(BATCH, -1, -1, -1).contiguous()


def _groups(q, kv_heads):
    """(KV head, its GQA group's query rows of q (Hq, D)) for each KV head."""
    g = q.shape[0] // kv_heads
    return [(h, q[h * g:(h + 1) * g]) for h in range(kv_heads)]


def _forced_first(rank, npages):
    """Page indices by descending `rank` (P,), the selection's forced pages (first, newest) first."""
    idx = torch.arange(npages, device=rank.device)
    forced = (idx < sparse.SINK_PAGES) | (idx >= npages - sparse.RECENT_PAGES)
    return torch.argsort(torch.where(forced, float("inf"), rank), descending=True)


def _oracle_pages(q, k, v, tau, n):
    """Fewest pages (per KV head of the original data, summed) meeting tau, chosen from the true
    page masses with the forced pages first. q (Hq, D), k/v (Hkv, n, D) float64."""
    d = q.shape[1]
    npages = -(-n // PAGE)
    total = 0
    for h, qq in _groups(q, k.shape[0]):
        g = qq.shape[0]
        s = qq @ k[h, :n].T * default_scale(d)
        p = torch.softmax(s, -1)  # (G, n)
        o = p @ v[h, :n]
        pad = npages * PAGE - n
        pp = torch.nn.functional.pad(p, (0, pad)).view(g, npages, PAGE)
        vv = torch.nn.functional.pad(v[h, :n], (0, 0, 0, pad)).view(npages, PAGE, -1)
        mass = pp.sum(-1)  # (G, P)
        contrib = torch.einsum("gpj,pjd->gpd", pp, vv)  # (G, P, Dv): each page's part of the output
        order = _forced_first(mass.amax(0), npages)
        num = torch.cumsum(contrib[:, order], 1)
        den = torch.cumsum(mass[:, order], 1)
        approx = num / den[..., None]
        err = relative_errors(approx, o[:, None], -1, torch.float32).amax(0)  # (P,)
        ok = torch.nonzero(err <= tau)
        total += int(ok[0, 0]) + 1 if len(ok) else npages
    return total


def _fixed_budget_error(q, k_min, k_max, k, v, counts, n, scale):
    """Error of keeping, per (sequence 0's) KV head, its `counts` pages of highest Quest bound
    (forced pages first), against exact attention. q (Hq, D); k_min/k_max (P, Hkv, D); k/v (Hkv, n, D)."""
    npages = -(-n // PAGE)
    worst = 0.0
    for h, qq in _groups(q.float(), k.shape[0]):
        bound = torch.maximum(qq[:, None] * k_max[:npages, h][None], qq[:, None] * k_min[:npages, h][None]).sum(-1)
        kept = torch.zeros(npages, dtype=torch.bool, device=q.device)
        kept[_forced_first(bound.amax(0), npages)[:int(counts[h])]] = True
        s = qq @ k[h, :n].float().T * scale
        exact = torch.softmax(s, -1) @ v[h, :n].float()
        approx = torch.softmax(s.masked_fill(~kept[torch.arange(n, device=q.device) // PAGE][None], float("-inf")),
                               -1) @ v[h, :n].float()
        worst = max(worst, float(relative_errors(approx, exact, -1, torch.float32).max()))
    return worst


def _make(device, layer, context):
    def make():
        q0, k0, v0 = _capture(device, context)[layer]  # q (1, 6, STEPS, 64); k, v (1, 2, N, 64)
        reps = KV_HEADS // k0.shape[1]
        n_total = k0.shape[2]
        hkv0 = k0.shape[1]
        k = _replicate(k0, reps, hkv0)
        v = _replicate(v0, reps, hkv0)
        q = _replicate(q0, reps, hkv0)
        k64, v64 = k0[0].double(), v0[0].double()
        scale = default_scale(64)
        rows = []
        measured = {}
        cache_dense = None
        for tau in TAUS:
            cache = KVCache(1, BATCH, KV_HEADS, n_total, 64, dtype=torch.bfloat16, device=device, page_size=PAGE,
                            summaries=True)
            n0 = n_total - WARM - MEASURED
            cache.append(0, k[:, :, :n0], v[:, :, :n0])
            errs, read, oracle, fixed = [], [], [], []
            steps = []
            for i in range(WARM + MEASURED):  # no host sync in here: a serving loop's GPU runs behind its host
                pos = n0 + i
                cache.append(0, k[:, :, pos:pos + 1], v[:, :, pos:pos + 1])
                qi = q[:, :, i:i + 1]
                warm = i < WARM
                policy = Policy(mode="auto", approximations=("skip",), tolerance=tau, verify=1.0 if warm else 0.05)
                plan = plan_decode(cache, heads=qi.shape[1], policy=policy, sparse="always")  # the selection itself
                with stats.collect() as recs:
                    out = decode_attention(qi, cache, 0, plan=plan)
                if warm:
                    continue
                ran = recs[-1].decisions
                counts = ran["pages_this_call"].view(BATCH, KV_HEADS)[0] if ran.get("sparse") == "sparse" else None
                exact = decode_attention(qi, cache, 0, plan=plan_decode(cache, heads=qi.shape[1]))
                steps.append((i, pos + 1, out, exact, counts))
            sparse_steps = sum(c is not None for *_, c in steps)
            for i, n, out, exact, counts in steps:
                npages = -(-n // PAGE)
                if counts is None:  # ran dense: every page read
                    counts = torch.full((KV_HEADS,), npages, device=device)
                counts = counts.float()
                err = ((out.float() - exact.float()).flatten(2).norm(dim=-1)
                       / exact.float().flatten(2).norm(dim=-1)).max()
                errs.append(float(err))
                read.append(float(counts.mean()) / npages)
                q_orig = q0[0, :, i].double()
                oracle.append(_oracle_pages(q_orig, k64, v64, tau, n) / (k0.shape[1] * npages))
                # the fixed budget: as many pages as ours read, per original KV head (heads 0 and reps of the copies)
                ours = torch.stack([counts[h * reps] for h in range(k0.shape[1])])
                phys = cache.block_table[0, :npages].long()
                kmin = cache.k_min[0][phys][:, ::reps].float()
                kmax = cache.k_max[0][phys][:, ::reps].float()
                fixed.append(_fixed_budget_error(q_orig, kmin, kmax, k64, v64, ours, n, scale))
            measured[tau] = {"pages_read": sum(read) / len(read), "oracle_pages": sum(oracle) / len(oracle),
                             "x_oracle": (sum(read) / max(sum(oracle), 1e-12)),
                             "error_max": max(errs), "error_mean": sum(errs) / len(errs),
                             "fixed_budget_error_max": max(fixed),
                             "fixed_budget_error_mean": sum(fixed) / len(fixed),
                             "measured_steps_sparse": sparse_steps, "measured_steps": MEASURED,
                             "theta": [round(x, 5) for x in sparse.site(cache, 0, tau).theta[0].tolist()]}
            q_last = q[:, :, -1:]
            info = measured[tau]
            for suffix, how in (("", None), (" always", "always")):  # as it runs by default; never dense
                tplan = plan_decode(cache, heads=q.shape[1], sparse=how,
                                    policy=Policy(mode="auto", approximations=("skip",), tolerance=tau))
                rows.append(Peer(f"kv bf16 sparse tau={tau:g}{suffix}",
                                 lambda c=cache, p=tplan: decode_attention(q_last, c, 0, plan=p),
                                 info=lambda info=info: dict(info)))
            # the sparse step captured in a CUDA graph (as serving replays a decode step): GPU time only
            rows.append(graphed(f"kv bf16 sparse tau={tau:g} always graph",
                                lambda c=cache, p=tplan: decode_attention(q_last, c, 0, plan=p),
                                lambda info=info: dict(info)))
            if cache_dense is None:
                cache_dense = cache
        dplan = plan_decode(cache_dense, heads=q.shape[1])
        q_last = q[:, :, -1:]
        rows.insert(0, Peer("kv bf16", lambda: decode_attention(q_last, cache_dense, 0, plan=dplan)))
        rows.insert(1, graphed("kv bf16 graph", lambda: decode_attention(q_last, cache_dense, 0, plan=dplan)))
        exact = decode_attention(q_last, cache_dense, 0, plan=dplan).float()

        def check(out):
            return float(relative_errors(out, exact, dtype=torch.float32))

        return rows, check

    return make


def _decisions(cache, layers) -> list:
    """How each layer's site ran its calls so far (dense / sparse / verified); None where none ran."""
    sites = cache._sparse_sites
    return [dict(sites[i].decisions) if i in sites else None for i in layers]


def _since(now: list, before: list) -> list:
    return [None if b is None else {k: n[k] - b[k] for k in b} for n, b in zip(now, before)]


def _random_case(device, context):
    kv_bytes = 2 * BATCH * KV_HEADS * context * 64 * 2
    series = f"sparse decode, random K/V, B={BATCH} Hq={3 * KV_HEADS} Hkv={KV_HEADS} D=64 bf16"

    def make():
        g = torch.Generator(device=device).manual_seed(7)
        shape = (BATCH, KV_HEADS, context, 64)
        k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        q = torch.randn(BATCH, 3 * KV_HEADS, WARM + 1, 64, generator=g, device=device, dtype=torch.bfloat16)
        rows = []
        first = None
        for tau in TAUS:
            cache = KVCache(1, BATCH, KV_HEADS, context, 64, dtype=torch.bfloat16, device=device, page_size=PAGE,
                            summaries=True)
            n0 = context - WARM
            cache.append(0, k[:, :, :n0], v[:, :, :n0])
            for i in range(WARM):  # the controller settles, every call verified
                cache.append(0, k[:, :, n0 + i:n0 + i + 1], v[:, :, n0 + i:n0 + i + 1])
                policy = Policy(mode="auto", approximations=("skip",), tolerance=tau, verify=1.0)
                decode_attention(q[:, :, i:i + 1], cache, 0, plan=plan_decode(cache, heads=q.shape[1], policy=policy))
            plan = plan_decode(cache, heads=q.shape[1], policy=Policy(mode="auto", approximations=("skip",),
                                                                      tolerance=tau))
            before = _decisions(cache, [0])
            rows.append(Peer(f"kv bf16 sparse tau={tau:g}",
                             lambda c=cache, p=plan: decode_attention(q[:, :, -1:], c, 0, plan=p),
                             info=lambda c=cache, b=before, p=plan: {
                                 "decisions_while_timed": _since(_decisions(c, [0]), b)[0], "plan": p.explain()}))
            if first is None:
                first = cache
        dplan = plan_decode(first, heads=q.shape[1])
        rows.insert(0, Peer("kv bf16", lambda: decode_attention(q[:, :, -1:], first, 0, plan=dplan)))
        exact = decode_attention(q[:, :, -1:], first, 0, plan=dplan).float()
        return rows, lambda out: float(relative_errors(out, exact, dtype=torch.float32))

    return Case("decode", f"{series} KV={context}", context,
                {"batch": BATCH, "heads": 3 * KV_HEADS, "kv_heads": KV_HEADS, "head_dim": 64, "dtype": "bfloat16",
                 "q_len": 1, "kv_len": context, "kv_bytes": kv_bytes, "workload": "random", "taus": list(TAUS)},
                "kv bf16", "TB/s", kv_bytes, make, series=series)


GEN_PROMPT, GEN_STEPS, GEN_TAU = 30000, 256, 5e-2


def _generation_case(device):
    layers, hkv, d = 8, 2, 64  # the 32k checkpoint's shape
    n = GEN_PROMPT + GEN_STEPS
    kv_bytes = layers * 2 * BATCH * hkv * n * d * 2
    series = f"generation, 32k checkpoint, B={BATCH}, {GEN_PROMPT}-byte prompt + {GEN_STEPS} steps"

    def make():
        from ...models import pretrained
        from ...models.capture import heldout_tokens

        model = pretrained.load(pretrained.LONG_WEIGHTS, device=device)
        tokens = heldout_tokens(n, BATCH).to(device)  # (B, n + 1)
        sparse_policy = Policy(mode="auto", approximations=("skip",), tolerance=GEN_TAU)
        runs = {}
        for name, policy in (("dense", None), (f"sparse tau={GEN_TAU:g}", sparse_policy)):
            runs[name] = _generate(model, tokens, policy)
        dense, ours = runs["dense"], runs[f"sparse tau={GEN_TAU:g}"]
        agree = (ours["greedy"] == dense["greedy"]).float()
        first_diff = [int(torch.nonzero(row == 0)[0, 0]) if bool((row == 0).any()) else GEN_STEPS for row in agree]
        summary = {"bits_per_byte_dense": dense["bpb"], "bits_per_byte_sparse": ours["bpb"],
                   "bpb_rel_diff": ours["bpb"] / dense["bpb"] - 1.0,
                   "greedy_tokens_agreeing": float(agree.mean()),
                   "greedy_first_difference_mean": sum(first_diff) / len(first_diff),
                   "pages_read_per_layer": ours["pages"], "decisions_per_layer": ours["decisions"],
                   "error_per_layer": ours["error"]}

        def peer(name, run, policy):
            cache, qs = run["cache"], run["queries"]
            plan = plan_decode(cache, heads=qs[0].shape[1], policy=policy)

            def step():
                return torch.stack([decode_attention(qs[i], cache, i, plan=plan) for i in range(layers)])

            before = _decisions(cache, range(layers))

            def info():
                return {**summary, "decisions_while_timed": _since(_decisions(cache, range(layers)), before)}

            return Peer(f"model decode attention, {name}", step, info=info)

        rows = [peer("dense", dense, None), peer(f"sparse tau={GEN_TAU:g}", ours, sparse_policy)]
        exact = rows[0].forward().float()
        return rows, lambda out: float(relative_errors(out, exact, dtype=torch.float32))

    return Case("decode", series, n, {"batch": BATCH, "heads": 6, "kv_heads": hkv, "head_dim": d, "dtype": "bfloat16",
                                      "q_len": 1, "kv_len": n, "kv_bytes": kv_bytes, "workload": "generation",
                                      "tolerance": GEN_TAU, "layers": layers},
                "model decode attention, dense", "TB/s", kv_bytes, make, series=series)


@torch.no_grad()
def _generate(model, tokens, policy):
    """Exact prefill of the prompt, then GEN_STEPS steps under `policy`: teacher-forced on the
    held-out continuation (bits per byte of its next bytes), and greedy from the same prompt."""
    import math

    import contextlib

    b = tokens.shape[0]
    prompt = tokens[:, :GEN_PROMPT]
    out = {}
    cuda = tokens.is_cuda
    with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
        for mode in ("forced", "greedy"):
            model.set_attention("adaattn", None)
            cache = model.make_cache(b, GEN_PROMPT + GEN_STEPS, summaries=True)
            logits, _ = model(prompt, cache=cache)
            model.set_attention("adaattn", policy)
            last = logits[:, -1].float()
            nll, picked, queries = [], [], {}
            for i in range(GEN_STEPS):
                if mode == "forced":
                    target = tokens[:, GEN_PROMPT + i]
                    nll.append(torch.nn.functional.cross_entropy(last, target, reduction="none"))
                    step = target[:, None]
                else:
                    step = last.argmax(-1, keepdim=True)
                    picked.append(step)
                if i == GEN_STEPS - 1 and mode == "forced":
                    model.set_recorder(lambda layer, q, k, v, o: queries.__setitem__(layer, q.transpose(1, 2).clone()))
                logits, _ = model(step, cache=cache)
                model.set_recorder(None)
                last = logits[:, -1].float()
            model.set_attention("adaattn", None)
            if mode == "forced":
                out["bpb"] = float(torch.cat(nll).mean()) / math.log(2)
                out["cache"] = cache
                out["queries"] = [queries[i] for i in range(len(queries))]
                sites = cache._sparse_sites
                out["pages"] = [round(float(sites[i].pages.mean()), 4) if i in sites else None for i in range(cache.layers)]
                out["error"] = [round(float(sites[i].error.max()), 5) if i in sites else None for i in range(cache.layers)]
                out["decisions"] = [dict(sites[i].decisions) if i in sites else None for i in range(cache.layers)]
            else:
                out["greedy"] = torch.cat(picked, 1)
                del cache
    return out


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def summarize(rows: list[dict]) -> tuple[dict, str]:
    """Per layer and tolerance against the Done-when bars (pages against the oracle, error against
    tolerance, speed against 1/pages, ours against the fixed budget); the whole model (sums over
    layers, and the oracle's bound: the dense time of each layer scaled by its oracle pages);
    random K/V against dense; generation."""
    out: dict = {"layers": [], "whole_model": [], "random": [], "generation": []}
    lines = []
    by = {}
    for r in rows:
        if r.get("layer") is not None and r.get("ms") is not None and "32k checkpoint" in r.get("case", ""):
            by[(r["layer"], r["peer"])] = r
    layers = sorted({k[0] for k in by})
    for tau in TAUS:
        name = f"kv bf16 sparse tau={tau:g}"
        dense_ms = sparse_ms = always_ms = bound_ms = 0.0
        complete = bool(layers)
        for layer in layers:
            d, s, a = by.get((layer, "kv bf16")), by.get((layer, name)), by.get((layer, name + " always"))
            if d is None or s is None or a is None:
                complete = False
                continue
            x = s.get("x_baseline_paired") or d["ms"] / s["ms"]
            xa = a.get("x_baseline_paired") or d["ms"] / a["ms"]
            pages, oracle = a.get("pages_read"), a.get("oracle_pages")
            dg, ag = by.get((layer, "kv bf16 graph")), by.get((layer, name + " always graph"))
            xg = dg["ms"] / ag["ms"] if dg is not None and ag is not None else None
            e = {"layer": layer, "tolerance": tau, "x_dense": x, "x_dense_always": xa, "x_dense_graph": xg,
                 "of_ideal_graph": None if xg is None or pages is None else xg * pages, "pages_read": pages,
                 "oracle_pages": oracle, "x_oracle": a.get("x_oracle"),
                 "meets_oracle_1.5": None if a.get("x_oracle") is None else a["x_oracle"] <= 1.5,
                 "error_max": a.get("error_max"),
                 "meets_tolerance": None if a.get("error_max") is None else a["error_max"] <= tau,
                 "of_ideal": None if pages is None else xa * pages,
                 "fixed_budget_error_max": a.get("fixed_budget_error_max"),
                 "ours_lower_than_fixed_budget": None if a.get("error_max") is None or a.get("fixed_budget_error_max") is None
                 else a["error_max"] < a["fixed_budget_error_max"]}
            out["layers"].append(e)
            dense_ms += d["ms"]
            sparse_ms += s["ms"]
            always_ms += a["ms"]
            bound_ms += d["ms"] * (oracle if oracle is not None else 1.0)
            lines.append(f"tau={tau:g} L{layer}: pages {_fmt(pages)} (oracle {_fmt(oracle)}, x{_fmt(a.get('x_oracle'), '.2f')}) "
                         f"err max {_fmt(a.get('error_max'), '.4f')} (fixed budget {_fmt(a.get('fixed_budget_error_max'), '.4f')}) "
                         f"| always {xa:.2f}x dense, {_fmt(e['of_ideal'], '.2f')} of 1/pages | default {x:.2f}x dense"
                         f" | graphs {_fmt(xg, '.2f')}x, {_fmt(e['of_ideal_graph'], '.2f')} of 1/pages")
        if complete:
            w = {"tolerance": tau, "dense_ms": dense_ms, "sparse_ms": sparse_ms, "always_ms": always_ms,
                 "x_dense": dense_ms / sparse_ms, "x_dense_always": dense_ms / always_ms,
                 "oracle_bound_x_dense": dense_ms / bound_ms}
            w["of_oracle_bound"] = w["x_dense"] / w["oracle_bound_x_dense"]
            out["whole_model"].append(w)
            lines.append(f"tau={tau:g} whole model (8 layers, sum of times): default {w['x_dense']:.2f}x dense, always "
                         f"{w['x_dense_always']:.2f}x; oracle bound {w['oracle_bound_x_dense']:.2f}x (default at "
                         f"{w['of_oracle_bound']:.2f} of it)")
    for r in rows:
        if r.get("workload") == "random" and r.get("peer", "").startswith("kv bf16 sparse") and r.get("ms") is not None:
            paired = r.get("x_baseline_paired")
            e = {"peer": r["peer"], "over_dense": None if not paired else 1.0 / paired - 1.0,
                 "decisions_while_timed": r.get("decisions_while_timed")}
            out["random"].append(e)
            lines.append(f"random K/V {r['peer']}: {_fmt(e['over_dense'], '+.3f')} over dense (paired); "
                         f"calls {e['decisions_while_timed']}")
        if r.get("workload") == "generation" and "sparse" in r.get("peer", "") and r.get("ms") is not None:
            e = {k: r.get(k) for k in ("bits_per_byte_dense", "bits_per_byte_sparse", "bpb_rel_diff",
                                       "greedy_tokens_agreeing", "greedy_first_difference_mean",
                                       "pages_read_per_layer", "error_per_layer", "decisions_while_timed")}
            e["attention_x_dense"] = r.get("x_baseline_paired")
            out["generation"].append(e)
            lines.append(f"generation: bpb {_fmt(e['bits_per_byte_sparse'], '.4f')} vs dense {_fmt(e['bits_per_byte_dense'], '.4f')} "
                         f"({_fmt(e['bpb_rel_diff'], '+.4%')}), greedy agreeing {_fmt(e['greedy_tokens_agreeing'])}; "
                         f"whole-model decode attention {_fmt(e['attention_x_dense'], '.2f')}x dense; "
                         f"pages per layer {e['pages_read_per_layer']}; calls while timed {e['decisions_while_timed']}")
    return out, "\n".join(lines)
