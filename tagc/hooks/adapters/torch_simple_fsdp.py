"""The one semi-private torch module TAGC's SimpleFSDP binding (``tagc.hooks.adapters.simple``) uses, in one place.

``torch.distributed._functional_collectives`` (:data:`funcol`) is semi-public: its module name is
underscored, but it is the documented home of the traceable collectives that ``torch.compile`` and
DTensor use. The compiled exchange needs an all-to-all that returns a tensor a graph can hold, which
no public module offers (``torch.distributed.all_to_all_single`` writes into a buffer and returns a
``Work``).

:data:`funcol` holds the collectives under torch 2.13's names on every supported release (torch 2.11 calls the
gather ``all_gather_tensor``). The names are checked at import (:func:`check_torch`).
"""

from __future__ import annotations

from backward_drain.torch_versions import check_internals, namespace

INTEGRATION = "TAGC's SimpleFSDP binding (tagc.hooks.adapters.simple)"
ADVICE = "use another integration (FSDP2: fully_shard, or DDP)"
NEEDS = ("torch.distributed._functional_collectives.all_gather_single|all_gather_tensor",
         "torch.distributed._functional_collectives.all_to_all_single",
         "torch.distributed._functional_collectives.wait_tensor")
"""The semi-private names checked at import (:func:`check_torch`): ``new|old`` where releases differ."""

__all__ = ["check_torch", "funcol"]


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if it is outside the range."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


check_torch()
funcol = namespace(NEEDS)
"""The traceable collectives in :data:`NEEDS`, each under its torch 2.13 name (``funcol.all_gather_single``)."""
