"""Quantizing peer codecs: ``bf16``, ``fp8`` and ``int4`` (ZeRO++ qgZ style), and the blockwise helpers
they share with ``sign`` (:mod:`tagc.hooks.codecs.sign`).

Each is what a user would run instead of TAGC on the same engine (:mod:`tagc.hooks.core.engine`),
so only the codec differs. Every rank row is quantized on its own (row ``j`` goes to rank
``j``); the owner dequantizes each rank's row and sums in float32. Scales are per *block* of
``block`` consecutive columns of a part (the last block may be short; it is zero-padded for
the arithmetic only, the padding never crosses the wire). Each codec's registry entry
(:class:`~tagc.hooks.codecs.spec.CodecSpec`) is defined under its class.

No codec here reads a tensor on the host in ``encode``/``decode`` (no ``.item()``,
``nonzero()``, ``bool(tensor)``): NaN/Inf handling is ``torch.where`` on 0-d tensors, and
the NaN/Inf count goes into :class:`~tagc.hooks.core.stats.ExchangeStats` as a 0-d tensor, read
when the statistics are (``as_dict``).

NaN/Inf (docs/design.md §6, §7): ``bf16`` carries them element by element like plain, ``fp8``/``int4`` make the
sender's whole block NaN at its owner; every owner learns that some rank's part was not finite (``bf16``'s flag
byte, the sign bit of ``fp8``/``int4``'s scales), so every rank counts it and ``nonfinite="raise"`` raises there.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tagc.config import is_int
from tagc.hooks.codecs.codec import Codec, Wire, finite
from tagc.hooks.codecs.spec import CodecSpec

E4M3_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value: a block's absmax maps to it."""
INT4_LEVELS = 7
"""Symmetric int4 codes are in ``[-7, 7]`` (stored as ``code + 8`` in a nibble)."""
_M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------- helpers


def check_block(block: object) -> int:
    """``block`` as a positive int, or a ``ValueError`` saying what is allowed."""
    if not is_int(block) or block < 1:
        raise ValueError(f"block must be a positive integer (elements per scale), got {block!r}")
    return block


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def blocked(rows: torch.Tensor, block: int, fill: float = 0.0) -> torch.Tensor:
    """``[N, n]`` -> float32 ``[N, ceil(n/block), block]``, the last block padded with ``fill``."""
    world, numel = rows.shape
    pad = n_blocks(numel, block) * block - numel
    rows = rows.float()
    if pad:
        rows = F.pad(rows, (0, pad), value=fill)
    return rows.reshape(world, -1, block)


