"""Coded positions: a row's sorted support in about its entropy, exactly, in a fixed-size wire.

TAGC's index (a bitmap, 1 bit per element) and ``topk``'s offsets (16 bits per kept entry) both
say *which* positions of a rank row are kept. At a density ``d`` of a few percent the entropy is
far lower (``H(0.0356) = 0.22`` bits per element). This module codes the kept positions of each
rank row with **Elias-Fano, per block of** :data:`CODE_BLOCK` **positions**:

* A block with ``m`` kept positions ``p`` (local, ``0 <= p < B``) writes ``m`` *low parts*
  (``p mod 2**l``, ``l`` bits each, LSB first) and then a *high bitvector* of
  ``m + B / 2**l`` bits in which the ``j``-th kept position (in order) sets bit
  ``(p >> l) + j``. That is ``m (l + 1) + B / 2**l`` bits. ``l`` is fixed by the planned
  density (:func:`low_bits`), so the code needs no per-block parameters.
* A block for which that is more than ``B`` bits (a dense block) is written as its **bitmap**
  (``B`` bits) instead; which blocks did is known from the counts alone (:func:`bitmap_blocks`,
  counted in the stats).
* The row's wire is a header of per-block counts (uint16, little-endian), then the blocks'
  codes back to back, padded with zero bits to :func:`coded_row_bytes`. Block ``b`` starts at
  the sum of the sizes before it, so every block decodes on its own (in parallel on a GPU).

**Fixed size.** For ``cap`` kept entries per row at most, the blocks' codes take at most
``cap (l + 1) + nb B / 2**l`` bits in all, wherever the entries fall (each block's size is
linear in its count, or less when it falls back to the bitmap). So a row that keeps at most
``cap`` entries always fits, and a traced graph can hold the wire's shape: the callers keep the
count within ``cap`` (``topk`` lists at most ``cap``; TAGC sends nothing from a row that would
keep more, see :func:`tagc.sketch.compress.compress_`).

**Cost** (docs/design.md §7): 0.245 bits per element at ``d = 3.56%`` (``l = 4``), the entropy's 0.222.

This module is the reference (vectorised torch, no host reads, so it also serves CUDA);
:mod:`tagc.kernels.dispatch` gives the same bytes from the CPU kernels and from the Triton
kernels (:mod:`tagc.kernels.positions`, one program per block).
"""

from __future__ import annotations

import math

import torch

from tagc.sketch.index import index_nbytes, pack_mask, unpack_counts

CODE_BLOCK = 1 << 12
"""Positions per coded block: small enough that the 16-bit count header costs 0.004 bits per
element and blocks adapt to local density, large enough that a block's ``B / 2**l`` high-part
overhead is spread over many entries."""
BLOCK_BITS = 12
MAX_LOW_BITS = BLOCK_BITS
HEADER_BYTES = 2
"""Bytes of one block's count in the header (uint16: a block keeps at most 4096)."""


def low_bits(density: float) -> int:
    """Elias-Fano's low-part width for a block kept at ``density``: ``floor(log2(1 / d))``
    (the width that minimises ``d (l + 1) + 2**-l``), within ``[0, 12]``."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return max(0, min(MAX_LOW_BITS, math.floor(math.log2(1.0 / density))))


def code_blocks(numel: int) -> int:
    """Coded blocks in a row of ``numel`` positions."""
    return -(-numel // CODE_BLOCK)


def coded_row_bytes(numel: int, cap: int, low: int) -> int:
    """Wire bytes per rank row: the count header plus room for ``cap`` entries (see the module docstring)."""
    blocks = code_blocks(numel)
    body = min(cap * (low + 1) + blocks * (CODE_BLOCK >> low), blocks * CODE_BLOCK)
    return blocks * HEADER_BYTES + -(-body // 8)


def block_sizes(counts: torch.Tensor, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bits, bitmap)`` per block from its kept count: Elias-Fano's ``m (l + 1) + B / 2**l``
    or the bitmap's ``B``, whichever is smaller (ties go to Elias-Fano)."""
    elias_fano = counts * (low + 1) + (CODE_BLOCK >> low)
    bitmap = elias_fano > CODE_BLOCK
    return torch.where(bitmap, CODE_BLOCK, elias_fano), bitmap


