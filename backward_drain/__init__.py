"""Work launched during a backward pass, completed in one final callback of the same pass.

An overlapped reduce-scatter is launched inside a unit's backward and must be finished, and its
result delivered (accumulated into ``.grad``, or copied into the buffer a wrapper reads), before
``backward()`` returns. :class:`BackwardDrain` holds such work: the first :meth:`BackwardDrain.add`
of a backward pass queues :meth:`BackwardDrain.finish` as a final callback of that pass, which
completes everything added, oldest first. Both wrappers that overlap this way use it: SimpleFSDP
(:class:`fsdp_integration.bucket.PendingGradients`) and TAGC's FSDP2 adapter
(``tagc.hooks.adapters.fsdp2``).

This package depends on torch only, so that ``fsdp_integration`` and ``tagc`` can share it
(docs/design.md §2): with the autograd internals it needs (:mod:`backward_drain.torch_autograd`) and the torch
version check (:mod:`backward_drain.torch_versions`).
"""

from __future__ import annotations

from typing import Callable, Optional

from backward_drain.torch_autograd import current_graph_task, queue_final_callback

Complete = Callable[[bool], None]
"""``complete(deliver)``: finish one piece of work (its collective); deliver its result only when
``deliver`` is true (false: the backward pass that launched it failed, its values are dropped)."""


def in_backward_pass() -> bool:
    """Whether autograd is running a backward pass on this thread (a backward function or hook calls this)."""
    return current_graph_task() != -1


class BackwardDrain:
    """Pieces of work launched in a backward pass, completed by one final callback of that pass.

    Every piece is completed, even after one raises: a collective left unfinished would leave
    the other ranks waiting. The first error is raised once all are done. Work left behind by a
    backward pass that failed before its callback ran is completed, without delivering, at the
    first :meth:`add` of the next pass.
    """

    def __init__(self) -> None:
        self._items: list[Complete] = []
        self._task: Optional[int] = None  # the autograd graph task the items belong to

    def add(self, complete: Complete) -> None:
        """Hold ``complete`` until the end of the current backward pass (call only inside one)."""
        task = current_graph_task()
        if task == -1:
            raise RuntimeError("BackwardDrain.add runs inside a backward pass (from a backward function or hook); "
                               "outside one, finish the work where it is launched")
        if task != self._task:  # the first launch of this backward pass
            self._run(deliver=False)  # a backward pass that failed left these: finish the collectives, drop the values
            self._task = task
            queue_final_callback(self.finish)
        self._items.append(complete)

    def finish(self) -> None:
        """Complete, and deliver, everything added in this backward pass (the final callback)."""
        self._task = None
        self._run(deliver=True)

    def _run(self, deliver: bool) -> None:
        items, self._items = self._items, []
        error = None
        for complete in items:  # complete all, even after an error: no collective is left behind
            try:
                complete(deliver)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error
