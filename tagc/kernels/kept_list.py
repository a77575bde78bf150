"""``topk``'s kept list on the device: :func:`tagc.sketch.kept_list.list_kept_` and ``sum_lists``.

**List** (:func:`launch_list_kept`): ``_list_count_kernel`` counts, per program of ``BLOCK`` entries, those above
``tau``, the ties and the non-finite gradients of ``a = residual + grad``; scans in torch give ``ok``, ``room`` and
each program's kept entries before it; ``_list_write_kernel`` writes the row's first ``cap`` kept entries into their
list slots and, if ``ok``, the residual. Every step is exact (integer counts, element-wise arithmetic, plain
stores), so counts, offsets, values and residual are the reference's bit for bit; no host sync.

**Sum** (:func:`launch_sum_lists`): ``_sum_lists_kernel`` adds one row's list into the output; rows are launched in
rank order and a row's positions are distinct, so each position's sum is the reference's ``index_add_``'s, exactly
(no atomics). :mod:`tagc.kernels.ops` registers the launchers as torch operators.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from tagc.kernels.fp import round_to_dtype
from tagc.sketch.kept_list import POSITION_BLOCK, position_blocks, zero_unless

BLOCK = 1024
"""Entries per program of the list kernels (divides :data:`POSITION_BLOCK`)."""
TILE = 1024
"""List entries per program of the sum."""


@triton.jit
def _accumulated(grad_ptr, res_ptr, tau_ptr, row, block, numel, BLOCK: tl.constexpr):
    """Positions of this program, their mask, ``a`` (float32, rounded to the residual's dtype), the
    gradient, and which entries are above ``tau`` / tied with it."""
    p = block * BLOCK + tl.arange(0, BLOCK)
    m = p < numel
    g = tl.load(grad_ptr + row * numel + p, mask=m, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * numel + p, mask=m, other=0.0).to(tl.float32)
    a = round_to_dtype(r + g, res_ptr.dtype.element_ty)
    tau = tl.load(tau_ptr + row)  # > 0: zeros are never kept
    nonzero = (a != 0.0) & m  # redundant with tau > 0, unless a device flushes subnormals
    above = (tl.abs(a) > tau) & nonzero
    tie = (tl.abs(a) == tau) & nonzero
    return p, m, a, g, above, tie


@triton.jit
def _list_count_kernel(grad_ptr, res_ptr, tau_ptr, counts_ptr, numel, BLOCK: tl.constexpr):
    """``counts[row, block]``: entries above ``tau``, ties, non-finite gradients."""
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    p, m, a, g, above, tie = _accumulated(grad_ptr, res_ptr, tau_ptr, row, block, numel, BLOCK)
    bad = m & ((g.to(tl.int32, bitcast=True) & 0x7F800000) == 0x7F800000)  # NaN or Inf: the exponent all ones
    slot = counts_ptr + (row * tl.num_programs(0) + block) * 3
    tl.store(slot, tl.sum(above.to(tl.int32), axis=0))
    tl.store(slot + 1, tl.sum(tie.to(tl.int32), axis=0))
    tl.store(slot + 2, tl.sum(bad.to(tl.int32), axis=0))


@triton.jit
def _list_write_kernel(grad_ptr, res_ptr, tau_ptr, ties_before_ptr, room_ptr, kept_before_ptr, ok_ptr,
                       offsets_ptr, values_ptr, numel, cap, BLOCK: tl.constexpr, POSITION_BLOCK: tl.constexpr):
    """List this program's kept entries within the row's first ``cap``; write the residual if ``ok``."""
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    slot = row * tl.num_programs(0) + block
    p, m, a, g, above, tie = _accumulated(grad_ptr, res_ptr, tau_ptr, row, block, numel, BLOCK)
    tie_rank = tl.load(ties_before_ptr + slot) + tl.cumsum(tie.to(tl.int64), axis=0)  # 1-based, index order
    kept = above | (tie & (tie_rank <= tl.load(room_ptr + row)))
    entry = tl.load(kept_before_ptr + slot) + tl.cumsum(kept.to(tl.int64), axis=0) - 1  # slot in the row's list
    listed = kept & (entry < cap)
    tl.store(offsets_ptr + row * cap + entry, (p & (POSITION_BLOCK - 1)).to(tl.uint16), mask=listed)
    tl.store(values_ptr + row * cap + entry, a, mask=listed)
    ok = (p * 0 + tl.load(ok_ptr)) != 0  # a tensor mask: the interpreter cannot AND a 0-d bool into one
    tl.store(res_ptr + row * numel + p, tl.where(listed, 0.0, a).to(res_ptr.dtype.element_ty), mask=m & ok)


@triton.jit
def _sum_lists_kernel(counts_ptr, offsets_ptr, values_ptr, first_ptr, out_ptr, numel, cap, TILE: tl.constexpr,
                      POSITION_BLOCK: tl.constexpr):
    """Add tile ``program_id(1)`` of one row's entries in position block ``program_id(0)`` into ``out``."""
    block = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1).to(tl.int64)
    n = tl.load(counts_ptr + block).to(tl.int64)
    first = tl.load(first_ptr + block)
    k = tile * TILE + tl.arange(0, TILE)
    j = first + k
    m = (k < n) & (j < cap)
    position = block * POSITION_BLOCK + tl.load(offsets_ptr + j, mask=m, other=0).to(tl.int64)
    m = m & (position < numel)
    value = tl.load(values_ptr + j, mask=m, other=0.0)
    tl.store(out_ptr + position, tl.load(out_ptr + position, mask=m, other=0.0) + value, mask=m)


