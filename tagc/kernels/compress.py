"""Fused compress: error feedback, sparsify, residual, packed index and count sketch.

Two kernels over programs of ``BLOCK`` consecutive elements of one chunk (a multiple of 8,
so a program owns whole index bytes), with a tiny scan between them; no host sync:

1. ``_count_kernel`` reads ``grad`` and ``residual``, forms ``a = residual + grad``
   (rounded to the residual's dtype, as ``residual.add_(grad)`` does) and stores the block's
   counts above the threshold (``|a| > tau[row]``) and of ties (``|a| == tau``). It writes
   nothing else.
2. In torch, per row: the exclusive prefix sums of the blocks' counts (the entries above
   ``tau`` and the ties before each block), ``room = limit - (count above tau)`` and what
   the capacity holds back (what the rule keeps, past ``cap``).
3. ``_compress_kernel`` reads them again and applies the selection rule of
   :mod:`tagc.sketch.sparsify`: the entries above ``tau`` and the ties whose rank in the row
   (the prefix + the running count in the block, in index order) is within ``room``, and of
   those the first ``cap``. It writes the new residual (``a``, with the kept entries zeroed), packs
   them into 1- or 4-bit index bytes (viewing the block as ``[BLOCK/8, 8]`` or ``[BLOCK/2, 2]``
   and summing shifted bits along the short axis) and atomically adds them, in float32, with
   their signs into their three sketch cells.

Counting first costs one more read of ``grad`` and ``residual`` (memory-bound: about 20
bytes per element against 12), and buys a row that never keeps more than ``cap``, whatever
the sample made of it, with one write pass.

The per-block rows / signs / lane-xor tables are loaded from :meth:`SketchLayout.tables`,
so the cells are exactly the reference's. The threshold ``tau`` comes from
:mod:`tagc.kernels.radix_select` (or is given); :func:`tagc.kernels.ops.compress_triton` is
the entry point that runs both. The only difference from the reference
:func:`tagc.sketch.compress_` is the order of the float atomics in the table (so the table
matches to float rounding, exactly where the sums are exact; index and residual match bit
for bit).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from tagc.kernels.fp import round_to_dtype
from tagc.sketch.index import index_nbytes

BLOCK = 1024


@triton.jit
def _add_to_sketch(table, p, value, keep, rows_ptr, signs_ptr, xor_ptr, LANE_BITS: tl.constexpr):
    """Atomically add ``sign * value`` of the ``keep`` positions ``p`` to their three cells:
    ``rows[b, j] * L + (t ^ xor[b])``."""
    b = p >> LANE_BITS
    col = (p & ((1 << LANE_BITS) - 1)) ^ tl.load(xor_ptr + b, mask=keep, other=0)
    for j in tl.static_range(3):
        cell_row = tl.load(rows_ptr + b * 3 + j, mask=keep, other=0)
        sign = tl.load(signs_ptr + b * 3 + j, mask=keep, other=0.0)
        tl.atomic_add(table + (cell_row << LANE_BITS) + col, sign * value, mask=keep)


@triton.jit
def _accumulated(grad_ptr, res_ptr, row, numel, p, m):
    """``a = residual + grad`` at positions ``p`` of ``row``, rounded to the residual's dtype."""
    g = tl.load(grad_ptr + row * numel + p, mask=m, other=0.0)
    r = tl.load(res_ptr + row * numel + p, mask=m, other=0.0)
    return round_to_dtype(r.to(tl.float32) + g.to(tl.float32), res_ptr.dtype.element_ty)


@triton.jit
def _rank_in_block(flag):
    """1-based rank in index order of each set entry of ``flag`` ``[BLOCK / PER, PER]`` (int32)."""
    per_byte = tl.sum(flag, axis=1)
    return (tl.cumsum(per_byte, axis=0) - per_byte)[:, None] + tl.cumsum(flag, axis=1)