def unblocked(blocks: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`blocked`: ``[N, nb, block]`` -> ``[N, numel]``."""
    return blocks.reshape(blocks.shape[0], -1)[:, :numel]


def block_scales(blocks: torch.Tensor, top: float) -> torch.Tensor:
    """Per block ``absmax / top`` ``[N, nb]``; NaN where the block holds a NaN or Inf."""
    absmax = blocks.abs().amax(dim=-1)
    return torch.where(torch.isfinite(absmax), absmax / top, torch.nan)


def _divisor(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` where positive, else 1 (an all-zero or underflowed block quantizes to 0)."""
    return torch.where(scales > 0, scales, 1.0)[..., None]


def quantize_fp8(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, n]`` -> (e4m3 codes as uint8 ``[N, n]``, float32 scales ``[N, nb]``), absmax -> 448."""
    blocks = blocked(rows, block)
    scales = block_scales(blocks, E4M3_MAX)
    scaled = (blocks / _divisor(scales)).nan_to_num_(0.0).clamp_(-E4M3_MAX, E4M3_MAX)
    codes = unblocked(scaled.to(torch.float8_e4m3fn).view(torch.uint8), rows.shape[1])
    return codes.contiguous(), scales


def dequantize_fp8(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: float32 ``[N, n]``."""
    values = blocked(codes.view(torch.float8_e4m3fn).float(), block)
    return unblocked(values * scales[..., None], codes.shape[1])


def pack_nibbles(codes: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """uint8 codes < 16 ``[N, m]`` -> ``[N, ceil(m/2)]``: element ``2i`` low nibble, ``2i+1`` high."""
    if codes.shape[1] % 2:
        codes = F.pad(codes, (0, 1), value=fill)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: uint8 ``[N, numel]``."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)[:, :numel]


def mix32(x):
    """A 32-bit integer hash (xor-shift-multiply; multipliers < 2^31 so int64 never overflows).

    Works on Python ints and on int64 tensors holding values in ``[0, 2^32)``."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    return x ^ (x >> 16)


def uniform_noise(shape: tuple[int, int], stream: int, device: torch.device) -> torch.Tensor:
    """float32 ``[N, m]`` in ``[0, 1)`` (24 random bits), a pure function of the element's
    place and ``stream``: counter-based, no generator state, the same on every path."""
    idx = torch.arange(shape[0] * shape[1], dtype=torch.int64, device=device).view(shape)
    h = mix32((idx & _M32) ^ (stream & _M32))
    h = mix32(h ^ (((idx >> 32) + (stream >> 32)) & _M32))
    return (h >> 8).float() * 2.0**-24


def quantize_int4(rows: torch.Tensor, block: int,
                  noise: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, n]`` -> (packed codes uint8 ``[N, ceil(n/2)]``, float32 scales ``[N, nb]``).

    ``q = round(x / s)`` with ``s = absmax / 7`` (``floor(x / s + u)`` with ``noise`` ``u`` in
    ``[0, 1)`` of shape ``[N, nb * block]``: stochastic rounding, unbiased)."""
    blocks = blocked(rows, block)
    scales = block_scales(blocks, INT4_LEVELS)
    scaled = (blocks / _divisor(scales)).nan_to_num_(0.0)
    q = scaled.round_() if noise is None else scaled.add_(noise.view_as(scaled)).floor_()
    codes = q.clamp_(-INT4_LEVELS, INT4_LEVELS).add_(8).to(torch.uint8)
    return pack_nibbles(unblocked(codes, rows.shape[1]), fill=8), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, numel: int, block: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: float32 ``[N, numel]``."""
    q = blocked(unpack_nibbles(packed, numel).float() - 8.0, block)
    return unblocked(q * scales[..., None], numel)


def flag_scales(scales: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``scales`` (>= 0 or NaN) with the sign bit set everywhere when ``rows`` hold a NaN/Inf:
    every owner learns of it, none of the values change (decoders use ``|scale|``)."""
    return torch.where(finite(rows), scales, -scales)


def scales_ok(scales: torch.Tensor) -> torch.Tensor:
    """0-d bool: no sender flagged (:func:`flag_scales`) or sent a NaN scale."""
    return finite(scales) & ~torch.signbit(scales).any()


def _rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


# ---------------------------------------------------------------------- codecs


class BF16Codec(Codec):
    """Values cast to bfloat16 on the wire, summed in float32 at the owner. No state, no options.

    Wire per rank row of ``n``: ``n`` bfloat16 and one uint8 flag (1 where the rank's bf16
    part holds a NaN/Inf): ``16 + 8/n`` bits per element.
    Bound (round to nearest, 8 significant bits): per element and rank
    ``|x - bf16(x)| <= 2^-8 |x| + 2^-134`` (the subnormal spacing), for ``|x|`` below
    bfloat16's max (larger finite float32 values round to Inf, as any bf16 cast). NaN/Inf
    reach the owner element by element, as with the plain codec.
    """

    name = "bf16"
    compresses = True
    summed_dtype = torch.bfloat16  # an all-reduce form sums these columns in bf16, as torch's bf16_compress_hook

    def wire(self, numel, world, dtype):
        return Wire(numel, torch.bfloat16), Wire(1, torch.uint8)

    def encode(self, grad, key, group):
        rows = grad.to(torch.bfloat16)
        flag = (~finite(rows)).to(torch.uint8).expand(rows.shape[0], 1)  # also a float32 too large for bf16
        return rows, flag.contiguous()

    def decode(self, received, numel, key, group, stats):
        rows, flags = received
        stats.count_nonfinite(~flags.any())
        return rows.sum(dim=0, dtype=torch.float32)


BF16_SPEC = CodecSpec(name="bf16", build=lambda config, residual_dtype, options: BF16Codec(), options={},
                      config_fields=(), summary="values cast to bfloat16, summed in float32 at the owner")


class FP8Codec(Codec):
    """float8 e4m3 with one float32 scale per block of ``block`` elements (``absmax / 448``).

    Wire per rank row of ``n``: ``n`` e4m3 codes (sent as uint8) and ``ceil(n/block)``
    float32 scales (sign bit set: the rank's part holds a NaN/Inf): ``8 + 32/block`` bits per element.
    Bound (3 mantissa bits, round to nearest): per element and rank
    ``|x - deq(x)| <= 2^-4 * blockmax`` (plus ``2^-140`` for blocks whose absmax is below
    ``448 * 2^-126``, whose scale is a float32 subnormal).
    Options: ``block`` (default 128, docs/design.md §9).
    NaN/Inf: the sender's whole block is NaN at its owner.
    """

    name = "fp8"
    compresses = True

    def __init__(self, block: int = 128) -> None:
        if getattr(torch, "float8_e4m3fn", None) is None:
            raise ValueError(f"codec 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks: "
                             "use codec 'bf16' or 'int4', or a torch with float8 dtypes (>= 2.1)")
        self.block = check_block(block)

    def wire(self, numel, world, dtype):
        return (Wire(numel, torch.uint8), Wire(n_blocks(numel, self.block), torch.float32))

    def encode(self, grad, key, group):
        codes, scales = quantize_fp8(grad, self.block)
        return codes, flag_scales(scales, grad)

    def decode(self, received, numel, key, group, stats):
        codes, scales = received
        stats.count_nonfinite(scales_ok(scales))
        return dequantize_fp8(codes, scales.abs(), self.block).sum(dim=0)


FP8_SPEC = CodecSpec(name="fp8", build=lambda config, residual_dtype, options: FP8Codec(**options),
                     options={"block": 128}, config_fields=(),
                     summary="float8 e4m3, one float32 scale (absmax / 448) per block")


class Int4Codec(Codec):
    """ZeRO++ qgZ-style blockwise symmetric int4: codes in ``[-7, 7]``, one float32 scale
    ``absmax / 7`` per block, two codes per byte (``code + 8``, low nibble first).

    Wire per rank row of ``n``: ``ceil(n/2)`` bytes and ``ceil(n/block)`` float32 scales
    (sign bit set: the rank's part holds a NaN/Inf): ``4 + 32/block`` bits per element.
    Bound per element and rank: ``|x - deq(x)| <= blockmax / 14`` (nearest) or
    ``< blockmax / 7`` (stochastic, unbiased).
    Options: ``block`` (default 128; qgZ sizes its groups by the tensor's shape instead, which
    a flat part of columns does not have) and ``stochastic`` (default False: stochastic
    rounding from a counter-based hash of the element's place, the part, the sending rank
    and the step, so it is reproducible and the same eager and compiled).
    Why ``[-7, 7]``: docs/design.md §9; float32 scales: a bf16 one, off by up to 2^-8, would need clipping.
    NaN/Inf: the sender's whole block is NaN at its owner.
    State: with ``stochastic``, an encode counter per part (in ``state_dict``).
    """

    name = "int4"
    compresses = True

    def __init__(self, block: int = 128, stochastic: bool = False) -> None:
        self.block = check_block(block)
        if not isinstance(stochastic, bool):
            raise ValueError(f"stochastic must be True or False, got {stochastic!r}")
        self.stochastic = stochastic
        self.steps: dict[str, int] = {}

    def wire(self, numel, world, dtype):
        return (Wire(-(-numel // 2), torch.uint8), Wire(n_blocks(numel, self.block), torch.float32))

    def encode(self, grad, key, group):
        noise = None
        if self.stochastic:
            step = self.steps.get(key, 0)
            self.steps[key] = step + 1
            stream = mix32(mix32(zlib.crc32(key.encode()) ^ mix32(_rank(group))) ^ step) | (step << 32)
            padded = n_blocks(grad.shape[1], self.block) * self.block
            noise = uniform_noise((grad.shape[0], padded), stream, grad.device)
        packed, scales = quantize_int4(grad, self.block, noise)
        return packed, flag_scales(scales, grad)

    def decode(self, received, numel, key, group, stats):
        packed, scales = received
        stats.count_nonfinite(scales_ok(scales))
        return dequantize_int4(packed, scales.abs(), numel, self.block).sum(dim=0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{key}#steps": torch.tensor(step, dtype=torch.int64, device="cpu") for key, step in self.steps.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        loaded = {key.removesuffix("#steps"): int(value) for key, value in state.items() if key.endswith("#steps")}
        self.steps.clear()  # in place, as every codec loads its state
        self.steps.update(loaded)


INT4_SPEC = CodecSpec(name="int4", build=lambda config, residual_dtype, options: Int4Codec(**options),
                      options={"block": 128, "stochastic": False}, config_fields=(),
                      summary="ZeRO++ qgZ-style symmetric int4, one float32 scale per block")
