"""The Numba kernels behind :mod:`tagc.kernels.cpu` (importing this module imports numba).

Module-level functions, so numba's on-disk cache (``cache=True``) finds them again in every
process: compiled once per machine, loaded in milliseconds after that.
"""

import math

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def cell(p, j, block_rows, lane_xor, lane_bits):
    """Flat table cell ``j`` of chunk position ``p`` (as :meth:`SketchLayout.cells`)."""
    b = p >> lane_bits
    return block_rows[b, j] * (1 << lane_bits) + ((p & ((1 << lane_bits) - 1)) ^ lane_xor[b])


@njit(cache=True, nogil=True, inline="always")
def accumulate_row(grad, residual, n, t, candidates):
    """Row ``n``: ``a = residual + grad`` written into the residual, the positions with
    ``|a| >= t`` listed in ``candidates`` (one compare per entry on the hot path).
    Returns (how many were listed, how many of them are strictly above ``t``)."""
    count = 0
    above = 0
    for p in range(residual.shape[1]):
        a = residual[n, p] + grad[n, p]
        residual[n, p] = a
        if a >= t or a <= -t:
            candidates[count] = p
            count += 1
            if a > t or a < -t:
                above += 1
    return count, above


@njit(cache=True, nogil=True)
def compress_rows(
    grad, residual, tau, limit, cap, block_rows, block_signs, lane_xor, lane_bits, bits, index, table, held
):
    """Per chunk, error feedback and the selection rule of :mod:`tagc.sketch.sparsify`
    (``|a| > tau`` and the first ``limit - count(|a| > tau)`` ties ``|a| == tau``, of those
    the first ``cap``, in index order), then index bits, sketch cells and residual;
    ``held[n]`` counts the entries the capacity left in the residual.

    One pass over the chunk writes ``a`` into the residual and lists the candidates
    ``|a| >= tau`` (one compare per entry on the hot path); a second walk over that short
    list, in position order, keeps them or not now that the count above ``tau`` is known,
    so cells receive their values in the reference's order (bit-identical table).
    """
    n_rows, numel = residual.shape
    per_byte = 8 // bits
    candidates = np.empty(numel, dtype=np.int64)  # pages are touched only as far as it fills
    for n in range(n_rows):
        t = tau[n]
        count, above = accumulate_row(grad, residual, n, t, candidates)
        room = limit - above
        held[n] = max(0, above + min(count - above, max(room, 0)) - cap)
        rank = 0
        kept = 0
        for i in range(count):
            p = candidates[i]
            a = residual[n, p]
            if a == t or a == -t:  # a tie: kept while its rank is within the room
                rank += 1
                if rank > room:
                    continue
            kept += 1
            if kept > cap:  # past the capacity: stays in the residual
                break
            b = p >> lane_bits
            for j in range(3):
                table[n, cell(p, j, block_rows, lane_xor, lane_bits)] += block_signs[b, j] * a
            index[n, p // per_byte] |= 1 << (bits * (p % per_byte))
            residual[n, p] = 0


@njit(cache=True, nogil=True)
def sampled_kth(grad, residual, stride, size, k):
    """Per row: the ``k``-th smallest (1-based) of ``|residual + grad|`` over the sample positions
    ``(i * stride) % numel``. A radix select on the float bits (non-negative floats order like
    their int32 patterns): a histogram of the top 16 bits, then of the low 16 in the chosen bucket."""
    n_rows, numel = residual.shape
    out = np.empty(n_rows, dtype=np.float32)
    sample = np.empty(size, dtype=np.float32)
    pattern = sample.view(np.int32)
    counts = np.empty(1 << 16, dtype=np.int64)
    for n in range(n_rows):
        counts[:] = 0
        p = 0
        for i in range(size):
            sample[i] = abs(residual[n, p] + grad[n, p])
            counts[pattern[i] >> 16] += 1
            p += stride
            if p >= numel:
                p -= numel
        rank = k
        high = 0
        while counts[high] < rank:
            rank -= counts[high]
            high += 1
        counts[:] = 0
        for i in range(size):
            if (pattern[i] >> 16) == high:
                counts[pattern[i] & 0xFFFF] += 1
        low = 0
        while counts[low] < rank:
            rank -= counts[low]
            low += 1
        out[n] = np.array([(high << 16) | low], dtype=np.int32).view(np.float32)[0]
    return out


@njit(cache=True, nogil=True)
def support(index, numel, bits):
    """Sorted positions of the non-zero fields of an index."""
    per_byte = 8 // bits
    field = (1 << bits) - 1
    fields = np.zeros(256, dtype=np.int64)  # non-zero fields of every byte value
    for v in range(256):
        for sub in range(per_byte):
            fields[v] += ((v >> (bits * sub)) & field) != 0
    count = 0
    for byte in range(index.size):
        count += fields[index[byte]]
    positions = np.empty(count, dtype=np.int64)
    k = 0
    for byte in range(index.size):
        v = index[byte]
        sub = 0
        while v:
            if v & field:
                positions[k] = byte * per_byte + sub
                k += 1
            v >>= bits
            sub += 1
    return positions[positions < numel]  # padding bits of a corrupt index


@njit(cache=True, nogil=True)
def peel(positions, work, out, block_rows, block_signs, lane_xor, lane_bits):
    """Peel with a queue of pure cells; writes settled values into ``out`` and takes them out
    of ``work``. Returns the settled mask, the number of generations (rounds) and the number
    of cells no position maps to that are non-zero (the consistency check of
    :func:`tagc.sketch.codec.decode`).

    Peeling is bound by random reads of the table, so each cell keeps its tally and its value side by side (one
    cache line for both), a pure cell's tally names its position itself (no read of ``positions``), and the
    settled positions are bits of a bitmap."""
    k = positions.size
    one = np.int64(1) << 40  # tally = (unsettled positions on the cell) << 40 | (sum of those positions)
    cells = np.zeros(2 * work.size, dtype=np.int64)
    tally = cells[0::2]
    table = cells.view(np.float64)[1::2]
    table[:] = work
    for i in range(k):
        p = positions[i]
        for j in range(3):
            tally[cell(p, j, block_rows, lane_xor, lane_bits)] += one + p
    settled_bits = np.zeros((out.size + 63) >> 6, dtype=np.uint64)
    queue = np.empty(work.size + 3 * k, dtype=np.int64)
    tail = 0
    inconsistent = 0
    for c in range(work.size):
        if (tally[c] >> 40) == 1:
            queue[tail] = c
            tail += 1
        elif tally[c] == 0 and table[c] != 0:
            inconsistent += 1
    head = 0
    rounds = 0
    while head < tail:  # one generation: the cells that turned pure during the previous one
        end = tail
        settled = False
        while head < end:
            c = queue[head]
            head += 1
            if (tally[c] >> 40) != 1:
                continue
            p = tally[c] & (one - 1)
            b = p >> lane_bits
            c0 = cell(p, 0, block_rows, lane_xor, lane_bits)
            c1 = cell(p, 1, block_rows, lane_xor, lane_bits)
            c2 = cell(p, 2, block_rows, lane_xor, lane_bits)
            s0, s1, s2 = block_signs[b, 0], block_signs[b, 1], block_signs[b, 2]
            value = (s0 if c == c0 else (s1 if c == c1 else s2)) * table[c]
            out[p] = value
            settled_bits[p >> 6] |= np.uint64(1) << np.uint64(p & 63)
            settled = True
            table[c0] -= s0 * value
            table[c1] -= s1 * value
            table[c2] -= s2 * value
            tally[c0] -= one + p
            tally[c1] -= one + p
            tally[c2] -= one + p
            if (tally[c0] >> 40) == 1:
                queue[tail] = c0
                tail += 1
            if (tally[c1] >> 40) == 1:
                queue[tail] = c1
                tail += 1
            if (tally[c2] >> 40) == 1:
                queue[tail] = c2
                tail += 1
        if settled:
            rounds += 1
    work[:] = table
    known = np.empty(k, dtype=np.bool_)
    for i in range(k):
        p = positions[i]
        known[i] = (settled_bits[p >> 6] >> np.uint64(p & 63)) & np.uint64(1)
    return known, rounds, inconsistent


@njit(cache=True, nogil=True)
def peel_parts(indexes, numel, bits, work, out, block_rows, block_signs, lane_xor, lane_bits):
    """:func:`peel` of every part (row) of ``indexes``, ``work`` and ``out``, each alone. Returns the positions
    peeling left (part ``q``'s position ``i`` as ``q * numel + i``, in increasing order), and per part its
    support, rounds and inconsistent cells."""
    n_parts = indexes.shape[0]
    supports = np.zeros(n_parts, dtype=np.int64)
    rounds = np.zeros(n_parts, dtype=np.int64)
    inconsistent = np.zeros(n_parts, dtype=np.int64)
    found = [support(indexes[q], numel, bits) for q in range(n_parts)]
    total = 0
    for q in range(n_parts):
        total += found[q].size
    stuck = np.empty(total, dtype=np.int64)
    n = 0
    for q in range(n_parts):
        positions = found[q]
        known, rounds[q], inconsistent[q] = peel(positions, work[q], out[q], block_rows, block_signs, lane_xor,
                                                 lane_bits)
        supports[q] = positions.size
        for i in range(positions.size):
            if not known[i]:
                stuck[n] = q * numel + positions[i]
                n += 1
    return stuck[:n], supports, rounds, inconsistent


@njit(cache=True, nogil=True)
def list_rows(grad, residual, tau, limit, block_bits, counts, offsets, values):
    """Per row, error feedback and the selection rule of :func:`compress_rows`, the kept entries
    written into the lists of :mod:`tagc.sketch.kept_list` (``counts`` per block of
    ``1 << block_bits`` positions, then the overflow; ``offsets``; ``values``) instead of a
    sketch. Listed entries leave 0 in the residual; kept entries past the capacity stay."""
    n_rows, numel = residual.shape
    cap = offsets.shape[1]
    overflow_at = counts.shape[1] - 1
    mask = (1 << block_bits) - 1
    candidates = np.empty(numel, dtype=np.int64)
    for n in range(n_rows):
        t = tau[n]
        count, above = accumulate_row(grad, residual, n, t, candidates)
        room = limit - above
        rank = 0
        listed = 0
        for i in range(count):
            p = candidates[i]
            a = residual[n, p]
            if a == t or a == -t:
                rank += 1
                if rank > room:
                    continue
            if listed == cap:
                counts[n, overflow_at] += 1
                continue
            counts[n, p >> block_bits] += 1
            offsets[n, listed] = p & mask
            values[n, listed] = a
            listed += 1
            residual[n, p] = 0


@njit(cache=True, nogil=True)
def sum_lists(counts, offsets, values, block_bits, out):
    """Adds every row's list into ``out`` (rank order, then list order): the owner's decode."""
    n_rows, cap = offsets.shape
    numel = out.size
    for n in range(n_rows):
        k = 0
        for b in range(counts.shape[1] - 1):
            base = b << block_bits
            for _ in range(counts[n, b]):
                if k == cap:
                    break
                p = base + offsets[n, k]
                if p < numel:
                    out[p] += values[n, k]
                k += 1


@njit(cache=True, nogil=True)
def list_positions(counts, offsets, block_bits, numel, positions, listed):
    """Every row's listed positions (``numel`` for padding) and which are listed, walking the per-block counts
    (non-negative, as :func:`list_rows` writes them) instead of searching them."""
    n_rows, cap = offsets.shape
    for n in range(n_rows):
        k = 0
        for b in range(counts.shape[1] - 1):
            base = b << block_bits
            for _ in range(min(counts[n, b], cap - k)):
                p = base + offsets[n, k]
                listed[n, k] = p < numel
                positions[n, k] = p if p < numel else numel
                k += 1
        for i in range(k, cap):
            listed[n, i] = False
            positions[n, i] = numel


# ---------------------------------------------------------------- coded positions (tagc.sketch.positions)


@njit(cache=True, nogil=True, inline="always")
def _set_bit(body, k):
    body[k >> 3] |= np.uint8(1 << (k & 7))


@njit(cache=True, nogil=True, inline="always")
def _block_code_bits(m, low, block):
    """A block's coded size (Elias-Fano, or its bitmap when that is smaller) and whether it is the bitmap."""
    elias_fano = m * (low + 1) + (block >> low)
    if elias_fano > block:
        return block, True
    return elias_fano, False


@njit(cache=True, nogil=True, inline="always")
def _write_header(out, r, counts):
    for b in range(counts.size):
        out[r, 2 * b] = counts[b] & 0xFF
        out[r, 2 * b + 1] = (counts[b] >> 8) & 0xFF


@njit(cache=True, nogil=True, inline="always")
def _code_block(body, at, local, m, low, block):
    """Write one block's ``m`` sorted local positions at bit ``at`` of ``body``; returns its size."""
    size, bitmap = _block_code_bits(m, low, block)
    if bitmap:
        for j in range(m):
            _set_bit(body, at + local[j])
        return size
    high = at + m * low
    for j in range(m):
        p = local[j]
        for t in range(low):
            if (p >> t) & 1:
                _set_bit(body, at + j * low + t)
        _set_bit(body, high + (p >> low) + j)
    return size


@njit(cache=True, nogil=True, inline="always")
def _code_row(out, r, positions, n, blocks, low, block_bits, counts, local):
    """Row ``r`` of ``out``: the header of per-block counts, then the blocks' codes of the sorted
    ``positions[:n]``; a block that would not fit in the row ends it (callers keep within the capacity)."""
    block = 1 << block_bits
    body_bits = (out.shape[1] - 2 * blocks) * 8
    counts[:] = 0
    for i in range(n):
        counts[positions[i] >> block_bits] += 1
    _write_header(out, r, counts)
    body = out[r, 2 * blocks:]
    at = 0
    i = 0
    for b in range(blocks):
        m = counts[b]
        size, _ = _block_code_bits(m, low, block)
        if at + size > body_bits:
            break
        for j in range(m):
            local[j] = positions[i + j] & (block - 1)
        at += _code_block(body, at, local, m, low, block)
        i += m


@njit(cache=True, nogil=True)
def code_positions(positions, count, blocks, low, block_bits, out):
    """Rows' sorted position lists (the first ``count[r]`` of ``positions[r]``) -> coded rows
    (``out`` zeroed)."""
    counts = np.zeros(blocks, dtype=np.int64)
    local = np.empty(1 << block_bits, dtype=np.int64)
    for r in range(positions.shape[0]):
        _code_row(out, r, positions[r], min(count[r], positions.shape[1]), blocks, low, block_bits, counts, local)


@njit(cache=True, nogil=True)
def code_bitmap(index, numel, cap, blocks, low, block_bits, out):
    """Rows' packed bitmaps (1 bit per position) -> coded rows of their first ``cap`` set positions
    below ``numel`` (as the reference), as :func:`code_positions`."""
    counts = np.zeros(blocks, dtype=np.int64)
    local = np.empty(1 << block_bits, dtype=np.int64)
    positions = np.empty(index.shape[1] * 8, dtype=np.int64)
    for r in range(index.shape[0]):
        n = 0
        for byte in range(index.shape[1]):
            v = np.uint64(index[r, byte])
            while v and n < cap:
                p = byte * 8 + _lowest_set(v)
                if p >= numel:
                    break
                positions[n] = p
                n += 1
                v &= v - np.uint64(1)
        _code_row(out, r, positions, n, blocks, low, block_bits, counts, local)


@njit(cache=True, nogil=True, inline="always")
def _read_bits(body, bit, n):
    """``n`` (at most 56) bits of ``body`` from bit ``bit`` on, the first in the lowest place; 0 past its end."""
    first = bit >> 3
    word = np.uint64(0)
    for i in range(((bit & 7) + n + 7) >> 3):
        if first + i < body.size:
            word |= np.uint64(body[first + i]) << np.uint64(8 * i)
    return (word >> np.uint64(bit & 7)) & ((np.uint64(1) << np.uint64(n)) - np.uint64(1))


@njit(cache=True, nogil=True, inline="always")
def _lowest_set(word):
    """Where the lowest set bit of a nonzero ``word`` sits (a power of two is exact in float64)."""
    return math.frexp(np.float64(word & (~word + np.uint64(1))))[1] - 1


@njit(cache=True, nogil=True, inline="always")
def _decode_row(code, r, blocks, low, block_bits, numel, out):
    """Row ``r``'s positions into ``out`` (at most its size); returns the header's count. The body is read 56
    bits at a time, each set bit found from the lowest up."""
    block = 1 << block_bits
    cap = out.size
    body = code[r, 2 * blocks:]
    body_bits = body.size * 8
    total = 0
    at = 0
    for b in range(blocks):
        m = np.int64(code[r, 2 * b]) | (np.int64(code[r, 2 * b + 1]) << 8)
        size, bitmap = _block_code_bits(m, low, block)
        base = b * block
        if bitmap:
            found = 0
            k = 0
            while found < m and k < block and at + k < body_bits:
                n = min(56, block - k, body_bits - (at + k))
                word = _read_bits(body, at + k, n)
                while word and found < m:
                    if total + found < cap:
                        out[total + found] = base + k + _lowest_set(word)
                    found += 1
                    word &= word - np.uint64(1)
                k += n
        else:
            high = at + m * low
            j = 0
            k = high
            while j < m and k < body_bits:
                n = min(56, body_bits - k)
                word = _read_bits(body, k, n)
                while word and j < m:
                    unary = k + _lowest_set(word)
                    if total + j < cap:
                        p = np.int64(_read_bits(body, at + j * low, low)) if low else 0
                        out[total + j] = base + (((unary - high - j) << low) | p)
                    j += 1
                    word &= word - np.uint64(1)
                k += n
        total += m
        at += size
    return total


@njit(cache=True, nogil=True)
def decode_positions(code, blocks, low, block_bits, numel, positions, count):
    """Coded rows -> sorted positions ``[R, cap]`` (``numel`` past the count) and the counts."""
    for r in range(code.shape[0]):
        positions[r, :] = numel
        count[r] = _decode_row(code, r, blocks, low, block_bits, numel, positions[r])


@njit(cache=True, nogil=True)
def union_bitmap(code, blocks, low, block_bits, numel, cap, index):
    """Coded rows -> the packed bitmap of the union of their positions (the owner's merge): row ``r`` into part
    ``r % P``'s, ``index`` ``[P, bytes]``."""
    scratch = np.empty(cap, dtype=np.int64)
    parts = index.shape[0]
    for r in range(code.shape[0]):
        total = min(_decode_row(code, r, blocks, low, block_bits, numel, scratch), cap)
        for i in range(total):
            p = scratch[i]
            if p < numel:
                index[r % parts, p >> 3] |= np.uint8(1 << (p & 7))
