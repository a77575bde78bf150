"""What the eager and the traced exchange share: a batch of parts' encode and decode through its codec (timed,
with a loaded checkpoint's check) and the ``nonfinite="raise"`` error. FSDP's reduce op as a scale is
:func:`tagc.hooks.core.transport.op_scale`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import torch

from tagc.hooks.codecs.codec import Codec
from tagc.hooks.core.checkpoint import Restored
from tagc.hooks.core.plan import Batch, Part
from tagc.hooks.core.state import UnitTiming
from tagc.hooks.core.stats import ExchangeStats


def raises_nonfinite(nonfinite: str, stats: ExchangeStats) -> bool:
    """Whether an exchange must raise: ``nonfinite="raise"`` and a part was NaN/Inf on some rank (no host
    read under ``"propagate"``)."""
    return nonfinite == "raise" and bool(stats.nonfinite_parts)


def nonfinite_error(key: str) -> FloatingPointError:
    return FloatingPointError(f"a gradient in TAGC bucket {key!r} is NaN/Inf on some rank (nonfinite='raise')")


@dataclasses.dataclass(frozen=True)
class PartCoder:
    """Encodes and decodes the parts of one exchange.

    ``restored``: a loaded checkpoint's bookkeeping (round 0 of a compressed part must find its state);
    ``plain``: the hook's plain codec (never checked); ``select_fingerprint``: for the check's message;
    ``piece_bytes``: bytes per peer of each all-to-all piece (:mod:`tagc.hooks.core.transport`)."""

    plain: Codec
    piece_bytes: int | None = None
    restored: Restored | None = None
    select_fingerprint: Callable[[], str] = str

    def check(self, part: Part) -> None:
        """A compressed part must find a loaded checkpoint's state (:meth:`Restored.check_part`)."""
        if self.restored is not None:
            self.restored.check_part(part, self.plain, self.select_fingerprint)

    def encode(self, batch: Batch, grad: torch.Tensor | Sequence[torch.Tensor], group, timing: UnitTiming,
               round: int = 0) -> tuple[torch.Tensor, ...]:
        """Round 0: ``grad`` is this rank's rows of the batch's columns (``[N, numel]``); a later round: what the
        previous round received."""
        if round == 0:
            for part in batch.parts:
                self.check(part)
        start = time.perf_counter()
        if round == 0:
            wires = batch.codec.encode_batch(grad, batch.keys, group)
        else:
            wires = batch.codec.next_round(round, grad, batch.key, group)
        if batch.codec.compresses:
            end = time.perf_counter()
            timing.compress_s += end - start
            timing.events.append(("compress", start, end))
        return wires

    def decode(self, batch: Batch, received: Sequence[torch.Tensor], group, stats: ExchangeStats,
               timing: UnitTiming | None = None) -> torch.Tensor:
        """The batch's summed values (its columns') from what every rank sent it (the codec adds its statistics to
        ``stats``)."""
        start = time.perf_counter()
        values = batch.codec.decode_batch(received, batch.parts[0].numel, batch.keys, group, stats)
        if batch.codec.compresses:
            end = time.perf_counter()
            stats.decode_s += end - start
            if timing is not None:
                timing.decode_s += end - start
                timing.events.append(("decode", start, end))
        return values
