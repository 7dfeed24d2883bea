"""Sparse decode on the 32k checkpoint's own keys and values (part of `--suite decode`).

Each layer of the shipped long-context GPT (models/weights/gpt_stdlib_32k.pt) runs once over
32768 held-out bytes; its post-RoPE keys, values and queries are replicated to B=16 sequences and
Hkv=8 KV heads (Hq=24, D=64) in a bf16 KVCache with page summaries. Per tolerance, decode steps
then walk the last STEPS positions (each appends its token, then attends): WARM steps verify every
call (the controller settles), MEASURED steps run under the policy's default sampling. Each
measured step records the pages read, the error against the exact step, the oracle's pages (the
fewest pages that meet the tolerance, chosen from the true scores, with the same forced pages),
and the error of a fixed-budget selection (Quest's min/max bound, top pages, as many as ours read,
no verification). The timed rows are one step at the final length: the dense split-KV kernel and
the sparse step (selection, kernel and merge; sampled verification included at its default rate).
"""

from __future__ import annotations

import torch

from ...kv import KVCache, decode_attention, plan_decode
from ...kv import sparse
from ...policy import Policy
from ..cases import Case, Peer

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
    out = []
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
        s = qq @ k[h, :n].T * d ** -0.5
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
        err = ((approx - o[:, None]).norm(dim=-1) / o.norm(dim=-1)[:, None]).amax(0)  # (P,)
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
        worst = max(worst, float(((approx - exact).norm(dim=-1) / exact.norm(dim=-1)).max()))
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
        scale = 64 ** -0.5
        rows = []
        measured = {}
        cache_dense = None
        for tau in TAUS:
            cache = KVCache(1, BATCH, KV_HEADS, n_total, 64, dtype=torch.bfloat16, device=device, page_size=PAGE,
                            summaries=True)
            n0 = n_total - WARM - MEASURED
            cache.append(0, k[:, :, :n0], v[:, :, :n0])
            errs, read, oracle, fixed = [], [], [], []
            for i in range(WARM + MEASURED):
                pos = n0 + i
                cache.append(0, k[:, :, pos:pos + 1], v[:, :, pos:pos + 1])
                qi = q[:, :, i:i + 1]
                warm = i < WARM
                policy = Policy(mode="auto", approximations=("skip",), tolerance=tau, verify=1.0 if warm else 0.05)
                plan = plan_decode(cache, heads=qi.shape[1], policy=policy, sparse=True)
                if not warm:
                    site = sparse.site(cache, 0, tau)
                    _, count = sparse.select(qi, cache, 0, plan, site.theta, scale, kernel=True)
                    counts = count.view(BATCH, KV_HEADS)[0]
                out = decode_attention(qi, cache, 0, plan=plan)
                if warm:
                    continue
                exact = decode_attention(qi, cache, 0, plan=plan_decode(cache, heads=qi.shape[1]))
                err = ((out.float() - exact.float()).flatten(2).norm(dim=-1)
                       / exact.float().flatten(2).norm(dim=-1)).max()
                n = pos + 1
                npages = -(-n // PAGE)
                errs.append(float(err))
                read.append(float(count.float().mean()) / npages)
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
                             "theta": [round(x, 5) for x in sparse.site(cache, 0, tau).theta.tolist()]}
            tplan = plan_decode(cache, heads=q.shape[1], policy=Policy(mode="auto", approximations=("skip",),
                                                                       tolerance=tau), sparse=True)
            q_last = q[:, :, -1:]
            info = measured[tau]
            rows.append(Peer(f"kv bf16 sparse tau={tau:g}", lambda c=cache, p=tplan: decode_attention(q_last, c, 0, plan=p),
                             info=lambda info=info: dict(info)))
            if cache_dense is None:
                cache_dense = cache
        dplan = plan_decode(cache_dense, heads=q.shape[1])
        q_last = q[:, :, -1:]
        rows.insert(0, Peer("kv bf16", lambda: decode_attention(q_last, cache_dense, 0, plan=dplan)))
        exact = decode_attention(q_last, cache_dense, 0, plan=dplan).float()

        def check(out):
            return float(((out.float() - exact).norm() / exact.norm()))

        return rows, check

    return make
