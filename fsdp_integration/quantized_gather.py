"""The int8 blockwise parameter all-gather (ZeRO++'s qwZ) of SimpleFSDP.

``MixedPrecisionPolicy(param_gather="int8")`` sends each rank's packed chunk of parameters as int8
instead of its float dtype: the chunk is cut into blocks of ``block`` elements (the last one
zero-padded), each block is scaled by its own ``scale = absmax / 127`` (float32) and rounded to the
nearest integer in ``[-127, 127]``. The wire of one rank is one int8 tensor, the scales' bytes followed by
the codes, so a unit still takes one all-gather; every rank then multiplies the codes back by their
block's scale. Per element the gathered value is within ``scale / 2`` of the exact one (plus float32
rounding); a block of zeros comes back exactly, and a non-finite element makes its whole block
non-finite.

Only the gathered copy used for compute is quantized: the sharded parameters (the optimizer's master
weights) stay exact, and the gradient's reduce-scatter is unchanged. The ops are tensor ops with
static shapes (no host syncs, no loops over elements), so the same code runs eager and compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PARAM_GATHERS = (None, "int8")
"""What ``MixedPrecisionPolicy.param_gather`` takes: ``None`` (the gather dtype, ``param_dtype`` or the
parameters') or ``"int8"`` (this module)."""

DEFAULT_BLOCK = 256
"""Elements per int8 block (one float32 scale each: 1/64 byte per element on top of the int8 code)."""

LEVELS = 127
"""The largest int8 code: symmetric, so ``-128`` is never used and zero is exact."""

_SCALE_BYTES = 4  # float32


def blocks_of(chunk: int, block: int) -> int:
    """Blocks of ``block`` elements that hold ``chunk`` elements (the last one padded)."""
    return -(-chunk // block)


def wire_numel(chunk: int, block: int) -> int:
    """Bytes (int8 elements) one rank all-gathers for a chunk of ``chunk`` elements: the codes and the scales."""
    blocks = blocks_of(chunk, block)
    return blocks * block + blocks * _SCALE_BYTES


def quantize(chunk: torch.Tensor, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """One rank's chunk ``[S]`` (any float dtype) -> its int8 wire ``[wire_numel(S, block)]``."""
    blocks = blocks_of(chunk.numel(), block)
    padded = F.pad(chunk.reshape(-1).float(), (0, blocks * block - chunk.numel())).view(blocks, block)
    scales = padded.abs().amax(dim=1) / LEVELS
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # a zero block: codes 0, scale 0
    codes = torch.round(padded / divisor[:, None]).clamp_(-LEVELS, LEVELS).to(torch.int8)
    return torch.cat([_scale_bytes(scales), codes.reshape(-1)])


def dequantize(gathered: torch.Tensor, world: int, chunk: int, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's int8 wire, gathered ``[world * wire_numel(chunk, block)]`` -> the chunks ``[world * chunk]``
    in ``dtype``."""
    blocks = blocks_of(chunk, block)
    rows = gathered.view(world, blocks * (_SCALE_BYTES + block))
    scales = _scales_from_bytes(rows[:, : blocks * _SCALE_BYTES].reshape(world, blocks, _SCALE_BYTES))
    codes = rows[:, blocks * _SCALE_BYTES :].reshape(world, blocks, block)
    values = (codes.float() * scales[:, :, None]).reshape(world, blocks * block)[:, :chunk]
    return values.to(dtype).reshape(-1)


_SHIFTS = (0, 8, 16, 24)


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales ``[blocks]`` -> their bytes ``[blocks * 4]`` (int8, little-endian). Shifts and masks on the
    same-size int32 view rather than a view of the float32 tensor as int8: Inductor miscompiles views between
    dtypes of different sizes (e.g. torch 2.13's int8 -> float32 of a gathered buffer gives wrong values)."""
    bits = scales.view(torch.int32)
    parts = torch.stack([(bits >> shift) & 0xFF for shift in _SHIFTS], dim=-1)
    return parts.to(torch.uint8).view(torch.int8).reshape(-1)


def _scales_from_bytes(data: torch.Tensor) -> torch.Tensor:
    """``[..., 4]`` int8 bytes (little-endian) -> the float32 scales ``[...]`` (:func:`_scale_bytes` reversed)."""
    parts = data.view(torch.uint8).to(torch.int32)
    bits = parts[..., 0] | (parts[..., 1] << 8) | (parts[..., 2] << 16) | (parts[..., 3] << 24)
    return bits.view(torch.float32)
