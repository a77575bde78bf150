"""DDP adapter: every codec of the engine as a ``DistributedDataParallel`` comm hook.

DDP hands a comm hook one bucket at a time: a flat buffer (``bucket.buffer()``) holding the
gradients of ``bucket.parameters()`` back to back, which the hook replaces by their average over
the ranks, returned in a future. :class:`DDPHookState` is DDP's ``state`` (the :class:`TAGCHook`
with its settings and error-feedback state, bound to the model so ``select`` sees parameter
names), :func:`ddp_comm_hook` the hook. Each bucket is reduced in one of four *forms*:

* ``"allreduce"``: the buffer scaled by ``1/N``, then all-reduced: DDP's own reduction
  (its gradients bit for bit). For ``codec="plain"`` with ``plain="fp32"``, and every step of a
  dense warm-up with ``plain="fp32"``.
* ``"sketch"``: the all-reduce form. TAGC (bitmap positions, float32 cells, ``fallback="estimate"``,
  ``plain="fp32"``): each rank compresses its whole bucket once (the threshold planned for ``N``
  ranks); the count-sketch tables and the plain columns are summed by one ``all_reduce(SUM)``
  (sketches add); the 1-bit index is merged by ``all_reduce(BOR)`` on gloo (NCCL has no bitwise
  reduction: an all-gather and OR there), the 4-bit rank counts by ``all_reduce(SUM)`` of the
  packed nibbles (exact: at most 15 ranks, so no nibble carries). Every rank decodes the whole
  bucket. TAGC under EF21 (``feedback="ef21"``) too: each rank compresses its change ``g - h_i``, every rank adds
  the decoded sum of the changes to its copy of ``H`` (the whole bucket: ``H`` is replicated) and hands DDP
  ``H / N``. A part whose summed table is not finite (a rank's gradient was) leaves every shift and ``H`` as
  they were: the summed table cannot tell which rank's change was finite, so every rank takes its own back.
  PowerSGD (``plain`` ``"fp32"`` or ``"bf16"``) likewise, as torch's ``powerSGD_hook``
  does: ``P`` with the uncompressed columns in one ``all_reduce``, then ``Q``; every rank forms
  ``P Q^T`` itself. Each travels in its own dtype and is summed in it, as torch's
  ``bf16_compress_hook`` sums in bf16: ``P``, ``Q`` and the codec's shape-less columns in its
  ``value_dtype`` (``powersgd-lean``: bf16), the plain parts in fp32 or bf16; tensors of a second
  dtype go in a second all-reduce beside ``P``'s. Not for ``plain="fp8"``/``"int4"``, whose
  blockwise scales do not add up in an all-reduce: those buckets go ``rs+ag``.
* ``"rs+ag"``: the engine's compressed reduce-scatter over the bucket cut as HSDP cuts a shard
  (each parameter padded and cut into ``N`` pieces: rank ``j`` owns piece ``j`` of every
  parameter), then an all-gather of the reduced pieces (float32, or bf16 with ``plain="bf16"``).
  Every codec.
* ``"gather"``: each rank's encoded pieces all-gathered and every rank decodes all ``N`` pieces
  (fixed-shape wires: ``tagc``, ``topk``, the quantized peers).

Bytes each rank sends per bucket of ``n`` elements (ring volumes; ``ring(x) = 2 (N-1) x / N``):
``allreduce`` ``ring(4 n)``; ``sketch`` ``ring(4 T + 4 p) + ring(I)`` with ``T`` the sketch cells,
``p`` the plain columns and ``I = ceil(n_c bits / 8)`` the index bytes of ``n_c`` compressed
elements (``(N-1) I`` where the index is all-gathered); PowerSGD ``ring(v (sum m r + p)) + ring(v sum n r)``
with ``v`` bytes per value (4, or 2 for ``powersgd-lean``: one ``ring`` per dtype of the first all-reduces);
``rs+ag`` ``(N-1) (W + c s)`` with ``W`` the engine's wire bytes per rank row of a ``c``-element
piece and ``s`` the all-gather's element size; ``gather`` ``(N-1) N W``. Where several forms apply
the hook takes the one that sends the fewest bytes, chosen once per bucket from its settings
(never from data), so a bucket keeps its form, and its residuals, from step to step.

The ``sketch`` and ``gather`` forms decode on every rank, so the ranks' gradients must come out
bit-identical: they run where every rank decodes the same bits (the CPU, the Triton kernels, or the
torch reference on CUDA under ``torch.use_deterministic_algorithms(True)``:
:func:`tagc.hooks.fsdp2.decodes_alike_on_every_replica`); elsewhere the bucket goes ``rs+ag`` (one
owner decodes each piece, everyone gathers its bits).

Error feedback is keyed by the bucket's parameters (their names) and the part, as for FSDP, never
by call order or bucket index. DDP's first iteration runs on buckets it rebuilds afterwards: that
iteration is reduced as DDP reduces it and is not counted as a step (:meth:`DDPHookState.settled`).
Steps are counted as the engine counts them (a bucket seen twice), or exactly by
:meth:`DDPHookState.end_step` after ``optimizer.step()``.

The exchange overlaps the rest of the backward pass, as torch's own hooks do (``overlap=True``, the
default): the hook encodes the bucket on the calling thread (the backward's critical path),
launches its collectives (``async_op=True``) and returns a future that completes with the averaged
buffer, decoded in the collectives' callbacks (``.then``). A collective that needs another's result
(``rs+ag``'s all-gather, PowerSGD's ``Q``) is launched on the backward's thread at the next hook call,
just before that call launches its own bucket's collectives (waiting there for the first collective
if it is still on the wire), and the last bucket's in a final callback of the backward pass that runs
before DDP's own waits for the buckets (so do the later rounds of a reduce-scatter of several rounds,
which the engine moves on one round per bucket it starts). DDP calls the hook for the buckets in one
order on every rank, on the backward's thread, so every rank launches every collective at the same
point of one sequence (for single-round exchanges, the blocking exchange's). Never from a
collective's callback, as torch's ``powerSGD_hook`` chains its ``Q``: on gloo that callback runs on
the backend's thread when the bytes happen to arrive, so with several buckets one rank may launch
bucket ``k``'s ``Q`` before bucket ``k+1``'s ``P`` and another after it, and gloo pairs collectives
by the order they were launched in (a mismatch sums the wrong tensors, or hangs). The final callback
records each bucket's statistics: the hook's counters are only ever touched by the backward's thread.
The collectives, the wire and the decode are the blocking exchange's, so the gradients are bit for
bit the same. ``overlap=False`` finishes every bucket inside its hook call; so does a hook called
outside a backward pass.
"""

