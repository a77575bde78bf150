"""Lane-parallel peeling decode, with the round loop inside the kernel.

Every table column is an independent peeling problem: column ``c`` holds, for each block
``b``, exactly one candidate position ``p = b * L + (c ^ xor[b])`` whose three cells are
``rows[b, j] * L + c``. A program owns ``G`` adjacent columns (``G = L / 256`` for wide
lanes, else one) and runs, with no host involvement:

1. setup: scan its candidates, keep those the union index selects (compacted with a
   prefix sum into a list of pending positions, ``state = 1``), and count how many
   support positions hit every cell (atomics); then the consistency check of
   :func:`tagc.sketch.decode`: count its cells that no position hits yet are non-zero
   (the program owns every cell of its columns, so no other program's atomics matter);
2. rounds, until one peels nothing, over the pending list only, each in two phases
   separated by a barrier so a round sees the table as it was at its start, exactly as the
   reference's vectorised rounds do:
   A) every pending position with a cell of count 1 records which cell (``state = 2 + j``,
      the lowest such ``j``, as the reference picks);
   B) each of those reads its value from that cell (no other position touches it), writes
      it, subtracts it (float64) from its three cells and decrements their counts; the
      others are compacted into the second list, which the next round reads;
3. fallback for positions still pending: the median of their three signed cells
   (``fallback="estimate"``) or nothing (``"raw"`` / ``"error"``, left as 0).

Counts (support, peeled, unpeeled, estimated, raw, rounds) are accumulated on the device
into an int64 ``stats`` tensor in :class:`~tagc.sketch.DecodeStats` field order, followed
by the count of inconsistent cells (:data:`PEEL_STATS`).

**The exact linear solve of stopping sets stays in torch** (the reference's
``finish_decode``, shared with it), after the kernel, in :func:`tagc.kernels.ops.decode_triton`:
it needs the stuck positions on the host side of a ``nonzero``, and is rare at the planned
density, so ``decode_triton`` reads the stats once (one sync per decode, which the host-side
``DecodeStats`` needs anyway) and runs the solve only when peeling left something.
:func:`tagc.kernels.ops.decode_async` is the sync-free variant: kernel only, no exact solve,
stats stay on the device.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from tagc.config import FALLBACKS
from tagc.sketch.codec import DecodeStats

PROGRAMS = 256
"""Programs per decode (at most; one per lane for narrow lanes): ``G = L / PROGRAMS`` lanes each."""
TILE = 1024
"""Positions per tile on the GPU; the interpreter, whose cost is per operation, takes 8192."""
PEEL_STATS = (*DecodeStats().as_dict(), "inconsistent")
"""The kernel's stats slots: :class:`~tagc.sketch.DecodeStats`'s fields in order
(:data:`tagc.kernels.STAT_FIELDS`), then the non-zero cells no support position maps to."""
FALLBACK_CODES = {name: code for code, name in enumerate(FALLBACKS)}
"""The kernel's ``FALLBACK`` constant: 0 estimate, 1 raw, 2 error (:data:`tagc.config.FALLBACKS` order)."""


@triton.jit
def _cells(p, xor_ptr, rows_ptr, signs_ptr, mask, LANE_BITS: tl.constexpr):
    """The three cells (int64) and signs (float64) of positions ``p``."""
    b = p >> LANE_BITS
    c = (p & ((1 << LANE_BITS) - 1)) ^ tl.load(xor_ptr + b, mask=mask, other=0)
    c0 = (tl.load(rows_ptr + b * 3 + 0, mask=mask, other=0) << LANE_BITS) + c
    c1 = (tl.load(rows_ptr + b * 3 + 1, mask=mask, other=0) << LANE_BITS) + c
    c2 = (tl.load(rows_ptr + b * 3 + 2, mask=mask, other=0) << LANE_BITS) + c
    s0 = tl.load(signs_ptr + b * 3 + 0, mask=mask, other=0.0).to(tl.float64)
    s1 = tl.load(signs_ptr + b * 3 + 1, mask=mask, other=0.0).to(tl.float64)
    s2 = tl.load(signs_ptr + b * 3 + 2, mask=mask, other=0.0).to(tl.float64)
    return c0, c1, c2, s0, s1, s2


