"""Context (sequence) parallel attention over a torch.distributed process group.

`ring_attention` computes exact attention for a sequence sharded across the ranks of a group:
K/V shards travel around the ring (isend/irecv) while each rank attends its local queries to
the visiting keys, and partial results merge exactly by log-sum-exp. The same code runs on
NCCL (GPU tensors) and gloo (CPU tensors). `shard` / `unshard` split and restore the global
sequence in the layout ("zigzag" or "plain") that ring_attention assumes. `gather_records`
collects every rank's adaattn.stats records (each ring call records its rank's decisions), and
`summarize_ranks` turns them into one summary per call. Under `Policy(mode="auto")` with
quantized precisions, each rank's blocks run at per-head levels under the policy's tolerance
(`adaattn.distributed.adaptive`). The planner chooses each call's block engine;
`explain_ring_block` shows that choice for one rank's shards, every engine with its reasons.

Not imported by `import adaattn`; use `import adaattn.distributed`.
"""

from __future__ import annotations

from .blocks import explain_ring_block
from .layout import positions, shard, unshard
from .module import RingAttention
from .records import gather_records, summarize_ranks
from .ring import ring_attention

__all__ = ["RingAttention", "explain_ring_block", "gather_records", "positions", "ring_attention", "shard",
           "summarize_ranks", "unshard"]