import collections
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from backward_drain import BackwardDrain, current_graph_task
from tagc.hooks import nonfinite
from tagc.hooks.callback_stream import own_stream
from tagc.hooks.codecs import TAGCCodec
from tagc.hooks.engine import TAGCHook, _BucketPlan, _Part, op_scale, scale_into
from tagc.hooks.feedback import SUM, EF21Codec
from tagc.hooks.powersgd import PowerSGDCodec, left_times, orthonormal, right_times
from tagc.hooks.replicas import (
    GatheredWires,
    PendingAllReduce,
    Pieces,
    decodes_alike_on_every_replica,
    gathers_wires,
    model_parameters,
)
from tagc.hooks.segment import Segment
from tagc.hooks.stats import ExchangeStats
from tagc.hooks.torch_ddp import has_rebuilt_buckets
from tagc.hooks.transport import all_gather_single, backend_of
from tagc.sketch.index import merge_index

FORMS = ("allreduce", "sketch", "rs+ag", "gather")
"""How a bucket is reduced (module docstring)."""


def ring(nbytes: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (N-1) / N`` of them."""
    return 2 * (world - 1) * nbytes // world


@dataclasses.dataclass
class _Bucket:
    """One DDP bucket: its parameters as segments at their offsets in the flat buffer, its form."""

    segments: tuple[Segment, ...]
    numel: int
    form: str | None = None
    planned_bytes: dict = dataclasses.field(default_factory=dict)
    pieces: dict = dataclasses.field(default_factory=dict)  # device -> Pieces


@dataclasses.dataclass
class _Flight:
    """One bucket's exchange, from its hook call until its statistics are recorded.

    ``future``: what DDP waits for, the averaged buffer; its callbacks decode, touching nothing shared
    but the bucket's own residuals (and ``stats``, which no other thread touches until ``future`` is
    done). ``launch``: the dependent collective, on the backward's thread (:meth:`DDPHookState._launch`);
    ``waited_s``: the time that launch waited on the backward's thread for PowerSGD's ``P`` to arrive, counted
    as exposed (the engine counts its own waits, the ``rs+ag`` form's reduce-scatter's). ``early``: whether
    :meth:`DDPHookState._release` launches it at the next hook call (not a reduce-scatter of several rounds: the
    engine moves those one round on at each bucket it starts, and finishing them at once would hold the
    backward's thread for every round left; they go at the end of the backward pass).
    ``stats``: recorded on the backward's thread once ``future`` is done; ``key``: the bucket then
    checked for NaN/Inf under ``nonfinite="raise"`` (``None``: the form raises where it decodes).
    ``errors``: what the callbacks raised, re-raised as it was (a future's ``wait`` would wrap it).
    ``bodies``: the callbacks, and with them every tensor they captured from the backward's stream (a part's
    ``M``, an EF21 shift's copy), held until the flight is finished, when that stream has waited for the future:
    freed at the callback's end, such a tensor's block could go to the backward's stream's next allocation while
    the hook's stream still reads it (a future's own values torch protects itself)."""

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
        run on the hook's own stream, not torch's pool (:mod:`tagc.hooks.callback_stream`), ``body`` held in
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
        self._flights: collections.deque[_Flight] = collections.deque()  # launched, not yet finished; oldest first
        self._drain = BackwardDrain()
        self._drained_task = -1  # the backward pass whose final callback last finished buckets
        self._spans: dict[str, tuple] = {}  # PowerSGD part key -> its runs in the bucket (_powersgd_spans)
        hook.note_parameters(model_parameters(model.module))  # the settings check compares what select picks

    def settled(self) -> bool:
        """Whether DDP's buckets are final. DDP rebuilds them once, in the order gradients became ready
        in the first iteration (unless ``find_unused_parameters`` without ``static_graph``): buckets
        of the first iteration differ from every later one's, so their residuals would be keyed for
        buckets that never come back. Until then every bucket is reduced as DDP reduces it (as
        torch's PowerSGD hook runs plain all-reduces first), and the step is not counted."""
        ddp = self._ddp
        return has_rebuilt_buckets(ddp) or (ddp.find_unused_parameters and not ddp.static_graph)

    # ------------------------------------------------------------------ delegation

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
        A step before DDP's buckets are final (:meth:`settled`) is not counted."""
        if self._unsettled_step:
            self._unsettled_step = False
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
            return _done(buffer)
        hook = self.hook
        hook.verify(self.group, buffer.device)
        if not self.settled():
            self._unsettled_step = True
            return self._allreduce(buffer, world)
        self._unsettled_step = False
        layout = self._layout(bucket, buffer)
        hook._check_codec_world(world)
        steady = hook._plan(layout.segments, layout.numel, world)
        hook._begin_bucket(steady.key)  # one key per bucket and step, whatever the form: steps are counted
        dense = hook.step_count < hook.dense_steps or not hook.codec.compresses
        if dense and hook.plain_name == "fp32":  # DDP's own reduction
            return self._allreduce(buffer, world)
        if layout.form is None:
            layout.form, layout.planned_bytes = self._choose(layout, buffer, world, steady)
        if layout.form == "sketch" and hook.step_count >= hook.dense_steps:
            plan = steady
            if hook.warming_up:  # the density ramp: this stage's ratios, the same parts and residuals
                plan = hook._plan(layout.segments, layout.numel, world, hook.step_count - hook.dense_steps)
            return self._defer(self._sketch(buffer, plan, world))
        return self._defer(self._pieces_exchange(layout, buffer, world))

    # ------------------------------------------------------------------ finishing buckets

    def _defer(self, flight: _Flight) -> torch.futures.Future:
        """Hand DDP the bucket's future, and finish the bucket (its dependent collective, its statistics) in a
        final callback of the backward pass. That callback is queued at the pass's first bucket, DDP's own
        (which waits for every bucket's future) at its last: ours runs first. Finished here instead with
        ``overlap=False``, outside a backward pass, or after our callback ran in this pass (a callback
        queued now would run after DDP's wait)."""
        task = current_graph_task()
        if not self.hook.overlap or task == -1 or task == self._drained_task:
            self._finish(flight)
            return flight.future
        flight.task = task
        self._drain.add(self._finish_oldest)  # first finishes what a failed pass left (its flights are older)
        self._flights.append(flight)
        return flight.future

    def _release(self) -> None:
        """Launch the dependent collective of every bucket still in flight, oldest first, before this hook call
        launches its own bucket's collectives (after its encode, in the all-reduce forms): every rank reaches this
        point at the same hook call, so bucket ``k``'s second collective goes just before bucket ``k+1``'s first,
        the blocking exchange's order, while the backward goes on. Not the flights that are not
        :attr:`_Flight.early`. An error is kept for the bucket's finish (the final callback), where it is raised
        as before."""
        for flight in self._flights:
            if not flight.early:
                continue
            try:
                self._launch(flight)
            except Exception as error:
                flight.errors.append(error)

    def _finish_oldest(self, deliver: bool) -> None:
        """The final callback's item, one per bucket, oldest first: launch every dependent collective not launched
        yet, in bucket order (the last bucket's: the earlier ones went at the next hook call, :meth:`_release`),
        then finish the oldest bucket. ``deliver`` false (a failed backward pass left the bucket): it
        is finished all the same, so that no rank is left waiting for its collectives."""
        flight = self._flights.popleft()
        self._drained_task = flight.task
        try:
            for launched in (flight, *self._flights):
                self._launch(launched)
        finally:
            self._finish(flight)

    @staticmethod
    def _launch(flight: _Flight) -> None:
        """Launch the bucket's dependent collective (once), on the backward's thread: every rank launches the
        buckets' collectives in the same order there."""
        launch, flight.launch = flight.launch, None
        if launch is None:
            return
        try:
            launch()
        except Exception as error:
            if not flight.future.done():
                flight.future.set_exception(error)
            raise

    def _finish(self, flight: _Flight) -> None:
        """Wait for the bucket's future and record its statistics (on the backward's thread)."""
        self._launch(flight)
        begin = time.perf_counter()
        try:
            flight.future.wait()
        except Exception:
            if flight.errors:
                raise flight.errors[0] from None  # as the decode raised it (e.g. FloatingPointError)
            raise
        flight.stats.exposed_s += time.perf_counter() - begin + flight.waited_s
        hook = self.hook
        hook._record(flight.stats, None)
        if flight.key is not None and hook.nonfinite == "raise" and bool(flight.stats.nonfinite_parts):
            raise FloatingPointError(f"a gradient in TAGC bucket {flight.key!r} is NaN/Inf on some rank "
                                     "(nonfinite='raise')")  # no host read under "propagate"

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
        self.hook._record(ExchangeStats(buckets=1, wire_bytes=ring(nbytes, world),
                                        plain_equivalent_bytes=ring(buffer.numel() * 4, world)), None)
        buffer.mul_(1.0 / world)  # as DDP's reducer scales a bucket without a hook: by the reciprocal
        self._release()
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    # ------------------------------------------------------------------ choosing a form

    def _choose(self, layout: _Bucket, buffer: torch.Tensor, world: int, steady: _BucketPlan) -> tuple[str, dict]:
        """The form sending the fewest bytes among those the settings allow (module docstring)."""
        hook = self.hook
        identical = decodes_alike_on_every_replica(buffer)
        planned = {}
        sketch = self._sketch_bytes(steady, world, buffer.device) if identical else None
        if sketch is not None:
            planned["sketch"] = sketch
        if hook.codec.rounds == 1:  # a multi-round codec's wire (powersgd's) follows the shapes: not planned in bytes
            pieces = self._pieces(layout, world, buffer.device)
            chunk = pieces.index.shape[1]
            row = hook.wire_row_bytes(pieces.segments, chunk, world, buffer.dtype)
            gather_size = 2 if hook.plain_name == "bf16" else buffer.element_size()
            planned["rs+ag"] = (world - 1) * (row + chunk * gather_size)
            if identical and all(part.codec.traceable() for part in hook._plan(pieces.segments, chunk, world).parts):
                planned["gather"] = (world - 1) * world * row
        if not planned:
            return "rs+ag", planned
        return min(planned, key=lambda form: (planned[form], FORMS.index(form))), planned

    def _sketch_bytes(self, plan: _BucketPlan, world: int, device: torch.device) -> int | None:
        """Bytes of the all-reduce form, or ``None`` where the settings do not allow it."""
        hook = self.hook
        if not plan.compressed:
            return None
        plain = sum(p.numel for p in plan.parts if p.codec is hook.plain)
        compressed = [p for p in plan.parts if p.codec is not hook.plain]
        sketched = [_sketched(p.codec) for p in compressed]
        if all(isinstance(codec, TAGCCodec) for codec in sketched):
            if hook.plain_name != "fp32" or any(codec.positions != "bitmap" or codec.value_dtype != torch.float32
                                                or codec.config.fallback != "estimate" for codec in sketched):
                return None
            cells = sum(codec.layout(p.numel).table_numel for p, codec in zip(compressed, sketched))
            index = sum(-(-p.numel * codec.config.index_bits // 8) for p, codec in zip(compressed, sketched))
            gathered = self._index_gathered(sketched[0].config.index_bits, device)
            return ring(4 * (cells + plain), world) + ((world - 1) * index if gathered else ring(index, world))
        if all(isinstance(p.codec, PowerSGDCodec) for p in compressed) and len(compressed) == 1:
            codec = compressed[0].codec
            dtypes = self._powersgd_dtypes(codec)
            if dtypes is None:
                return None
            shapes = codec._layouts[compressed[0].key]
            columns = sum(count for _, count in shapes.plain)
            first = _by_dtype([(dtypes.values, sum(shapes.p_sizes)), (dtypes.columns, columns), (dtypes.plain, plain)])
            return (sum(ring(dtype.itemsize * sum(counts), world) for dtype, counts in first.items())
                    + ring(dtypes.values.itemsize * sum(shapes.q_sizes), world))
        return None

    def _powersgd_dtypes(self, codec: PowerSGDCodec) -> "_PowerSGDDtypes | None":
        """What PowerSGD's all-reduce form sends in which dtype, or ``None`` where the plain codec has no
        all-reduce form (``fp8``, ``int4``: their blocks' scales do not add up)."""
        plain = _SUMMED_PLAIN.get(self.hook.plain_name)
        if plain is None:
            return None
        return _PowerSGDDtypes(codec.value_dtype, codec._plain_dtype(torch.float32), plain)

    def _index_gathered(self, bits: int, device: torch.device) -> bool:
        """Whether the 1-bit index is merged by all-gather and OR (no bitwise all-reduce on the backend)."""
        return bits == 1 and backend_of(self.group, device) != "gloo"

    # ------------------------------------------------------------------ the all-reduce form

    def _sketch(self, buffer: torch.Tensor, plan: _BucketPlan, world: int) -> _Flight:
        hook = self.hook
        n = buffer.numel()
        stats = ExchangeStats(buckets=1, compressed_buckets=1, plain_equivalent_bytes=ring(4 * n, world))
        flight = _Flight(stats, key=plan.key)
        compressed = [p for p in plan.parts if p.codec is not hook.plain]
        plain = [p for p in plan.parts if p.codec is hook.plain]
        for part in compressed:
            hook._check_restored_part(part)
        if isinstance(compressed[0].codec, PowerSGDCodec):
            self._powersgd(flight, buffer, compressed[0], plain, world)
        else:
            self._tagc(flight, buffer, compressed, plain, world)
        return flight

    def _all_reduce(self, tensor: torch.Tensor, stats: ExchangeStats, op=dist.ReduceOp.SUM) -> torch.futures.Future:
        """Launch ``tensor``'s all-reduce (in place); a future of its completion."""
        stats.wire_bytes += ring(tensor.numel() * tensor.element_size(), dist.get_world_size(self.group))
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True).get_future()

    def _tagc(self, flight: _Flight, buffer: torch.Tensor, parts: list[_Part], plain: list[_Part], world: int) -> None:
        """TAGC's all-reduce form: compress every part whole, launch the tables' sum and the indexes' merge; the
        future decodes. Under EF21 (an :class:`EF21Codec` around TAGC) a part compresses ``g - h_i`` (its residual
        holds ``-h_i``; ``v_i - h_i`` with momentum), its residual becomes the next ``-h_i`` as
        :meth:`EF21Codec.encode` leaves it, and the decoded sum is added to ``H`` (:func:`_ef21_decoded`)."""
        device = buffer.device
        stats = flight.stats
        indexes, tables, shifts = [], [], []
        codecs: list[TAGCCodec] = [_sketched(part.codec) for part in parts]
        for part, codec in zip(parts, codecs):
            ef21 = part.codec if isinstance(part.codec, EF21Codec) else None
            grad = buffer[part.index(device)].view(1, part.numel)
            if ef21 is not None:
                ef21.fade(part.key)
                grad = ef21.feed(grad, part.key)
            residual = codec.residual(part.key, grad)
            before = residual.clone() if ef21 is not None else None
            ok, grad = nonfinite.zero_unless_finite(grad)
            cap, _ = codec._capacity(part.numel, world)
            index, table, held = nonfinite.compress_(ok, grad, residual, codec.config.density(world),
                                                     codec.layout(part.numel), codec.config.index_bits, cap)
            if ef21 is not None:
                residual.sub_(grad)  # -(h_i + sent): zero where the part is not finite, as EF21Codec.encode
            shifts.append(None if ef21 is None else (ef21, residual, before))
            stats.count("overflow", held)
            indexes.append(index.reshape(-1))
            tables.append(table.reshape(-1).float())
        values = torch.cat([buffer[p.index(device)].float() for p in plain] + tables)
        self._release()
        launched = [self._all_reduce(values, stats)]
        bits = codecs[0].config.index_bits
        merge = self._merge_indexes(torch.cat(indexes), bits, stats, launched)

        def decode(_: torch.futures.Future) -> torch.Tensor:
            for done in launched:
                done.wait()  # raises a collective's error; on CUDA, orders this stream after the collective
            merged = merge()
            summed = torch.empty(buffer.numel(), dtype=torch.float32, device=device)
            at = 0
            for part in plain:
                summed[part.index(device)] = values[at : at + part.numel]
                at += part.numel
            index_at = 0
            for part, codec, shift in zip(parts, codecs, shifts):
                layout = codec.layout(part.numel)
                table = values[at : at + layout.table_numel]
                index_bytes = -(-part.numel * bits // 8)
                union = merged[index_at : index_at + index_bytes]
                decoded = nonfinite.decode_(table, union, layout, bits, "estimate", stats)
                summed[part.index(device)] = decoded if shift is None else _ef21_decoded(part, decoded, *shift)
                at += layout.table_numel
                index_at += index_bytes
            scale_into(buffer, summed, op_scale(dist.ReduceOp.AVG, world))
            return buffer

        flight.future = self._after_all(launched, device).then(flight.callback(decode, device))

    def _after_all(self, launched: list[torch.futures.Future], device: torch.device) -> torch.futures.Future:
        """A future done once every one of ``launched`` is. On NCCL the last one (done at launch, CUDA semantics):
        its callbacks run on streams made to wait for it, and the callback waits for the others (events, no host
        wait), so the decode stays off the backward's stream. Elsewhere ``collect_all``: a callback must not block
        a backend thread waiting for another collective."""
        if backend_of(self.group, device) == "nccl":
            return launched[-1]
        return torch.futures.collect_all(launched)

    def _merge_indexes(self, index: torch.Tensor, bits: int, stats: ExchangeStats,
                       launched: list[torch.futures.Future]) -> Callable[[], torch.Tensor]:
        """Launch the merge of every rank's index bytes (OR of the 1-bit bitmaps, sum of the 4-bit counts), adding
        its future to ``launched``; returns what gives the merged index once it is done."""
        if bits == 4:
            launched.append(self._all_reduce(index, stats))  # packed nibbles add without carrying: at most 15 ranks
            return lambda: index
        if not self._index_gathered(bits, index.device):
            launched.append(self._all_reduce(index, stats, dist.ReduceOp.BOR))
            return lambda: index
        world = dist.get_world_size(self.group)
        gathered = index.new_empty(world * index.numel())
        launched.append(all_gather_single(gathered, index, group=self.group, async_op=True).get_future())
        stats.wire_bytes += (world - 1) * index.numel()

        def merge() -> torch.Tensor:
            rows = gathered.view(world, -1)
            merged = rows[0]
            for row in rows[1:]:  # one OR per rank, not per element
                merged = merge_index(merged, row, 1)
            return merged

        return merge

    def _powersgd(self, flight: _Flight, buffer: torch.Tensor, part: _Part, plain: list[_Part], world: int) -> None:
        """PowerSGD's all-reduce form, the DDP hook's algorithm on the codec's state (:mod:`tagc.hooks.powersgd`):
        ``P`` (with the uncompressed columns) launched here, ``Q`` by :attr:`_Flight.launch` once ``P`` is summed
        (on the backward's thread), ``P Q^T`` formed in ``Q``'s callback.

        Each tensor travels in its dtype (:meth:`_powersgd_dtypes`) and is summed in it by the all-reduce, as
        torch's ``bf16_compress_hook`` sums in bf16: ``P`` and ``Q`` in the codec's ``value_dtype``, its
        shape-less columns in the same 16-bit dtype (fp32 with float32 values), the plain parts in fp32 or bf16
        (``plain``). The first round is one all-reduce per dtype, ``P``'s first; every rank receives the same
        summed bits, so every rank orthonormalises the same ``P``. The codec's error feedback holds this rank's
        ``M`` minus the averaged approximation formed from the rounded, summed ``P`` and ``Q``: the rounding of
        the 16-bit wire lands in the residual, as on the flat lean wire.

        The matrices and the shape-less columns are whole parameters, each a contiguous run of the bucket
        (:meth:`_powersgd_spans`): ``M`` is read from the buffer as a view (one pass: the gradient plus the
        residual) and the averaged approximation is formed in the buffer itself (:meth:`PowerSGDCodec.average_into`),
        the residual in ``M``'s memory: no gather of the part's columns, no matrix-sized temporaries, as torch's hook
        decompresses into the bucket."""
        codec: PowerSGDCodec = part.codec
        dtypes = self._powersgd_dtypes(codec)
        shapes = codec._layouts[part.key]
        matrix_at, columns_at = self._powersgd_spans(part, shapes)
        device = buffer.device
        stats = flight.stats
        ms, qs = [], []
        for mat, at in zip(shapes.matrices, matrix_at):
            name = f"{part.key}/{mat.name}"
            grad = buffer[at : at + mat.rows * mat.cols].view(mat.rows, mat.cols)
            residual = codec.residuals.get(name)
            if residual is not None and grad.dtype == torch.float32:
                m = torch.add(grad, residual)  # float32: this rank's own copy (the buffer is overwritten in the decode)
            else:
                m = grad.to(torch.float32, copy=True)
                if residual is not None:
                    m.add_(residual)
            ms.append(m)
            qs.append(orthonormal(codec._q(name, mat, device)))
        p_flat = (torch.cat([right_times(m, q).reshape(-1) for m, q in zip(ms, qs)]) if ms
                  else buffer.new_zeros(0).float())
        uncompressed = [buffer[at : at + count] for at, count in columns_at]
        first = _Summands([(dtypes.values, p_flat), *((dtypes.columns, t) for t in uncompressed),
                           *((dtypes.plain, buffer[p.index(device)]) for p in plain)])
        self._release()
        summed_first = [self._all_reduce(tensor, stats) for tensor in first.flat.values()]  # P's dtype first
        flight.future = _future_of(buffer)
        scale = op_scale(dist.ReduceOp.AVG, world)

        def launch() -> None:
            begin = time.perf_counter()
            summed_first[0].wait()
            flight.waited_s += time.perf_counter() - begin
            summed_ps = first.summed(0).split(shapes.p_sizes)
            ps = [orthonormal(p.view(mat.rows, mat.rank)) for p, mat in zip(summed_ps, shapes.matrices)]
            second = (torch.cat([left_times(m, p).reshape(-1) for m, p in zip(ms, ps)]) if ms
                      else p_flat.new_zeros(0)).to(dtypes.values)
            launched = [*summed_first[1:], self._all_reduce(second, stats)]

            def decode(_: torch.futures.Future) -> torch.Tensor:
                for done in launched:
                    done.wait()  # raises a collective's error; on CUDA, orders this stream after the collective
                summed_qs = second.float().split(shapes.q_sizes)
                for mat, at, m, q_used, p, q in zip(shapes.matrices, matrix_at, ms, qs, ps, summed_qs):
                    region = buffer[at : at + mat.rows * mat.cols].view(mat.rows, mat.cols)
                    averaged = region if region.dtype == torch.float32 else torch.empty_like(m)
                    codec.average_into(f"{part.key}/{mat.name}", m, p, q.view(mat.cols, mat.rank), q_used, world,
                                       averaged, stats)
                    if averaged is not region:
                        region.copy_(averaged)
                for index, (at, count) in enumerate(columns_at, start=1):
                    scale_into(buffer[at : at + count], first.summed(index), scale)
                for index, p in enumerate(plain, start=1 + len(columns_at)):
                    columns = p.index(device)
                    if isinstance(columns, slice):
                        scale_into(buffer[columns], first.summed(index), scale)
                    else:
                        scaled = buffer.new_empty(p.numel)
                        scale_into(scaled, first.summed(index), scale)
                        buffer[columns] = scaled
                return buffer

            _complete(flight.future, self._after_all(launched, device).then(flight.callback(decode, device)))

        flight.launch = launch

    def _powersgd_spans(self, part: _Part, shapes) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """Where PowerSGD's matrices start in the bucket, and its shape-less columns' ``(start, count)`` runs there:
        each is a whole parameter (the codec takes whole segments), so a contiguous run of the buffer. Found once per
        part from its column list (on the host)."""
        spans = self._spans.get(part.key)
        if spans is None:
            columns = part.columns

            def start(at: int, count: int) -> int:
                if isinstance(columns, slice) or count == 0:  # an empty parameter: any start
                    return (columns.start if isinstance(columns, slice) else 0) + at
                first, last = int(columns[at]), int(columns[at + count - 1])
                if last - first != count - 1:
                    raise RuntimeError(f"powersgd part {part.key!r}: a parameter is not one run of the DDP bucket "
                                       "(the codec takes whole parameters); please report this")
                return first

            spans = (tuple(start(m.start, m.rows * m.cols) for m in shapes.matrices),
                     tuple((start(at, count), count) for at, count in shapes.plain))
            self._spans[part.key] = spans
        return spans

    # ------------------------------------------------------------------ the reduce-scatter forms

    def _pieces(self, layout: _Bucket, world: int, device: torch.device) -> Pieces:
        """The bucket cut as HSDP cuts a shard, each piece keeping its parameter's shape (piece ``j`` of a
        parameter is its ``j``-th contiguous slice, so the rows' concatenation is the parameter: powersgd)."""
        if device not in layout.pieces:
            pieces = Pieces.build(layout.segments, layout.numel, world, device)
            whole = [s for s in layout.segments if s.numel]
            shaped = tuple(dataclasses.replace(p, shape=s.shape) for p, s in zip(pieces.segments, whole))
            layout.pieces[device] = dataclasses.replace(pieces, segments=shaped)
        return layout.pieces[device]

    def _pieces_exchange(self, layout: _Bucket, buffer: torch.Tensor, world: int) -> _Flight:
        """``rs+ag`` or ``gather`` (during a dense warm-up with ``plain`` not fp32: ``rs+ag``)."""
        hook = self.hook
        pieces = self._pieces(layout, world, buffer.device)
        rows = torch.cat([buffer, buffer.new_zeros(1)])[pieces.index]
        chunk = buffer.new_empty(pieces.index.shape[1])
        gather_dtype = torch.bfloat16 if hook.plain_name == "bf16" else buffer.dtype
        op = dist.ReduceOp.AVG
        self._release()
        if layout.form == "gather" and gathers_wires(hook, pieces.segments, chunk, world, gather_dtype, self.group):
            hook.topology(self.group)  # the decode reads it: made here, where a hierarchical one may create groups
            wires = GatheredWires(hook, rows, buffer, pieces, self.group, op, ExchangeStats())  # encodes, launches
            flight = _Flight(wires.stats)
            if hook.strict_sync:
                # strict sync mode counts the host reads of the hook's thread: decode there (in the final callback)
                flight.future = _future_of(buffer)
                flight.launch = lambda: (wires.work.wait(), flight.future.set_result(wires.decode()))
            else:
                flight.future = wires.work.get_future().then(
                    flight.callback(lambda gathered: (gathered.wait(), wires.decode())[1], buffer.device))
            return flight
        replicas = PendingAllReduce.start(hook, chunk, rows, buffer, pieces, self.group, op, gather_dtype)
        flight = _Flight(ExchangeStats(), _future_of(buffer))  # the engine records the reduce-scatter's statistics
        # the all-gather needs the reduce-scatter's result: launched on the backward's thread
        flight.launch = lambda: _complete(flight.future, replicas.gather())
        flight.early = all(part.codec.rounds == 1 for part in replicas.pending.plan.parts)
        return flight


_SUMMED_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""``plain=`` -> the dtype the plain parts are summed in by PowerSGD's all-reduce form (the others quantize in
blocks whose scales do not add up: that form is not planned for them)."""


@dataclasses.dataclass(frozen=True)
class _PowerSGDDtypes:
    """What PowerSGD's all-reduce form sends in which dtype: ``P`` and ``Q`` (the codec's ``value_dtype``), the
    codec's shape-less columns (the same, or float32 with float32 values), the hook's plain parts."""

    values: torch.dtype
    columns: torch.dtype
    plain: torch.dtype


def _by_dtype(sizes: list[tuple[torch.dtype, int]]) -> dict[torch.dtype, list[int]]:
    """``(dtype, numel)`` pieces grouped by dtype, the dtypes in the order they first come: one all-reduce each."""
    groups: dict[torch.dtype, list[int]] = {}
    for dtype, numel in sizes:
        groups.setdefault(dtype, []).append(numel)
    return groups


class _Summands:
    """Tensors to sum over the ranks, each cast to its dtype and packed with the others of that dtype
    (:func:`_by_dtype`): :attr:`flat` is what the all-reduces sum in place, :meth:`summed` a piece after."""

    def __init__(self, pieces: list[tuple[torch.dtype, torch.Tensor]]) -> None:
        groups = _by_dtype([(dtype, tensor.numel()) for dtype, tensor in pieces])
        self._slots, at = [], dict.fromkeys(groups, 0)
        for dtype, tensor in pieces:
            self._slots.append((dtype, at[dtype], tensor.numel()))
            at[dtype] += tensor.numel()
        self.flat = {dtype: torch.cat([t.reshape(-1).to(dtype) for d, t in pieces if d == dtype]) for dtype in groups}

    def summed(self, index: int) -> torch.Tensor:
        """Piece ``index`` of the summed tensors, as float32."""
        dtype, start, numel = self._slots[index]
        return self.flat[dtype][start : start + numel].float()


def _sketched(codec):
    """The codec whose sketch travels: TAGC itself, or the TAGC an :class:`EF21Codec` wraps."""
    return codec.inner if isinstance(codec, EF21Codec) and isinstance(codec.inner, TAGCCodec) else codec


def _ef21_decoded(part: _Part, decoded: torch.Tensor, ef21: EF21Codec, residual: torch.Tensor,
                  before: torch.Tensor) -> torch.Tensor:
    """EF21 in the all-reduce form: ``H`` (replicated: every rank decodes the whole part) plus the decoded sum of the
    ranks' changes, returned. Where the summed table was not finite (``decoded`` all NaN), ``H`` stays and every
    rank takes its change back (its residual, ``-h_i``, as ``before`` the encode), so ``H`` stays the sum of the
    ``h_i``; the part comes out NaN, as the codecs' policy has it."""
    total, ok = ef21.add_decoded(part.key + SUM, part.numel, decoded)
    residual.copy_(torch.where(ok, residual, before))
    return torch.where(ok, total, torch.nan)


def _future_of(buffer: torch.Tensor) -> torch.futures.Future:
    """A future for ``buffer``, completed by :func:`_complete` (on CUDA: its waiters wait for the writer's stream)."""
    return torch.futures.Future(devices=[buffer.device] if buffer.device.type == "cuda" else None)


def _complete(future: torch.futures.Future, source: torch.futures.Future) -> None:
    """Complete ``future`` as ``source`` completes: a callback cannot return a future for ``then`` to wait on."""

    def forward(done: torch.futures.Future) -> None:
        try:
            value = done.value()
        except Exception as error:
            future.set_exception(error)
        else:
            future.set_result(value)

    source.then(forward)  # on CUDA: runs on streams made to wait for ``source``, where the result is recorded


def _done(buffer: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


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