@triton.jit
def _count_kernel(grad_ptr, res_ptr, tau_ptr, counts_ptr, numel, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Store this block's counts of ``|a| > tau`` and ``|a| == tau`` (``a != 0``)."""
    PER: tl.constexpr = 8 // BITS
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    byte = block * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    p = byte[:, None] * PER + tl.arange(0, PER)[None, :]
    m = p < numel
    af = _accumulated(grad_ptr, res_ptr, row, numel, p, m)
    tau = tl.load(tau_ptr + row)  # > 0: zeros are never kept
    nonzero = (af != 0.0) & m  # redundant with tau > 0, unless a device flushes subnormals
    above = ((tl.abs(af) > tau) & nonzero).to(tl.int32)
    tie = ((tl.abs(af) == tau) & nonzero).to(tl.int32)
    counts = counts_ptr + (row * tl.num_programs(1) + block) * 2
    tl.store(counts, tl.sum(tl.sum(above, axis=1), axis=0))
    tl.store(counts + 1, tl.sum(tl.sum(tie, axis=1), axis=0))


@triton.jit
def _compress_kernel(
    grad_ptr,
    res_ptr,
    tau_ptr,
    index_ptr,
    table_ptr,
    above_before_ptr,
    ties_before_ptr,
    room_ptr,
    cap,
    rows_ptr,
    signs_ptr,
    xor_ptr,
    numel,
    nbytes,
    table_numel,
    LANE_BITS: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Keep the entries above ``tau`` and the ties ranked within ``room[row]``, of those the
    first ``cap`` (ranks: the counts before the block + the running count in it, in index order)."""
    PER: tl.constexpr = 8 // BITS  # elements per index byte
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    slot = row * tl.num_programs(1) + block
    byte = block * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    sub = tl.arange(0, PER)
    p = byte[:, None] * PER + sub[None, :]  # [BLOCK / PER, PER] chunk positions
    m = p < numel
    af = _accumulated(grad_ptr, res_ptr, row, numel, p, m)
    tau = tl.load(tau_ptr + row)
    nonzero = (af != 0.0) & m
    above = (tl.abs(af) > tau) & nonzero
    tie = (tl.abs(af) == tau) & nonzero
    room = tl.load(room_ptr + row)
    above_through = tl.load(above_before_ptr + slot) + _rank_in_block(above.to(tl.int32))  # up to each position
    ties_through = tl.load(ties_before_ptr + slot) + _rank_in_block(tie.to(tl.int32))
    kept_through = above_through + tl.minimum(ties_through, tl.maximum(room, 0))  # kept before the capacity
    keep = (above | (tie & (ties_through <= room))) & (kept_through <= cap)
    tl.store(res_ptr + row * numel + p, tl.where(keep, 0.0, af).to(res_ptr.dtype.element_ty), mask=m)
    field = keep.to(tl.int32) << (sub * BITS)[None, :]
    tl.store(index_ptr + row * nbytes + byte, tl.sum(field, axis=1).to(tl.uint8), mask=byte < nbytes)
    _add_to_sketch(table_ptr + row * table_numel, p, af, keep, rows_ptr, signs_ptr, xor_ptr, LANE_BITS)


def launch_compress(
    grad: torch.Tensor,
    residual: torch.Tensor,
    tau: torch.Tensor,
    rows: torch.Tensor,
    signs: torch.Tensor,
    lane_xor: torch.Tensor,
    lane_bits: int,
    table_numel: int,
    bits: int,
    limit: int,
    cap: int,
    wrap: Callable = lambda k: k,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the two kernels on contiguous ``[N, S]`` ``grad``/``residual`` (residual in place)
    with positive thresholds ``tau`` ``[N]``, the per-row ``limit`` (:func:`keep_limit`) and
    capacity ``cap`` (:func:`capacity`).

    Returns ``(index [N, nbytes] uint8, table [N, table_numel] float32, held [N] int64)``:
    ``held``, the entries the capacity left in the residual.
    """
    n_rows, numel = residual.shape
    nbytes = index_nbytes(numel, bits)
    index = torch.empty(n_rows, nbytes, dtype=torch.uint8, device=residual.device)
    table = torch.zeros(n_rows, table_numel, dtype=torch.float32, device=residual.device)
    held = torch.zeros(n_rows, dtype=torch.int64, device=residual.device)
    if n_rows and numel:
        blocks = triton.cdiv(numel, BLOCK)
        grid = (n_rows, blocks)
        counts = torch.empty(n_rows, blocks, 2, dtype=torch.int32, device=residual.device)  # above tau, ties
        wrap(_count_kernel)[grid](grad, residual, tau, counts, numel, BITS=bits, BLOCK=BLOCK)
        above, ties = counts[:, :, 0], counts[:, :, 1]
        above_before = (above.cumsum(1, dtype=torch.int32) - above).contiguous()  # in earlier blocks of the row
        ties_before = (ties.cumsum(1, dtype=torch.int32) - ties).contiguous()
        above_total = above.sum(1, dtype=torch.int64)
        room = (limit - above_total).clamp(-1, 2**31 - 1).to(torch.int32)
        held = (above_total + torch.minimum(ties.sum(1, dtype=torch.int64), room.clamp(min=0)) - cap).clamp_(min=0)
        wrap(_compress_kernel)[grid](
            grad, residual, tau, index, table, above_before, ties_before, room, cap, rows, signs, lane_xor, numel,
            nbytes, table_numel, LANE_BITS=lane_bits, BITS=bits, BLOCK=BLOCK,
        )
    return index, table, held
