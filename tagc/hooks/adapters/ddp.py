"""DDP adapter: every codec of the engine as a ``DistributedDataParallel`` comm hook.

DDP hands a comm hook one bucket at a time: a flat buffer (``bucket.buffer()``) holding the gradients of
``bucket.parameters()`` back to back, which the hook replaces by their average over the ranks, in a future. As
torch's ``powerSGD_hook.py``, a small state and functions: :class:`DDPHookState` is DDP's ``state`` (the
:class:`TAGCHook`, bound to the model so ``select`` sees parameter names), :func:`ddp_comm_hook` the hook. This
module only turns DDP's buckets into the engine's parts and futures; each bucket is reduced in one of four *forms*:

* ``"allreduce"``: the buffer scaled by ``1/N``, then all-reduced: DDP's own reduction (its gradients bit for bit).
  For ``codec="plain"`` with ``plain="fp32"``, and every step of a dense warm-up with ``plain="fp32"``.
* ``"sketch"``: the codec's all-reduce form (:meth:`tagc.hooks.codecs.codec.Codec.all_reduce_form`,
  :mod:`tagc.hooks.core.allreduce`), every rank decoding the whole bucket: TAGC's summed sketch and merged index (also
  under EF21: :class:`tagc.hooks.codecs.codec.SummedSketch`), PowerSGD's ``P`` then ``Q`` as torch's ``powerSGD_hook``
  (:class:`tagc.hooks.codecs.powersgd.SummedFactors`).
* ``"rs+ag"``: the engine's compressed reduce-scatter over the bucket cut as HSDP cuts a shard (rank ``j`` owns
  piece ``j`` of every parameter), then an all-gather of the reduced pieces (in
  :func:`tagc.hooks.adapters.replicas.replica_gather_dtype`). Every codec.
* ``"gather"``: each rank's encoded pieces all-gathered and every rank decodes all ``N`` pieces (fixed-shape wires).

Bytes each rank sends per bucket of ``n`` elements (``ring(x) = 2 (N-1) x / N``): ``allreduce`` ``ring(4 n)``;
``sketch`` the form's (its class docstring: ``SummedSketch``, ``SummedFactors``); ``rs+ag`` ``(N-1) (W + c s)``,
``W`` the wire bytes per rank row of a ``c``-element piece, ``s`` the all-gather's element size; ``gather``
``(N-1) N W``. The hook takes the form that sends the fewest, chosen once per bucket from its settings (never from
data). ``sketch`` and ``gather`` decode on every rank, so they run only where every rank decodes the same bits
(:func:`tagc.hooks.adapters.replicas.decodes_alike_on_every_replica`); elsewhere ``rs+ag``.

Error feedback is keyed by the bucket's parameters (their names) and the part, never by call order. DDP's first
iteration runs on buckets it rebuilds afterwards: it is reduced as DDP reduces it and not counted as a step
(:meth:`DDPHookState.settled`). Steps are counted as the engine counts them, or by :meth:`DDPHookState.end_step`.

The exchange overlaps the rest of the backward pass (``overlap=True``; how: :mod:`tagc.hooks.core.flights`);
``overlap=False`` finishes every bucket inside its hook call.
"""
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tagc.hooks.adapters.replicas import (
    GatheredWires,
    PendingAllReduce,
    Pieces,
    decodes_alike_on_every_replica,
    gathers_wires,
    model_parameters,
    replica_gather_dtype,
)
from tagc.hooks.adapters.torch_ddp import has_rebuilt_buckets
from tagc.hooks.core.allreduce import AllReduceForm, Collectives, ring
from tagc.hooks.core.engine import TAGCHook
from tagc.hooks.core.flights import Flight, Flights, complete, future_of, resolved
from tagc.hooks.core.plan import BucketPlan
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.stats import ExchangeStats

FORMS = ("allreduce", "sketch", "rs+ag", "gather")
"""How a bucket is reduced (module docstring)."""


