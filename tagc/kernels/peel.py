"""Peeling decode on the device, stopping sets solved exactly, with no host involvement.

Every table column is an independent peeling problem: column ``c`` holds, for each block
``b``, exactly one candidate position ``p = b * L + (c ^ xor[b])`` whose three cells are
``rows[b, j] * L + c``. :func:`launch_peel` runs five kernels, one after another on the
stream, and reads nothing on the host:

1. ``_setup_kernel`` (programs of whole blocks, ``[blocks, L]`` candidates each, at most
   :data:`SETUP_TILE`, and on a GPU enough of them for :data:`PROGRAMS_PER_SM` per multiprocessor
   when the chunk allows: :func:`setup_rows`): marks the positions the union index selects (``state = 1``),
   counts how many hit each cell (integer atomics) and how many each column holds per program.
   An exclusive scan in torch turns those counts into where each column's positions go.
2. ``_list_kernel`` (the same programs): writes every column's positions, in increasing order,
   into the column's pending list.
3. ``_check_kernel`` (one program per 1,024 cells): the consistency check of
   :func:`tagc.sketch.decode` (cells no position hits, yet non-zero) and the count of NaN and
   Inf cells, so the caller can raise without a second look at the table.
4. ``_peel_kernel`` (one program per column, the most programs whose rounds need no barrier
   across programs): rounds until one peels nothing, over the
   pending list only, each in two phases separated by a barrier so a round sees the table as
   it was at its start, exactly as the reference's vectorised rounds do:
   A) every pending position with a cell of count 1 records which cell (``state = 2 + j``,
      the lowest such ``j``);
   B) each of those reads its value from that cell (no other position touches it), writes
      it, subtracts it (float64) from its three cells and decrements their counts; the others
      are compacted into the second list, which the next round reads.
   Then the fallback for positions still pending (the median of their three signed cells for
   ``"estimate"``; nothing, 0, for ``"raw"`` / ``"error"``), and they are appended to a list of
   at most :data:`~tagc.sketch.codec.EXACT_SOLVE_LIMIT` stuck positions.
5. ``_solve_kernel`` (one program; it returns at once unless ``0 < stuck <= EXACT_SOLVE_LIMIT``):
   the exact solve of the stopping sets (docs/design.md §3.7) by Gauss-Jordan elimination of the
   normal equations, with the reference's rule for a determined position; the fallback is applied
   again to the others with the solved values taken out of their cells.

**Bit-identical from run to run** (docs/design.md §5): no float atomics (the lowest position sharing a cell goes
first, by an integer ``atomic_min``), tiles in list order, the solve in one program. Values agree with the CPU back
ends within float32 rounding (a position owning several pure cells may read another of them; the solve eliminates
instead of taking an SVD). **A batch of parts** (docs/design.md §3.1, "Batched decode"): the parts are one more
grid axis, each program doing for its part exactly what it does for the part alone.

Statistics are accumulated on the device into an int64 ``stats`` tensor (a row per part): the
:class:`~tagc.sketch.DecodeStats` fields in order, then the inconsistent, NaN and Inf cells
(:data:`PEEL_STATS`). :func:`tagc.kernels.ops.decode_triton` reads it once;
:func:`tagc.kernels.ops.decode_async` never does.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from tagc.config import FALLBACKS
from tagc.sketch.codec import EXACT_SOLVE_LIMIT, DecodeStats

TILE = 1024
"""Pending positions per step of a column's rounds on a GPU (a parameter of :func:`launch_peel`)."""
INTERPRETER_TILE = 8192
"""The same under the interpreter, whose cost is per operation rather than per element."""
SETUP_TILE = 4096
"""Candidates (``blocks x lanes``) per program of the setup kernels (wider under the interpreter)."""
PROGRAMS_PER_SM = 4
"""Setup programs a GPU's multiprocessor gets when the chunk is large enough (the rounds run one program
per table column: a column's rounds need the barriers of one program)."""
CHECK_BLOCK = 1024
"""Cells per program of the consistency check."""
SOLVE_ROWS = 16
"""Rows of the normal equations per step of the solve kernel on a GPU (all of them under the interpreter)."""
DETERMINED_TOL = 1e-9
"""The solve's thresholds: a pivot below ``DETERMINED_TOL * 3`` (an unknown's own diagonal is 3,
one per cell) ends the elimination; a free unknown whose coefficient in a pivot's row is below
``DETERMINED_TOL`` of the pivot leaves it determined (the reference's 1e-9 on its null space)."""
PEEL_STATS = (*DecodeStats().as_dict(), "inconsistent", "nan_cells", "inf_cells")
"""The kernels' stats slots: :class:`~tagc.sketch.DecodeStats`'s fields in order
(:data:`tagc.kernels.STAT_FIELDS`), then the non-zero cells no support position maps to, then the
NaN and the infinite cells of the table."""
FALLBACK_CODES = {name: code for code, name in enumerate(FALLBACKS)}
"""The kernels' ``FALLBACK`` constant: 0 estimate, 1 raw, 2 error (:data:`tagc.config.FALLBACKS` order)."""
_COUPLED = tl.constexpr(DETERMINED_TOL)
_SLOT = {name: i for i, name in enumerate(PEEL_STATS)}
_NO_OWNER = 2**31 - 1
_SENTINEL = 2**62  # sorts after every position


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
def _candidates(xor_ptr, numel, blocks, LANE_BITS: tl.constexpr, BB: tl.constexpr):
    """This setup program's candidates ``[BB, L]``: blocks down, table columns across."""
    b = tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB)
    col = tl.arange(0, 1 << LANE_BITS).to(tl.int64)
    bm = b < blocks
    x = tl.load(xor_ptr + b, mask=bm, other=0)
    p = (b << LANE_BITS)[:, None] + (col[None, :] ^ x[:, None])
    return b, col, p, bm[:, None] & (p < numel)


