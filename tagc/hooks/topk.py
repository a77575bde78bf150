"""``topk``: TAGC's selection and error feedback, the kept values sent as a list instead of a sketch.

The peer that isolates what TAGC's count sketch buys: the same selection on the same
``residual + grad`` (TAGC's threshold and tie rule at ``config.density(world)``), the kept
values sent as (position, value) lists in index order and scatter-added at the owner, exact on
what was kept. The semantics and the wire layout are :mod:`tagc.sketch.kept_list`; encode and
decode go through :mod:`tagc.kernels.dispatch` like TAGC's, so on a CPU both peers run fused
Numba kernels (one pass per row) and neither pays for the other's torch passes.

Static shapes (the traced path needs them): each rank row's list is padded to a
*capacity* fixed by the planned density (:func:`capacity`).
"""

from __future__ import annotations

import torch

from tagc.config import TAGCConfig
from tagc.hooks.codecs import Codec, Wire, finite
from tagc.kernels.dispatch import list_kept_, sum_lists
from tagc.sketch.kept_list import capacity, position_blocks

__all__ = ["TopKCodec", "capacity"]


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
    NaN/Inf: a rank whose gradient part is not finite sends NaN values; the owner's whole
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
        counts = Wire(position_blocks(numel) + 1, torch.int32)
        return counts, Wire(2 * cap, torch.uint8), Wire(cap, torch.float32)

    def encode(self, grad, key, group):
        world, numel = grad.shape
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros(grad.shape, dtype=self.residual_dtype, device=grad.device)
        counts, offsets, values = list_kept_(grad, residual, self.config.density(world), self.capacity(numel, world))
        return counts, offsets.view(torch.uint8), values

    def decode(self, received, numel, key, group, stats):
        counts, offsets, values = received
        ok = finite(values)  # padding is 0, so any NaN/Inf is a rank's poisoned part
        stats.nonfinite_parts = stats.nonfinite_parts + (~ok).to(torch.int64)
        stats.overflow = stats.overflow + counts[:, -1].sum(dtype=torch.int64)
        summed = sum_lists(counts, offsets.contiguous().view(torch.uint16), values, numel)
        return torch.where(ok, summed, torch.nan)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {key: value.clone() for key, value in state.items()}
