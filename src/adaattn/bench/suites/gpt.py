"""gpt: the shipped byte-level GPT: attention on its captured q, k, v, a training step, held-out bits/byte."""

from __future__ import annotations

import torch

from ..cases import Case, Peer
from ..dense import shape_case
from ..grid import Grid, Shape
from ..peers import gpu_peers
from ..workload import parse_layers
from . import options

NAME = "gpt"
HELP = ("the shipped GPT (needs its weights): --gpt-parts kernels (attention on q, k, v captured from it on "
        "held-out text, N 8k/32k, x cuDNN), step (training step tokens/s, --gpt-size shipped|medium, x sdpa), "
        "heldout (bits/byte and tokens/s with each attention, mode=auto at tolerance 3e-2 included, after one "
        "warm-up pass, x sdpa)")
NEEDS_CUDA = True
PARTS = ("kernels", "step", "heldout")
KINDS = ("sdpa", "adaattn", "adaattn:triton")  # models.gpt.parse_attention specs
HELDOUT_KINDS = (*KINDS, "auto:0.03")
KERNELS = Grid((8192, 32768), batch=2, heads=0, kv_heads=None, head_dim=0, dtypes=(torch.bfloat16,), causal="yes")
MEDIUM = dict(n_layer=24, d_model=1024, n_head=16, n_kv_head=16, mlp_hidden=2752)  # GPT-2 medium's size


def cases(args, device):
    parts = getattr(args, "gpt_parts", None) or PARTS
    out = []
    if "kernels" in parts:
        out += _kernel_cases(args, device)
    if "step" in parts:
        out.append(_step_case(args, device))
    if "heldout" in parts:
        out.append(_heldout_case(args, device))
    return out


def _kernel_cases(args, device):
    from ...models import capture, load

    config = load(getattr(args, "weights", None), "cpu").config  # small: only to read the sizes
    layers = parse_layers(getattr(args, "gpt_layers", None) or "ends", config.n_layer)
    grid = options.grid(args, KERNELS, heads=config.n_head, kv_heads=config.n_kv_head, head_dim=config.head_dim)
    held: dict = {}

    def inputs(dtype, n, layer):
        def get(requires_grad):
            if (dtype, n) not in held:
                held.clear()
                model = load(getattr(args, "weights", None), device)
                cap = capture(model, seq_len=n, batch=grid.batch, layers=layers, dtype=dtype)
                held[(dtype, n)] = {lc.layer: (lc.q, lc.k, lc.v) for lc in cap.layers}
            return tuple(t.to(dtype).detach().requires_grad_(requires_grad) for t in held[(dtype, n)][layer])

        return get

    out = []
    for dtype in grid.dtypes:
        for n in grid.seq_lens:
            for causal in (True, False) if grid.causal == "both" else (grid.causal == "yes",):
                for layer in layers:
                    shape = Shape(grid.batch, config.n_head, config.n_kv_head, n, config.head_dim, dtype, causal)
                    out.append(shape_case(NAME, shape, device, gpu_peers, "cuDNN", False,
                                          error_rows=options.error_rows(args), inputs=inputs(dtype, n, layer),
                                          fields={"layer": layer}))
    return out


def _model_config(args):
    from ...models import GPTConfig

    size = getattr(args, "gpt_size", None) or "shipped"
    return GPTConfig(**MEDIUM) if size == "medium" else GPTConfig(), size


def _step_case(args, device):
    config, size = _model_config(args)
    batch = getattr(args, "batch", None) or 8
    n = config.train_seq_len

    def make():
        from ...models import GPT
        from ...models.gpt import parse_attention

        torch.manual_seed(options.seed(args))
        model = GPT(config).to(device).train()
        x = torch.randint(0, config.vocab_size, (batch, n), device=device)
        y = torch.roll(x, -1, dims=1)

        def peer(kind):
            def step():
                model.set_attention(*parse_attention(kind))
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    _, loss = model(x, y)
                loss.backward()
                model.zero_grad(set_to_none=True)
                return None

            return Peer(kind, step)

        return [peer(kind) for kind in KINDS], None

    fields = {"model": size, **config.as_dict(), "batch": batch, "seq_len": n, "pass": "fwd+bwd, bf16 autocast"}
    return Case(NAME, f"GPT {size} training step B={batch} N={n}", n, fields, "sdpa", "tokens/s", batch * n, make,
                series=f"GPT {size} training step")


def _heldout_case(args, device):
    windows = getattr(args, "gpt_windows", None) or 16
    return heldout_case(getattr(args, "weights", None), 8192, windows, HELDOUT_KINDS, device, "shipped", batch=8, warm=1)


def heldout_case(weights, n: int, windows: int, kinds, device, model_name: str, batch: int, warm: int) -> Case:
    """Held-out bits/byte and tokens/s of the model on `windows` windows of `n` bytes, one peer per
    attention spec (models.gpt.parse_attention), x the first; `warm` passes before timing settle
    adaptive sites."""

    def make():
        from ...models import load
        from ...models.evaluate import heldout_windows, score_windows
        from ...models.gpt import parse_attention

        model = load(weights, device)
        wins = heldout_windows(n, windows)

        def peer(kind):
            last: dict = {}

            def score():
                model.set_attention(*parse_attention(kind))
                with torch.no_grad():
                    last.update(score_windows(model, wins, batch=batch))

            return Peer(kind, score, warm=warm, info=lambda: {"bits_per_byte": last.get("bits_per_byte")})

        return [peer(kind) for kind in kinds], None

    fields = {"model": model_name, "seq_len": n, "windows": windows}
    series = f"GPT {model_name} held-out"
    return Case(NAME, f"{series} {windows} x {n} bytes", n, fields, kinds[0], "tokens/s", windows * n, make,
                series=series)