@triton.jit
def _setup_kernel(index_ptr, state_ptr, counts_ptr, per_column_ptr, rows_ptr, xor_ptr, numel, blocks, index_bytes,
                  table_numel, LANE_BITS: tl.constexpr, BITS: tl.constexpr, BB: tl.constexpr):
    """Mark the support (``state = 1``), count it per cell and per column of this program (of part
    ``program_id(1)``)."""
    part = tl.program_id(1).to(tl.int64)
    index_ptr += part * index_bytes
    state_ptr += part * numel
    counts_ptr += part * table_numel
    per_column_ptr += (part * tl.num_programs(0)) << LANE_BITS
    b, col, p, valid = _candidates(xor_ptr, numel, blocks, LANE_BITS, BB)
    if BITS == 1:
        byte = tl.load(index_ptr + (p >> 3), mask=valid, other=0).to(tl.int32)
        on = ((byte >> (p & 7).to(tl.int32)) & 1) != 0
    else:
        byte = tl.load(index_ptr + (p >> 1), mask=valid, other=0).to(tl.int32)
        on = ((byte >> ((p & 1) * 4).to(tl.int32)) & 15) != 0
    on = on & valid
    tl.store(state_ptr + p, on.to(tl.int8), mask=valid)
    for j in tl.static_range(3):
        cell = (tl.load(rows_ptr + b * 3 + j, mask=b < blocks, other=0) << LANE_BITS)[:, None] + col[None, :]
        tl.atomic_add(counts_ptr + cell, tl.full(cell.shape, 1, tl.int32), mask=on)
    tl.store(per_column_ptr + (tl.program_id(0).to(tl.int64) << LANE_BITS) + col, tl.sum(on.to(tl.int32), axis=0))


@triton.jit
def _list_kernel(state_ptr, first_ptr, list_ptr, xor_ptr, numel, blocks, LANE_BITS: tl.constexpr, BB: tl.constexpr):
    """Write this program's support positions into their columns' lists, in increasing order (of part
    ``program_id(1)``)."""
    part = tl.program_id(1).to(tl.int64)
    state_ptr += part * numel
    first_ptr += (part * tl.num_programs(0)) << LANE_BITS
    list_ptr += (part * 2 * blocks) << LANE_BITS
    b, col, p, valid = _candidates(xor_ptr, numel, blocks, LANE_BITS, BB)
    on = (tl.load(state_ptr + p, mask=valid, other=0) != 0).to(tl.int32)
    first = tl.load(first_ptr + (tl.program_id(0).to(tl.int64) << LANE_BITS) + col)
    rank = first[None, :] + tl.cumsum(on, axis=0) - on  # earlier blocks of the column come first
    tl.store(list_ptr + col[None, :] * blocks + rank, p.to(tl.int32), mask=on != 0)


