"""The eager exchange: a bucket's parts encoded and launched at once, decoded as their bytes arrive.

* :meth:`PendingBucket.send` encodes every batch of parts (one codec call each) and launches its all-to-all; the
  bytes travel while the caller computes. The hook's ``start`` first polls the buckets in flight, so earlier
  buckets' parts whose bytes have arrived are decoded between later buckets; :meth:`PendingBucket.wait` decodes
  what is left and writes the output.
* A codec with several rounds (``powersgd``: P, then Q) moves each part one round on at every later ``start``
  (:meth:`PendingBucket.advance`) and finishes in :meth:`PendingBucket.wait`: points every rank reaches in the same
  order, never on local arrival, so every rank issues the same all-to-alls in the same order.
* On CUDA the codec work runs on a side stream (:class:`SideStreams`, made to wait for the caller's stream), which
  launches each batch's all-to-all, so NCCL waits only for that batch's encode: batch ``k+1`` is encoded while batch
  ``k`` is on the wire and the caller's stream runs on meanwhile (``input`` and ``output`` marked used there).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import torch

from tagc.hooks.core import strict
from tagc.hooks.core.exchange import PartCoder, nonfinite_error, raises_nonfinite
from tagc.hooks.core.hierarchy import Topology, host_reduce
from tagc.hooks.core.plan import Batch, BucketPlan
from tagc.hooks.core.state import ExchangeState, UnitTiming
from tagc.hooks.core.stats import ExchangeStats
from tagc.hooks.core.transport import PendingExchange, all_to_all_rows, reduce_scatter_rows, scale_into


def _on(stream) -> contextlib.AbstractContextManager:
    """Make ``stream`` (a CUDA side stream, or ``None`` on the CPU) current for the block."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class SideStreams:
    """One CUDA side stream per device for the codec work."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def for_input(self, input: torch.Tensor):
        """The side stream for a bucket on ``input``'s device, made to wait for the caller's stream;
        ``None`` off CUDA: the CPU path is unchanged."""
        if input.device.type != "cuda":
            return None
        device = input.device
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the gradient is ready on the caller's stream
        input.record_stream(stream)  # read there after the caller may have freed it
        return stream

    def join(self) -> None:
        """Make the caller's current stream wait for the side streams (before reading what they wrote)."""
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)


def launch(wires: Sequence[torch.Tensor], group, piece_bytes: int | None, stats: ExchangeStats, timing: UnitTiming,
           remote_rows: int = 0, summed: bool = False) -> list[PendingExchange]:
    """Start every wire tensor's all-to-all; ``remote_rows`` of its rows go to other hosts.

    ``summed``: the codec's decode only sums the rows it receives (:attr:`Codec.summed_rows`), so the
    transport may reduce on the wire (NCCL's reduce-scatter: :func:`tagc.hooks.core.transport.reduce_scatter_rows`)."""
    send = reduce_scatter_rows if summed else all_to_all_rows
    exchanges = [send(w, group, piece_bytes) for w in wires]
    if exchanges:
        timing.launched = timing.launched or exchanges[0].launched
    stats.wire_bytes += sum(x.sent_bytes for x in exchanges)
    stats.inter_host_bytes += sum(remote_rows * w.shape[1] * w.element_size() for w in wires)
    return exchanges


@dataclasses.dataclass
class Flight:
    """A batch of parts' current exchange round on the wire (:attr:`BucketPlan.batches`)."""

    batch: Batch
    round: int
    exchanges: list[PendingExchange]

    @property
    def last(self) -> bool:
        return self.round == self.batch.codec.rounds - 1


