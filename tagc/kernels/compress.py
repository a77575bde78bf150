"""Fused compress: error feedback, sparsify, residual, packed index and count sketch.

Three kernels over programs of ``BLOCK`` consecutive elements of a chunk (whole index bytes), a scan in torch
between the first two; no host sync:

1. ``_count_kernel`` counts, per program, ``|a| > tau`` and the ties ``|a| == tau`` of ``a = residual + grad``
   (rounded to the residual's dtype, as ``residual.add_(grad)`` does);
2. in torch, per row: the counts' exclusive prefix sums, ``room = limit - (count above tau)`` and what the capacity
   holds back;
3. ``_compress_kernel`` applies the selection rule of :mod:`tagc.sketch.sparsify` with those ranks, writes the new
   residual and the packed index, and what it sent into a scratch chunk;
4. ``_table_kernel`` sums the sent values with their signs into each table row's cells, blocks in increasing
   order, one lane per cell: the reference's order, no float atomics (:func:`blocks_by_row` is the inverse).

Counting first costs one more read of ``grad`` and ``residual`` (docs/design.md §3.3) and buys a row that never
keeps more than ``cap`` and a table that is the same bits on every run and back end. Programs over a chunk's blocks
are on grid axis 0 (CUDA allows 2**31 - 1 there, 65,535 on axes 1 and 2). The threshold comes from
:mod:`tagc.kernels.radix_select` (or is given); :func:`tagc.kernels.ops.compress_triton` runs both. Index, residual
and table match :func:`tagc.sketch.compress_` on the CPU bit for bit (on CUDA the reference's ``scatter_add_`` adds a
cell's values in the order its atomics land, so its own table may differ in the last bits from run to run).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from tagc.kernels.fp import round_to_dtype
from tagc.sketch.index import index_nbytes

BLOCK = 1024
"""Elements per program of the count and compress kernels (a multiple of 8: whole index bytes)."""
TABLE_TILE = 2048
"""Cells per program of the table kernel (whole rows: at least one)."""
TABLE_TILE_INTERPRETER = 16384
"""The same under the interpreter, whose cost is per operation."""


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
    block = tl.program_id(0).to(tl.int64)  # axis 0: up to 2**31 - 1 programs (axes 1 and 2 stop at 65,535)
    row = tl.program_id(1).to(tl.int64)
    byte = block * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
    p = byte[:, None] * PER + tl.arange(0, PER)[None, :]
    m = p < numel
    af = _accumulated(grad_ptr, res_ptr, row, numel, p, m)
    tau = tl.load(tau_ptr + row)  # > 0: zeros are never kept
    nonzero = (af != 0.0) & m  # redundant with tau > 0, unless a device flushes subnormals
    above = ((tl.abs(af) > tau) & nonzero).to(tl.int32)
    tie = ((tl.abs(af) == tau) & nonzero).to(tl.int32)
    counts = counts_ptr + (row * tl.num_programs(0) + block) * 2
    tl.store(counts, tl.sum(tl.sum(above, axis=1), axis=0))
    tl.store(counts + 1, tl.sum(tl.sum(tie, axis=1), axis=0))


@triton.jit
def _compress_kernel(grad_ptr, res_ptr, tau_ptr, index_ptr, sent_ptr, above_before_ptr, ties_before_ptr, room_ptr, cap,
                     numel, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Keep the entries above ``tau`` and the ties ranked within ``room[row]``, of those the
    first ``cap`` (ranks: the counts before the block + the running count in it, in index order)."""
    PER: tl.constexpr = 8 // BITS  # elements per index byte
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    slot = row * tl.num_programs(0) + block
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
    tl.store(sent_ptr + row * numel + p, tl.where(keep, af, 0.0), mask=m)