def launch_list_kept(grad: torch.Tensor, residual: torch.Tensor, tau: torch.Tensor, cap: int, limit: int,
                     wrap: Callable = lambda k: k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the list kernels on contiguous ``[N, n]`` ``grad``/``residual`` (residual in place) with
    positive float32 thresholds ``tau`` ``[N]`` and the per-row ``limit`` (:func:`keep_limit`).

    Returns ``(counts int32 [N, nb + 1], offsets uint16 [N, cap], values float32 [N, cap])``.
    """
    rows, numel = residual.shape
    device = residual.device
    offsets = torch.zeros(rows, cap, dtype=torch.uint16, device=device)
    values = torch.zeros(rows, cap, dtype=torch.float32, device=device)
    if rows == 0 or numel == 0:
        return torch.zeros(rows, position_blocks(numel) + 1, dtype=torch.int32, device=device), offsets, values
    blocks = triton.cdiv(numel, BLOCK)
    grid = (blocks, rows)
    counts = torch.empty(rows, blocks, 3, dtype=torch.int32, device=device)  # above tau, ties, non-finite
    wrap(_list_count_kernel)[grid](grad, residual, tau, counts, numel, BLOCK=BLOCK)
    above, ties, bad = counts.to(torch.int64).unbind(dim=2)
    ok = bad.sum() == 0
    room = limit - above.sum(dim=1, keepdim=True)
    ties_before = torch.cumsum(ties, dim=1) - ties
    kept = above + torch.minimum(ties, (room - ties_before).clamp(min=0))  # ties kept in index order up to room
    kept_before = torch.cumsum(kept, dim=1) - kept
    wrap(_list_write_kernel)[grid](grad, residual, tau, ties_before.contiguous(), room.contiguous(),
                                   kept_before.contiguous(), ok.to(torch.int32), offsets, values, numel, cap,
                                   BLOCK=BLOCK, POSITION_BLOCK=POSITION_BLOCK)
    listed = torch.minimum(kept, (cap - kept_before).clamp(min=0))  # per program: the row's first cap
    per_group = POSITION_BLOCK // BLOCK
    listed = torch.nn.functional.pad(listed, (0, position_blocks(numel) * per_group - blocks))
    per_block = listed.view(rows, -1, per_group).sum(dim=2)
    overflow = (kept.sum(dim=1, keepdim=True) - cap).clamp(min=0)
    out = torch.cat([per_block, overflow], dim=1).to(torch.int32)
    return torch.where(ok, out, 0), zero_unless(ok, offsets), torch.where(ok, values, torch.nan)


def launch_sum_lists(counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int,
                     wrap: Callable = lambda k: k) -> torch.Tensor:
    """Every row's list added into float32 ``[numel]``, rows in rank order (one launch each)."""
    rows, cap = offsets.shape
    out = torch.zeros(numel, dtype=torch.float32, device=values.device)
    blocks = counts.shape[1] - 1
    if rows == 0 or cap == 0 or blocks <= 0 or numel == 0:
        return out
    counts = counts.contiguous()
    offsets = offsets.contiguous()
    values = values.to(torch.float32).contiguous()
    per_block = counts[:, :blocks].to(torch.int64)
    firsts = (torch.cumsum(per_block, dim=1) - per_block).contiguous()
    grid = (blocks, triton.cdiv(min(cap, POSITION_BLOCK), TILE))
    for row in range(rows):  # rank order: each position's sum is the reference's, bit for bit
        wrap(_sum_lists_kernel)[grid](counts[row], offsets[row], values[row], firsts[row], out, numel, cap,
                                      TILE=TILE, POSITION_BLOCK=POSITION_BLOCK)
    return out
