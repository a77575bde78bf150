"""Eager prefetching: start the next unit's all-gather while this unit computes.

FSDP2 does this implicitly (its all-gathers run ahead on their own stream); eager
SimpleFSDP on gloo gets it by issuing the next unit's all-gather asynchronously:

* forward - when unit ``k`` starts, the all-gather of the unit that ran after it in the
  first forward (the recorded order) is started;
* backward - when the forward ends, the re-gather of the last resharding unit (the first one
  backward reaches) is started; when unit ``k`` re-gathers its parameters, the re-gather of
  the unit before it in forward order (the next one backward reaches) is started.

Every rank runs the same order, so the prefetched collectives match across ranks (what it overlaps:
docs/guide.md, "The hook", "SimpleFSDP"). A prefetched all-gather is used only if the shards did not change since
it started (their version counters), else dropped. Compiled models do not prefetch here: Inductor reorders their
collectives itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_integration.bucket import GatheredUnit


class Prefetcher:
    """The forward order of a model's units (recorded in its first forward) and the prefetches it drives."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.order: list[GatheredUnit] = []
        self._position: dict[int, int] = {}
        self.recorded = False

    def forward_started(self, unit: GatheredUnit) -> None:
        """``unit`` gathered its parameters for forward: record it, or prefetch its successor."""
        if not self.recorded:
            if id(unit) not in self._position:
                self._position[id(unit)] = len(self.order)
                self.order.append(unit)
            return
        following = self._neighbour(unit, +1)
        if following is not None:
            following.bucket.prefetch(following.local_shards())

    def forward_finished(self, unit: GatheredUnit) -> None:
        """The outermost unit (the root) returned: the order is complete; with autograd on,
        start re-gathering the unit backward needs first (the last one that reshards)."""
        if not self.order or unit is not self.order[0]:
            return
        self.recorded = True
        if self.enabled and torch.is_grad_enabled():
            last = next((u for u in reversed(self.order) if u.reshard), None)
            if last is not None and last.bucket.regathered is None:
                last.bucket.prefetch(last.local_shards())

    def backward_started(self, unit: GatheredUnit) -> None:
        """``unit`` re-gathered its parameters for backward: prefetch the next one backward needs."""
        if not self.recorded:
            return
        preceding = self._neighbour(unit, -1)
        if preceding is not None and preceding.reshard and preceding.bucket.regathered is None:
            preceding.bucket.prefetch(preceding.local_shards())

    def _neighbour(self, unit: GatheredUnit, offset: int) -> Optional[GatheredUnit]:
        if not self.enabled or id(unit) not in self._position:
            return None
        index = self._position[id(unit)] + offset
        return self.order[index] if 0 <= index < len(self.order) else None
