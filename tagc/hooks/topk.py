"""``topk``: TAGC's selection and error feedback, the kept values sent as a list instead of a sketch.

The peer that isolates what TAGC's count sketch buys: the same selection on the same
``residual + grad`` (:func:`tagc.sketch.sparsify.row_thresholds` at ``config.density(world)``
and :func:`~tagc.sketch.sparsify.keep_mask`, as TAGC's ``compress_``), the kept values sent as (position, value) pairs
in index order and scatter-added at the owner, exact on what was kept.

Static shapes (the traced path needs them): each rank row's list is padded to a
*capacity* fixed by the planned density (:func:`capacity`). Compaction runs on the device
with ``cumsum`` and ``searchsorted`` (no ``nonzero()``, no host reads).
"""

from __future__ import annotations

import math

import torch

from tagc.config import TAGCConfig
from tagc.hooks.codecs import Codec, Wire, finite
from tagc.sketch.sparsify import keep_limit, keep_mask, row_thresholds, sample_size

POSITION_BLOCK = 1 << 16
"""Positions travel as uint16 offsets within blocks of this many columns, plus a count per block."""
SLACK_SIGMAS = 4.0
"""Capacity covers the planned count plus this many standard deviations of the kept count."""
MARGIN = 8
"""A few more entries, for parts so small that the spread is below one element."""


def capacity(numel: int, density: float) -> int:
    """Entries per rank row: room for every entry the selection keeps, but for rare sampling outliers.

    A row of at most :data:`~tagc.sketch.sparsify.MIN_SAMPLE` entries (or at density >= 1) is
    thresholded exactly and keeps at most ``k = keep_limit(numel, density)``: capacity ``k``.
    A larger row's threshold is the ``h``-th largest of a spread sample holding
    ``h = keep_limit(sample, density)`` >= ``SAMPLE_HITS`` = 4096 kept entries, so the kept
    fraction it yields has a relative spread ~``1/sqrt(h)`` (a Beta quantile, 1.6% at 4096);
    the rest of the row then keeps a binomial count around it (spread ``sqrt(mu)``). With
    ``mu = density * numel`` and ``sigma = sqrt(mu + mu^2 / h)`` the capacity is
    ``ceil(mu + 4 sigma) + 8``: +6.25% for large rows at h = 4096, overflow odds ~3e-5 per row
    under that model. Gradients the sample misjudges can still overflow: see :class:`TopKCodec`.
    """
    size = sample_size(numel, density) if density < 1.0 else numel
    if size >= numel:
        return keep_limit(numel, density)
    hits = keep_limit(size, density)
    mean = density * numel
    sigma = math.sqrt(mean + mean * mean / hits)
    return min(numel, math.ceil(mean + SLACK_SIGMAS * sigma) + MARGIN)


def compact(kept: torch.Tensor, values: torch.Tensor,
            cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first ``cap`` kept entries of each row, in index order, into fixed-size lists.

    Args:
        kept: bool ``[N, n]``; values: ``[N, n]``.
    Returns:
        ``(counts int32 [N, nb + 1], offsets uint16 [N, cap], values float32 [N, cap], sent bool [N, n])``:
        kept entries per block of :data:`POSITION_BLOCK` with the row's overflow (kept entries
        beyond ``cap``) last, each entry's offset in its block and its value (0 past the count),
        and which entries went into the lists.
    """
    world, numel = kept.shape
    running = kept.cumsum(dim=1, dtype=torch.int32)  # [N, n]: kept entries up to and including each position
    sent = kept & (running <= cap)
    slots = torch.arange(1, cap + 1, dtype=torch.int32, device=kept.device).expand(world, cap).contiguous()
    positions = torch.searchsorted(running, slots)  # the position of the k-th kept entry; n past the last
    valid = positions < numel
    positions = positions.clamp_(max=max(numel - 1, 0))
    listed = torch.where(valid, values.float().gather(1, positions), 0.0)
    blocks = -(-numel // POSITION_BLOCK)
    ends = torch.arange(1, blocks + 1, device=kept.device).mul_(POSITION_BLOCK).clamp_(max=numel) - 1
    through = running[:, ends].clamp_(max=cap)  # entries listed up to each block's end
    per_block = torch.diff(through, dim=1, prepend=torch.zeros(world, 1, dtype=through.dtype, device=kept.device))
    overflow = (running[:, -1:] - cap).clamp_(min=0)
    counts = torch.cat([per_block, overflow], dim=1)
    offsets = torch.where(valid, positions % POSITION_BLOCK, 0).to(torch.uint16)
    return counts, offsets, listed, sent


def expand(counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`compact`, summed over rows: float32 ``[numel]``, padding ignored.

    Rows are added in rank order (one ``index_add_`` each; positions within a row are distinct),
    so the sum is deterministic.
    """
    world, cap = offsets.shape
    ends = counts[:, :-1].to(torch.int64).cumsum(dim=1)  # [N, nb]
    entry = torch.arange(cap, device=offsets.device).expand(world, cap).contiguous()
    block = torch.searchsorted(ends, entry, right=True)
    positions = block * POSITION_BLOCK + offsets.to(torch.int64)
    valid = (entry < ends[:, -1:]) & (positions < numel)
    positions = torch.where(valid, positions, numel)  # padding lands in a slot that is dropped
    values = torch.where(valid, values, 0.0)
    summed = torch.zeros(numel + 1, dtype=torch.float32, device=values.device)
    for row in range(world):
        summed.index_add_(0, positions[row], values[row])
    return summed[:numel]


