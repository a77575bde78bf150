"""Each rank's own gradient of the shards it owns, kept for the optimizer.

Error feedback delivers an element that waits ``k`` steps as one burst of about ``k`` steps'
gradient. Adam squares that burst into its second moment, so on an element whose gradient is
mostly signal ``v`` grows about ``k``-fold and the update shrinks about ``sqrt(k)``-fold (the
diagnosis in ``docs/quality-diagnosis.md``). Every rank still holds, before it compresses, its
own dense gradient of every element, the shards it owns included: a second moment fed with
that sees no bursts. :class:`tagc.optim.AdamW` reads what this store keeps.

The kept gradient is one rank's, not the mean over ranks: its noise is ``world`` times the
mean's, so on an element whose gradient is mostly noise the second moment grows by up to
``world`` (the update shrinks by up to ``sqrt(world)``), where on bursts it grew by ``k``. It
also misses what only other ranks' batches touch: an embedding's rows of tokens absent from
this rank's batch are zero here and not in the mean, and a second moment of zero under a
nonzero first moment is an unbounded step. Embedding weights (``nn.Embedding``, a tied LM head
included) are therefore not kept.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import torch.nn as nn

from tagc.hooks.segment import Segment


def owned_parameter(segment: Segment) -> Union[nn.Parameter, None]:
    """The parameter object registered for ``segment`` on its module (the one an optimizer holds),
    or ``None`` where the adapter gave no module or the name is not a parameter of it."""
    if segment.module is None:
        return None
    return segment.module._parameters.get(segment.name.rpartition(".")[2])


class LocalGradients:
    """This rank's gradient of its own shard of each compressed parameter, for one step.

    :meth:`keep` is called by the exchange (once per compressed bucket, before it encodes);
    :meth:`take` by the optimizer, which empties the store. A bucket kept twice before a
    :meth:`take` (gradient accumulation) adds up, as the gradient does."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, int], tuple[Segment, torch.Tensor]] = {}
        self.embeddings = False
        """Keep embedding weights too: for a reader that does not feed a second moment with them (the trainer's
        diagnostics), never for :class:`tagc.optim.AdamW` (module docstring)."""

    def keep(self, segments: Sequence[Segment], row: torch.Tensor, factor: Union[float, torch.Tensor]) -> None:
        """Keep ``row[segment]`` (this rank's chunk of the packed gradient) times ``factor`` for
        each of ``segments``: ``factor`` puts one rank's gradient on the scale of the reduced one
        (``world`` times the reduce op's scale: 1 for an average)."""
        for segment in segments:
            if isinstance(segment.module, nn.Embedding) and not self.embeddings:
                continue
            piece = row[segment.start : segment.start + segment.numel] * factor
            key = (segment.name, segment.start)
            if key in self._kept:
                self._kept[key][1].add_(piece)
            else:
                self._kept[key] = (segment, piece)

    def take(self) -> dict[int, torch.Tensor]:
        """``{id(parameter): kept gradient}`` (flat, the parameter's padded shard), emptying the
        store; segments whose parameter cannot be found are left out."""
        kept = self.peek()
        self._kept.clear()
        return kept

    def peek(self) -> dict[int, torch.Tensor]:
        """What :meth:`take` would return, leaving the store as it is (for a reader beside the optimizer)."""
        kept = {}
        for segment, gradient in self._kept.values():
            parameter = owned_parameter(segment)
            if parameter is not None:
                kept[id(parameter)] = gradient
        return kept

    def __len__(self) -> int:
        return len(self._kept)
