"""The support index: which positions of a chunk are non-zero, as a packed bitmap (``bits=1``, merged by OR) or
4-bit rank counts (``bits=4``, merged by addition); the byte layouts and why: docs/design.md §3.4.
"""

from __future__ import annotations

import torch

_GATHER_BITS = 0x0102040810204080
_NIBBLE_MAX = 15


def index_nbytes(numel: int, bits: int) -> int:
    """Bytes of an index over ``numel`` elements."""
    check_bits(bits)
    return -(-numel * bits // 8)


def check_bits(bits: int) -> None:
    if bits not in (1, 4):
        raise ValueError(f"index bits must be 1 or 4, got {bits!r}")


def pack_mask(mask: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a flat bool (or 0..15 count) tensor into a ``bits``-per-element uint8 index."""
    check_bits(bits)
    per_byte = 8 // bits
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % per_byte
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, per_byte)
    if bits == 1:  # 8 bytes of 0/1 as one (little-endian) int64; the multiply gathers byte i's bit into bit 56+i
        return ((groups.view(torch.int64).view(-1) * _GATHER_BITS) >> 56).to(torch.uint8)
    return groups[:, 0] | (groups[:, 1] << 4)


def unpack_counts(index: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Per-element values of an index: 0/1 for ``bits=1``, the 0..15 count for ``bits=4``."""
    check_index(index, numel, bits)
    if bits == 1:
        shifts = torch.arange(8, dtype=torch.uint8, device=index.device)
        return ((index[:, None] >> shifts) & 1).reshape(-1)[:numel]
    return torch.stack([index & 0x0F, index >> 4], dim=1).reshape(-1)[:numel]


def index_to_mask(index: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """The support (bool, ``[numel]``) an index describes."""
    return unpack_counts(index, numel, bits).bool()


def index_positions(index: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Sorted int64 positions of the support, unpacking only the non-zero bytes."""
    check_index(index, numel, bits)
    return parts_positions(index.view(1, -1), numel, bits)[0]


def parts_positions(indexes: torch.Tensor, numel: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The supports of several parts' indexes (uint8 ``[P, index_nbytes(numel, bits)]``) at once, unpacking only
    the non-zero bytes: ``(positions, part)``, int64, each part's positions in increasing order, part after part."""
    per_byte = 8 // bits
    row_bytes = indexes.shape[1]
    flat = indexes.reshape(-1)
    nonzero_bytes = flat.nonzero().squeeze(1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=indexes.device)
    fields = (flat.index_select(0, nonzero_bytes)[:, None] >> shifts) & ((1 << bits) - 1)
    hit = fields.nonzero()
    byte = nonzero_bytes.index_select(0, hit[:, 0])
    part = torch.div(byte, row_bytes, rounding_mode="floor")
    positions = (byte - part * row_bytes) * per_byte + hit[:, 1]
    inside = positions < numel
    return positions[inside], part[inside]


def check_index(index: torch.Tensor, numel: int, bits: int) -> None:
    check_bits(bits)
    if not isinstance(index, torch.Tensor) or index.dtype != torch.uint8 or index.dim() != 1:
        raise ValueError(f"an index must be a 1-D uint8 tensor, got {getattr(index, 'dtype', type(index))}")
    expected = index_nbytes(numel, bits)
    if index.numel() != expected:
        raise ValueError(f"a {bits}-bit index over {numel} elements has {expected} bytes, got {index.numel()}")


def build_index(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The ``bits``-per-element index of the non-zeros of ``values`` (flattened)."""
    return pack_mask(values.reshape(-1) != 0, bits)


def merge_index(a: torch.Tensor, b: torch.Tensor, bits: int) -> torch.Tensor:
    """Combine two ranks' indexes: bitwise OR (1 bit) or per-element count sum (4 bits).

    Raises:
        OverflowError: a 4-bit count would pass 15 (more than 15 ranks mark one element).
    """
    check_bits(bits)
    if a.shape != b.shape or a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise ValueError("indexes to merge must be uint8 tensors of one shape, "
                         f"got {a.dtype}{tuple(a.shape)} and {b.dtype}{tuple(b.shape)}")
    if bits == 1:
        return a | b
    low = (a & 0x0F) + (b & 0x0F)
    high = (a >> 4) + (b >> 4)
    if bool((low > _NIBBLE_MAX).any() | (high > _NIBBLE_MAX).any()):
        raise OverflowError(
            "4-bit index overflow: an element is marked by more than 15 ranks; use index_bits=1 (exact OR) "
            "for groups of more than 15 ranks"
        )
    return low | (high << 4)
