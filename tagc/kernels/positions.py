"""Coded positions on the device: the Elias-Fano wire of :mod:`tagc.sketch.positions`, one program per block.

A block's bit offset is the exclusive scan of the sizes before it, and its size follows from its count alone, so
with the counts known every (block, row) is independent: a grid of ``(blocks, rows)`` programs, one
:data:`~tagc.sketch.positions.CODE_BLOCK` each.

* **code a bitmap** (:func:`launch_code_index`): ``_count_kernel`` counts each block's set
  bits; in torch, the counts are bounded by the capacity (a row codes its first ``cap``
  positions, as the reference does), giving each block's count ``m``, size and start;
  ``_code_bitmap_kernel`` then ranks the block's kept bits (a cumulative sum) and ORs
  their code bits into the row's body.
* **code a position list** (:func:`launch_encode_positions`): counts by a scatter-add in
  torch (the reference's), then ``_code_list_kernel`` reads each block's entries in tiles.
* **decode** (:func:`launch_decode_positions`, :func:`launch_union_index`): counts from the
  header, starts in torch; ``_decode_kernel`` reads the block's marker bits (the high
  bitvector, or the bitmap), ranks them with a cumulative sum, reads each entry's low part,
  and stores the positions (``decode``) or ORs them into the union bitmap of the row's part, shared by
  every rank's row of that part (``union``).

Adjacent blocks share the bytes at their boundary, so the encoders OR their bits into an
int32 view of the body with atomics (at most three per entry: its marker and its low part,
which may straddle two words); the union ORs one bit per entry. OR is order-free, so the
bytes are the reference's exactly, whatever order the programs run in. No host reads: shapes
follow from ``(numel, cap, low)``.

:mod:`tagc.kernels.ops` registers the launchers as torch operators; :mod:`tagc.kernels.dispatch` picks them.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from tagc.sketch.index import index_nbytes
from tagc.sketch.positions import BLOCK_BITS, CODE_BLOCK, HEADER_BYTES, block_sizes, code_blocks, coded_row_bytes

BYTES = tl.constexpr(CODE_BLOCK // 8)
"""Index bytes per coded block."""
TILE = 1024
"""Entries per step of the list encoder."""
WARPS = 8
"""Warps of the programs that hold a whole block (4096 lanes)."""


@triton.jit
def _flag(like, flag):
    """``flag`` (a 0-d int) broadcast to a bool tensor shaped like ``like`` (the interpreter cannot
    AND a 0-d bool into a tensor mask)."""
    return (like * 0 + flag) != 0


@triton.jit
def _or_code_bits(body_ptr, words, x, j, keep, m, start, LOW: tl.constexpr, B_BITS: tl.constexpr):
    """OR into ``body_ptr`` (``words`` int32 words) the code bits of the entries ``keep``: local
    position ``x``, rank ``j`` within a block of ``m`` entries starting at bit ``start``.

    Elias-Fano: the marker bit ``start + m * LOW + (x >> LOW) + j`` and the low part
    ``x mod 2**LOW`` at ``start + j * LOW``; bitmap (when that is smaller): the bit ``start + x``.
    Nothing is written past the body (a list that breaks the callers' contract: unsorted, or
    more than ``cap`` entries).
    """
    B: tl.constexpr = 1 << B_BITS
    bitmap = m * (LOW + 1) + (B >> LOW) > B
    ef = _flag(x, (~bitmap).to(tl.int32))
    marker = tl.where(ef, start + m * LOW + (x >> LOW) + j, start + x)
    tl.atomic_or(body_ptr + (marker >> 5), (1 << (marker & 31)).to(tl.int32), mask=keep & ((marker >> 5) < words),
                 sem="relaxed")
    if LOW > 0:
        at = start + j * LOW
        part = (x & ((1 << LOW) - 1)).to(tl.int64) << (at & 31)  # at most 43 bits: two words
        lo = (part & 0xFFFFFFFF).to(tl.int32)
        hi = (part >> 32).to(tl.int32)
        tl.atomic_or(body_ptr + (at >> 5), lo, mask=keep & ef & (lo != 0) & ((at >> 5) < words), sem="relaxed")
        tl.atomic_or(body_ptr + (at >> 5) + 1, hi, mask=keep & ef & (hi != 0) & ((at >> 5) + 1 < words), sem="relaxed")


@triton.jit
def _block_bits(index_ptr, row, block, numel, stride):
    """The block's bits of a packed 1-bit index, ``[BYTES, 8]`` int32, and their local positions."""
    byte = block * BYTES + tl.arange(0, BYTES)
    sub = tl.arange(0, 8)
    p = byte[:, None] * 8 + sub[None, :]
    v = tl.load(index_ptr + row * stride + byte, mask=byte * 8 < numel, other=0).to(tl.int32)
    bit = ((v[:, None] >> sub[None, :]) & 1) * (p < numel).to(tl.int32)
    return bit, (p - block * (BYTES * 8)).to(tl.int32)


