"""Real workloads: a small byte-level GPT trained on the standard library's sources.

    from adaattn import models
    model = models.load()                          # the shipped weights, float32 on the CPU
    cap = models.capture(model, seq_len=1024)      # per layer: post-RoPE q, k, v and exact output
"""

from .capture import Capture, LayerCapture, capture, heldout_tokens
from .data import Corpus, load_corpus
from .gpt import GPT, GPTConfig
from .pretrained import DEFAULT_WEIGHTS, load, save

__all__ = [
    "Capture",
    "Corpus",
    "DEFAULT_WEIGHTS",
    "GPT",
    "GPTConfig",
    "LayerCapture",
    "capture",
    "heldout_tokens",
    "load",
    "load_corpus",
    "save",
]
