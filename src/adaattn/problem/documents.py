"""Documents packed along the sequence axis (adaattn.documents), FlexAttention's document mask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import _name


@dataclass(frozen=True, eq=False)
class Documents:
    """Documents packed along the sequence axis (adaattn.documents): query i attends key j only
    where both lie in one document. cu_seqlens (int32, on the ids' device) holds the start of
    every document in flattened positions b * length + n, then batch * length; max_seqlen is
    the longest document."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    batch: int
    length: int

    def __repr__(self) -> str:
        return (f"Documents({self.cu_seqlens.shape[0] - 1} documents over batch={self.batch} x "
                f"length={self.length}, longest {self.max_seqlen})")

    def for_batch(self, batch: int) -> "Documents":
        """These documents repeated over `batch` rows (ids given once for every row)."""
        if batch == self.batch:
            return self
        if self.batch != 1:
            raise ValueError(f"documents cover a batch of {self.batch}, the tensors have {batch}")
        starts = self.cu_seqlens[:-1]
        rows = torch.arange(batch, device=starts.device, dtype=torch.int32)[:, None] * self.length
        cu = torch.cat([(starts[None, :] + rows).reshape(-1),
                        torch.full((1,), batch * self.length, dtype=torch.int32, device=starts.device)])
        return Documents(cu, self.max_seqlen, batch, self.length)


def documents(document_ids: object) -> Documents:
    """Packed documents from per-position ids, as FlexAttention's document mask reads them:
    `document_ids` (N,) or (B, N), integers; positions with equal ids in one row form one
    document, which must be one contiguous run (ids need not be sorted or start at 0).
    Build it once per batch and pass it to every layer's adaattn.attention(..., documents=...):
    it reads the document count and longest length from the device once (a host sync).
    Raises TypeError for non-integer ids, ValueError for another rank or a document split in
    two runs."""
    if not isinstance(document_ids, torch.Tensor):
        try:
            document_ids = torch.as_tensor(document_ids)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"document_ids must be an integer tensor, got {_name(document_ids)}") from None
    ids = document_ids
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"document_ids must be an integer tensor, got {ids.dtype}")
    if ids.dim() not in (1, 2):
        raise ValueError(f"document_ids must be (N,) or (B, N), got shape {tuple(ids.shape)}")
    batch, length = (1, ids.shape[0]) if ids.dim() == 1 else tuple(ids.shape)
    total = batch * length
    if total >= 2 ** 31:
        raise ValueError(f"document_ids cover {total} positions; at most 2**31 - 1 are addressable")
    flat = ids.reshape(-1)
    pos = torch.arange(total, device=ids.device)
    new_run = (pos % max(length, 1) == 0) | (flat != flat.roll(1))
    starts = new_run.nonzero().flatten()
    pairs = torch.stack([starts // max(length, 1), flat[starts].long()], 1)
    if torch.unique(pairs, dim=0).shape[0] != pairs.shape[0]:
        raise ValueError("document_ids must hold each document in one contiguous run of positions (an id "
                         "appears again after another id); give each run its own id")
    cu = torch.cat([starts, torch.full((1,), total, device=ids.device, dtype=starts.dtype)]).to(torch.int32)
    longest = int(cu.diff().max()) if cu.shape[0] > 1 else 0
    return Documents(cu, longest, batch, length)