@triton.jit
def _count_kernel(index_ptr, counts_ptr, numel, stride, blocks):
    """``counts[row, block]``: the set bits of a block of the index."""
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    bit, _ = _block_bits(index_ptr, row, block, numel, stride)
    tl.store(counts_ptr + row * blocks + block, tl.sum(tl.sum(bit, axis=1), axis=0))


@triton.jit
def _code_bitmap_kernel(index_ptr, m_ptr, start_ptr, body_ptr, numel, stride, blocks, body_words,
                        LOW: tl.constexpr, B_BITS: tl.constexpr):
    """The block's first ``m`` set bits of the index, coded into the row's body."""
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    m = tl.load(m_ptr + row * blocks + block)
    start = tl.load(start_ptr + row * blocks + block)
    bit, x = _block_bits(index_ptr, row, block, numel, stride)
    per_byte = tl.sum(bit, axis=1)
    rank = (tl.cumsum(per_byte, axis=0) - per_byte)[:, None] + tl.cumsum(bit, axis=1)  # 1-based, index order
    keep = (bit != 0) & (rank <= m)
    _or_code_bits(body_ptr + row * body_words, body_words, x, (rank - 1).to(tl.int64), keep, m, start, LOW, B_BITS)


@triton.jit
def _code_list_kernel(pos_ptr, m_ptr, first_ptr, start_ptr, body_ptr, cap, blocks, body_words,
                      LOW: tl.constexpr, B_BITS: tl.constexpr, TILE: tl.constexpr):
    """The block's ``m`` entries of the row's sorted list (from entry ``first``), coded into the body."""
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    m = tl.load(m_ptr + row * blocks + block)
    first = tl.load(first_ptr + row * blocks + block)
    start = tl.load(start_ptr + row * blocks + block)
    for j0 in range(0, m, TILE):
        j = j0 + tl.arange(0, TILE).to(tl.int64)
        keep = j < m
        p = tl.load(pos_ptr + row * cap + first + j, mask=keep, other=0)
        x = p & ((1 << B_BITS) - 1)
        _or_code_bits(body_ptr + row * body_words, body_words, x, j, keep, m, start, LOW, B_BITS)