def bitmap_blocks(code: torch.Tensor, numel: int, low: int) -> torch.Tensor:
    """How many blocks of the coded rows ``code`` fell back to their bitmap (an int64 0-d tensor)."""
    return block_sizes(_header(code, numel), low)[1].sum()


def positions_from_mask(mask: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``cap`` set positions of each row of a bool ``[R, n]`` mask, in order.

    Returns ``(positions int64 [R, cap], count int64 [R])``; entries past ``count`` are ``n``.
    """
    rows, numel = mask.shape
    running = mask.cumsum(dim=1, dtype=torch.int32)
    slots = torch.arange(1, cap + 1, dtype=torch.int32, device=mask.device).expand(rows, cap).contiguous()
    positions = torch.searchsorted(running, slots)  # the k-th set position; n past the last
    count = (running[:, -1].to(torch.int64) if numel else torch.zeros(rows, dtype=torch.int64, device=mask.device))
    return positions, count.clamp(max=cap)


def mask_from_positions(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """Bool ``[R, numel]``: the rows' positions set (entries ``>= numel`` are padding)."""
    rows = positions.shape[0]
    mask = torch.zeros(rows, numel + 1, dtype=torch.bool, device=positions.device)
    mask.scatter_(1, positions.clamp(max=numel), True)
    return mask[:, :numel]


def encode_positions(positions: torch.Tensor, count: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    """Code each row's first ``count`` positions (sorted, distinct, ``< numel``; ``count <= cap``).

    Args:
        positions: int64 ``[R, cap]``, in increasing order; entries past ``count`` are ignored.
        count: int64 ``[R]``.
        numel: the row length; cap: the most entries a row holds; low: :func:`low_bits`.
    Returns:
        uint8 ``[R, coded_row_bytes(numel, cap, low)]``.
    """
    rows = positions.shape[0]
    device = positions.device
    blocks = code_blocks(numel)
    row_bytes = coded_row_bytes(numel, cap, low)
    body_bits = (row_bytes - blocks * HEADER_BYTES) * 8
    entry = torch.arange(cap, device=device).expand(rows, cap)
    valid = entry < count.reshape(rows, 1)
    block = torch.where(valid, positions >> BLOCK_BITS, blocks)  # padding goes to a dropped block
    local = positions & (CODE_BLOCK - 1)
    counts = torch.zeros(rows, blocks + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, block, valid.to(torch.int64))
    counts = counts[:, :blocks]
    sizes, bitmap = block_sizes(counts, low)
    starts = torch.cumsum(sizes, dim=1) - sizes  # bit offset of each block in the body
    firsts = torch.cumsum(counts, dim=1) - counts  # entry index of each block's first entry
    block_c = block.clamp(max=max(blocks - 1, 0))
    start = starts.gather(1, block_c)
    rank = entry - firsts.gather(1, block_c)  # the entry's rank within its block
    is_bitmap = bitmap.gather(1, block_c)
    marker = torch.where(is_bitmap, start + local, start + counts.gather(1, block_c) * low + (local >> low) + rank)
    targets = [marker]
    values = [valid]
    for t in range(low):  # low part bit t of an Elias-Fano entry
        targets.append(start + rank * low + t)
        values.append(valid & ~is_bitmap & (((local >> t) & 1) == 1))
    target = torch.cat(targets, dim=1)
    value = torch.cat(values, dim=1)
    target = torch.where(value, target, body_bits)  # cleared bits go to a dropped slot
    bits = torch.zeros(rows, body_bits + 1, dtype=torch.uint8, device=device)
    bits.scatter_(1, target, 1)
    body = pack_mask(bits[:, :body_bits].reshape(-1), 1).view(rows, -1)
    header = torch.stack([counts & 0xFF, counts >> 8], dim=2).to(torch.uint8).view(rows, blocks * HEADER_BYTES)
    return torch.cat([header, body], dim=1)


def check_coded(code: torch.Tensor, numel: int, cap: int, low: int) -> None:
    """A clear ``ValueError`` unless ``code`` is uint8 ``[R, coded_row_bytes(numel, cap, low)]``."""
    if not isinstance(code, torch.Tensor) or code.dtype != torch.uint8 or code.dim() != 2:
        raise ValueError(f"coded positions are a 2-D uint8 tensor, got {getattr(code, 'dtype', type(code))}")
    if code.shape[1] != coded_row_bytes(numel, cap, low):
        raise ValueError(f"coded rows of {numel} positions (cap {cap}, low {low}) have "
                         f"{coded_row_bytes(numel, cap, low)} bytes, got {code.shape[1]}")


def _header(code: torch.Tensor, numel: int) -> torch.Tensor:
    blocks = code_blocks(numel)
    pairs = code[:, : blocks * HEADER_BYTES].to(torch.int64).view(code.shape[0], blocks, HEADER_BYTES)
    return pairs[..., 0] | (pairs[..., 1] << 8)


def decode_positions(code: torch.Tensor, numel: int, cap: int, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`encode_positions`: ``(positions int64 [R, cap], count int64 [R])``,
    positions in increasing order, ``numel`` past a row's count."""
    rows = code.shape[0]
    device = code.device
    blocks = code_blocks(numel)
    check_coded(code, numel, cap, low)
    counts = _header(code, numel)
    sizes, bitmap = block_sizes(counts, low)
    starts = torch.cumsum(sizes, dim=1) - sizes
    ends = torch.cumsum(counts, dim=1)
    count = ends[:, -1] if blocks else torch.zeros(rows, dtype=torch.int64, device=device)
    body = code[:, blocks * HEADER_BYTES:].contiguous()
    body_bits = body.shape[1] * 8
    bits = unpack_counts(body.reshape(-1), body.numel() * 8, 1).view(rows, body_bits).to(torch.bool)
    # every kept entry has one *marker* bit: its high bit (Elias-Fano) or its bit (bitmap)
    bit = torch.arange(body_bits, device=device).expand(rows, body_bits).contiguous()
    bit_block = (torch.searchsorted(starts.contiguous(), bit, right=True) - 1).clamp(min=0)
    marker_from = starts + torch.where(bitmap, 0, counts * low)
    in_markers = (bit >= marker_from.gather(1, bit_block)) & (bit < (starts + sizes).gather(1, bit_block))
    marks = bits & in_markers
    marker_rank = marks.cumsum(dim=1) - 1  # = the entry's index in the row
    slot = torch.where(marks & (marker_rank < cap), marker_rank, cap)
    marker = torch.zeros(rows, cap + 1, dtype=torch.int64, device=device)
    marker.scatter_(1, slot, bit)
    marker = marker[:, :cap]
    entry = torch.arange(cap, device=device).expand(rows, cap).contiguous()
    block = torch.searchsorted(ends.contiguous(), entry, right=True).clamp(max=max(blocks - 1, 0))
    rank = entry - (ends - counts).gather(1, block)
    start = starts.gather(1, block)
    offset = marker - marker_from.gather(1, block)
    low_part = torch.zeros_like(entry)
    for t in range(low):
        at = (start + rank * low + t).clamp(max=body_bits - 1)
        low_part |= bits.gather(1, at).to(torch.int64) << t
    local = torch.where(bitmap.gather(1, block), offset, ((offset - rank) << low) | low_part)
    positions = torch.where(entry < count.reshape(rows, 1), (block << BLOCK_BITS) + local, numel)
    return positions, count


def code_index(index: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    """Rows of a packed 1-bit index (uint8 ``[R, ceil(numel / 8)]``, at most ``cap`` set each) -> coded rows."""
    rows = index.shape[0]
    mask = unpack_counts(index.reshape(-1), index.numel() * 8, 1).view(rows, -1)[:, :numel].bool()
    positions, count = positions_from_mask(mask, cap)
    return encode_positions(positions, count, numel, cap, low)


def union_index(code: torch.Tensor, numel: int, cap: int, low: int, parts: int = 1) -> torch.Tensor:
    """Coded rows -> the packed 1-bit index of the union of their positions (TAGC's owner merge). With ``parts``,
    row ``j * parts + p`` is part ``p``'s row from rank ``j``: each part's union, the parts' indexes back to back
    (uint8 ``[parts * ceil(numel / 8)]``)."""
    positions, _ = decode_positions(code, numel, cap, low)
    mask = mask_from_positions(positions, numel).view(-1, parts, numel).any(dim=0)
    padding = index_nbytes(numel, 1) * 8 - numel  # each part's index is whole bytes
    if padding:
        mask = torch.cat([mask, mask.new_zeros(parts, padding)], dim=1)
    return pack_mask(mask, 1)
