"""Fused compress: error feedback, sparsify, residual, packed index and count sketch.

Two kernels over programs of ``BLOCK`` consecutive elements of one chunk (a multiple of 8,
so a program owns whole index bytes), with a tiny scan between them; no host sync:

1. ``_compress_kernel`` reads ``grad`` and ``residual``, forms ``a = residual + grad``
   (rounded to the residual's dtype, as ``residual.add_(grad)`` does) and keeps the
   entries strictly above the threshold, ``|a| > tau[row]``: writes the new residual
   (``a`` with those zeroed, ties ``|a| == tau`` still in it), packs them into 1- or 4-bit
   index bytes (viewing the block as ``[BLOCK/8, 8]`` or ``[BLOCK/2, 2]`` and summing
   shifted bits along the short axis), atomically adds them, in float32, with their signs
   into their three sketch cells, and stores the block's counts above ``tau`` and of ties.
2. In torch, per row: ``room = limit - (count above tau)`` and the exclusive prefix sum
   of the blocks' tie counts (the ties before each block).
3. ``_ties_kernel`` keeps the first ``room`` ties of the row in index order (the selection
   rule of :mod:`tagc.sketch.sparsify`): a block with no tie to keep (none, or its prefix
   already ``>= room``) reads nothing; the others re-read their residual, rank their ties
   as prefix + in-block cumulative sum, and for those within ``room`` zero the residual,
   OR their bits into the index bytes and add them to the sketch.

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
def _compress_kernel(
    grad_ptr,
    res_ptr,
    tau_ptr,
    index_ptr,
    table_ptr,
    counts_ptr,
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
    PER: tl.constexpr = 8 // BITS  # elements per index byte
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    byte = block * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    sub = tl.arange(0, PER)
    p = byte[:, None] * PER + sub[None, :]  # [BLOCK / PER, PER] chunk positions
    m = p < numel
    g = tl.load(grad_ptr + row * numel + p, mask=m, other=0.0)
    r = tl.load(res_ptr + row * numel + p, mask=m, other=0.0)
    af = round_to_dtype(r.to(tl.float32) + g.to(tl.float32), res_ptr.dtype.element_ty)
    tau = tl.load(tau_ptr + row)  # > 0: zeros are never kept
    nonzero = (af != 0.0) & m  # redundant with tau > 0, unless a device flushes subnormals
    above = (tl.abs(af) > tau) & nonzero
    tie = (tl.abs(af) == tau) & nonzero
    tl.store(res_ptr + row * numel + p, tl.where(above, 0.0, af).to(res_ptr.dtype.element_ty), mask=m)
    field = above.to(tl.int32) << (sub * BITS)[None, :]
    tl.store(index_ptr + row * nbytes + byte, tl.sum(field, axis=1).to(tl.uint8), mask=byte < nbytes)
    _add_to_sketch(table_ptr + row * table_numel, p, af, above, rows_ptr, signs_ptr, xor_ptr, LANE_BITS)
    counts = counts_ptr + (row * tl.num_programs(1) + block) * 2
    tl.store(counts, tl.sum(tl.sum(above.to(tl.int32), axis=1), axis=0))
    tl.store(counts + 1, tl.sum(tl.sum(tie.to(tl.int32), axis=1), axis=0))


@triton.jit
def _ties_kernel(
    res_ptr,
    tau_ptr,
    index_ptr,
    table_ptr,
    counts_ptr,
    before_ptr,
    room_ptr,
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
    """Keep the ties of this block whose rank in the row (ties before the block + rank in
    the block) is at most ``room[row]``; blocks with none to keep read nothing."""
    PER: tl.constexpr = 8 // BITS
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    slot = row * tl.num_programs(1) + block
    ties = tl.load(counts_ptr + slot * 2 + 1)
    before = tl.load(before_ptr + slot)
    room = tl.load(room_ptr + row)
    active = ((ties > 0) & (before < room)).to(tl.int32)
    byte = block * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    sub = tl.arange(0, PER)
    p = byte[:, None] * PER + sub[None, :]
    live = (byte * 0 + active) != 0  # [BLOCK / PER]: the interpreter cannot AND a scalar bool into a tensor mask
    m = (p < numel) & live[:, None]
    a = tl.load(res_ptr + row * numel + p, mask=m, other=0.0).to(tl.float32)
    tau = tl.load(tau_ptr + row)
    tie = ((tl.abs(a) == tau) & (a != 0.0) & m).to(tl.int32)
    per_byte = tl.sum(tie, axis=1)
    rank = before + (tl.cumsum(per_byte, axis=0) - per_byte)[:, None] + tl.cumsum(tie, axis=1)  # 1-based, index order
    keep = (tie != 0) & (rank <= room)
    tl.store(res_ptr + row * numel + p, tl.zeros(p.shape, res_ptr.dtype.element_ty), mask=keep)
    bm = (byte < nbytes) & live
    old = tl.load(index_ptr + row * nbytes + byte, mask=bm, other=0).to(tl.int32)
    field = keep.to(tl.int32) << (sub * BITS)[None, :]
    tl.store(index_ptr + row * nbytes + byte, (old | tl.sum(field, axis=1)).to(tl.uint8), mask=bm)
    _add_to_sketch(table_ptr + row * table_numel, p, a, keep, rows_ptr, signs_ptr, xor_ptr, LANE_BITS)


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
    wrap: Callable = lambda k: k,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the two kernels on contiguous ``[N, S]`` ``grad``/``residual`` (residual in place)
    with positive thresholds ``tau`` ``[N]`` and the per-row ``limit`` (:func:`keep_limit`).

    Returns ``(index [N, nbytes] uint8, table [N, table_numel] float32)``.
    """
    n_rows, numel = residual.shape
    nbytes = index_nbytes(numel, bits)
    index = torch.empty(n_rows, nbytes, dtype=torch.uint8, device=residual.device)
    table = torch.zeros(n_rows, table_numel, dtype=torch.float32, device=residual.device)
    if n_rows and numel:
        blocks = triton.cdiv(numel, BLOCK)
        grid = (n_rows, blocks)
        counts = torch.empty(n_rows, blocks, 2, dtype=torch.int32, device=residual.device)  # above tau, ties
        wrap(_compress_kernel)[grid](
            grad, residual, tau, index, table, counts, rows, signs, lane_xor, numel, nbytes, table_numel,
            LANE_BITS=lane_bits, BITS=bits, BLOCK=BLOCK,
        )
        ties = counts[:, :, 1]
        before = (ties.cumsum(1, dtype=torch.int32) - ties).contiguous()  # ties in earlier blocks of the row
        room = (limit - counts[:, :, 0].sum(1, dtype=torch.int64)).clamp(-1, 2**31 - 1).to(torch.int32)
        wrap(_ties_kernel)[grid](
            residual, tau, index, table, counts, before, room, rows, signs, lane_xor, numel, nbytes, table_numel,
            LANE_BITS=lane_bits, BITS=bits, BLOCK=BLOCK,
        )
    return index, table