@triton.jit
def _decode_kernel(code_ptr, m_ptr, first_ptr, start_ptr, out_ptr, numel, cap, blocks, row_bytes, parts, out_words,
                   LOW: tl.constexpr, B_BITS: tl.constexpr, UNION: tl.constexpr):
    """The block's entries: stored at ``out[row, first + j]`` (``UNION=False``), or ORed into the
    int32 words of the union bitmap of the row's part ``row % parts`` (``UNION=True``: ``out`` ``[parts,
    out_words]``); only a row's first ``cap`` entries."""
    B: tl.constexpr = 1 << B_BITS
    block = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    m = tl.load(m_ptr + row * blocks + block)
    first = tl.load(first_ptr + row * blocks + block)
    start = tl.load(start_ptr + row * blocks + block)
    body = code_ptr + row * row_bytes + blocks * 2
    body_bytes = row_bytes - blocks * 2
    k = tl.arange(0, B)  # in-block quantities are int32; bit offsets and positions int64
    bitmap = m * (LOW + 1) + (B >> LOW) > B
    ef = _flag(k, (~bitmap).to(tl.int32))
    marks_from = tl.where(ef, start + m * LOW, start)  # the markers: high bitvector, or the bitmap
    length = tl.where(ef, m + (B >> LOW), B)
    q = marks_from + k
    inside = (k < length) & ((q >> 3) < body_bytes)
    byte = tl.load(body + (q >> 3), mask=inside, other=0).to(tl.int32)
    hit = ((byte >> (q & 7).to(tl.int32)) & 1) * inside.to(tl.int32)
    j = tl.cumsum(hit, axis=0) - hit  # the entry's rank in the block
    if LOW > 0:
        at = start + j * LOW
        need = ef & (hit != 0)
        b0 = tl.load(body + (at >> 3), mask=need & ((at >> 3) < body_bytes), other=0).to(tl.int32)
        b1 = tl.load(body + (at >> 3) + 1, mask=need & ((at >> 3) + 1 < body_bytes), other=0).to(tl.int32)
        b2 = tl.load(body + (at >> 3) + 2, mask=need & ((at >> 3) + 2 < body_bytes), other=0).to(tl.int32)
        part = ((b0 | (b1 << 8) | (b2 << 16)) >> (at & 7).to(tl.int32)) & ((1 << LOW) - 1)
        x = tl.where(ef, ((k - j) << LOW) | part, k)
    else:
        x = tl.where(ef, k - j, k)
    position = block * B + x
    keep = (hit != 0) & (first + j < cap)
    if UNION:
        keep = keep & (position < numel)
        tl.atomic_or(out_ptr + (row % parts) * out_words + (position >> 5), (1 << (position & 31)).to(tl.int32),
                     mask=keep, sem="relaxed")
    else:
        tl.store(out_ptr + row * cap + first + j, position, mask=keep)


def _header(counts: torch.Tensor) -> torch.Tensor:
    """uint8 ``[R, 2 * blocks]``: the counts as little-endian uint16 (the reference's header)."""
    rows = counts.shape[0]
    return torch.stack([counts & 0xFF, counts >> 8], dim=2).to(torch.uint8).view(rows, -1)


def _layout(counts: torch.Tensor, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first entry, start bit)`` of every block, int64 ``[R, blocks]``: exclusive scans."""
    sizes, _ = block_sizes(counts, low)
    return (torch.cumsum(counts, dim=1) - counts).contiguous(), (torch.cumsum(sizes, dim=1) - sizes).contiguous()


def _coded(counts: torch.Tensor, words: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    """Header and body (``words``, int32, little-endian bytes) as one uint8 ``[R, coded_row_bytes]``."""
    body_bytes = coded_row_bytes(numel, cap, low) - code_blocks(numel) * HEADER_BYTES
    return torch.cat([_header(counts), words.view(torch.uint8)[:, :body_bytes]], dim=1)


def _body_words(numel: int, cap: int, low: int) -> int:
    return -(-(coded_row_bytes(numel, cap, low) - code_blocks(numel) * HEADER_BYTES) // 4)


def launch_code_index(index: torch.Tensor, numel: int, cap: int, low: int,
                       wrap: Callable = lambda k: k) -> torch.Tensor:
    """Rows of a packed 1-bit index (uint8 ``[R, >= ceil(numel / 8)]``) -> coded rows, each its first
    ``cap`` set positions: uint8 ``[R, coded_row_bytes(numel, cap, low)]``."""
    index = index.contiguous()
    rows, blocks = index.shape[0], code_blocks(numel)
    words = torch.zeros(rows, _body_words(numel, cap, low), dtype=torch.int32, device=index.device)
    if rows == 0 or blocks == 0:
        return _coded(torch.zeros(rows, blocks, dtype=torch.int64, device=index.device), words, numel, cap, low)
    raw = torch.empty(rows, blocks, dtype=torch.int32, device=index.device)
    wrap(_count_kernel)[(blocks, rows)](index, raw, numel, index.shape[1], blocks)
    raw = raw.to(torch.int64)
    counts = torch.minimum(raw, (cap - (torch.cumsum(raw, dim=1) - raw)).clamp(min=0)).contiguous()  # the first cap
    _, starts = _layout(counts, low)
    wrap(_code_bitmap_kernel)[(blocks, rows)](index, counts, starts, words, numel, index.shape[1], blocks,
                                              words.shape[1], LOW=low, B_BITS=BLOCK_BITS, num_warps=WARPS)
    return _coded(counts, words, numel, cap, low)


def launch_encode_positions(positions: torch.Tensor, count: torch.Tensor, numel: int, cap: int, low: int,
                            wrap: Callable = lambda k: k) -> torch.Tensor:
    """Rows' sorted positions (int64 ``[R, cap]``, the first ``count`` of each) -> coded rows."""
    rows, blocks = positions.shape[0], code_blocks(numel)
    device = positions.device
    words = torch.zeros(rows, _body_words(numel, cap, low), dtype=torch.int32, device=device)
    entry = torch.arange(cap, device=device).expand(rows, cap)
    valid = entry < count.reshape(rows, 1)
    block = torch.where(valid, positions >> BLOCK_BITS, blocks)  # padding goes to a dropped block
    counts = torch.zeros(rows, blocks + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, block, valid.to(torch.int64))
    counts = counts[:, :blocks].contiguous()
    if rows and blocks and cap:
        firsts, starts = _layout(counts, low)
        wrap(_code_list_kernel)[(blocks, rows)](positions.to(torch.int64).contiguous(), counts, firsts, starts, words,
                                                cap, blocks, words.shape[1], LOW=low, B_BITS=BLOCK_BITS, TILE=TILE)
    return _coded(counts, words, numel, cap, low)


