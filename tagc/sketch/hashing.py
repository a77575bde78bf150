"""Deterministic integer hashing in torch (never Python's ``hash``).

All arithmetic is on int64 tensors holding 32-bit values, with multipliers below 2**31 so
no product overflows: the same inputs give the same bits on every process, machine and
device.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_MUL_A = 0x7FEB352D
_MUL_B = 0x6B43A9B5
_GOLDEN = 0x9E3779B9


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer (xor-shift-multiply), elementwise on int64 tensors."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & MASK32
    return x ^ (x >> 16)


def stream_key(seed: int, stream: int) -> int:
    """A 32-bit key for hash stream ``stream`` under ``seed`` (pure Python ints)."""
    key = torch.tensor([(seed * _GOLDEN + stream * 0x85EBCA6B + 0x165667B1) & MASK32], dtype=torch.int64)
    return int(mix32(mix32(key) ^ stream))


def hash32(x: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """Independent-looking 32-bit hashes of integers ``x`` for each ``(seed, stream)``."""
    return mix32(mix32(x ^ stream_key(seed, stream)) + stream)


def _permute_pow2(x: torch.Tensor, bits: int, keys: tuple[int, ...]) -> torch.Tensor:
    """A keyed bijection of ``[0, 2**bits)`` (add, odd multiply, xor-shift rounds)."""
    if bits == 0:
        return x
    mask = (1 << bits) - 1
    shift = max(1, (bits + 1) // 2)
    for key in keys:
        x = (x + key) & mask
        x = (x * (_MUL_A | 1)) & mask
        x = x ^ (x >> shift)
        x = (x * (_MUL_B | 1)) & mask
        x = x ^ (x >> shift)
    return x


def permute(x: torch.Tensor, domain: int, seed: int, stream: int) -> torch.Tensor:
    """A keyed pseudo-random permutation of ``[0, domain)`` applied to ``x`` (< domain).

    Cycle-walks a power-of-two bijection, so distinct inputs give distinct outputs. Used
    once per layout (cached), never on the step path.
    """
    if domain > 2**32:
        raise ValueError(f"permutation domain {domain} exceeds 2**32")
    bits = max(0, (domain - 1).bit_length())
    keys = tuple(stream_key(seed, stream * 8 + r) for r in range(3))
    y = _permute_pow2(x, bits, keys)
    outside = y >= domain
    while bool(outside.any()):
        y = torch.where(outside, _permute_pow2(y, bits, keys), y)
        outside = y >= domain
    return y
