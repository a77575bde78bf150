"""The two autograd-engine internals a backward drain needs, used nowhere else.

Neither has a public API: torch's own FSDP uses the same two to finish its reduce-scatters before
``backward()`` returns.
"""

from __future__ import annotations

from typing import Callable

import torch

from backward_drain.torch_versions import check_internals

INTEGRATION = "the backward drain (overlap=True of TAGC's FSDP2 adapter and of SimpleFSDP)"
ADVICE = "run with overlap=False (each reduce-scatter then finishes where it is launched)"
NEEDS = ("torch._C._current_graph_task_id", "torch.autograd.Variable._execution_engine.queue_callback")
"""The private names this module reads (checked at import by :func:`check_torch`)."""


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if it is outside the range."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


def current_graph_task() -> int:
    """The autograd graph task running on this thread, -1 outside a backward pass (``torch._C``'s
    ``_current_graph_task_id``; public autograd says only whether grad mode is on, not whether a backward runs)."""
    return torch._C._current_graph_task_id()


def queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has run every node (the autograd engine's
    ``queue_callback``: no public hook fires after the whole pass, post-accumulate hooks fire per tensor)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


check_torch()