@dataclasses.dataclass
class _Bucket:
    """One DDP bucket: its parameters as segments at their offsets in the flat buffer, its form."""

    segments: tuple[Segment, ...]
    numel: int
    form: str | None = None
    planned_bytes: dict = dataclasses.field(default_factory=dict)
    pieces: dict = dataclasses.field(default_factory=dict)  # device -> Pieces


class DDPHookState:
    """DDP's comm-hook state: a :class:`TAGCHook` bound to the DDP model that registers it.

    ``model``: the :class:`~torch.nn.parallel.DistributedDataParallel` model (parameter names are
    its module's; it also tells when its buckets are final: :meth:`settled`). ``group``: the process
    group DDP reduces over (``None``: the default group, as DDP's)."""

    def __init__(self, hook: TAGCHook, model: nn.parallel.DistributedDataParallel,
                 group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(hook, TAGCHook):
            raise TypeError(f"expected a hook from tagc.hook(...), got {type(hook).__name__}")
        if not isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError(f"expected the DDP model (DistributedDataParallel) that registers the hook, got "
                            f"{type(model).__name__}: wrap the module first, then bind the hook to the wrapper")
        self.hook = hook
        self.group = group
        self._ddp = model
        modules = dict(model.module.named_modules())
        self._params = {id(p): (name, modules[name.rpartition(".")[0]]) for name, p in model.module.named_parameters()}
        self._buckets: dict[tuple, _Bucket] = {}
        self._unsettled_step = False  # this step's buckets were DDP's first ones, reduced as DDP does
        self.flights = Flights(hook)  # the buckets in flight (tagc.hooks.core.flights)
        hook.note_parameters(model_parameters(model.module))  # the settings check compares what select picks

    def settled(self) -> bool:
        """Whether DDP's buckets are final: it rebuilds them once, after the first iteration (unless
        ``find_unused_parameters`` without ``static_graph``; :mod:`tagc.hooks.adapters.torch_ddp`). Until then every
        bucket is reduced as DDP reduces it (as torch's PowerSGD hook runs plain all-reduces first), uncounted."""
        ddp = self._ddp
        return has_rebuilt_buckets(ddp) or (ddp.find_unused_parameters and not ddp.static_graph)

    # ------------------------------------------------------------------ delegation to the hook
    def state_dict(self) -> dict:
        """The hook's checkpoint state (:meth:`TAGCHook.state_dict`): step, settings, residuals."""
        return self.hook.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s output (:meth:`TAGCHook.load_state_dict`)."""
        self.hook.load_state_dict(state)

    def stats(self) -> dict:
        """The hook's statistics (:meth:`TAGCHook.stats`)."""
        return self.hook.stats()

    def follow_lr(self, optimizer: torch.optim.Optimizer | None, peak_lr: float | None = None) -> None:
        """Fade EF21's shifts less as ``optimizer``'s learning rate decays (:meth:`TAGCHook.follow_lr`)."""
        self.hook.follow_lr(optimizer, peak_lr)

    def end_step(self) -> None:
        """Close a step (after ``optimizer.step()``): exact step counting, e.g. with gradient accumulation.
        A step before DDP's buckets are final (:meth:`settled`) is not counted; its statistics are closed as its
        own (``stats()["last_step"]``), not added to the next step's."""
        if self._unsettled_step:
            self._unsettled_step = False
            self.hook.state.close_step()
            return
        self.hook.end_step()

    def forms(self) -> dict[str, tuple[str, dict]]:
        """Every bucket seen: its parameters (joined by ``|``) -> ``(form, planned bytes per form)``."""
        return {"|".join(s.name for s in b.segments): (b.form, dict(b.planned_bytes)) for b in self._buckets.values()
                if b.form is not None}

    # ------------------------------------------------------------------ the exchange

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        """Average ``bucket``'s buffer over the group in the bucket's form; a future of the buffer."""
        buffer = bucket.buffer()
        world = dist.get_world_size(self.group)
        if world == 1:
            return resolved(buffer)
        hook = self.hook
        hook.verify(self.group, buffer.device)
        if not self.settled():
            self._unsettled_step = True
            return self._allreduce(buffer, world)
        self._unsettled_step = False
        layout = self._layout(bucket, buffer)
        hook.check_codec_world(world)
        steady = hook.plan(layout.segments, layout.numel, world)
        hook.begin_bucket(steady.key)  # one key per bucket and step, whatever the form: steps are counted
        dense = hook.step_count < hook.dense_steps or not hook.codec.compresses
        if dense and hook.settings.plain == "fp32":  # DDP's own reduction
            return self._allreduce(buffer, world)
        if layout.form is None:
            layout.form, layout.planned_bytes = self._choose(layout, buffer, world, steady)
        if layout.form == "sketch" and hook.step_count >= hook.dense_steps:
            return self.flights.defer(self._sketch(buffer, steady, world))
        return self.flights.defer(self._pieces_exchange(layout, buffer, world))

    def _layout(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> _Bucket:
        params = bucket.parameters()
        key = (tuple(id(p) for p in params), buffer.numel())
        if key not in self._buckets:
            segments, start = [], 0
            for param in params:
                if id(param) not in self._params:
                    raise ValueError("a parameter of this DDP bucket is not a parameter of the model the hook was "
                                     "bound to: bind the hook to the DDP model that registers it")
                name, module = self._params[id(param)]
                segments.append(Segment(name, start, param.numel(), module, shape=tuple(param.shape)))
                start += param.numel()
            if start != buffer.numel():
                raise ValueError(f"DDP bucket of {buffer.numel()} elements does not hold its parameters back to back "
                                 f"({start} elements): sparse or strided gradients are not supported")
            self._buckets[key] = _Bucket(tuple(segments), start)
        return self._buckets[key]

    def _allreduce(self, buffer: torch.Tensor, world: int) -> torch.futures.Future:
        """DDP's own reduction without a hook: scale by ``1/N`` (its reducer multiplies by the reciprocal), then
        all-reduce."""
        nbytes = buffer.numel() * buffer.element_size()
        self.hook.record(ExchangeStats(buckets=1, wire_bytes=ring(nbytes, world),
                                       plain_equivalent_bytes=ring(buffer.numel() * 4, world)), None)
        buffer.mul_(1.0 / world)  # as DDP's reducer scales a bucket without a hook: by the reciprocal
        self.flights.release()
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    # ------------------------------------------------------------------ the forms

    def _choose(self, layout: _Bucket, buffer: torch.Tensor, world: int, steady: BucketPlan) -> tuple[str, dict]:
        """The form sending the fewest bytes among those the settings allow (module docstring)."""
        hook = self.hook
        identical = decodes_alike_on_every_replica(buffer)
        planned = {}
        form = self._form(steady) if identical else None
        if form is not None:
            planned["sketch"] = form.planned_bytes(self.group, buffer.device)
        if hook.codec.rounds == 1:  # a multi-round codec's wire (powersgd's) follows the shapes: not planned in bytes
            pieces = self._pieces(layout, world, buffer.device)
            chunk = pieces.index.shape[1]
            row = hook.wire_row_bytes(pieces.segments, chunk, world, buffer.dtype)
            gather_size = replica_gather_dtype(hook.settings.plain, hook.codec, buffer.dtype).itemsize
            planned["rs+ag"] = (world - 1) * (row + chunk * gather_size)
            if identical and all(part.codec.traceable() for part in hook.plan(pieces.segments, chunk, world).parts):
                planned["gather"] = (world - 1) * world * row
        if not planned:
            return "rs+ag", planned
        return min(planned, key=lambda form: (planned[form], FORMS.index(form))), planned

    def _form(self, plan: BucketPlan) -> AllReduceForm | None:
        """``plan``'s all-reduce form, if its codec has one under these settings (``Codec.all_reduce_form``)."""
        plain_codec = self.hook.plain
        compressed = [p for p in plan.parts if p.codec is not plain_codec]
        if not plan.compressed or not compressed:
            return None
        plain = [p for p in plan.parts if p.codec is plain_codec]
        return compressed[0].codec.all_reduce_form(compressed, plain, plain_codec)

    def _sketch(self, buffer: torch.Tensor, plan: BucketPlan, world: int) -> Flight:
        """The ``sketch`` form: the bucket reduced by its codec's all-reduce form (:mod:`tagc.hooks.core.allreduce`)."""
        hook = self.hook
        stats = ExchangeStats(buckets=1, compressed_buckets=1, plain_equivalent_bytes=ring(4 * buffer.numel(), world))
        flight = Flight(stats, key=plan.key)
        for part in plan.parts:
            if part.codec is not hook.plain:
                hook.check_restored_part(part)
        self._form(plan).start(buffer, Collectives(flight, self.group, self.flights.release))
        return flight

    def _pieces(self, layout: _Bucket, world: int, device: torch.device) -> Pieces:
        """The bucket cut as HSDP cuts a shard, each piece keeping its parameter's shape (piece ``j`` of a
        parameter is its ``j``-th contiguous slice, so the rows' concatenation is the parameter: powersgd)."""
        if device not in layout.pieces:
            pieces = Pieces.build(layout.segments, layout.numel, world, device)
            whole = [s for s in layout.segments if s.numel]
            shaped = tuple(dataclasses.replace(p, shape=s.shape) for p, s in zip(pieces.segments, whole))
            layout.pieces[device] = dataclasses.replace(pieces, segments=shaped)
        return layout.pieces[device]

    def _pieces_exchange(self, layout: _Bucket, buffer: torch.Tensor, world: int) -> Flight:
        """``rs+ag`` or ``gather`` (during a dense warm-up with ``plain`` not fp32: ``rs+ag``)."""
        hook = self.hook
        pieces = self._pieces(layout, world, buffer.device)
        rows = pieces.cut(buffer)
        chunk = buffer.new_empty(pieces.index.shape[1])
        gather_dtype = replica_gather_dtype(hook.settings.plain, hook.codec, buffer.dtype)
        op = dist.ReduceOp.AVG
        self.flights.release()
        if layout.form == "gather" and gathers_wires(hook, pieces.segments, chunk, world, gather_dtype, self.group):
            hook.topology(self.group)  # the decode reads it: made here, where a hierarchical one may create groups
            wires = GatheredWires(hook, rows, buffer, pieces, self.group, op, ExchangeStats())  # encodes, launches
            flight = Flight(wires.stats)
            if hook.strict_sync:
                # strict sync mode counts the host reads of the hook's thread: decode there (in the final callback)
                flight.future = future_of(buffer)
                flight.launch = lambda: (wires.work.wait(), flight.future.set_result(wires.decode()))
            else:
                flight.future = wires.work.get_future().then(
                    flight.callback(lambda gathered: (gathered.wait(), wires.decode())[1], buffer.device))
            return flight
        replicas = PendingAllReduce.start(hook, chunk, rows, buffer, pieces, self.group, op, gather_dtype)
        flight = Flight(ExchangeStats(), future_of(buffer))  # the engine records the reduce-scatter's statistics
        # the all-gather needs the reduce-scatter's result: launched on the backward's thread
        flight.launch = lambda: complete(flight.future, replicas.gather())
        flight.early = all(part.codec.rounds == 1 for part in replicas.pending.plan.parts)
        return flight


def ddp_comm_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: ``ddp_model.register_comm_hook(state, ddp_comm_hook)``; the future's value is
    the bucket's averaged flat gradient."""
    return state.reduce(bucket)


def bind_ddp(model: nn.parallel.DistributedDataParallel, hook: TAGCHook,
             group: dist.ProcessGroup | None = None) -> tuple[DDPHookState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``, bound to ``model``."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and group is None:
        group = model.process_group
    return DDPHookState(hook, model, group), ddp_comm_hook


def register_ddp(model: nn.parallel.DistributedDataParallel, hook: TAGCHook) -> DDPHookState:
    """Install ``hook`` on a DDP model (over the group DDP reduces over); returns the state."""
    state, comm_hook = bind_ddp(model, hook)
    model.register_comm_hook(state, comm_hook)
    return state


__all__ = ["FORMS", "DDPHookState", "bind_ddp", "ddp_comm_hook", "register_ddp", "ring"]