class PendingBucket:
    """One bucket's exchange in flight; :meth:`wait` returns the output shard once it is reduced.

    ``hook``: the hook this bucket belongs to, whose strict-sync counting covers :meth:`wait`
    (:func:`tagc.hooks.core.strict.counted`); the bucket itself works on what it is given: the part
    ``coder``, the exchange ``state`` (statistics, the buckets in flight) and the ``nonfinite`` policy."""

    def __init__(self, hook: Any, plan: BucketPlan, output: torch.Tensor, scale: float | torch.Tensor, group,
                 stats: ExchangeStats, timing: UnitTiming, *, coder: PartCoder, state: ExchangeState,
                 nonfinite: str, stream=None, remote_rows: int = 0) -> None:
        self.hook = hook
        self.plan = plan
        self.output = output
        self.scale = scale
        self.group = group
        """The group the codec exchanges over: the flat group, or a hierarchical exchange's cross group."""
        self.remote_rows = remote_rows
        """Rows of each all-to-all that go to another host (for ``inter_host_bytes``)."""
        self.stats = stats
        self.timing = timing
        self.coder = coder
        self.state = state
        self.nonfinite = nonfinite
        self.stream = stream
        """The CUDA side stream this bucket's codec work runs on (``None``: the caller's stream, e.g. on the CPU)."""
        with _on(stream):
            self.summed = torch.zeros(plan.chunk, dtype=torch.float32, device=output.device)
        self._in_flight: collections.deque[Flight] = collections.deque()
        self.done = False

    def send(self, rows: torch.Tensor, topo: Topology) -> None:
        """Encode ``rows`` (``[world, chunk]``: row ``j`` for rank ``j``) batch by batch (:attr:`BucketPlan.batches`)
        and launch each batch's exchange, on this bucket's stream. Hierarchical (``topo``): first the plain,
        blocking sum inside the host, then the codec over the cross group (:attr:`group`). One rank: the sum is its
        own row."""
        stats, timing, coder = self.stats, self.timing, self.coder
        with _on(self.stream):
            if rows.shape[0] == 1:
                self.summed.copy_(rows[0])
                return
            if topo.hierarchical:  # step 1, plain and blocking (the fast intra-host links): exposed time
                begin = time.perf_counter()
                rows, sent = host_reduce(rows, topo, coder.piece_bytes)
                end = time.perf_counter()
                stats.wire_bytes += sent
                stats.exposed_s += end - begin
                timing.exposed_s += end - begin
                timing.events.append(("wait", begin, end))  # the caller blocked on bytes, as in a wait
            for batch in self.plan.batches:
                wires = coder.encode(batch, batch.take(rows), self.group, timing)
                launched = launch(wires, self.group, coder.piece_bytes, stats, timing, self.remote_rows,
                                  summed=batch.codec.summed_rows)
                self._in_flight.append(Flight(batch, 0, launched))

    def poll(self) -> None:
        """Decode the parts whose last round has arrived, in order, without blocking (never launches)."""
        with _on(self.stream):
            while self._in_flight and self._in_flight[0].last and all(
                    x.is_completed() for x in self._in_flight[0].exchanges):
                self._decode_next()

    def advance(self) -> None:
        """Move every part with rounds left one round on: wait for its current round and launch the
        next. Called only where every rank calls it in the same order (the hook's ``start``,
        :meth:`wait`), never on local arrival, so the collectives of all buckets stay matched."""
        with _on(self.stream):
            for flight in self._in_flight:
                if not flight.last:
                    self._next_round(flight)

    @strict.counted
    def wait(self) -> torch.Tensor:
        """Block until every part arrived, decode, write and return the output shard.

        On CUDA the decode and the output's write run on the side stream; the caller's current
        stream then waits for them (an event, not a host wait), so whatever the caller queues
        next reads the finished output."""
        if self.done:
            return self.output
        with _on(self.stream):
            while self._in_flight:
                while not self._in_flight[0].last:
                    self._next_round(self._in_flight[0])
                self._decode_next()
            self.done = True
            self.state.in_flight.remove(self)
            self.timing.arrived = max(self.timing.arrived, self.timing.launched)
            self.stats.wire_s += self.timing.wire_s
            self.timing.wire_bytes = self.stats.wire_bytes
            self.stats.compress_s = self.timing.compress_s  # encode time, all rounds (the codec adds it to the unit)
            scale_into(self.output, self.summed, self.scale)
            self.state.record(self.stats, self.timing)
            raise_nonfinite = raises_nonfinite(self.nonfinite, self.stats)
        if self.stream is not None:
            torch.cuda.current_stream(self.output.device).wait_stream(self.stream)
        if raise_nonfinite:
            raise nonfinite_error(self.plan.key)
        return self.output

    def _receive(self, exchanges: list[PendingExchange]) -> list[torch.Tensor]:
        start = time.perf_counter()
        received = [x.wait() for x in exchanges]
        waited = time.perf_counter()
        self.stats.exposed_s += waited - start
        self.timing.exposed_s += waited - start
        self.timing.arrived = max([self.timing.arrived] + [x.arrived or waited for x in exchanges])
        if waited - start > 1e-4:
            self.timing.events.append(("wait", start, waited))
        if exchanges:
            self.timing.events.append(("wire", exchanges[0].launched, max(x.arrived or waited for x in exchanges)))
        return received

    def _decode_next(self) -> None:
        flight = self._in_flight.popleft()
        received = self._receive(flight.exchanges)
        flight.batch.put(self.summed, self.coder.decode(flight.batch, received, self.group, self.stats, self.timing))

    def _next_round(self, flight: Flight) -> None:
        received = self._receive(flight.exchanges)
        flight.round += 1
        wires = self.coder.encode(flight.batch, received, self.group, self.timing, flight.round)
        flight.exchanges = launch(wires, self.group, self.coder.piece_bytes, self.stats, self.timing, self.remote_rows)


def poll(in_flight: Sequence[PendingBucket]) -> None:
    """Decode every part (of buckets in flight) whose bytes have arrived, without blocking.

    Codecs whose decode is a collective (``fallback="raw"``) decode only in ``wait()``,
    where every rank decodes in the same order."""
    for pending in list(in_flight):
        if pending.plan.parts and not all(part.codec.overlappable() for part in pending.plan.parts):
            return
        pending.poll()
