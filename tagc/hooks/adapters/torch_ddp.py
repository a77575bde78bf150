"""The one private torch name TAGC's DDP adapter uses, in one place.

DDP rebuilds its buckets once, after the first iteration, in the order gradients became ready;
error-feedback state keyed by the first iteration's buckets would belong to buckets that never
come back. Whether DDP has rebuilt them is its ``_has_rebuilt_buckets`` flag: no public API says
so (torch's own ``powerSGD_hook`` counts iterations instead).

DDP sets the flag at run time (its constructor), so it is read through
:func:`backward_drain.torch_versions.read_internal`, which names it when missing; :func:`check_torch`
checks the torch version at import.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from backward_drain.torch_versions import check_internals, read_internal

INTEGRATION = "TAGC's DDP adapter (tagc.hooks.adapters.ddp)"
ADVICE = "use another integration (FSDP2: fully_shard, or SimpleFSDP)"
NEEDS: tuple[str, ...] = ()
"""The private names checked at import (:func:`check_torch`): none; ``_has_rebuilt_buckets`` is checked where read."""

__all__ = ["check_torch", "has_rebuilt_buckets"]


def check_torch() -> None:
    """Warn once if the running torch is outside the supported range (:data:`NEEDS` is empty)."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


def has_rebuilt_buckets(ddp: DistributedDataParallel) -> bool:
    """Whether ``ddp`` has rebuilt its buckets (it does once, after its first iteration, unless it never will)."""
    return read_internal(ddp, "_has_rebuilt_buckets", INTEGRATION, ADVICE)


check_torch()
