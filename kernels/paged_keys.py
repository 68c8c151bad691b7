"""Key rows of the sparse-attention and indexer kernels read from two places: a pool of rows, then a paged store
through a page list (``kernels.attention``, ``kernels.attention_split``, ``kernels.indexer``).

A decode step's key lists (``models.deepseek_v4.decode_step``, ``deepseek_v41.decode_step``) number the window rows
``0 .. N1-1`` (a pool the step gathers) and then, row after row of the batch, each row's compressed rows in position
order: key ``N1 + j`` is row ``j % R`` of page ``pages[j // R]`` of the paged store (``R`` rows a page; ``pages`` the
rows' block tables, one after another). The indexer's range scores read every key from the pages (``N1 = 0``). Read
through the pages, those rows need not be gathered into a copy each step (a copy of every compressed row and index
key of every sequence, though the attention reads only the listed ones: the indexer's top-k in a CSA layer).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def key_rows(k_ptr, p_ptr, pages_ptr, kid, valid, N1, R, D: tl.constexpr, PAGED: tl.constexpr):
    """Pointers to the first element of keys ``kid`` (int64): ``k_ptr + kid·D`` below ``N1``; with ``PAGED`` above it
    row ``(kid - N1) % R`` of page ``pages[(kid - N1) // R]`` of the store at ``p_ptr`` (``[pages, R, D]``). A page id
    is read only for ``valid`` keys."""
    if PAGED:
        j = tl.maximum(kid - N1, 0)
        paged = valid & (kid >= N1)
        page = tl.load(pages_ptr + j // R, mask=paged, other=0).to(tl.int64)
        return tl.where(kid < N1, k_ptr + kid * D, p_ptr + (page * R + j % R) * D)
    return k_ptr + kid * D


def check_paged(keys: torch.Tensor, paged: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    """The kernels' paged arguments ``(store, pages, R, PAGED)`` for ``keys [N1, d]`` and ``paged = (store [P, R, d],
    pages [M] int32/int64)`` (or none: ``keys`` alone). Raises on a store of another dtype, width or device."""
    if paged is None:
        return keys, keys, 1, False
    store, pages = paged
    if store.dim() != 3 or store.shape[2] != keys.shape[1] or store.dtype != keys.dtype:
        raise ValueError(
            f"paged keys: the store must be [pages, R, {keys.shape[1]}] of {keys.dtype}, got {store.dtype} "
            f"{tuple(store.shape)}"
        )
    if pages.dim() != 1 or pages.dtype not in (torch.int32, torch.int64) or not store.is_contiguous():
        raise ValueError(f"paged keys: pages must be 1-D int32/int64 and the store contiguous, got {pages.dtype}")
    if store.device != keys.device or pages.device != keys.device:
        raise ValueError("paged keys: the store and its pages must be on the keys' device")
    return store, pages.contiguous(), store.shape[1], True


def gathered(keys: torch.Tensor, paged: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The pool the paged keys stand for: ``keys`` then every listed page's rows (the reference's copy; ``torch.cat``'s
    type promotion)."""
    if paged is None:
        return keys
    store, pages = paged
    return torch.cat([keys, store.index_select(0, pages.long()).flatten(0, 1)])


__all__ = ["check_paged", "gathered"]
