"""The all-reduce form of a codec: a whole bucket reduced by all-reduces, every rank decoding all of it.

Where every rank needs the whole average (DDP), a codec whose wire adds up can skip the reduce-scatter
(docs/design.md §3.1, "A codec owns its exchange forms"): :meth:`tagc.hooks.codecs.codec.Codec.all_reduce_form`
returns ``None`` (the default) or an :class:`AllReduceForm` of the bucket, implemented beside the codec
(``SummedSketch``, ``SummedFactors``). The form plans its bytes from the settings alone
(:meth:`AllReduceForm.planned_bytes`) and runs through :class:`Collectives`, which an adapter makes for each
bucket: the group, the bucket's :class:`~tagc.hooks.core.flights.Flight` and the adapter's release of earlier
buckets' dependent collectives. Every rank receives the same sums, so every rank must decode them to the same
bits: adapters take the form only where decoding is deterministic
(:func:`tagc.hooks.adapters.replicas.decodes_alike_on_every_replica`).

Error feedback where every rank decodes the whole part: a codec's own residual needs nothing more; EF21 keeps
the whole part's ``H`` on every rank through a :class:`Shift` per part (:meth:`Codec.summed_shift`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tagc.hooks.core.flights import Flight
from tagc.hooks.core.stats import ExchangeStats
from tagc.hooks.core.transport import all_gather_single, backend_of


def ring(nbytes: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1) / N`` of them."""
    return 2 * (world - 1) * nbytes // world


class Collectives:
    """How an all-reduce form launches one bucket's collectives: on ``group``, counting the bytes each rank sends
    in the flight's :attr:`stats`. :attr:`release` (the adapter's) launches earlier buckets' dependent collectives:
    a form calls it once, after its encode and before its first collective, so every rank launches in one order
    (:mod:`tagc.hooks.core.flights`)."""

    def __init__(self, flight: Flight, group: dist.ProcessGroup | None,
                 release: Callable[[], None] = lambda: None) -> None:
        self.flight, self.group, self.release = flight, group, release
        self.world = dist.get_world_size(group)

    @property
    def stats(self) -> ExchangeStats:
        return self.flight.stats

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.futures.Future:
        """Launch ``tensor``'s all-reduce (in place); a future of its completion."""
        self.stats.wire_bytes += ring(tensor.numel() * tensor.element_size(), self.world)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True).get_future()

    def all_gather(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.futures.Future]:
        """Launch the all-gather of every rank's ``tensor``: ``(gathered, future)``, ``gathered`` rank after rank."""
        gathered = tensor.new_empty(self.world * tensor.numel())
        future = all_gather_single(gathered, tensor, group=self.group, async_op=True).get_future()
        self.stats.wire_bytes += (self.world - 1) * tensor.numel() * tensor.element_size()
        return gathered, future

    def after_all(self, launched: list[torch.futures.Future], device: torch.device) -> torch.futures.Future:
        """A future done once every one of ``launched`` is. On NCCL the last one (done at launch, CUDA semantics):
        its callbacks run on streams made to wait for it, and the callback waits for the others (events, no host
        wait), so the decode stays off the backward's stream. Elsewhere ``collect_all``: a callback must not block
        a backend thread waiting for another collective."""
        return launched[-1] if backend_of(self.group, device) == "nccl" else torch.futures.collect_all(launched)

    def decoded(self, launched: list[torch.futures.Future], decode: Callable[[torch.futures.Future], torch.Tensor],
                device: torch.device) -> torch.futures.Future:
        """A future of ``decode``'s value, run once every one of ``launched`` is done (:meth:`after_all`), as a
        callback of the flight's (:meth:`tagc.hooks.core.flights.Flight.callback`). ``decode`` first waits for each of
        ``launched``: that raises a collective's error and, on CUDA, orders its stream after the collectives."""
        return self.after_all(launched, device).then(self.flight.callback(decode, device))


class AllReduceForm:
    """A codec's all-reduce form of one bucket (:meth:`tagc.hooks.codecs.codec.Codec.all_reduce_form`)."""

    def planned_bytes(self, group: dist.ProcessGroup | None, device: torch.device) -> int:
        """Bytes each rank sends for the bucket (ring volumes), from the settings alone, as :meth:`start` counts
        them."""
        raise NotImplementedError

    def start(self, buffer: torch.Tensor, collectives: Collectives) -> None:
        """Encode ``buffer`` (the flat bucket, overwritten with the average over the ranks) on the calling thread,
        call ``collectives.release()``, launch the collectives; set the flight's ``future`` (the averaged buffer,
        decoded in the collectives' callbacks) and, for a collective that needs another's result, its ``launch``
        (run on the backward's thread)."""
        raise NotImplementedError


class Shift:
    """A part's error feedback in an all-reduce form, where every rank decodes the whole part. This one is the
    codecs' own (classic) feedback: the residual is the codec's, nothing more is kept. EF21 keeps its ``H`` here
    (:class:`tagc.hooks.codecs.feedback.SummedShift`)."""

    def feed(self, grad: torch.Tensor) -> torch.Tensor:
        """What the part compresses this step, from its gradient (before the codec's residual is read)."""
        return grad

    def hold(self, residual: torch.Tensor) -> None:
        """The part's residual as it is before this step's encode."""

    def sent(self, taken: torch.Tensor) -> None:
        """After the encode: ``taken`` is what was fed (zero where the part is not finite)."""

    def decoded(self, decoded: torch.Tensor) -> torch.Tensor:
        """The part's summed values, from the decoded sum of what the ranks sent."""
        return decoded


def by_dtype(sizes: list[tuple[torch.dtype, int]]) -> dict[torch.dtype, list[int]]:
    """``(dtype, numel)`` pieces grouped by dtype, the dtypes in the order they first come: one all-reduce each."""
    groups: dict[torch.dtype, list[int]] = {}
    for dtype, numel in sizes:
        groups.setdefault(dtype, []).append(numel)
    return groups


class Summands:
    """Tensors to sum over the ranks, each cast to its dtype and packed with the others of that dtype
    (:func:`by_dtype`): :attr:`flat` is what the all-reduces sum in place, :meth:`summed` a piece after."""

    def __init__(self, pieces: list[tuple[torch.dtype, torch.Tensor]]) -> None:
        groups = by_dtype([(dtype, tensor.numel()) for dtype, tensor in pieces])
        self._slots, at = [], dict.fromkeys(groups, 0)
        for dtype, tensor in pieces:
            self._slots.append((dtype, at[dtype], tensor.numel()))
            at[dtype] += tensor.numel()
        self.flat = {dtype: torch.cat([t.reshape(-1).to(dtype) for d, t in pieces if d == dtype]) for dtype in groups}

    def summed(self, index: int) -> torch.Tensor:
        """Piece ``index`` of the summed tensors, as float32."""
        dtype, start, numel = self._slots[index]
        return self.flat[dtype][start : start + numel].float()


__all__ = ["AllReduceForm", "Collectives", "Shift", "Summands", "by_dtype", "ring"]
