"""The ``sign`` peer codec: 1 bit per element and a mean-``|a|`` scale per block, with error feedback
(EF-signSGD / 1-bit Adam's compressor).

This module is the whole codec, the model of a new codec's module (``docs/design.md``, "Adding a codec"): the
class and its :data:`SPEC`, which one line of :mod:`tagc.hooks.codecs.registry` registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tagc.hooks.codecs.codec import ResidualCodec, Wire, finite
from tagc.hooks.codecs.quantized import blocked, check_block, n_blocks, unblocked
from tagc.hooks.codecs.spec import CodecSpec

DEFAULT_BLOCK = 1024
"""Elements per scale when ``block`` is not given (see :class:`SignCodec`)."""


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool ``[N, m]`` -> uint8 ``[N, ceil(m/8)]``: element ``8i+b`` is bit ``b`` of byte ``i``."""
    pad = -bits.shape[1] % 8
    if pad:
        bits = F.pad(bits, (0, pad))
    weights = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8, device=bits.device)
    return (bits.view(bits.shape[0], -1, 8).to(torch.uint8) * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: bool ``[N, numel]``."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).bool().reshape(packed.shape[0], -1)[:, :numel]


class SignCodec(ResidualCodec):
    """1 bit per element plus one float32 scale per block (mean ``|a|`` of the block), with
    error feedback (EF-signSGD / 1-bit Adam): ``a = residual + grad``, sent ``sign(a) * scale``
    (``a == 0`` sends ``+scale``), ``residual = a - sent``.

    Wire per rank row of ``n``: ``ceil(n/8)`` bytes of sign bits (bit set = ``+``) and
    ``ceil(n/block)`` float32 scales: ``1 + 32/block`` bits per element.
    Bound: none per step (a 1-bit code); what is not sent stays in the residual, so the
    sum over steps of what was sent tracks the sum of gradients within the residual.
    ``sent + residual == a`` up to one rounding of the residual (``fl(a - sent)``; exact
    where the subtraction is, e.g. ``scale/2 <= |a| <= 2 scale``).
    Options: ``block`` (default 1024, docs/design.md §9).
    NaN/Inf: a rank whose accumulated part is not finite sends NaN scales; the owner's whole
    part is NaN; that rank's residual stays as it was.
    State: one residual ``[N, n]`` per part (``residual_dtype``), keyed by the part.
    """

    name = "sign"
    compresses = True

    def __init__(self, block: int = DEFAULT_BLOCK, residual_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(residual_dtype)
        self.block = check_block(block)

    def wire(self, numel, world, dtype):
        return (Wire(-(-numel // 8), torch.uint8), Wire(n_blocks(numel, self.block), torch.float32))

    def encode(self, grad, key, group):
        numel = grad.shape[1]
        residual = self.residual(key, grad)
        accumulated = residual.float() + grad.float()
        ok = finite(accumulated)
        blocks = blocked(accumulated, self.block)
        counts = (numel - self.block * torch.arange(blocks.shape[1], device=grad.device)).clamp_(max=self.block)
        scales = (blocks.abs() / counts[:, None]).sum(dim=-1)  # divide first: no overflow near float32's max
        positive = accumulated >= 0
        sent = unblocked(blocked(torch.where(positive, 1.0, -1.0), self.block) * scales[..., None], numel)
        residual.copy_(torch.where(ok, accumulated - sent, residual))
        return pack_bits(positive), torch.where(ok, scales, torch.nan)

    def decode(self, received, numel, key, group, stats):
        packed, scales = received
        ok = finite(scales)
        stats.count_nonfinite(ok)
        signs = unpack_bits(packed, numel).float().mul_(2).sub_(1)
        values = unblocked(blocked(signs, self.block) * scales[..., None], numel).sum(dim=0)
        return torch.where(ok, values, torch.nan)


SPEC = CodecSpec(name="sign",
                 build=lambda config, residual_dtype, options: SignCodec(residual_dtype=residual_dtype, **options),
                 options={"block": DEFAULT_BLOCK}, config_fields=(),
                 summary="1 bit per element and a mean-|a| scale per block, with error feedback")
"""The registry's entry for ``sign`` (:func:`tagc.hooks.codecs.registry.register`)."""
