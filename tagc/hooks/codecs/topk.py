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
from tagc.hooks.codecs.codec import (
    ResidualCodec,
    Wire,
    check_wire_options,
    finite,
    pack_values,
    unpack_values,
    value_wires,
    with_ratio,
)
from tagc.kernels.dispatch import decode_positions, encode_positions, list_kept_, list_positions, sum_lists
from tagc.sketch.kept_list import POSITION_BLOCK, position_blocks
from tagc.sketch.positions import coded_row_bytes, low_bits
from tagc.sketch.sparsify import capacity

__all__ = ["TopKCodec", "capacity"]


POSITIONS = ("offsets", "coded")


class TopKCodec(ResidualCodec):
    """TAGC's threshold and error feedback; the kept values as a (position, value) list.

    Wire per rank row of ``n``: ``nb + 1`` int32 (kept entries per block of 65,536 columns, then the row's
    overflow), the positions (``positions="offsets"``: ``cap`` uint16 offsets within their block;
    ``"coded"``: Elias-Fano per block of 4,096, about ``density * (log2(1 / density) + 2)`` bits per element) and
    ``cap`` values (``cap = capacity(n, density)``; zeros past a row's count; docs/design.md §7). Values in
    bfloat16, float16 or float8 (``value_dtype``) give each value's rounding back to the residual, so error
    feedback sends it later and ``sent + residual == residual_before + grad`` stays exact.

    Bound: exact on what was sent (the owner's float32 sum of the sent values, in rank order).
    Overflow: a row keeping more than ``cap`` sends its first ``cap`` kept entries in index
    order and leaves the rest in the residual (error feedback sends them later); the owner
    adds the count to ``stats.overflow``.
    Settings: ``ratio``/``sparsity`` give the density exactly as for TAGC; ``index_bits``,
    ``lane``, ``seed`` and ``fallback`` do not apply, and ``tagc.hook`` refuses them.
    NaN/Inf: a rank whose gradient part is not finite sends NaN values; the owner's whole
    part is NaN (``nonfinite_parts``); that rank's residual stays as it was.
    """

    name = "topk"
    compresses = True
    uses_ratio = True

    def __init__(self, config: TAGCConfig, residual_dtype: torch.dtype = torch.float32, positions: str = "offsets",
                 value_dtype="float32") -> None:
        value_dtype = check_wire_options(positions, value_dtype, POSITIONS)
        super().__init__(residual_dtype)
        self.config = config
        self.positions = positions
        self.value_dtype = value_dtype

    def capacity(self, numel: int, world: int) -> int:
        return capacity(numel, self.config.density(world))

    def _low(self, world: int) -> int:
        return low_bits(self.config.density(world))

    def wire(self, numel, world, dtype):
        cap = self.capacity(numel, world)
        counts = Wire(position_blocks(numel) + 1, torch.int32)
        if self.positions == "coded":
            where = Wire(coded_row_bytes(numel, cap, self._low(world)), torch.uint8)
        else:
            where = Wire(2 * cap, torch.uint8)
        return (counts, where, *value_wires(cap, self.value_dtype))

    def encode(self, grad, key, group):
        world, numel = grad.shape
        residual = self.residual(key, grad)
        cap = self.capacity(numel, world)
        counts, offsets, values = list_kept_(grad, residual, self.config.density(world), cap)
        if self.value_dtype != torch.float32 or self.positions == "coded":
            positions, listed = list_positions(counts, offsets, numel)
        wires = pack_values(values, self.value_dtype)
        if self.value_dtype != torch.float32:
            rounding = torch.where(listed, values - unpack_values(wires), 0.0)  # exact in float32
            residual.scatter_add_(1, positions.clamp(max=numel - 1), rounding.to(residual.dtype))
        if self.positions == "coded":
            where = encode_positions(positions, listed.sum(dim=1), numel, cap, self._low(world))
        else:
            where = offsets.view(torch.uint8)
        return (counts, where, *wires)

    def decode(self, received, numel, key, group, stats):
        counts, where, *wires = received
        values = unpack_values(wires)
        world, cap = values.shape
        ok = finite(values)  # padding is 0, so any NaN/Inf is a rank's poisoned part
        stats.count_nonfinite(ok)
        stats.count("overflow", counts[:, -1].sum(dtype=torch.int64))
        if self.positions == "coded":
            positions, _ = decode_positions(where.contiguous(), numel, cap, self._low(world))
            offsets = (positions & (POSITION_BLOCK - 1)).to(torch.uint16)
        else:
            offsets = where.contiguous().view(torch.uint16)
        summed = sum_lists(counts, offsets, values, numel)
        return torch.where(ok, summed, torch.nan)

    def at_ratio(self, ratio: float) -> "TopKCodec":
        return self if ratio == self.config.ratio else with_ratio(self, ratio)