def _read_header(code: torch.Tensor, numel: int) -> torch.Tensor:
    blocks = code_blocks(numel)
    pairs = code[:, : blocks * HEADER_BYTES].to(torch.int64).view(code.shape[0], blocks, HEADER_BYTES)
    return (pairs[..., 0] | (pairs[..., 1] << 8)).contiguous()


def launch_decode_positions(code: torch.Tensor, numel: int, cap: int, low: int,
                            wrap: Callable = lambda k: k) -> tuple[torch.Tensor, torch.Tensor]:
    """Coded rows -> ``(positions int64 [R, cap], count int64 [R])``: increasing, ``numel`` past the count."""
    code = code.contiguous()
    rows, blocks = code.shape[0], code_blocks(numel)
    counts = _read_header(code, numel)
    positions = torch.full((rows, cap), numel, dtype=torch.int64, device=code.device)
    if rows and blocks and cap:
        firsts, starts = _layout(counts, low)
        wrap(_decode_kernel)[(blocks, rows)](code, counts, firsts, starts, positions, numel, cap, blocks, code.shape[1],
                                             1, 0, LOW=low, B_BITS=BLOCK_BITS, UNION=False, num_warps=WARPS)
    return positions, counts.sum(dim=1)


def launch_union_index(code: torch.Tensor, numel: int, cap: int, low: int, parts: int = 1,
                       wrap: Callable = lambda k: k) -> torch.Tensor:
    """Coded rows -> the packed 1-bit index (uint8 ``[parts * ceil(numel / 8)]``) of the union of their positions,
    per part: row ``j * parts + p`` is part ``p``'s from rank ``j``; the parts' indexes back to back."""
    code = code.contiguous()
    rows, blocks = code.shape[0], code_blocks(numel)
    words = torch.zeros(parts, -(-numel // 32), dtype=torch.int32, device=code.device)
    if rows and blocks and cap:
        counts = _read_header(code, numel)
        firsts, starts = _layout(counts, low)
        wrap(_decode_kernel)[(blocks, rows)](code, counts, firsts, starts, words, numel, cap, blocks, code.shape[1],
                                             parts, words.shape[1], LOW=low, B_BITS=BLOCK_BITS, UNION=True,
                                             num_warps=WARPS)
    return words.view(torch.uint8)[:, : index_nbytes(numel, 1)].reshape(-1)
