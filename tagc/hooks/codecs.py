"""Codecs: how one part of a bucket's columns crosses the wire and is summed at its owner.

The exchange engine (:mod:`tagc.hooks.engine`) cuts every bucket into *parts* (a set of
columns of the packed ``[N, S]`` reduce-scatter input, row ``j`` for rank ``j``) and hands
each part to a codec:

* :meth:`Codec.wire` - the tensors a part sends, as ``(columns per rank row, dtype)``. They
  follow from the part's size and the settings alone, so a compiled graph can hold them and
  the bytes on the wire are known before anything is sent;
* :meth:`Codec.encode` - this rank's rows ``[N, n]`` -> those wire tensors (row ``j`` goes
  to rank ``j``), updating any error-feedback state the codec owns;
* :meth:`Codec.decode` - every rank's row for this rank (``[N, columns]`` per wire tensor,
  row ``j`` from rank ``j``) -> the float32 sum over ranks of this rank's ``n`` columns.

A codec may take more than one exchange round (``rounds > 1``, e.g. PowerSGD's P then Q):
:meth:`Codec.next_round` turns what round ``k-1`` received into round ``k``'s wire tensors,
and :meth:`Codec.decode` gets what the last round received. Such a codec is not traceable.
A codec that needs whole parameters (their shapes) sets ``whole_segments``: the engine then
gives it one part per bucket holding every selected segment, and tells it their places once,
through :meth:`Codec.prepare`.

The same two calls serve the eager pipeline (one all-to-all per part, launched as soon as
the part is encoded) and the traced halves of a compiled model (one all-to-all per wire
dtype), so both give the same values, the same bytes and the same NaN/Inf behaviour.

**NaN/Inf policy (every codec, eager and compiled alike).** No extra exchange agrees on it
(at most a flag travels inside a codec's own wire: ``bf16``'s one byte per row, the sign bit
of ``fp8``/``int4``'s scales). A value that is not finite reaches its owner: the plain codec sends it as it
is, so the owner's sum is NaN/Inf where plain FSDP's would be; TAGC cannot place a value
outside its sketch, so a rank whose part holds a NaN/Inf sends a table of NaN and every
owner's whole part comes out NaN (count: ``nonfinite_parts``). Residuals are never
poisoned: the rank with the NaN/Inf keeps its residual as it was, the others keep what they
did not send (the sent values are lost with the step, as when an optimizer skips a
non-finite step). With ``nonfinite="raise"`` every rank raises ``FloatingPointError`` once
the exchange is complete, so no collective is left unmatched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from tagc.config import TAGCConfig
from tagc.hooks.stats import ExchangeStats
from tagc.hooks.transport import gather_from_owners
from tagc.kernels.dispatch import compress_, decode
from tagc.sketch import SketchLayout
from tagc.sketch.kept_list import finite  # noqa: F401  (the one finite check; the codecs import it from here)
from tagc.sketch.index import merge_index

if TYPE_CHECKING:
    from tagc.hooks.segment import Segment

@dataclasses.dataclass(frozen=True)
class Wire:
    """One tensor a part sends: ``columns`` per rank row, of ``dtype``."""

    columns: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return self.columns * self.dtype.itemsize


class Codec:
    """The interface every codec implements (see the module docstring)."""

    name: str = ""
    compresses: bool = False
    """Whether the hook's ``select`` policy routes columns to this codec (the plain codec takes the rest)."""
    rounds: int = 1
    """Exchange rounds per part: round 0 sends :meth:`encode`'s tensors, round ``k`` :meth:`next_round`'s."""
    whole_segments: bool = False
    """Whether a part must hold whole segments (one part per bucket, described by :meth:`prepare`)."""

    def prepare(self, key: str, segments: Sequence["Segment"], world: int) -> None:
        """For ``whole_segments`` codecs, once per part when a bucket is planned: the part's
        segments, their ``start`` relative to the part's columns."""

    def next_round(self, round: int, received: Sequence[torch.Tensor], key: str,
                   group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
        """Round ``round``'s wire tensors (row ``j`` to rank ``j``) from what round ``round - 1``
        received (row ``j`` from rank ``j``). Only for ``rounds > 1``."""
        raise NotImplementedError

    def wire(self, numel: int, world: int, dtype: torch.dtype) -> tuple[Wire, ...]:
        raise NotImplementedError

    def encode(self, grad: torch.Tensor, key: str, group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def decode(self, received: Sequence[torch.Tensor], numel: int, key: str, group: Optional[dist.ProcessGroup],
               stats: ExchangeStats) -> torch.Tensor:
        raise NotImplementedError

    def overlappable(self) -> bool:
        """Whether :meth:`decode` is free of collectives, so it may run whenever its bytes arrived."""
        return True

    def traceable(self) -> bool:
        """Whether encode/decode keep the wire shapes of :meth:`wire` (a compiled graph can hold them);
        a codec with ``rounds > 1`` is not."""
        return self.rounds == 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class PlainCodec(Codec):
    """The columns as they are (the reduce dtype), summed in float32 at the owner: a fair
    reduce-scatter, ``(N-1)/N`` of the buffer per rank, no state."""

    name = "plain"

    def wire(self, numel: int, world: int, dtype: torch.dtype) -> tuple[Wire, ...]:
        return (Wire(numel, dtype),)

    def encode(self, grad, key, group):
        return (grad,)

    def decode(self, received, numel, key, group, stats):
        return received[0].sum(dim=0, dtype=torch.float32)


class TAGCCodec(Codec):
    """Error feedback, threshold, exact index and count sketch; index merge and peeling at the owner.

    State: one residual ``[N, n]`` per part (``residual_dtype``), keyed by the bucket's
    parameters and the part, never by call order.
    """

    name = "tagc"
    compresses = True

    def __init__(self, config: TAGCConfig, residual_dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.residual_dtype = residual_dtype
        self.residuals: dict[str, torch.Tensor] = {}
        self._accumulated: dict[str, torch.Tensor] = {}  # fallback="raw": grad + residual until decode
        self.layout = functools.lru_cache(maxsize=4096)(self._layout)  # per instance: no hook kept alive by a cache

    def _layout(self, numel: int) -> SketchLayout:
        return SketchLayout(numel, self.config.ratio, self.config.lane, self.config.seed)

    def wire(self, numel, world, dtype):
        layout = self.layout(numel)
        return (Wire(-(-numel * self.config.index_bits // 8), torch.uint8), Wire(layout.table_numel, torch.float32))

    def overlappable(self) -> bool:
        return self.config.fallback != "raw"  # the raw re-send is a collective: it runs where every rank runs it

    def traceable(self) -> bool:
        return self.config.fallback != "raw"  # the raw re-send has data-dependent sizes

    def encode(self, grad, key, group):
        world, numel = grad.shape
        layout = self.layout(numel)
        if not bool(finite(grad)):  # the rank's residual stays as it was; every owner sees the NaN table
            index_wire, table_wire = self.wire(numel, world, grad.dtype)
            return (torch.zeros(world, index_wire.columns, dtype=torch.uint8, device=grad.device),
                    torch.full((world, table_wire.columns), float("nan"), dtype=torch.float32, device=grad.device))
        residual = self.residuals.get(key)
        if residual is None:
            residual = self.residuals[key] = torch.zeros(grad.shape, dtype=self.residual_dtype, device=grad.device)
        if self.config.fallback == "raw":
            self._accumulated[key] = residual.to(torch.float32, copy=True).add_(grad)
        return compress_(grad, residual, self.config.density(world), layout, self.config.index_bits)

    def decode(self, received, numel, key, group, stats):
        indexes, tables = received
        layout = self.layout(numel)
        summed = tables.sum(dim=0)
        if not bool(finite(summed)):
            stats.nonfinite_parts += 1
            self._accumulated.pop(key, None)
            values = torch.full((numel,), float("nan"), dtype=torch.float32, device=tables.device)
            if self.config.fallback == "raw":  # every rank takes part in the re-send round, asking nothing
                gather_from_owners(torch.zeros(0, dtype=torch.int64, device=tables.device),
                                   torch.zeros(indexes.shape[0], 0, device=tables.device), group)
            return values
        bits = self.config.index_bits
        union = functools.reduce(lambda a, b: merge_index(a, b, bits), indexes.unbind(0))
        values, decoded = decode(summed, union, layout, bits, fallback=self.config.fallback)
        stats.support += int(decoded.support)
        stats.peeled += int(decoded.peeled)
        stats.unpeeled += int(decoded.unpeeled)
        stats.estimated += int(decoded.estimated)
        if self.config.fallback == "raw":  # every rank takes part, also with nothing to ask for
            wanted = decoded.raw_positions if decoded.raw_positions is not None else torch.zeros(0, dtype=torch.int64, device=summed.device)
            sent_values = self._accumulated.pop(key) - self.residuals[key]
            raw_values, sent = gather_from_owners(wanted, sent_values, group)
            values[wanted] = raw_values
            stats.wire_bytes += sent
            stats.raw += int(decoded.raw)
        return values

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.residuals)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residuals = {key: value.clone() for key, value in state.items()}

