"""The kept entries as a list: TAGC's selection without the sketch (the ``topk`` peer's semantics).

Per rank row of ``n`` entries: error feedback (``a = residual + grad``), TAGC's selection rule, then the kept
entries, in index order, in fixed-size lists: ``counts`` int32 ``[N, nb + 1]`` (listed entries per block of
:data:`POSITION_BLOCK` positions, then the row's *overflow*: kept entries beyond the capacity ``cap``, which stay in
the residual), ``offsets`` uint16 ``[N, cap]`` (within the block) and ``values`` float32 ``[N, cap]`` (0 past the
row's count). A part whose gradient holds a NaN/Inf lists nothing, sends NaN values and keeps its residual.

This module is the reference (vectorised torch, no host reads: ``cumsum`` and ``searchsorted``
instead of ``nonzero()``); :mod:`tagc.kernels.dispatch` gives the same results from the Numba
(CPU) and Triton (GPU, :mod:`tagc.kernels.kept_list`) kernels, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from tagc.sketch.sparsify import (
    capacity,  # noqa: F401  (the lists' length: the selection rule's capacity)
    check_density,
    check_sketch_dtype,
    keep_limit,
    keep_mask,
    row_thresholds,
)

POSITION_BLOCK = 1 << 16
"""Positions travel as uint16 offsets within blocks of this many entries, plus a count per block."""


def position_blocks(numel: int) -> int:
    """Blocks of :data:`POSITION_BLOCK` positions in a row of ``numel``."""
    return -(-numel // POSITION_BLOCK)


def check_list_args(grad: torch.Tensor, residual: torch.Tensor, density: float, cap: int) -> None:
    """The argument checks every back end of :func:`list_kept_` makes (clear ``ValueError``)."""
    check_density(density)
    if grad.dim() != 2 or grad.shape != residual.shape:
        raise ValueError(f"grad {tuple(grad.shape)} and residual {tuple(residual.shape)} must be one [N, n] shape")
    check_sketch_dtype(grad, "the gradient")
    check_sketch_dtype(residual, "the residual")
    if not 0 <= cap <= grad.shape[1]:
        raise ValueError(f"capacity must be in [0, {grad.shape[1]}] (the row length), got {cap}")


def finite(x: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor: no NaN/Inf in ``x`` (one min/max pass; no host read)."""
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    low, high = torch.aminmax(x)
    return torch.isfinite(low) & torch.isfinite(high)


def compact(kept: torch.Tensor, values: torch.Tensor,
            cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``cap`` kept entries (bool ``[N, n]``) of each row of ``values``, in index order, into fixed-size
    lists: ``(counts, offsets, values)`` as in the module docstring, and ``listed`` (bool ``[N, n]``)."""
    world, numel = kept.shape
    running = kept.cumsum(dim=1, dtype=torch.int32)  # kept entries up to and including each position
    listed = kept & (running <= cap)
    slots = torch.arange(1, cap + 1, dtype=torch.int32, device=kept.device).expand(world, cap).contiguous()
    positions = torch.searchsorted(running, slots)  # the position of the k-th kept entry; n past the last
    valid = positions < numel
    positions = positions.clamp_(max=max(numel - 1, 0))
    listed_values = torch.where(valid, values.float().gather(1, positions), 0.0)
    ends = torch.arange(1, position_blocks(numel) + 1, device=kept.device).mul_(POSITION_BLOCK).clamp_(max=numel) - 1
    through = running[:, ends].clamp_(max=cap)  # entries listed up to each block's end
    per_block = torch.diff(through, dim=1, prepend=torch.zeros(world, 1, dtype=through.dtype, device=kept.device))
    overflow = (running[:, -1:] - cap).clamp_(min=0)
    counts = torch.cat([per_block, overflow], dim=1)
    offsets = torch.where(valid, positions % POSITION_BLOCK, 0).to(torch.uint16)
    return counts, offsets, listed_values, listed


def list_kept_(grad: torch.Tensor, residual: torch.Tensor, density: float, cap: int,
               tau: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error feedback, TAGC's selection, and the kept entries as lists; ``residual`` keeps the rest.

    Args:
        grad: ``[N, n]`` (float32, bfloat16 or float16); residual: the same shape, updated in
            place (in its own dtype, as TAGC's ``compress_``).
        density: the fraction of each row to keep; cap: list entries per row (:func:`capacity`).
        tau: optional per-row thresholds ``[N]`` instead of :func:`row_thresholds`.
    Returns:
        ``(counts int32 [N, nb + 1], offsets uint16 [N, cap], values float32 [N, cap])``.
    """
    check_list_args(grad, residual, density, cap)
    numel = grad.shape[1]
    ok = finite(grad)
    accumulated = residual.clone().add_(grad)
    if tau is None:
        tau = row_thresholds(accumulated, density)
    kept = keep_mask(accumulated, tau.reshape(-1, 1), keep_limit(numel, density))  # scratch: compact() consumes it
    counts, offsets, values, listed = compact(kept, accumulated, cap)
    residual.copy_(torch.where(ok, accumulated.masked_fill_(listed, 0), residual))
    return torch.where(ok, counts, 0), zero_unless(ok, offsets), torch.where(ok, values, torch.nan)


def zero_unless(ok: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``offsets`` (uint16) where ``ok``, else 0: ``torch.where`` through an int16 view of the same bits
    (CUDA's ``where`` has no uint16 kernel)."""
    return torch.where(ok, offsets.view(torch.int16), 0).view(torch.uint16)


def sum_lists(counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Every row's list scatter-added into float32 ``[numel]``: the inverse of :func:`list_kept_`
    summed over rows, padding ignored.

    Rows are added in rank order (one ``index_add_`` each; positions within a row are
    distinct), so the sum is deterministic and the same on every back end.
    """
    world = offsets.shape[0]
    positions, valid = list_positions(counts, offsets, numel)  # padding lands in slot numel, dropped
    values = torch.where(valid, values, 0.0)
    summed = torch.zeros(numel + 1, dtype=torch.float32, device=values.device)
    for row in range(world):
        summed.index_add_(0, positions[row], values[row])
    return summed[:numel]


def list_positions(counts: torch.Tensor, offsets: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed entries' positions, int64 ``[N, cap]`` (``numel`` for padding), and which are listed (bool)."""
    world, cap = offsets.shape
    ends = counts[:, :-1].to(torch.int64).cumsum(dim=1)  # [N, nb]
    entry = torch.arange(cap, device=offsets.device).expand(world, cap).contiguous()
    block = torch.searchsorted(ends, entry, right=True)
    positions = block * POSITION_BLOCK + offsets.to(torch.int64)
    valid = (entry < ends[:, -1:]) & (positions < numel)
    return torch.where(valid, positions, numel), valid