@triton.jit
def _peel_kernel(
    work_ptr,
    counts_ptr,
    index_ptr,
    out_ptr,
    state_ptr,
    stats_ptr,
    list_ptr,
    rows_ptr,
    signs_ptr,
    xor_ptr,
    numel,
    blocks,
    table_rows,
    LANE_BITS: tl.constexpr,
    BITS: tl.constexpr,
    G: tl.constexpr,
    BLOCK_B: tl.constexpr,
    TILE: tl.constexpr,
    FALLBACK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64) * G + tl.arange(0, G)  # this program's columns
    cap = blocks.to(tl.int64) * G  # candidates of this program
    lists = list_ptr + tl.program_id(0).to(tl.int64) * 2 * cap  # two compact lists of positions

    # 1. Setup: the support positions of these columns (compacted into list 0), and how many
    #    positions hit each cell.
    active = 0
    for b0 in range(0, blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        bm = b < blocks
        x = tl.load(xor_ptr + b, mask=bm, other=0)
        p = (b.to(tl.int64) << LANE_BITS)[:, None] + (c[None, :] ^ x[:, None])  # [BLOCK_B, G]
        valid = bm[:, None] & (p < numel)
        if BITS == 1:
            byte = tl.load(index_ptr + (p >> 3), mask=valid, other=0).to(tl.int32)
            on = ((byte >> (p & 7).to(tl.int32)) & 1) != 0
        else:
            byte = tl.load(index_ptr + (p >> 1), mask=valid, other=0).to(tl.int32)
            on = ((byte >> ((p & 1) * 4).to(tl.int32)) & 15) != 0
        on = on & valid
        tl.store(state_ptr + p, on.to(tl.int8), mask=valid)
        for j in tl.static_range(3):
            cell = (tl.load(rows_ptr + b * 3 + j, mask=bm, other=0) << LANE_BITS)[:, None] + c[None, :]
            tl.atomic_add(counts_ptr + cell, tl.full(cell.shape, 1, tl.int32), mask=on)
        flat_on = tl.reshape(on, [BLOCK_B * G]).to(tl.int32)
        slot = active + tl.cumsum(flat_on, axis=0) - 1
        tl.store(lists + slot, tl.reshape(p, [BLOCK_B * G]).to(tl.int32), mask=flat_on != 0)
        active += tl.sum(flat_on)
    support = active
    tl.debug_barrier()
    inconsistent = 0  # cells of these columns no support position hits, yet non-zero
    for r0 in range(0, table_rows, BLOCK_B):
        r = r0 + tl.arange(0, BLOCK_B)
        cell = (r.to(tl.int64) << LANE_BITS)[:, None] + c[None, :]
        rm = (r < table_rows)[:, None] & (c[None, :] >= 0)
        hits = tl.load(counts_ptr + cell, mask=rm, other=1, volatile=True)
        held = tl.load(work_ptr + cell, mask=rm, other=0.0)
        inconsistent += tl.sum(tl.sum(((hits == 0) & (held != 0.0)).to(tl.int32), axis=1), axis=0)

    # 2. Peeling rounds over the compact list of pending positions, each a read phase and a
    #    write phase, until a round peels nothing. The survivors go to the other list.
    rounds = 0
    parity = 0
    progress = 1
    while progress > 0:
        src = lists + parity * cap
        dst = lists + (1 - parity) * cap
        for i0 in range(0, active, TILE):  # A: which positions own a pure cell
            i = i0 + tl.arange(0, TILE)
            m = i < active
            p = tl.load(src + i, mask=m, other=0, volatile=True).to(tl.int64)
            c0, c1, c2, s0, s1, s2 = _cells(p, xor_ptr, rows_ptr, signs_ptr, m, LANE_BITS)
            n0 = tl.load(counts_ptr + c0, mask=m, other=0, volatile=True)
            n1 = tl.load(counts_ptr + c1, mask=m, other=0, volatile=True)
            n2 = tl.load(counts_ptr + c2, mask=m, other=0, volatile=True)
            choice = tl.where(n0 == 1, 2, tl.where(n1 == 1, 3, tl.where(n2 == 1, 4, 1)))  # lowest pure j
            tl.store(state_ptr + p, choice.to(tl.int8), mask=m)
        tl.debug_barrier()
        survivors = 0
        for i0 in range(0, active, TILE):  # B: settle them and subtract them out
            i = i0 + tl.arange(0, TILE)
            m = i < active
            p = tl.load(src + i, mask=m, other=0, volatile=True).to(tl.int64)
            c0, c1, c2, s0, s1, s2 = _cells(p, xor_ptr, rows_ptr, signs_ptr, m, LANE_BITS)
            st = tl.load(state_ptr + p, mask=m, other=0, volatile=True)
            go = m & (st >= 2)
            pure = tl.where(st == 2, c0, tl.where(st == 3, c1, c2))
            sign = tl.where(st == 2, s0, tl.where(st == 3, s1, s2))
            value = sign * tl.load(work_ptr + pure, mask=go, other=0.0, volatile=True)
            tl.store(out_ptr + p, value.to(tl.float32), mask=go)
            tl.atomic_add(work_ptr + c0, -s0 * value, mask=go)
            tl.atomic_add(work_ptr + c1, -s1 * value, mask=go)
            tl.atomic_add(work_ptr + c2, -s2 * value, mask=go)
            minus = tl.full(p.shape, -1, tl.int32)
            tl.atomic_add(counts_ptr + c0, minus, mask=go)
            tl.atomic_add(counts_ptr + c1, minus, mask=go)
            tl.atomic_add(counts_ptr + c2, minus, mask=go)
            tl.store(state_ptr + p, tl.zeros(p.shape, tl.int8), mask=go)
            stay = (m & (st < 2)).to(tl.int32)
            tl.store(dst + survivors + tl.cumsum(stay, axis=0) - 1, p.to(tl.int32), mask=stay != 0)
            survivors += tl.sum(stay)
        tl.debug_barrier()
        progress = active - survivors
        rounds += (progress > 0).to(tl.int32)
        active = survivors
        parity = 1 - parity

    # 3. Fallback for what peeling left (the last list; their state is still 1).
    if FALLBACK == 0:
        src = lists + parity * cap
        for i0 in range(0, active, TILE):
            i = i0 + tl.arange(0, TILE)
            m = i < active
            p = tl.load(src + i, mask=m, other=0, volatile=True).to(tl.int64)
            c0, c1, c2, s0, s1, s2 = _cells(p, xor_ptr, rows_ptr, signs_ptr, m, LANE_BITS)
            w0 = s0 * tl.load(work_ptr + c0, mask=m, other=0.0, volatile=True)
            w1 = s1 * tl.load(work_ptr + c1, mask=m, other=0.0, volatile=True)
            w2 = s2 * tl.load(work_ptr + c2, mask=m, other=0.0, volatile=True)
            median = tl.maximum(tl.minimum(w0, w1), tl.minimum(tl.maximum(w0, w1), w2))
            tl.store(out_ptr + p, median.to(tl.float32), mask=m)
    tl.atomic_add(stats_ptr + 0, support.to(tl.int64))
    tl.atomic_add(stats_ptr + 1, (support - active).to(tl.int64))
    tl.atomic_add(stats_ptr + 3, active.to(tl.int64))
    if FALLBACK == 0:
        tl.atomic_add(stats_ptr + 4, active.to(tl.int64))
    if FALLBACK == 1:
        tl.atomic_add(stats_ptr + 5, active.to(tl.int64))
    tl.atomic_max(stats_ptr + 6, rounds.to(tl.int64))
    tl.atomic_add(stats_ptr + 7, inconsistent.to(tl.int64))


def launch_peel(
    table: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    signs: torch.Tensor,
    lane_xor: torch.Tensor,
    numel: int,
    lane_bits: int,
    bits: int,
    fallback: int,
    wrap: Callable = lambda k: k,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the peeling kernel. Returns ``(values f32 [numel], state i8 [numel], work f64
    [table], stats i64 [8])`` (:data:`PEEL_STATS`); ``state == 1`` marks positions peeling
    did not recover and ``work`` is the table with every peeled value subtracted."""
    work = table.reshape(-1).to(torch.float64, copy=True)
    counts = torch.zeros(work.numel(), dtype=torch.int32, device=work.device)
    out = torch.zeros(numel, dtype=torch.float32, device=work.device)
    state = torch.zeros(numel, dtype=torch.int8, device=work.device)
    stats = torch.zeros(len(PEEL_STATS), dtype=torch.int64, device=work.device)
    lanes, blocks = 1 << lane_bits, rows.shape[0]
    if blocks * lanes >= 2**31:
        raise ValueError(f"chunks of 2**31 or more elements are not supported by the peeling kernel (got {numel})")
    group = max(1, lanes // PROGRAMS)
    tile = 8192 if table.device.type == "cpu" else TILE
    block_b = min(triton.next_power_of_2(blocks), max(1, tile // group))
    lists = torch.empty(2 * blocks * lanes, dtype=torch.int32, device=work.device)
    wrap(_peel_kernel)[(lanes // group,)](
        work, counts, index, out, state, stats, lists, rows, signs, lane_xor, numel, blocks, work.numel() >> lane_bits,
        LANE_BITS=lane_bits, BITS=bits, G=group, BLOCK_B=block_b, TILE=tile, FALLBACK=fallback,
    )
    return out, state, work, stats
