"""The one semi-private torch module TAGC's SimpleFSDP binding (``tagc.hooks.simple``) uses, in one place.

``torch.distributed._functional_collectives`` (:data:`funcol`) is semi-public: its module name is
underscored, but it is the documented home of the traceable collectives that ``torch.compile`` and
DTensor use. The compiled exchange needs an all-to-all that returns a tensor a graph can hold, which
no public module offers (``torch.distributed.all_to_all_single`` writes into a buffer and returns a
``Work``).

The names are checked against the tested torch versions at import (:func:`check_torch`).
"""

from __future__ import annotations

import torch.distributed._functional_collectives as funcol

from backward_drain.torch_versions import check_internals

INTEGRATION = "TAGC's SimpleFSDP binding (tagc.hooks.simple)"
ADVICE = "use another integration (FSDP2: fully_shard, or DDP)"
NEEDS = ("torch.distributed._functional_collectives.all_gather_single",
         "torch.distributed._functional_collectives.all_to_all_single",
         "torch.distributed._functional_collectives.wait_tensor")
"""The semi-private names checked at import (:func:`check_torch`)."""

__all__ = ["check_torch", "funcol"]


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if its version was not tested."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


check_torch()