@triton.jit
def _check_kernel(work_ptr, counts_ptr, stats_ptr, table_numel, INCONSISTENT: tl.constexpr, STATS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Count the cells no support position hits that are non-zero, and the NaN and Inf cells (of part
    ``program_id(1)``)."""
    part = tl.program_id(1).to(tl.int64)
    work_ptr += part * table_numel
    counts_ptr += part * table_numel
    stats_ptr += part * STATS
    cell = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = cell < table_numel
    held = tl.load(work_ptr + cell, mask=m, other=0.0)
    hits = tl.load(counts_ptr + cell, mask=m, other=1)
    stray = tl.sum(((hits == 0) & (held != 0.0) & m).to(tl.int64), axis=0)
    nan = tl.sum(((held != held) & m).to(tl.int64), axis=0)
    inf = tl.sum(((tl.abs(held) == float("inf")) & m).to(tl.int64), axis=0)
    tl.atomic_add(stats_ptr + INCONSISTENT, stray)
    tl.atomic_add(stats_ptr + INCONSISTENT + 1, nan)
    tl.atomic_add(stats_ptr + INCONSISTENT + 2, inf)


@triton.jit
def _subtract_in_order(work_ptr, owner_ptr, cell, amount, p, todo):
    """``work[cell] -= amount`` for the ``todo`` lanes, several lanes of one cell one after another in
    increasing ``p`` (each claims the cell with an integer ``atomic_min``; the lowest goes first), so
    the float64 result does not depend on the order the hardware would apply atomics in."""
    me = p.to(tl.int32)
    left = tl.sum(todo.to(tl.int32), axis=0)
    while left > 0:
        tl.atomic_min(owner_ptr + cell, me, mask=todo)
        tl.debug_barrier()
        first = tl.load(owner_ptr + cell, mask=todo, other=-1, volatile=True)
        win = todo & (first == me)
        held = tl.load(work_ptr + cell, mask=win, other=0.0, volatile=True)
        tl.store(work_ptr + cell, held - amount, mask=win)
        tl.store(owner_ptr + cell, tl.full(me.shape, 2147483647, tl.int32), mask=win)
        tl.debug_barrier()
        todo = todo & (first != me)
        left = tl.sum(todo.to(tl.int32), axis=0)


@triton.jit
def _median3(w0, w1, w2):
    return tl.maximum(tl.minimum(w0, w1), tl.minimum(tl.maximum(w0, w1), w2))


@triton.jit
def _peel_kernel(work_ptr, counts_ptr, owner_ptr, out_ptr, state_ptr, stats_ptr, list_ptr, support_ptr, stuck_ptr,
                 rows_ptr, signs_ptr, xor_ptr, blocks, numel, table_numel, LANE_BITS: tl.constexpr, TILE: tl.constexpr,
                 FALLBACK: tl.constexpr, STUCK_CAP: tl.constexpr, STATS: tl.constexpr):
    """Peel column ``program_id(0)`` of part ``program_id(1)``: rounds over its pending list, then the fallback
    for what is left."""
    column = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    half = blocks * (1 << LANE_BITS)  # list 1 starts after every column's list 0
    work_ptr += part * table_numel
    counts_ptr += part * table_numel
    owner_ptr += part * table_numel
    out_ptr += part * numel
    state_ptr += part * numel
    stats_ptr += part * STATS
    list_ptr += part * 2 * half
    support_ptr += part << LANE_BITS
    stuck_ptr += part * STUCK_CAP
    active = tl.load(support_ptr + column)
    support = active
    rounds = 0
    parity = 0
    progress = 1
    while progress > 0:
        src = list_ptr + parity * half + column * blocks
        dst = list_ptr + (1 - parity) * half + column * blocks
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
            _subtract_in_order(work_ptr, owner_ptr, c0, s0 * value, p, go)
            _subtract_in_order(work_ptr, owner_ptr, c1, s1 * value, p, go)
            _subtract_in_order(work_ptr, owner_ptr, c2, s2 * value, p, go)
            minus = tl.full(p.shape, -1, tl.int32)
            tl.atomic_add(counts_ptr + c0, minus, mask=go)
            tl.atomic_add(counts_ptr + c1, minus, mask=go)
            tl.atomic_add(counts_ptr + c2, minus, mask=go)
            tl.store(state_ptr + p, tl.zeros(p.shape, tl.int8), mask=go)
            stay = (m & (st < 2)).to(tl.int32)
            tl.store(dst + survivors + tl.cumsum(stay, axis=0) - 1, p.to(tl.int32), mask=stay != 0)
            survivors += tl.sum(stay, axis=0)
        tl.debug_barrier()
        progress = active - survivors
        rounds += (progress > 0).to(tl.int32)
        active = survivors
        parity = 1 - parity

    # What peeling left (the last list; their state is 1): the fallback, and the list for the solve.
    src = list_ptr + parity * half + column * blocks
    first = tl.atomic_add(stats_ptr + 3, active.to(tl.int64))  # unpeeled; the slots before ours
    for i0 in range(0, active, TILE):
        i = i0 + tl.arange(0, TILE)
        m = i < active
        p = tl.load(src + i, mask=m, other=0, volatile=True).to(tl.int64)
        if FALLBACK == 0:
            c0, c1, c2, s0, s1, s2 = _cells(p, xor_ptr, rows_ptr, signs_ptr, m, LANE_BITS)
            w0 = s0 * tl.load(work_ptr + c0, mask=m, other=0.0, volatile=True)
            w1 = s1 * tl.load(work_ptr + c1, mask=m, other=0.0, volatile=True)
            w2 = s2 * tl.load(work_ptr + c2, mask=m, other=0.0, volatile=True)
            tl.store(out_ptr + p, _median3(w0, w1, w2).to(tl.float32), mask=m)
        slot = first + i
        tl.store(stuck_ptr + slot, p, mask=m & (slot < STUCK_CAP))
    tl.atomic_add(stats_ptr + 0, support.to(tl.int64))
    tl.atomic_add(stats_ptr + 1, (support - active).to(tl.int64))
    if FALLBACK == 0:
        tl.atomic_add(stats_ptr + 4, active.to(tl.int64))
    if FALLBACK == 1:
        tl.atomic_add(stats_ptr + 5, active.to(tl.int64))
    tl.atomic_max(stats_ptr + 6, rounds.to(tl.int64))


@triton.jit
def _solve_kernel(work_ptr, stuck_ptr, system_ptr, rhs_ptr, out_ptr, state_ptr, stats_ptr, rest_ptr,
                  rows_ptr, signs_ptr, xor_ptr, numel, table_numel, LANE_BITS: tl.constexpr, M: tl.constexpr,
                  ROWS: tl.constexpr, FALLBACK: tl.constexpr, TOL: tl.constexpr, STATS: tl.constexpr):
    """The exact solve of the ``n = stats[unpeeled]`` stuck positions ``stuck[:n]`` (sorted) of part
    ``program_id(0)``, when ``0 < n <= M``: writes the determined ones, redoes the fallback for the others and
    lists them, in order, in ``rest``; updates the statistics."""
    part = tl.program_id(0).to(tl.int64)
    work_ptr += part * table_numel
    stuck_ptr += part * M
    system_ptr += part * M * M
    rhs_ptr += part * M
    out_ptr += part * numel
    state_ptr += part * numel
    stats_ptr += part * STATS
    rest_ptr += part * M
    n = tl.load(stats_ptr + 3)
    if (n > 0) & (n <= M):
        k = tl.arange(0, M)
        valid = k < n
        p = tl.load(stuck_ptr + k, mask=valid, other=0)
        c0, c1, c2, s0, s1, s2 = _cells(p, xor_ptr, rows_ptr, signs_ptr, valid, LANE_BITS)
        # The normal equations: G[r, q] = sum_j [cell_j(r) == cell_j(q)] s_j(r) s_j(q), b = A^T w.
        for r0 in range(0, n, ROWS):
            r = r0 + tl.arange(0, ROWS)
            rv = r < n
            pr = tl.load(stuck_ptr + r, mask=rv, other=0)
            d0, d1, d2, t0, t1, t2 = _cells(pr, xor_ptr, rows_ptr, signs_ptr, rv, LANE_BITS)
            g = tl.where(d0[:, None] == c0[None, :], t0[:, None] * s0[None, :], 0.0)
            g += tl.where(d1[:, None] == c1[None, :], t1[:, None] * s1[None, :], 0.0)
            g += tl.where(d2[:, None] == c2[None, :], t2[:, None] * s2[None, :], 0.0)
            g = tl.where(rv[:, None] & valid[None, :], g, 0.0)
            tl.store(system_ptr + r[:, None] * M + k[None, :], g, mask=rv[:, None])
            w = t0 * tl.load(work_ptr + d0, mask=rv, other=0.0)
            w += t1 * tl.load(work_ptr + d1, mask=rv, other=0.0)
            w += t2 * tl.load(work_ptr + d2, mask=rv, other=0.0)
            tl.store(rhs_ptr + r, w, mask=rv)
        tl.debug_barrier()
        # Gauss-Jordan with diagonal pivoting (G is symmetric positive semi-definite).
        pivot = tl.zeros([M], tl.int32)
        steps = 0
        more = 1
        while more > 0:
            diag = tl.load(system_ptr + k * M + k, mask=valid, other=0.0, volatile=True)
            diag = tl.where(valid & (pivot == 0), diag, -1.0)
            best = tl.max(diag, axis=0)
            at = tl.argmax(diag, axis=0)
            ok = (best > TOL).to(tl.int32)
            if ok != 0:
                row = tl.load(system_ptr + at * M + k, mask=valid, other=0.0, volatile=True)
                head = tl.load(rhs_ptr + at, volatile=True)
                for r0 in range(0, n, ROWS):
                    r = r0 + tl.arange(0, ROWS)
                    rm = (r < n) & (r != at)
                    f = tl.load(system_ptr + r * M + at, mask=rm, other=0.0, volatile=True) / best
                    tile = tl.load(system_ptr + r[:, None] * M + k[None, :], mask=rm[:, None], other=0.0,
                                   volatile=True)
                    tile = tl.where(k[None, :] == at, 0.0, tile - f[:, None] * row[None, :])
                    tl.store(system_ptr + r[:, None] * M + k[None, :], tile, mask=rm[:, None])
                    rhs = tl.load(rhs_ptr + r, mask=rm, other=0.0, volatile=True)
                    tl.store(rhs_ptr + r, rhs - f * head, mask=rm)
                tl.debug_barrier()
            pivot = tl.where((k == at) & (ok != 0), 1, pivot)
            steps += 1
            more = ok * (steps < n).to(tl.int32)
        # Determined: a pivot whose row no free unknown enters. x = rhs / pivot (free unknowns at 0).
        diag = tl.load(system_ptr + k * M + k, mask=valid, other=1.0, volatile=True)
        coupled = tl.zeros([M], tl.int32)
        for r0 in range(0, n, ROWS):
            r = r0 + tl.arange(0, ROWS)
            rv = r < n
            tile = tl.load(system_ptr + r[:, None] * M + k[None, :], mask=rv[:, None] & valid[None, :], other=0.0,
                           volatile=True)
            d = tl.load(system_ptr + r * M + r, mask=rv, other=1.0, volatile=True)
            free = (pivot == 0) & valid
            big = tl.where(free[None, :] & (tl.abs(tile) > _COUPLED * tl.abs(d)[:, None]), 1, 0)
            hit = tl.max(big, axis=1)  # [ROWS]
            coupled = tl.maximum(coupled, tl.max(tl.where(r[:, None] == k[None, :], hit[:, None], 0), axis=0))
        determined = valid & (pivot != 0) & (coupled == 0)
        x = tl.load(rhs_ptr + k, mask=valid, other=0.0, volatile=True) / diag
        x = tl.where(determined, x, 0.0)
        tl.store(out_ptr + p, x.to(tl.float32), mask=determined)
        tl.store(state_ptr + p, tl.zeros([M], tl.int8), mask=determined)
        # The others: the fallback again, with the solved values taken out of their cells.
        undetermined = valid & ~determined
        if FALLBACK == 0:
            for r0 in range(0, n, ROWS):
                r = r0 + tl.arange(0, ROWS)
                rv = r < n
                pr = tl.load(stuck_ptr + r, mask=rv, other=0)
                d0, d1, d2, t0, t1, t2 = _cells(pr, xor_ptr, rows_ptr, signs_ptr, rv, LANE_BITS)
                solved = tl.where(determined, x, 0.0)[None, :]
                w0 = tl.load(work_ptr + d0, mask=rv, other=0.0) - tl.sum(
                    tl.where(d0[:, None] == c0[None, :], s0[None, :] * solved, 0.0), axis=1)
                w1 = tl.load(work_ptr + d1, mask=rv, other=0.0) - tl.sum(
                    tl.where(d1[:, None] == c1[None, :], s1[None, :] * solved, 0.0), axis=1)
                w2 = tl.load(work_ptr + d2, mask=rv, other=0.0) - tl.sum(
                    tl.where(d2[:, None] == c2[None, :], s2[None, :] * solved, 0.0), axis=1)
                keep = rv & (tl.max(tl.where((r[:, None] == k[None, :]) & undetermined[None, :], 1, 0), axis=1) != 0)
                tl.store(out_ptr + pr, _median3(t0 * w0, t1 * w1, t2 * w2).to(tl.float32), mask=keep)
        order = tl.cumsum(undetermined.to(tl.int32), axis=0) - 1
        tl.store(rest_ptr + order, p, mask=undetermined)
        count = tl.sum(determined.to(tl.int64), axis=0)
        tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + count)
        tl.store(stats_ptr + 2, count)
        tl.store(stats_ptr + 3, n - count)
        if FALLBACK == 0:
            tl.store(stats_ptr + 4, tl.load(stats_ptr + 4) - count)
        if FALLBACK == 1:
            tl.store(stats_ptr + 5, tl.load(stats_ptr + 5) - count)


@functools.lru_cache(maxsize=16)
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property: no synchronisation)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def setup_rows(lanes: int, blocks: int, device: torch.device) -> int:
    """Blocks per program of the setup kernels (a power of two): at most :data:`SETUP_TILE` candidates a
    program, and on a GPU few enough that the chunk gives every multiprocessor four programs when it
    can. The interpreter takes the widest programs (its cost is per operation)."""
    if device.type == "cuda":
        rows = min(max(1, SETUP_TILE // lanes), max(1, blocks // (PROGRAMS_PER_SM * multiprocessors(device))))
    else:
        rows = max(1, INTERPRETER_TILE // lanes)
    rows = min(rows, triton.next_power_of_2(blocks))
    return 1 << (rows.bit_length() - 1)


def launch_peel(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, signs: torch.Tensor,
                lane_xor: torch.Tensor, numel: int, lane_bits: int, bits: int, fallback: int,
                tile: Optional[int] = None, wrap: Callable = lambda k: k,
                setup_blocks: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode on the device: peel, solve the stopping sets, apply the fallback; for ``P`` parts of one layout at
    once (``table`` ``[P, T]``, ``index`` ``[P, I]``; a 1-D index is one part), each exactly as alone: every
    kernel's grid takes the parts as one more axis, every buffer has a row per part.

    ``tile`` is the pending positions a column's program handles per step (default
    :data:`TILE`, :data:`INTERPRETER_TILE` on CPU tensors; a power of two) and ``setup_blocks``
    the blocks per setup program (default :func:`setup_rows`, from the work and the device): results
    do not depend on either. Returns ``(values f32 [P, numel], state i8 [P, numel], stats i64 [P, len(PEEL_STATS)],
    rest i64 [P, EXACT_SOLVE_LIMIT])``: ``state == 1`` marks the positions neither peeling nor the
    solve recovered; when the solve ran, ``rest`` lists them first, in increasing order (as
    the reference's ``raw_positions``).
    """
    device = table.device
    index = (index[None] if index.dim() == 1 else index).contiguous()
    parts = index.shape[0]
    work = table.reshape(-1).to(torch.float64, copy=True)
    table_numel = work.numel() // max(parts, 1)
    lanes, blocks = 1 << lane_bits, rows.shape[0]
    if blocks * lanes >= 2**31:
        raise ValueError(f"chunks of 2**31 or more elements are not supported by the peeling kernel (got {numel})")
    on_cpu = device.type == "cpu"
    tile = tile or (INTERPRETER_TILE if on_cpu else TILE)
    if tile < 1 or tile & (tile - 1):
        raise ValueError(f"the peel tile must be a power of two, got {tile}")
    counts = torch.zeros(work.numel(), dtype=torch.int32, device=device)
    owner = torch.full((work.numel(),), _NO_OWNER, dtype=torch.int32, device=device)
    out = torch.zeros(parts, numel, dtype=torch.float32, device=device)
    state = torch.zeros(parts, numel, dtype=torch.int8, device=device)
    stats = torch.zeros(parts, len(PEEL_STATS), dtype=torch.int64, device=device)
    stuck = torch.full((parts, EXACT_SOLVE_LIMIT), _SENTINEL, dtype=torch.int64, device=device)
    rest = torch.full((parts, EXACT_SOLVE_LIMIT), -1, dtype=torch.int64, device=device)
    bb = setup_blocks or setup_rows(lanes, blocks, device)
    if bb & (bb - 1):
        raise ValueError(f"setup_blocks must be a power of two, got {bb}")
    programs = triton.cdiv(blocks, bb)
    per_column = torch.empty(parts, programs, lanes, dtype=torch.int32, device=device)
    wrap(_setup_kernel)[(programs, parts)](index, state, counts, per_column, rows, lane_xor, numel, blocks,
                                           index.shape[1], table_numel, LANE_BITS=lane_bits, BITS=bits, BB=bb)
    # a column's count before a program's; scanned along the last dimension of the transpose, because CUDA's
    # scan down the first dimension is several times slower on these (programs, lanes) shapes
    first = (per_column.transpose(1, 2).cumsum(2, dtype=torch.int32).transpose(1, 2) - per_column).contiguous()
    support = per_column.sum(1, dtype=torch.int32)
    lists = torch.empty(parts, 2 * blocks * lanes, dtype=torch.int32, device=device)
    wrap(_list_kernel)[(programs, parts)](state, first, lists, lane_xor, numel, blocks, LANE_BITS=lane_bits, BB=bb)
    wrap(_check_kernel)[(triton.cdiv(table_numel, CHECK_BLOCK), parts)](
        work, counts, stats, table_numel, INCONSISTENT=_SLOT["inconsistent"], STATS=len(PEEL_STATS),
        BLOCK=CHECK_BLOCK)
    wrap(_peel_kernel)[(lanes, parts)](work, counts, owner, out, state, stats, lists, support, stuck, rows, signs,
                                       lane_xor, blocks, numel, table_numel, LANE_BITS=lane_bits, TILE=tile,
                                       FALLBACK=fallback, STUCK_CAP=EXACT_SOLVE_LIMIT, STATS=len(PEEL_STATS))
    stuck = torch.sort(stuck, dim=1).values  # programs append in any order; the solve reads them sorted
    system = torch.empty(parts, EXACT_SOLVE_LIMIT * EXACT_SOLVE_LIMIT, dtype=torch.float64, device=device)
    rhs = torch.empty(parts, EXACT_SOLVE_LIMIT, dtype=torch.float64, device=device)
    wrap(_solve_kernel)[(parts,)](work, stuck, system, rhs, out, state, stats, rest, rows, signs, lane_xor, numel,
                                  table_numel, LANE_BITS=lane_bits, M=EXACT_SOLVE_LIMIT,
                                  ROWS=EXACT_SOLVE_LIMIT if on_cpu else SOLVE_ROWS, FALLBACK=fallback,
                                  TOL=3.0 * DETERMINED_TOL, STATS=len(PEEL_STATS))
    return out, state, stats, rest
