"""The exchange engine behind every adapter: :class:`TAGCHook`, a small facade over one state object
and functions with one job each, in the manner of torch's ``powerSGD_hook.py``.

An adapter hands the hook a bucket: the packed reduce-scatter input (``[N, S]``: row ``j`` is
rank ``j``'s chunk), the output shard, the group, FSDP's reduce op, and the *segments* of a
chunk (each parameter's padded shard). The pieces, one module each (its docstring says what it does):
:mod:`~tagc.hooks.core.settings`, :mod:`~tagc.hooks.core.plan`, :mod:`~tagc.hooks.core.state`, the eager path
(:mod:`~tagc.hooks.core.eager`: :meth:`TAGCHook.start`) and the traced one (:mod:`~tagc.hooks.core.traced`:
:meth:`TAGCHook.encode_bucket` / :meth:`TAGCHook.decode_bucket`, for a compiled graph), what both share
(:mod:`~tagc.hooks.core.exchange`), the cross-rank settings check (:mod:`~tagc.hooks.core.verify`,
:mod:`~tagc.hooks.core.fingerprint`) and checkpoints (:mod:`~tagc.hooks.core.checkpoint`).

Bytes are counted once, from the codecs' wire shapes, the same for every path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from tagc.config import TAGCConfig
from tagc.hooks.codecs.feedback import LearningRateFading
from tagc.hooks.core import checkpoint, eager, strict, traced
from tagc.hooks.core.eager import PendingBucket, SideStreams
from tagc.hooks.core.exchange import PartCoder, nonfinite_error, raises_nonfinite
from tagc.hooks.core.fingerprint import SelectionRecord
from tagc.hooks.core.hierarchy import Topology, group_ranks, topology
from tagc.hooks.core.plan import BucketPlan, Part, Planner
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.settings import DENSE_STEPS, MIN_PART, NONFINITE, PLAIN_CODECS, HookSettings
from tagc.hooks.core.state import ExchangeState, UnitTiming
from tagc.hooks.core.stats import ExchangeStats, plain_bytes
from tagc.hooks.core.transport import op_scale, scale_into
from tagc.hooks.core.verify import check_agreement

__all__ = ["DENSE_STEPS", "MIN_PART", "NONFINITE", "PLAIN_CODECS", "PendingBucket", "Segment", "TAGCHook",
           "UnitTiming", "op_scale", "scale_into"]


ADAPTERS: dict[str, Callable] = {}
"""What the adapters plug into the engine: ``bind`` (SimpleFSDP's hook point), ``describe`` and
``warn_if_weak_selection``, registered by :mod:`tagc.hooks.adapters` when it is imported (``import tagc`` does), so
that the engine imports no adapter."""

class TAGCHook:
    """One comm hook: settings, the codecs (and their error-feedback state), statistics.

    Build it with :func:`tagc.hook`; install it with :func:`tagc.register_comm_hook` (FSDP2,
    FSDP1) or ``model.register_comm_hook(hook)`` (SimpleFSDP).

    Memory: the residuals (docs/guide.md, "The hook", "Memory"); ``fallback="raw"`` keeps one more residual-sized
    copy per bucket during the exchange, to re-send what decode cannot recover exactly; with ``overlap=True`` the
    wire tensors of a backward pass (about ``1/ratio`` of each compressed bucket, all of a plain one) live until
    the backward pass ends.
    """

    def __init__(self, settings: HookSettings | TAGCConfig, **arguments) -> None:
        """``settings``: a :class:`HookSettings`, or a :class:`TAGCConfig` and the other settings as keywords."""
        if isinstance(settings, TAGCConfig):
            settings = HookSettings(config=settings, **arguments)
        elif arguments:
            raise TypeError("settings are given once: a HookSettings, or a TAGCConfig and keywords "
                            f"(got both: {sorted(arguments)})")
        self.settings = settings
        self.codec, self.plain = settings.make_codecs()
        self.planner = Planner(settings, self.codec, self.plain)
        """How buckets are cut into parts, and the plans made so far (:class:`tagc.hooks.core.plan.Planner`)."""
        self._selection = SelectionRecord(self.planner)
        self.state = ExchangeState(settings.warmup_steps(self.codec))
        self.step_count = 0  # sets warmed_up too
        self._verified: set[tuple[int, str]] = set()
        self.topologies: dict[tuple[int, ...], Topology] = {}
        """The topology of every group exchanged on, by its ranks (:meth:`topology` makes them)."""
        self._streams = SideStreams()
        self._selection_checked = False  # warn_if_weak_selection ran (after the first warmed-up step)
        self.strict_sync = strict.enabled()
        """Count host reads of tensors in the exchange (``TAGC_STRICT_SYNC=1``; :mod:`tagc.hooks.core.strict`)."""
        self.counting_reads = False  # an entry point is counting host reads now (tagc.hooks.core.strict.counted)
        self._lr_source: LearningRateFading | None = None

    # ------------------------------------------------------------------ public

    def __call__(self, unit):
        """SimpleFSDP's comm-hook protocol, ``hook(unit) -> (reduce_scatter, start)``, so that
        ``model.register_comm_hook(tagc.hook(...))`` is the one line on a SimpleFSDP model
        (:func:`tagc.hooks.adapters.simple.bind`; ``tagc.register_comm_hook(model, hook)`` does the same)."""
        return ADAPTERS["bind"](self, unit)

    def stats(self) -> dict:
        """``{"step": n, "last_step": {...}, "total": {...}, "units": [...]}``: :class:`ExchangeStats` of the last
        step and of the run, and the last step's units. Codecs count on the device: this is where the counts are
        read (a host synchronisation). On CUDA the times are the host's: when work was queued and when it waited."""
        self._streams.join()
        return {"step": self.step_count, "last_step": self.last_step.as_dict(), "total": self.total.as_dict(),
                "units": [unit.as_dict() for unit in self.last_units]}

    def describe(self, model: torch.nn.Module) -> str:
        """A table of what this hook does to ``model`` (wrapped by SimpleFSDP, FSDP2 or FSDP1), per parameter and
        unit: :mod:`tagc.hooks.adapters.describe`. Runs no collective."""
        return ADAPTERS["describe"](self, model)

    @property
    def residuals(self) -> dict[str, list[torch.Tensor]]:
        """The codec's error-feedback residuals, ``{bucket key: [one [N, part] tensor per part]}``."""
        return checkpoint.residuals_by_bucket(self.codec)

    def agreed_settings(self) -> dict:
        """Every setting that changes what crosses the wire, or when, as it is now: must agree across ranks.
        ``select`` is its fingerprint (:meth:`select_fingerprint`); ``follow_lr`` the peak rate the fading follows
        (``"from the optimizer"`` when it reads it there), ``None`` when it follows none."""
        source = self._lr_source
        follows = None if source is None else (source.peak_lr or "from the optimizer")
        return {**self.settings.agreed(self.codec, self.select_fingerprint()), "follow_lr": follows}

    @property
    def dense_steps(self) -> int:
        """Steps sent plain first: ``None`` gives :data:`DENSE_STEPS` to error-feedback codecs, 0 to the others."""
        return self.state.dense_steps

    SETTINGS_ONLY = frozenset(HookSettings.__dataclass_fields__) - {"codec", "plain", "dense_steps"}
    """Names that are settings only (``hook.settings.<name>``): setting one on the hook is an error, not a no-op.
    ``codec`` and ``plain`` are also the hook's codec objects, ``dense_steps`` its resolved warm-up (read-only)."""

    def __setattr__(self, name: str, value) -> None:
        if name in self.SETTINGS_ONLY:
            raise AttributeError(f"{name} is a setting: read hook.settings.{name}; change it with "
                                 f"hook.update({name}=...) where allowed ({', '.join(self.RUN_TIME)})")
        super().__setattr__(name, value)

    RUN_TIME = ("piece_bytes", "side_stream")
    """The settings :meth:`update` may change between steps: how the bytes travel, not what they are."""

    def update(self, **changes) -> None:
        """Change settings of :data:`RUN_TIME` between steps (validated; the same on every rank, which the next
        exchange checks again): ``hook.update(piece_bytes=1 << 16)``. The others are fixed when the hook is built."""
        fixed = sorted(set(changes) - set(self.RUN_TIME))
        if fixed:
            raise AttributeError(f"{', '.join(fixed)} is fixed when the hook is built: build another with "
                                 f"tagc.hook(...); update() changes only {self.RUN_TIME}")
        self.settings = self.settings.replace(**changes)
        self._verified.clear()

    def set_feedback_decay(self, decay: float) -> None:
        """Fade EF21's shifts by ``decay`` from the next step on (``feedback="ef21"`` only): the settings report it,
        and the next exchange checks again that every rank has it. Call it between steps, with the same value on
        every rank; :meth:`follow_lr` sets it from the learning rate at each step."""
        self._require_ef21("set_feedback_decay")
        self.settings = self.settings.replace(feedback_decay=decay)  # validated before the codec takes it
        self.codec.set_decay(decay)
        self._verified.clear()

    def follow_lr(self, optimizer: torch.optim.Optimizer | None, peak_lr: float | None = None) -> None:
        """Fade EF21's shifts less as ``optimizer``'s learning rate decays: at each step's first exchange
        (:class:`tagc.hooks.codecs.feedback.LearningRateFading`; docs/guide.md, "The hook"). ``feedback="ef21"``
        only; ``None`` stops following (the fading stays where it is)."""
        if optimizer is None:
            self._lr_source = None
            self._verified.clear()
            return
        self._require_ef21("follow_lr")
        self._lr_source = LearningRateFading(optimizer, self.settings.feedback_decay, peak_lr)
        self._verified.clear()

    def _require_ef21(self, method: str) -> None:
        if self.codec.feedback != "ef21":
            raise ValueError(f"{method} fades EF21's shifts: this hook's feedback is "
                             f"{self.settings.feedback!r}; make it with tagc.hook(feedback='ef21', ...)")

    @property
    def last_step(self) -> ExchangeStats:
        return self.state.last_step

    @property
    def total(self) -> ExchangeStats:
        return self.state.total

    @property
    def last_units(self) -> list[UnitTiming]:
        return self.state.last_units

    @property
    def host_read_sites(self):
        """Where host reads happened in strict sync mode (a ``collections.Counter`` of call sites)."""
        return self.state.host_read_sites

    # ------------------------------------------------------------------ steps

    @property
    def step_count(self) -> int:
        """Steps completed (:meth:`end_step`)."""
        return self.state.step_count

    @step_count.setter
    def step_count(self, step: int) -> None:
        self.state.step_count = step
        self.warmed_up = not self.warming_up
        """Whether the dense warm-up is over: a plain attribute, kept with the step, so that a compiled
        graph guards on it (one graph for the warm-up, one for after it)."""

    @property
    def warming_up(self) -> bool:
        """Whether this step is in the dense warm-up (the bucket goes plain)."""
        return self.state.dense

    def end_step(self) -> None:
        """Close this step's statistics (``stats()["last_step"]``, ``stats()["units"]``). Optional: a
        bucket seen twice also starts a new step, but calling this after ``optimizer.step()`` is
        exact, e.g. with gradient accumulation."""
        self.state.settle_restored()
        if not self._selection_checked and not self.warming_up:  # the first warmed-up step planned every bucket
            self._selection_checked = True
            ADAPTERS["warn_if_weak_selection"](self)
        self.step_count += 1
        self.state.close_step()

    def begin_bucket(self, key: str) -> None:
        """Count the bucket ``key`` in this step, before its exchange: a bucket seen again ends the step
        (:meth:`end_step`); the step's first bucket sets EF21's fading from the learning rate (:meth:`follow_lr`).
        Every path calls this once per bucket and step, whatever it sends (an adapter that reduces a bucket
        itself, e.g. DDP's all-reduce forms, too)."""
        if self.state.repeats(key):  # a bucket repeats: a new step began
            self.end_step()
        if self._lr_source is not None and not self.state.seen_this_step:  # the step's first exchange
            self.codec.set_decay(self._lr_source.decay())
        self.state.seen_this_step.add(key)

    def record(self, stats: ExchangeStats, timing: UnitTiming | None) -> None:
        """Add an exchange's statistics to this step's and the run's (and its unit's ``timing`` to this step's
        units, :meth:`stats`). The counters are not locked: record from the thread that runs the exchanges, never
        from a collective's callback."""
        self.state.record(stats, timing)

    def note_host_reads(self, reads: strict.HostReads) -> None:
        """Count an entry point's host reads in the statistics (strict sync mode,
        :func:`tagc.hooks.core.strict.counted`)."""
        self.state.note_host_reads(reads)

    # ------------------------------------------------------------------ planning (tagc.hooks.core.plan)

    def plan(self, segments: tuple[Segment, ...], chunk: int, world: int) -> BucketPlan:
        """The plan of a bucket of ``chunk`` columns over ``world`` ranks (the codec's exchange: the hosts, when
        hierarchical): its parts and their codecs, cached (:meth:`tagc.hooks.core.plan.Planner.plan`)."""
        return self.planner.plan(segments, chunk, world)

    # ------------------------------------------------------------------ what select selects, the settings check

    def note_parameters(self, segments: Iterable[Segment]) -> None:
        """Record what ``select`` gives each of these parameters (an adapter calls this with the model's parameters
        when it installs the hook), which :meth:`select_fingerprint` digests (:mod:`tagc.hooks.core.fingerprint`).
        A loaded checkpoint's ``select`` is compared at the next :meth:`verify` (adapters bind in steps)."""
        self._selection.note_parameters(segments)

    def select_fingerprint(self) -> str:
        """``select`` by what it selects (:class:`tagc.hooks.core.fingerprint.SelectionRecord`): a digest of the
        parameters it compresses and their ratios, over the parameters the hook has seen (a hook used
        directly, without an adapter, sees each bucket's segments as it starts)."""
        return self._selection.fingerprint()

    def verify(self, group: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
        """Check once per group (and again if the parameters seen grow) that every rank has the same
        settings (a clear error on every rank otherwise: :mod:`tagc.hooks.core.verify`), on ``device`` (the
        exchange's own) and ``group``."""
        if not dist.is_initialized():
            return
        self._check_restored_select()
        key = (id(group), self.select_fingerprint())
        if key in self._verified:
            return
        check_agreement(self.agreed_settings(), group, device)
        self._verified.add(key)

    def topology(self, group: dist.ProcessGroup | None) -> Topology:
        """How ``group``'s ranks sit on hosts, cached by its ranks; a hierarchical topology creates its
        subgroups on first use, so every rank of the group must reach this in the same order
        (:meth:`start` after :meth:`verify`, or :func:`tagc.hooks.adapters.simple.bind`)."""
        if not dist.is_initialized():
            return Topology(1)
        ranks = group_ranks(group)
        if ranks not in self.topologies:
            self.topologies[ranks] = topology(group, self.settings.hierarchy, self.settings.ranks_per_host)
        return self.topologies[ranks]

    def _enter(self, segments: Sequence[Segment], group, device: torch.device) -> None:
        """Every exchange's first step: fingerprint ``select`` by the bucket (a hook no adapter bound), then
        check the settings across ranks."""
        if not self._selection.bound:
            self._selection.note_bucket(segments)
        self.verify(group, device)

    def check_codec_world(self, world: int) -> None:
        """Raise unless the codec can exchange over ``world`` ranks (the hosts, when hierarchical):
        ``index_bits=4`` counts them in 4 bits. Every path checks before its first exchange of a bucket."""
        if self.settings.config.index_bits == 4 and world > 15:
            raise ValueError("index_bits=4 counts ranks in 4 bits and is exact for at most 15 ranks; this exchange has "
                             f"{world}: use index_bits=1")

    # ------------------------------------------------------------------ checkpoints (tagc.hooks.core.checkpoint)

    def state_dict(self) -> dict:
        """The codec's state (this rank's residuals, keyed by rank, bucket and part), the step counter,
        and the settings the keys follow from (``config``; ``select``: :meth:`select_fingerprint`)."""
        self._streams.join()
        return checkpoint.state_dict(self.codec, self.step_count, self.settings.config, self.select_fingerprint())

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s output, before the first step or later. A checkpoint whose keys this hook
        would not use is an error, never a silent restart of error feedback from zeros, raised as soon as it can be
        seen (:mod:`tagc.hooks.core.checkpoint`)."""
        restored = checkpoint.restored_from(state, self.settings.config)
        checkpoint.check_feedback(state, self.codec)
        self._streams.join()
        self.state.restored = restored
        self._check_restored_select()
        self.codec.load_state_dict(checkpoint.codec_state(state))
        self.step_count = int(state["step"])

    def _check_restored_select(self) -> None:
        if self.state.restored is not None:
            self.state.restored.check_select(self.select_fingerprint(), self._selection.bound)

    def check_restored_part(self, part: Part) -> None:
        """Raise if a loaded checkpoint holds no state for this compressed ``part`` (never a silent restart of
        error feedback from zeros): what every path checks before it encodes a part
        (:meth:`tagc.hooks.core.exchange.PartCoder.check`)."""
        self._coder().check(part)

    def _coder(self) -> PartCoder:
        """How this exchange's parts are encoded and decoded (:class:`tagc.hooks.core.exchange.PartCoder`)."""
        return PartCoder(self.plain, self.settings.piece_bytes, self.state.restored, self.select_fingerprint)

    # ------------------------------------------------------------------ the eager exchange (tagc.hooks.core.eager)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, op,
                       segments: Sequence[Segment], unit: str | None = None) -> None:
        """Write into ``output`` (one chunk) FSDP's reduce op over ranks of ``input``'s chunk (blocking)."""
        self.start(output, input, group, op, segments, unit).wait()

    @strict.counted
    def start(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, op,
              segments: Sequence[Segment], unit: str | None = None) -> PendingBucket:
        """Encode ``input``'s parts and launch their exchange; :meth:`PendingBucket.wait` finishes it.

        Earlier buckets' parts whose bytes have arrived are decoded first, and their multi-round parts move one
        round on (:mod:`tagc.hooks.core.eager`, which also says how the codec work runs on a side stream on CUDA).
        Every rank must start the same buckets in the same order (FSDP's backward order is the same on every rank).
        """
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        chunk = input.numel() // world
        if chunk * world != input.numel() or output.numel() != chunk:
            raise ValueError(f"reduce-scatter input of {input.numel()} elements does not split into {world} chunks of "
                             f"{output.numel()}")
        self._enter(segments, group, input.device)
        topo = self.topology(group) if world > 1 else Topology(world)
        # hierarchical: the codec exchanges the host-reduced block over the cross group, planned for H ranks
        codec_group, codec_world = (topo.cross, topo.hosts) if topo.hierarchical else (group, world)
        self.check_codec_world(codec_world)
        self.poll()
        for earlier in list(self.state.in_flight):  # the same point, the same order on every rank
            earlier.advance()
        plan = self.plan(tuple(segments), chunk, codec_world)
        self.begin_bucket(plan.key)
        if self.state.dense:  # the dense warm-up: the whole bucket plain, under the steady plan's key
            plan = self.planner.plain_plan(plan.key, chunk)
        stats = ExchangeStats(buckets=1, compressed_buckets=int(plan.compressed),
                              plain_equivalent_bytes=plain_bytes(world, chunk))
        side = self._streams.for_input(input) if self.settings.side_stream else None
        if side is not None:
            output.record_stream(side)  # written there by wait()
        remote = topo.hosts - 1 if topo.hierarchical else topo.remote_rows
        timing = UnitTiming(unit or plan.key)
        pending = PendingBucket(self, plan, output, op_scale(op, world), codec_group, stats, timing,
                                coder=self._coder(), state=self.state, nonfinite=self.settings.nonfinite, stream=side,
                                remote_rows=remote)
        rows = input.view(world, chunk)
        pending.send(rows, topo)
        self.state.in_flight.append(pending)
        return pending

    @strict.counted
    def poll(self) -> None:
        """Decode every part (of buckets in flight) whose bytes have arrived, without blocking
        (:func:`tagc.hooks.core.eager.poll`)."""
        eager.poll(self.state.in_flight)

    def wait_all(self) -> None:
        """Finish every exchange in flight, oldest first."""
        for pending in list(self.state.in_flight):
            pending.wait()

    # ------------------------------------------------------------------ the traced exchange (tagc.hooks.core.traced)

    def wire_row_bytes(self, segments: Sequence[Segment], chunk: int, world: int, dtype: torch.dtype) -> int:
        """Bytes per rank row of the one tensor :meth:`encode_bucket` returns (every part's wire
        tensors side by side, as bytes). Fixed by the settings, so a compiled graph can hold it."""
        return traced.wire_row_bytes(self.plan(tuple(segments), chunk, world), world, dtype)

    def traceable(self, segments: Sequence[Segment], chunk: int, world: int) -> bool:
        """Whether a bucket can be exchanged in halves around fixed-shape collectives now: its
        settings allow it (:meth:`traceable_settings`) and the warm-up is over (:attr:`warmed_up`)."""
        return self.warmed_up and self.traceable_settings(segments, chunk, world)

    def traceable_settings(self, segments: Sequence[Segment], chunk: int, world: int) -> bool:
        """Whether a bucket's settings allow the traced halves once the dense warm-up is over
        (its wire differs from the steady one): it has compressed parts,
        and no setting needs data-dependent sizes (``fallback="raw"``) — otherwise the whole
        exchange stays one opaque call."""
        return traced.traceable(self.plan(tuple(segments), chunk, world), world)

    @strict.counted
    def encode_bucket(self, packed: torch.Tensor, group, segments: Sequence[Segment]) -> torch.Tensor:
        """First half: every part encoded, its wire tensors side by side as bytes (``uint8 [N, B]``):
        one all-to-all per bucket, whose wait a compiler can move past later compute."""
        self._enter(segments, group, packed.device)
        world = dist.get_world_size(group)
        self.check_codec_world(world)
        rows = packed.view(world, -1)
        plan = self.plan(tuple(segments), rows.shape[1], world)
        self.begin_bucket(plan.key)
        wire, timing = traced.encode_bucket(plan, rows, group, self._coder())
        self.record(ExchangeStats(compress_s=timing.compress_s), None)
        return wire

    @strict.counted
    def decode_bucket(self, received: torch.Tensor, group, segments: Sequence[Segment], chunk: int,
                      dtype: torch.dtype, op=dist.ReduceOp.AVG, topology: Topology | None = None,
                      into: ExchangeStats | None = None) -> torch.Tensor:
        """Second half: every rank's row of :meth:`encode_bucket`'s bytes (row ``j`` from rank ``j``)
        -> this rank's reduced ``chunk`` elements, in ``dtype`` (the packed input's).

        ``topology``: the whole group's, when ``group`` is its cross group (a hierarchical exchange):
        ``op`` then scales over the whole group, and the bytes count its intra-host step.
        ``into``: add the statistics there instead of recording them (a caller that decodes several
        chunks of one exchange records them once)."""
        world = dist.get_world_size(group)
        plan = self.plan(tuple(segments), chunk, world)
        whole = topology if topology is not None and topology.hierarchical else None
        output, stats = traced.decode_bucket(plan, received, group, world, dtype, op, self._coder(), whole,
                                             self.topology(group).remote_rows)
        if into is not None:
            into.add(stats)
        else:
            self.record(stats, None)
        if raises_nonfinite(self.settings.nonfinite, stats):
            raise nonfinite_error(plan.key)
        return output