@triton.jit
def _table_kernel(sent_ptr, table_ptr, by_row_ptr, row_start_ptr, signs_ptr, xor_ptr, numel, table_numel, table_rows,
                  LANE_BITS: tl.constexpr, ROWS: tl.constexpr):
    """``ROWS`` table rows of chunk ``program_id(1)``: into each row, every block that adds into it, in
    increasing block order (the reference's order, position by position), ``sign * sent`` summed into
    the row's ``L`` cells in float32, each cell by one lane: no atomics, the same bits on every run
    and as the reference's ``scatter_add_``."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    chunk = tl.program_id(1).to(tl.int64)
    rm = r < table_rows
    start = tl.load(row_start_ptr + r, mask=rm, other=0)
    count = tl.load(row_start_ptr + r + 1, mask=rm, other=0) - start
    col = tl.arange(0, 1 << LANE_BITS).to(tl.int64)
    acc = tl.zeros([ROWS, 1 << LANE_BITS], tl.float32)
    for e in range(0, tl.max(count, axis=0)):
        has = e < count
        entry = tl.load(by_row_ptr + start + e, mask=has, other=0)  # block * 3 + j
        b = entry // 3
        x = tl.load(xor_ptr + b, mask=has, other=0)
        p = (b << LANE_BITS)[:, None] + (col[None, :] ^ x[:, None])
        sent = tl.load(sent_ptr + chunk * numel + p, mask=has[:, None] & (p < numel), other=0.0)
        acc += tl.load(signs_ptr + entry, mask=has, other=0.0)[:, None] * sent  # + 0 where nothing was sent: exact
    tl.store(table_ptr + chunk * table_numel + (r << LANE_BITS)[:, None] + col[None, :], acc, mask=rm[:, None])


def launch_compress(grad: torch.Tensor, residual: torch.Tensor, tau: torch.Tensor, rows: torch.Tensor,
                    signs: torch.Tensor, lane_xor: torch.Tensor, lane_bits: int, table_numel: int, bits: int,
                    limit: int, cap: int, by_row: Optional[torch.Tensor] = None,
                    row_start: Optional[torch.Tensor] = None,
                    wrap: Callable = lambda k: k) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the two kernels on contiguous ``[N, S]`` ``grad``/``residual`` (residual in place)
    with positive thresholds ``tau`` ``[N]``, the per-row ``limit`` (:func:`keep_limit`) and
    capacity ``cap`` (:func:`capacity`). ``by_row, row_start`` are :func:`blocks_by_row` of ``rows``
    (computed here when not given).

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
        grid = (blocks, n_rows)  # blocks on axis 0: a chunk of up to 2**31 elements launches
        counts = torch.empty(n_rows, blocks, 2, dtype=torch.int32, device=residual.device)  # above tau, ties
        wrap(_count_kernel)[grid](grad, residual, tau, counts, numel, BITS=bits, BLOCK=BLOCK)
        above, ties = counts[:, :, 0], counts[:, :, 1]
        above_before = (above.cumsum(1, dtype=torch.int32) - above).contiguous()  # in earlier blocks of the row
        ties_before = (ties.cumsum(1, dtype=torch.int32) - ties).contiguous()
        above_total = above.sum(1, dtype=torch.int64)
        room = (limit - above_total).clamp(-1, 2**31 - 1).to(torch.int32)
        held = (above_total + torch.minimum(ties.sum(1, dtype=torch.int64), room.clamp(min=0)) - cap).clamp_(min=0)
        sent = torch.empty(n_rows, numel, dtype=torch.float32, device=residual.device)
        wrap(_compress_kernel)[grid](grad, residual, tau, index, sent, above_before, ties_before, room, cap, numel,
                                     nbytes, BITS=bits, BLOCK=BLOCK)
        if by_row is None or row_start is None:
            by_row, row_start = blocks_by_row(rows, table_numel >> lane_bits)
        table_rows = table_numel >> lane_bits
        rows_each = max(1, min(triton.next_power_of_2(table_rows),
                               (TABLE_TILE_INTERPRETER if residual.device.type == "cpu" else TABLE_TILE) >> lane_bits))
        wrap(_table_kernel)[(triton.cdiv(table_rows, rows_each), n_rows)](
            sent, table, by_row, row_start, signs, lane_xor, numel, table_numel, table_rows, LANE_BITS=lane_bits,
            ROWS=rows_each,
        )
    return index, table, held


def blocks_by_row(rows: torch.Tensor, table_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of the layout's block rows: ``(by_row, row_start)``, int64.

    ``by_row[row_start[r]:row_start[r + 1]]`` are the entries ``b * 3 + j`` with ``rows[b, j] == r``,
    in increasing block order (a stable sort of ``rows``' flat entries). Device ops only.
    """
    flat = rows.reshape(-1)
    by_row = torch.argsort(flat, stable=True)
    row_start = torch.searchsorted(flat[by_row], torch.arange(table_rows + 1, device=rows.device, dtype=flat.dtype))
    return by_row.contiguous(), row_start.contiguous()