class TopKCodec(Codec):
    """TAGC's threshold and error feedback; the kept values as a (position, value) list.

    Wire per rank row of ``n`` (``nb = ceil(n / 65536)``, ``cap = capacity(n, density)``):
    ``nb + 1`` int32 (kept entries per block of 65,536 columns, then the row's overflow),
    ``cap`` uint16 offsets within their block (sent as ``2 cap`` bytes), ``cap`` float32
    values; entries past a row's total are padding (zeros, ignored). About
    ``48 * density * (1 + slack) + 32 / 65536`` bits per element.
    Bound: exact on what was kept (the owner's float32 sum of the kept values, in rank order);
    ``sent + residual == residual_before + grad`` exactly (in ``residual_dtype``).
    Overflow: a row keeping more than ``cap`` sends its first ``cap`` kept entries in index
    order and leaves the rest in the residual (error feedback sends them later); the owner
    adds the count to ``stats.overflow``.
    Settings: ``ratio``/``sparsity`` give the density exactly as for TAGC; ``index_bits``,
    ``lane``, ``seed`` and ``fallback`` do not apply.
    NaN/Inf: a rank whose accumulated part is not finite sends NaN values; the owner's whole
    part is NaN (``nonfinite_parts``); that rank's residual stays as it was.
    """

    name = "topk"
    compresses = True

    def __init__(self, config: TAGCConfig, residual_dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.residual_dtype = residual_dtype
        self.residuals: dict[str, torch.Tensor] = {}

    def capacity(self, numel: int, world: int) -> int:
        return capacity(numel, self.config.density(world))

    def wire(self, numel, world, dtype):
        cap = self.capacity(numel, world)
        counts = Wire(-(-numel // POSITION_BLOCK) + 1, torch.int32)
        return counts, Wire(2 * cap, torch.uint8), Wire(cap, torch.float32)

    def encode(self, grad, key, group):
        world, numel = grad.shape
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros(grad.shape, dtype=self.residual_dtype, device=grad.device)
        accumulated = residual.clone().add_(grad)  # in residual_dtype, as TAGC's compress_
        ok = finite(accumulated)
        density = self.config.density(world)
        tau = row_thresholds(accumulated, density)
        kept = keep_mask(accumulated, tau[:, None], keep_limit(numel, density))  # scratch: compact() consumes it
        counts, offsets, values, sent = compact(kept, accumulated, self.capacity(numel, world))
        residual.copy_(torch.where(ok, accumulated.masked_fill_(sent, 0), residual))
        counts[:, -1:] = torch.where(ok, counts[:, -1:], 0)
        return counts, offsets.view(torch.uint8), torch.where(ok, values, torch.nan)

    def decode(self, received, numel, key, group, stats):
        counts, offsets, values = received
        ok = finite(values)  # padding is 0, so any NaN/Inf is a rank's poisoned part
        stats.nonfinite_parts = stats.nonfinite_parts + (~ok).to(torch.int64)
        stats.overflow = stats.overflow + counts[:, -1].sum(dtype=torch.int64)
        summed = expand(counts, offsets.contiguous().view(torch.uint16), values, numel)
        return torch.where(ok, summed, torch.nan)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {key: value.clone() for key, value in state.items()}
