"""Exchanges handed over as futures and finished at the end of the backward pass: a :class:`Flight` per
bucket, :class:`Flights` to defer them, and the future helpers.

A wrapper that hands a hook one bucket at a time and waits on a future (DDP) gets the bucket's future at
once: the hook encodes the bucket on the backward's thread, launches its collectives (``async_op=True``) and
returns a future of the averaged buffer, decoded in the collectives' callbacks (``.then``). What must happen on
the backward's thread after that is the bucket's :class:`Flight`:

* a collective that needs another's result (an all-gather of a reduce-scatter's result, PowerSGD's ``Q``) is
  launched at the next hook call, before that call's own collectives (:meth:`Flights.release`), and the last
  bucket's in a final callback of the backward pass that runs before the wrapper waits (so do the later rounds of
  a multi-round reduce-scatter): every rank launches every collective at the same point of one sequence. Never
  from a collective's callback, as torch's ``powerSGD_hook`` chains its ``Q``: on gloo that callback runs when
  the bytes happen to arrive, so ranks could launch bucket ``k``'s ``Q`` and bucket ``k+1``'s ``P`` in different
  orders, and gloo pairs collectives by launch order (a mismatch sums the wrong tensors, or hangs);
* the statistics, recorded in that final callback: only the backward's thread touches the hook's counters.

The collectives, the wire and the decode are the blocking exchange's, so the gradients are bit for bit the
same. ``overlap=False`` finishes every bucket inside its hook call; so does a hook called outside a
backward pass.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from backward_drain import BackwardDrain, current_graph_task
from tagc.hooks.core.callback_stream import own_stream
from tagc.hooks.core.stats import ExchangeStats


@dataclasses.dataclass
class Flight:
    """One bucket's exchange, from its hook call until its statistics are recorded.

    ``future``: what the wrapper waits for, the averaged buffer; its callbacks decode, touching nothing shared
    but the bucket's own residuals (and ``stats``, which no other thread touches until ``future`` is done).
    ``launch``: the dependent collective, on the backward's thread (:meth:`Flights.release`); ``waited_s``:
    the time that launch waited on the backward's thread for the collective it needs, counted as exposed
    (the engine counts its own waits, a reduce-scatter's). ``early``: whether :meth:`Flights.release`
    launches it at the next hook call (not a reduce-scatter of several rounds: the engine moves those one
    round on at each bucket it starts, and finishing them at once would hold the backward's thread for every
    round left; they go at the end of the backward pass). ``stats``: recorded on the backward's thread once
    ``future`` is done; ``key``: the bucket then checked for NaN/Inf under ``nonfinite="raise"`` (``None``:
    the form raises where it decodes). ``errors``: what the callbacks raised, re-raised as it was (a
    future's ``wait`` would wrap it). ``bodies``: the callbacks, and with them every tensor they captured
    from the backward's stream (a part's ``M``, an EF21 shift's copy), held until that stream has waited for the
    future (why: docs/design.md §2, "Where DDP's callbacks run")."""

    stats: ExchangeStats
    future: torch.futures.Future | None = None
    launch: Callable[[], None] | None = None
    key: str | None = None
    task: int = -1
    waited_s: float = 0.0
    early: bool = True
    errors: list = dataclasses.field(default_factory=list)
    bodies: list = dataclasses.field(default_factory=list)

    def callback(self, body: Callable[[torch.futures.Future], torch.Tensor], device: torch.device) -> Callable:
        """``body`` for ``Future.then`` on the bucket's ``device``, keeping what it raises in :attr:`errors`; on CUDA
        run on the hook's own stream, not torch's pool (:mod:`tagc.hooks.core.callback_stream`), ``body`` held in
        :attr:`bodies`."""
        self.bodies.append(body)

        def run(future: torch.futures.Future) -> torch.Tensor:
            try:
                with own_stream(device):
                    return body(future)
            except Exception as error:
                self.errors.append(error)
                raise

        return run


class Flights:
    """The flights of one hook's buckets still in flight, oldest first, finished in a final callback of the
    backward pass (:class:`backward_drain.BackwardDrain`) or, where that cannot be, at once.

    ``hook``: the :class:`~tagc.hooks.core.engine.TAGCHook` whose ``overlap`` defers, whose ``record`` takes the
    statistics and whose ``nonfinite`` says whether a NaN/Inf raises."""

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.pending: collections.deque[Flight] = collections.deque()  # launched, not yet finished; oldest first
        self.drained_task = -1
        """The backward pass whose final callback last finished buckets."""
        self._drain = BackwardDrain()

    def defer(self, flight: Flight) -> torch.futures.Future:
        """Hand the wrapper the bucket's future, and finish the bucket (its dependent collective, its statistics) in a
        final callback of the backward pass. That callback is queued at the pass's first bucket, the wrapper's own
        (which waits for every bucket's future) at its last: ours runs first. Finished here instead with
        ``overlap=False``, outside a backward pass, or after our callback ran in this pass (a callback queued now
        would run after the wrapper's wait)."""
        task = current_graph_task()
        if not self.hook.settings.overlap or task == -1 or task == self.drained_task:
            self.finish(flight)
            return flight.future
        flight.task = task
        self._drain.add(self._finish_oldest)  # first finishes what a failed pass left (its flights are older)
        self.pending.append(flight)
        return flight.future

    def release(self) -> None:
        """Launch the dependent collective of every bucket still in flight, oldest first, before this hook call
        launches its own bucket's collectives (after its encode, in the all-reduce forms): every rank reaches this
        point at the same hook call, so bucket ``k``'s second collective goes just before bucket ``k+1``'s first,
        the blocking exchange's order, while the backward goes on. Not the flights that are not
        :attr:`Flight.early`. An error is kept for the bucket's finish (the final callback), where it is raised as
        before."""
        for flight in self.pending:
            if not flight.early:
                continue
            try:
                launch(flight)
            except Exception as error:
                flight.errors.append(error)

    def _finish_oldest(self, deliver: bool) -> None:
        """The final callback's item, one per bucket, oldest first: launch every dependent collective not launched
        yet, in bucket order (the last bucket's: the earlier ones went at the next hook call, :meth:`release`),
        then finish the oldest bucket. ``deliver`` false (a failed backward pass left the bucket): it is finished
        all the same, so that no rank is left waiting for its collectives."""
        flight = self.pending.popleft()
        self.drained_task = flight.task
        try:
            for launched in (flight, *self.pending):
                launch(launched)
        finally:
            self.finish(flight)

    def finish(self, flight: Flight) -> None:
        """Wait for the bucket's future and record its statistics (on the backward's thread)."""
        launch(flight)
        begin = time.perf_counter()
        try:
            flight.future.wait()
        except Exception:
            if flight.errors:
                raise flight.errors[0] from None  # as the decode raised it (e.g. FloatingPointError)
            raise
        flight.stats.exposed_s += time.perf_counter() - begin + flight.waited_s
        hook = self.hook
        hook.record(flight.stats, None)
        if flight.key is not None and hook.settings.nonfinite == "raise" and bool(flight.stats.nonfinite_parts):
            raise FloatingPointError(f"a gradient in TAGC bucket {flight.key!r} is NaN/Inf on some rank "
                                     "(nonfinite='raise')")  # no host read under "propagate"


def launch(flight: Flight) -> None:
    """Launch the bucket's dependent collective (once), on the backward's thread: every rank launches the buckets'
    collectives in the same order there."""
    body, flight.launch = flight.launch, None
    if body is None:
        return
    try:
        body()
    except Exception as error:
        if not flight.future.done():
            flight.future.set_exception(error)
        raise


def future_of(buffer: torch.Tensor) -> torch.futures.Future:
    """A future for ``buffer``, completed by :func:`complete` (on CUDA: its waiters wait for the writer's stream)."""
    return torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)


def complete(future: torch.futures.Future, source: torch.futures.Future) -> None:
    """Complete ``future`` as ``source`` completes: a callback cannot return a future for ``then`` to wait on."""

    def forward(done: torch.futures.Future) -> None:
        try:
            value = done.value()
        except Exception as error:
            future.set_exception(error)
        else:
            future.set_result(value)

    source.then(forward)  # on CUDA: runs on streams made to wait for ``source``, where the result is recorded


def resolved(value: torch.Tensor) -> torch.futures.Future:
    """A future already completed with ``value``."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


__all__ = ["Flight", "Flights", "complete", "future_of", "launch", "resolved"]
