"""The exchange engine behind every FSDP adapter: one path, eager or traced, blocking or overlapped.

An adapter hands the hook a bucket: the packed reduce-scatter input (``[N, S]``: row ``j`` is
rank ``j``'s chunk), the output shard, the group, FSDP's reduce op, and the *segments* of a
chunk (each parameter's padded shard). The bucket is cut into *parts*: the columns the
``select`` policy leaves alone go to the plain codec, the selected ones to the hook's codec
(:mod:`tagc.hooks.codecs`), in pieces of at least ``min_part`` elements so part ``k+1`` is
encoded while part ``k`` is on the wire.

* :meth:`TAGCHook.start` encodes every part, launches its all-to-all and returns a
  :class:`PendingBucket` at once; the bytes travel while the caller computes (the rest of the
  backward pass). Each later :meth:`~TAGCHook.start` first decodes the parts of earlier buckets
  whose bytes have arrived (interleaved with the backward pass, on the caller's thread);
  :meth:`PendingBucket.wait` decodes what is left and writes the output.
* A codec with several rounds (``powersgd``: P, then Q) moves each part one round on at every
  later :meth:`~TAGCHook.start` and finishes the rest in :meth:`PendingBucket.wait`: points every
  rank reaches in the same order, never on local arrival (which differs between ranks), so every
  rank issues the same all-to-alls in the same order. Round ``k`` of a bucket travels during
  the next block's backward.
* :meth:`TAGCHook.reduce_scatter` is ``start(...).wait()``: the blocking exchange.
* :meth:`TAGCHook.encode_bucket` / :meth:`TAGCHook.decode_bucket` are the same per-part encode
  and decode around fixed-shape collectives, for a compiled graph (:mod:`tagc.hooks.simple`).

Bytes are counted once, from the codecs' wire shapes, the same for every path.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import pickle
import re
import time
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tagc.config import TAGCConfig
from tagc.hooks import strict
from tagc.hooks.codec_registry import make_codec, resolve_options
from tagc.hooks.codecs import Codec, PlainCodec, Wire
from tagc.hooks.describe import describe, warn_if_weak_selection
from tagc.hooks.hierarchy import Topology, check_hierarchy, group_ranks, host_reduce, resolve_ranks_per_host, topology
from tagc.hooks.local_grads import LocalGradients
from tagc.hooks.segment import Segment
from tagc.hooks.selection import SelectPolicy, resolve_policy
from tagc.hooks.stats import ExchangeStats, plain_bytes
from tagc.hooks.transport import PendingExchange, _peer_errors, all_to_all_rows, backend_of, reduce_scatter_rows

MIN_PART = 1 << 20
"""Compressed columns are split into pipeline parts of at least this many elements. Each part
samples its own threshold (:func:`tagc.sketch.sparsify.row_thresholds`, ~4096/density entries
per row), so parts much smaller than that sample pay a full selection each (how it was chosen:
``docs/results.md``)."""

DENSE_STEPS = 10
"""The dense warm-up of an error-feedback codec when ``dense_steps`` is not given: early gradients
carry large, dense moves that error feedback under Adam would spread over many steps (how 10 was
chosen: ``docs/results.md``)."""

RAMP_STAGES = 4
"""A density ramp (``ramp_steps``) climbs to the ratio in this many equal-length stages (as Deep
Gradient Compression's warm-up does over 4 epochs): each stage is a plan of its own."""


def ramp_stage(steps_into_ramp: int, ramp_steps: int) -> int:
    """The stage (``0 .. RAMP_STAGES - 1``) ``steps_into_ramp`` steps into a ``ramp_steps``-step ramp."""
    return min(RAMP_STAGES - 1, steps_into_ramp * RAMP_STAGES // ramp_steps)


def ramp_ratio(ratio: float, stage: int) -> float:
    """The ratio of stage ``stage`` of a density ramp to ``ratio``: ``ratio ** ((stage + 1) /
    (RAMP_STAGES + 1))``, so the ratio climbs geometrically (ratio 10: 1.58, 2.51, 3.98, 6.31,
    then 10; on 2 ranks a density of 25%, 15%, 9.2%, 5.7%, then 3.6%), and the kept fraction
    falls as DGC's does."""
    return ratio ** ((stage + 1) / (RAMP_STAGES + 1))


NONFINITE = ("propagate", "raise")
PLAIN_CODECS = {"fp32": "plain", "bf16": "bf16", "fp8": "fp8", "int4": "int4"}
"""``plain=`` -> the codec of the columns the ``select`` policy leaves alone (and of a dense
warm-up): ``"fp32"`` sends them as they are (the reduce dtype); the others are the stateless
low-precision peers of :mod:`tagc.hooks.quantized`, summed in float32 at the owner."""


@dataclasses.dataclass
class _Part:
    columns: slice | torch.Tensor
    numel: int
    codec: Codec
    key: str  # the codec's state key: the bucket's parameters and the part's place
    _on_device: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def index(self, device: torch.device) -> slice | torch.Tensor:
        """``columns`` to index a tensor on ``device``: a slice, or the column list copied there once
        (a host index on a GPU tensor would be copied to the device at every use)."""
        if isinstance(self.columns, slice):
            return self.columns
        if device not in self._on_device:
            self._on_device[device] = self.columns.to(device)
        return self._on_device[device]


@dataclasses.dataclass
class _Flight:
    """A part's current exchange round on the wire."""

    part: _Part
    round: int
    exchanges: list[PendingExchange]

    @property
    def last(self) -> bool:
        return self.round == self.part.codec.rounds - 1


@dataclasses.dataclass
class _BucketPlan:
    key: str
    chunk: int
    parts: list[_Part]  # the plain columns first (if any), then the compressed parts
    chosen: tuple[Segment, ...] = ()  # the compressed parameters

    @property
    def compressed_parts(self) -> list[_Part]:
        return [part for part in self.parts if part.codec.compresses]

    @property
    def compressed(self) -> bool:
        return bool(self.compressed_parts)


@dataclasses.dataclass
class UnitTiming:
    """One bucket's exchange in one step, in ``time.perf_counter()`` seconds.

    ``wire_s`` runs from the first launch to the last byte received; ``exposed_s`` is how long
    the caller blocked waiting for those bytes (the rest of ``wire_s`` was hidden behind other
    work); ``events`` are ``(kind, start, end)`` spans on the caller's thread (``compress``,
    ``decode``, ``wait``) and ``wire`` spans of the parts, for a timeline picture.
    """

    unit: str
    wire_bytes: int = 0
    launched: float = 0.0
    arrived: float = 0.0
    exposed_s: float = 0.0
    compress_s: float = 0.0
    decode_s: float = 0.0
    events: list = dataclasses.field(default_factory=list)

    @property
    def wire_s(self) -> float:
        return max(0.0, self.arrived - self.launched)

    def as_dict(self) -> dict:
        return {"unit": self.unit, "wire_bytes": self.wire_bytes, "wire_s": self.wire_s, "exposed_s": self.exposed_s, "compress_s": self.compress_s,
                "decode_s": self.decode_s, "events": list(self.events)}


def op_scale(op, world_size: int) -> Union[float, torch.Tensor]:
    """The factor FSDP's reduce op applies to the sum (SUM 1, AVG 1/N, PREMUL_SUM its factor).

    A PREMUL_SUM factor given as a tensor is returned as that tensor, never read on the host (on a
    GPU that read would wait for the device): :func:`scale_into` applies it on the device."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = op.factor
        return factor if isinstance(factor, torch.Tensor) else float(factor)
    raise ValueError(f"TAGC reduces with SUM, AVG or PREMUL_SUM; got {op}")


def scale_into(output: torch.Tensor, summed: torch.Tensor, scale: Union[float, torch.Tensor]) -> None:
    """``output = summed * scale``, rounded to ``output``'s (reduce) dtype first and scaled in it: FSDP's own order.

    The scale divides as its float64 reciprocal, a Python float or a tensor alike (a tensor scale
    stays where it is: no host read)."""
    output.copy_(summed)
    if isinstance(scale, torch.Tensor):
        output.div_(torch.reciprocal(scale.detach().to(torch.float64)))
    elif scale != 1.0:
        output.div_(1.0 / scale)


def _columns(segments: Sequence[Segment]) -> Optional[torch.Tensor]:
    """A plan's column list, on the host: plans are device-free; :meth:`_Part.index` puts it on the device."""
    if not segments:
        return None
    return torch.cat([torch.arange(s.start, s.start + s.numel, device="cpu") for s in segments])


def _on(stream) -> contextlib.AbstractContextManager:
    """Make ``stream`` (a CUDA side stream, or ``None`` on the CPU) current for the block."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _selector(columns: torch.Tensor) -> slice | torch.Tensor:
    """A slice where ``columns`` are consecutive (indexing by it is a view, not a gather)."""
    if columns.numel() > 1 and not bool((columns[1:] - columns[:-1] == 1).all()):
        return columns
    return slice(int(columns[0]), int(columns[-1]) + 1)


class PendingBucket:
    """One bucket's exchange in flight; :meth:`wait` returns the output shard once it is reduced."""

    def __init__(self, hook: "TAGCHook", plan: _BucketPlan, output: torch.Tensor, scale: Union[float, torch.Tensor],
                 group,
                 stats: ExchangeStats, timing: UnitTiming, stream=None, remote_rows: int = 0) -> None:
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
        self.stream = stream
        """The CUDA side stream this bucket's codec work runs on (``None``: the caller's stream, e.g. on the CPU)."""
        with _on(stream):
            self.summed = torch.zeros(plan.chunk, dtype=torch.float32, device=output.device)
        self._in_flight: collections.deque[_Flight] = collections.deque()
        self.done = False

    def poll(self) -> None:
        """Decode the parts whose last round has arrived, in order, without blocking (never launches)."""
        with _on(self.stream):
            while self._in_flight and self._in_flight[0].last and all(x.is_completed() for x in self._in_flight[0].exchanges):
                self._decode_next()

    def advance(self) -> None:
        """Move every part with rounds left one round on: wait for its current round and launch the
        next. Called only where every rank calls it in the same order (:meth:`TAGCHook.start`,
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
            self.hook._finished(self)
            self.timing.arrived = max(self.timing.arrived, self.timing.launched)
            self.stats.wire_s += self.timing.wire_s
            self.timing.wire_bytes = self.stats.wire_bytes
            self.stats.compress_s = self.timing.compress_s  # encode time, all rounds (the codec adds it to the unit only)
            scale_into(self.output, self.summed, self.scale)
            self.hook._record(self.stats, self.timing)
            raise_nonfinite = self.hook.nonfinite == "raise" and bool(self.stats.nonfinite_parts)  # no host read under "propagate"
        if self.stream is not None:
            torch.cuda.current_stream(self.output.device).wait_stream(self.stream)
        if raise_nonfinite:
            raise FloatingPointError(f"a gradient in TAGC bucket {self.plan.key!r} is NaN/Inf on some rank (nonfinite='raise')")
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
        self.summed[flight.part.index(self.summed.device)] = self.hook._decode_part(flight.part, received, self.group, self.stats, self.timing)

    def _next_round(self, flight: _Flight) -> None:
        received = self._receive(flight.exchanges)
        flight.round += 1
        wires = self.hook._encode_part(flight.part, received, self.group, self.timing, flight.round)
        flight.exchanges = self.hook._launch(wires, self.group, self.stats, self.timing, self.remote_rows)


class TAGCHook:
    """One comm hook: settings, the codecs (and their error-feedback state), statistics.

    Build it with :func:`tagc.hook`; install it with :func:`tagc.register_comm_hook` (FSDP2,
    FSDP1) or ``model.register_comm_hook(hook)`` (SimpleFSDP).

    Memory: the residual of a compressed bucket has the bucket's *unsharded* size (every
    rank keeps what it did not send to each owner), i.e. ``world_size`` times the sharded
    gradient of the compressed parameters, in ``residual_dtype`` (``torch.bfloat16``
    halves it at some loss of what error feedback carries). ``fallback="raw"`` keeps one more
    such copy per bucket during the exchange, to re-send what decode cannot recover exactly.
    With ``overlap=True`` the exchanges of a backward pass are in flight together: their wire
    tensors (about ``1/ratio`` of each compressed bucket, all of a plain one) live until the
    backward pass ends.
    """

    def __init__(
        self,
        config: TAGCConfig,
        select: Union[str, SelectPolicy] = "non_attention_linear",
        nonfinite: str = "propagate",
        residual_dtype: torch.dtype = torch.float32,
        min_part: int = MIN_PART,
        piece_bytes: Optional[int] = None,
        dense_steps: Optional[int] = None,
        codec: str = "tagc",
        overlap: bool = True,
        codec_options: Optional[dict] = None,
        plain: str = "fp32",
        hierarchy: str = "auto",
        ranks_per_host: Optional[int] = None,
        ramp_steps: int = 0,
    ) -> None:
        self.hierarchy = check_hierarchy(hierarchy)
        self.ranks_per_host = resolve_ranks_per_host(ranks_per_host)
        """Global ranks per host (host-major numbering), ``None``: one host (:mod:`tagc.hooks.hierarchy`)."""
        if plain not in PLAIN_CODECS:
            raise ValueError(f"plain must be one of {tuple(PLAIN_CODECS)} (the codec of the columns not sparsified), got {plain!r}")
        if nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE} (see tagc.hooks.codecs), got {nonfinite!r}")
        if residual_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual_dtype must be torch.float32 or torch.bfloat16, got {residual_dtype}")
        if isinstance(min_part, bool) or not isinstance(min_part, int) or min_part < 1:
            raise ValueError(f"min_part must be a positive integer, got {min_part!r}")
        if piece_bytes is not None and (isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int)
                                        or piece_bytes < 1):
            raise ValueError("piece_bytes must be None (pieces on gloo, whole collectives on NCCL) or a positive "
                             f"integer, got {piece_bytes!r}")
        if dense_steps is not None and (isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0):
            raise ValueError(f"dense_steps must be a non-negative integer or None (the codec's default), got {dense_steps!r}")
        if isinstance(ramp_steps, bool) or not isinstance(ramp_steps, int) or ramp_steps < 0:
            raise ValueError(f"ramp_steps must be a non-negative integer, got {ramp_steps!r}")
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        self.config = config
        self.select = resolve_policy(select)
        self.nonfinite = nonfinite
        self.residual_dtype = residual_dtype
        self.min_part = min_part
        self.piece_bytes = piece_bytes
        """Bytes per peer of each all-to-all piece: ``None`` cuts them on gloo only (:mod:`tagc.hooks.transport`)."""
        self.ramp_steps = ramp_steps
        self.overlap = overlap
        self.codec_options = resolve_options(codec, codec_options)
        self.codec = make_codec(codec, config, residual_dtype, self.codec_options)
        self.dense_steps = (DENSE_STEPS if self.codec.error_feedback else 0) if dense_steps is None else dense_steps
        """Steps sent plain first: ``None`` gives :data:`DENSE_STEPS` to error-feedback codecs, 0 to the others."""
        if ramp_steps and not self.codec.uses_ratio:
            raise ValueError(f"ramp_steps ramps a compression ratio; codec {codec!r} has none (ramp_steps applies to tagc and topk)")
        self._codecs_at: dict[float, Codec] = {}
        self.plain_name = plain
        self.plain = make_codec(PLAIN_CODECS[plain], config) if plain != "fp32" else PlainCodec()
        self.step_count = 0  # sets warmed_up too
        self._seen_this_step: set[str] = set()
        self._verified: set[tuple[int, str]] = set()
        self._selection: dict[str, Optional[Union[float, str]]] = {}
        """What ``select`` gives each parameter the hook was bound to (:meth:`note_parameters`)."""
        self._bound = False
        self._fingerprint: Optional[str] = None  # select_fingerprint(), until _selection changes
        self._restored: Optional[set[str]] = None
        """Bucket parts a loaded checkpoint holds codec state for, until the first step after the load."""
        self._selection_checked = False  # warn_if_weak_selection ran (after the first warmed-up step)
        self._restored_select: Optional[str] = None
        self._topologies: dict[tuple[int, ...], Topology] = {}
        self._plans: dict[tuple, _BucketPlan] = {}
        self._in_flight: list[PendingBucket] = []
        self.last_step = ExchangeStats()
        self._current = ExchangeStats()
        self.total = ExchangeStats()
        self.last_units: list[UnitTiming] = []
        self._units: list[UnitTiming] = []
        self.side_stream = True
        """On CUDA, run the codec work on a side stream (:meth:`start`); no effect on the CPU."""
        self._streams: dict = {}
        self.strict_sync = strict.enabled()
        """Count host reads of tensors in the exchange (``TAGC_STRICT_SYNC=1``; :mod:`tagc.hooks.strict`)."""
        self.host_read_sites: collections.Counter[str] = collections.Counter()
        self._counting_reads = False
        self.keep_local_gradients = False
        """Keep each rank's own gradient of its shards of the compressed parameters (:attr:`local_gradients`)
        for :class:`tagc.optim.AdamW`, which sets it."""
        self.local_gradients = LocalGradients()

    # ------------------------------------------------------------------ public

    def __call__(self, unit):
        """SimpleFSDP's comm-hook protocol, ``hook(unit) -> (reduce_scatter, start)``, so that
        ``model.register_comm_hook(tagc.hook(...))`` is the one line on a SimpleFSDP model
        (:func:`tagc.hooks.simple.bind`; ``tagc.register_comm_hook(model, hook)`` does the same)."""
        from tagc.hooks.simple import bind

        return bind(self, unit)

    def stats(self) -> dict:
        """``{"step": n, "last_step": {...}, "total": {...}, "units": [...]}``: bytes this rank put on
        the wire next to what a plain reduce-scatter would send, peel success, NaN/Inf parts, and
        times (codec, wire, exposed) in all and, for the last step, per unit.

        Codecs count on the device; this is where the counts are read (a host synchronisation).
        On CUDA the times are the host's: when work was queued and when the caller waited."""
        self._join_streams()
        return {"step": self.step_count, "last_step": self.last_step.as_dict(), "total": self.total.as_dict(),
                "units": [unit.as_dict() for unit in self.last_units]}

    def describe(self, model: torch.nn.Module) -> str:
        """A table of what this hook does to ``model`` (wrapped by SimpleFSDP, FSDP2 or FSDP1): every
        parameter, compressed or plain, at which ratio and by which codec, and the planned wire bytes
        per step against plain, per unit and in all (:func:`tagc.hooks.describe.describe_plan` gives
        the rows). Runs no collective."""
        return describe(self, model)

    @property
    def residuals(self) -> dict[str, list[torch.Tensor]]:
        """The codec's error-feedback residuals, ``{bucket key: [one [N, part] tensor per part]}``."""
        grouped: dict[str, list[torch.Tensor]] = {}
        for key, value in sorted(getattr(self.codec, "residuals", {}).items(), key=lambda kv: _part_order(kv[0])):
            grouped.setdefault(key.rsplit("/part", 1)[0], []).append(value)
        return grouped

    def settings(self) -> dict:
        """Every setting that changes what crosses the wire, or when: must agree across ranks.

        ``select`` is compared by what it selects (:meth:`select_fingerprint`), not by its name."""
        return {**dataclasses.asdict(self.config), "codec": self.codec.name,
                "codec_options": sorted(self.codec_options.items()), "select": self.select_fingerprint(),
                "min_part": self.min_part,
                "piece_bytes": self.piece_bytes, "dense_steps": self.dense_steps, "ramp_steps": self.ramp_steps, "nonfinite": self.nonfinite,
                "plain": self.plain_name, "hierarchy": self.hierarchy, "ranks_per_host": self.ranks_per_host}

    # ------------------------------------------------------------------ what select selects

    def note_parameters(self, segments: Iterable[Segment]) -> None:
        """Record what ``select`` gives each of these parameters (an adapter calls this with the model's
        parameters when it installs the hook): :meth:`select_fingerprint` is then a digest of those
        answers, so two policies that select differently never pass the settings check as equal,
        whatever their names (two lambdas are both ``<lambda>``)."""
        for segment in segments:
            self._selection[segment.name] = self._answer(segment)
        self._fingerprint = None
        self._bound = True  # a loaded checkpoint's select is compared at the next verify(): adapters bind in steps

    def _answer(self, segment: Segment) -> Optional[Union[float, str]]:
        """``select``'s answer for ``segment``: its ratio, ``None`` (plain), or the repr of an answer
        :meth:`_ratio_of` rejects (it raises when the bucket is planned)."""
        try:
            return self._ratio_of(segment)
        except ValueError:
            return repr(self.select(segment.name, segment.module) if segment.selected is None else segment.selected)

    def select_fingerprint(self) -> str:
        """``select`` by what it selects: a digest of the parameters it compresses and their ratios,
        over the parameters the hook has seen (:meth:`note_parameters`; a hook used directly, without
        an adapter, sees each bucket's segments as it starts). The policy's name while it has seen none,
        or when the codec compresses nothing."""
        if self._fingerprint is None:
            name = self.select.__name__ if hasattr(self.select, "__name__") else repr(self.select)
            if not self._selection or not self.codec.compresses:
                return name
            chosen = sorted((param, answer) for param, answer in self._selection.items() if answer is not None)
            digest = hashlib.sha256(repr(chosen).encode()).hexdigest()[:16]
            total = len(self._selection)
            self._fingerprint = f"{name}: {len(chosen)} of {total} parameters compressed, digest {digest}"
        return self._fingerprint

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The codec's state (this rank's residuals, keyed by rank, bucket and part), the step counter,
        and the settings the keys follow from (``config``; ``select``: :meth:`select_fingerprint`)."""
        self._join_streams()
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {"step": self.step_count, "config": repr(self.config.fingerprint()), "select": self.select_fingerprint(),
                **{f"residual.rank{rank}.{key}": value for key, value in self.codec.state_dict().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Load :meth:`state_dict`'s output, before the first step or later.

        Residuals are keyed by the bucket's compressed parameters and part: a checkpoint whose keys
        this hook would not use is an error, never a silent restart of error feedback from zeros.
        It is raised here when the checkpoint's ``select`` fingerprint differs from this hook's (once
        the hook is installed on its model), else at the first compressed part the checkpoint holds
        no state for."""
        if state.get("config") != repr(self.config.fingerprint()):
            raise ValueError(f"checkpoint was written with TAGC settings {state.get('config')}, this hook has {self.config}")
        self._join_streams()
        rank = dist.get_rank() if dist.is_initialized() else 0
        prefix = f"residual.rank{rank}."
        codec_state = {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}
        self._restored_select = state.get("select")
        self._restored = {_part_key(key) for key in codec_state} or None
        self._check_restored_select()
        self.codec.load_state_dict(codec_state)
        self.step_count = int(state["step"])

    def _check_restored_select(self) -> None:
        """A loaded checkpoint's ``select`` against this hook's, where both are fingerprints of what they select."""
        saved, mine = self._restored_select, self.select_fingerprint()
        if self._restored is None or saved is None or not self._bound or "digest" not in saved or "digest" not in mine:
            return
        if saved != mine:
            raise ValueError(f"this checkpoint's residuals are keyed for select={saved!r}; the hook has "
                             f"select={mine!r}: build the hook with the select policy (and ratios) the checkpoint "
                             "was written with")

    def _check_restored_part(self, part: _Part) -> None:
        """The first steps after a load: a compressed part must find the checkpoint's state for it."""
        if self._restored is None or part.codec is self.plain or part.key in self._restored:
            return
        held = sorted(self._restored)
        raise ValueError(
            f"this checkpoint's residuals are keyed for buckets {held[:4]}{' ...' if len(held) > 4 else ''}; this "
            f"hook compresses bucket part {part.key!r}, for which it holds none (checkpoint "
            f"select={self._restored_select!r}, the hook has select={self.select_fingerprint()!r}): select, its "
            "ratios, min_part or min_compress_numel differ from the hook that wrote it. Build the hook with those "
            "settings, or start without the checkpoint's residuals")

    # ------------------------------------------------------------------ the settings check

    def verify(self, group: Optional[dist.ProcessGroup], device: Optional[torch.device] = None) -> None:
        """Check once per group (and again if the parameters seen grow) that every rank has the same
        settings (a clear error on every rank otherwise).

        The settings travel as bytes in tensors on ``device`` (the exchange's own device: NCCL takes
        no CPU tensor), by two all-gathers on ``group``: no collective on another group or device."""
        if not dist.is_initialized():
            return
        self._check_restored_select()
        key = (id(group), self.select_fingerprint())
        if key in self._verified:
            return
        mine = self.settings()
        everyone = _all_gather_settings(mine, group, device if device is not None else _object_device(group))
        for rank, theirs in enumerate(everyone):
            differ = [f"{name} (this rank {mine[name]!r}, rank {rank} {theirs.get(name)!r})" for name in mine if theirs.get(name) != mine[name]]
            if differ:
                hint = (" (select is compared by what it selects: the policies pick different parameters or ratios)"
                        if any(d.startswith("select ") for d in differ) else "")
                raise ValueError(f"TAGC settings differ across ranks: {'; '.join(differ)}{hint}")
        self._verified.add(key)

    def topology(self, group: Optional[dist.ProcessGroup]) -> Topology:
        """How ``group``'s ranks sit on hosts, cached by its ranks; a hierarchical topology creates its
        subgroups on first use, so every rank of the group must reach this in the same order
        (:meth:`start` after :meth:`verify`, or :func:`tagc.hooks.simple.bind`)."""
        if not dist.is_initialized():
            return Topology(1)
        ranks = group_ranks(group)
        if ranks not in self._topologies:
            self._topologies[ranks] = topology(group, self.hierarchy, self.ranks_per_host)
        return self._topologies[ranks]

    def _note_bucket(self, segments: Sequence[Segment]) -> None:
        """A hook no adapter bound to a model (:meth:`note_parameters`) fingerprints ``select`` by the
        buckets it starts (host work on the first step of each bucket only)."""
        if self.codec.compresses and any(s.name not in self._selection for s in segments):
            for segment in segments:
                self._selection.setdefault(segment.name, self._answer(segment))
            self._fingerprint = None

    def _check_codec_world(self, world: int) -> None:
        """``index_bits=4`` counts the ranks of the codec's exchange (the hosts, when hierarchical) in 4 bits."""
        if self.config.index_bits == 4 and world > 15:
            raise ValueError(f"index_bits=4 counts ranks in 4 bits and is exact for at most 15 ranks; this exchange has {world}: use index_bits=1")

    # ------------------------------------------------------------------ the exchange

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], op,
                       segments: Sequence[Segment], unit: Optional[str] = None) -> None:
        """Write into ``output`` (one chunk) FSDP's reduce op over ranks of ``input``'s chunk (blocking)."""
        self.start(output, input, group, op, segments, unit).wait()

    @strict.counted
    def start(self, output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup], op,
              segments: Sequence[Segment], unit: Optional[str] = None, keep_local: bool = True) -> PendingBucket:
        """Encode ``input``'s parts and launch their exchange; :meth:`PendingBucket.wait` finishes it.

        Earlier buckets' parts whose bytes have arrived are decoded first, and their multi-round
        parts move one round on. Every rank must start the same buckets in the same order (FSDP's
        backward order is the same on every rank).

        On CUDA (``side_stream``) the codec work runs on a side stream of the hook's: it waits for
        the caller's stream (where ``input`` was produced) with an event, then encodes part after
        part and launches each part's all-to-all from the side stream, so NCCL waits only for that
        part's encode: part ``k+1`` is encoded while part ``k`` is on the wire, and the caller's
        stream (the next backward) runs on meanwhile. ``input`` and ``output`` are marked
        (``record_stream``) as used on the side stream.

        ``keep_local=False``: the segments are pieces of parameters (an all-reduce cut into pieces), so
        this rank's row is not its own shard: the caller keeps :attr:`local_gradients` itself.
        """
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        chunk = input.numel() // world
        if chunk * world != input.numel() or output.numel() != chunk:
            raise ValueError(f"reduce-scatter input of {input.numel()} elements does not split into {world} chunks of {output.numel()}")
        if not self._bound:
            self._note_bucket(segments)
        self.verify(group, input.device)
        topo = self.topology(group) if world > 1 else Topology(world)
        # hierarchical: the codec exchanges the host-reduced block over the cross group, planned for H ranks
        codec_group, codec_world = (topo.cross, topo.hosts) if topo.hierarchical else (group, world)
        self._check_codec_world(codec_world)
        self.poll()
        for earlier in list(self._in_flight):  # the same point, the same order on every rank
            earlier.advance()
        plan = self._plan(tuple(segments), chunk, codec_world)
        self._begin_bucket(plan.key)
        if self.step_count < self.dense_steps:  # dense warm-up: the whole bucket goes plain
            plan = self._plain_plan(plan.key, chunk)
        elif self.warming_up:  # density ramp: the same parts (and residuals) at this stage's ratios
            plan = self._plan(tuple(segments), chunk, codec_world, self.step_count - self.dense_steps)
        stats = ExchangeStats(buckets=1, compressed_buckets=int(plan.compressed), plain_equivalent_bytes=plain_bytes(world, chunk))
        timing = UnitTiming(unit or plan.key)
        side = self._side_stream(input)
        if side is not None:
            output.record_stream(side)  # written there by wait()
        remote = topo.hosts - 1 if topo.hierarchical else topo.remote_rows
        pending = PendingBucket(self, plan, output, op_scale(op, world), codec_group, stats, timing, stream=side, remote_rows=remote)
        rows = input.view(world, chunk)
        if keep_local and self.keep_local_gradients and plan.compressed:
            own = dist.get_rank(group) if world > 1 else 0
            self.local_gradients.keep(plan.chosen, rows[own], op_scale(op, world) * world)
        with _on(side):
            if world == 1:
                pending.summed.copy_(rows[0])
            else:
                if topo.hierarchical:  # step 1, plain and blocking (the fast intra-host links): exposed time
                    begin = time.perf_counter()
                    rows, sent = host_reduce(rows, topo, self.piece_bytes)
                    end = time.perf_counter()
                    stats.wire_bytes += sent
                    stats.exposed_s += end - begin
                    timing.exposed_s += end - begin
                    timing.events.append(("wait", begin, end))  # the caller blocked on bytes, as in a wait
                for part in plan.parts:
                    wires = self._encode_part(part, rows[:, part.index(rows.device)], codec_group, timing)
                    launched = self._launch(wires, codec_group, stats, timing, remote, summed=part.codec.summed_rows)
                    pending._in_flight.append(_Flight(part, 0, launched))
        self._in_flight.append(pending)
        return pending

    def _side_stream(self, input: torch.Tensor):
        """The side stream for a bucket on ``input``'s device, made to wait for the caller's stream;
        ``None`` off CUDA (or with ``side_stream=False``): the CPU path is unchanged."""
        if not self.side_stream or input.device.type != "cuda":
            return None
        device = input.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the gradient is ready on the caller's stream
        input.record_stream(stream)  # read there after the caller may have freed it
        return stream

    def _join_streams(self) -> None:
        """Make the caller's current stream wait for the side streams (before reading what they wrote)."""
        for device, stream in self._streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)

    def _note_host_reads(self, reads: "strict.HostReads") -> None:
        for stats in (self._current, self.total):
            stats.host_reads += reads.count
            stats.backend_host_reads += reads.backend
        self.host_read_sites.update(reads.sites)

    @strict.counted
    def poll(self) -> None:
        """Decode every part (of buckets in flight) whose bytes have arrived, without blocking.

        Codecs whose decode is a collective (``fallback="raw"``) decode only in ``wait()``,
        where every rank decodes in the same order."""
        for pending in list(self._in_flight):
            if pending.plan.parts and not all(part.codec.overlappable() for part in pending.plan.parts):
                return
            pending.poll()

    def keep_local(self, segments: Sequence[Segment], pieces: Sequence[Segment], chunk: int, world: int,
                   gradient: torch.Tensor, factor: Union[float, torch.Tensor]) -> None:
        """For an exchange cut into ``pieces`` (an all-reduce): keep ``gradient`` (the whole of this rank's
        ``segments``, not a piece) for the parameters the steady plan of ``pieces`` compresses, when this
        step compresses (:attr:`keep_local_gradients`; :class:`tagc.hooks.local_grads.LocalGradients`)."""
        if not self.keep_local_gradients or self.step_count < self.dense_steps:
            return
        compressed = {s.name for s in self._plan(tuple(pieces), chunk, world).chosen}
        self.local_gradients.keep([s for s in segments if s.name in compressed], gradient, factor)

    def wait_all(self) -> None:
        """Finish every exchange in flight, oldest first."""
        for pending in list(self._in_flight):
            pending.wait()

    def _finished(self, pending: PendingBucket) -> None:
        self._in_flight.remove(pending)

    def _launch(self, wires: Sequence[torch.Tensor], group, stats: ExchangeStats, timing: UnitTiming,
                remote_rows: int = 0, summed: bool = False) -> list[PendingExchange]:
        """Start every wire tensor's all-to-all; ``remote_rows`` of its rows go to other hosts.

        ``summed``: the codec's decode only sums the rows it receives (:attr:`Codec.summed_rows`), so the
        transport may reduce on the wire (NCCL's reduce-scatter: :func:`tagc.hooks.transport.reduce_scatter_rows`)."""
        send = reduce_scatter_rows if summed else all_to_all_rows
        exchanges = [send(w, group, self.piece_bytes) for w in wires]
        if exchanges:
            timing.launched = timing.launched or exchanges[0].launched
        stats.wire_bytes += sum(x.sent_bytes for x in exchanges)
        stats.inter_host_bytes += sum(remote_rows * w.shape[1] * w.element_size() for w in wires)
        return exchanges

    def _encode_part(self, part: _Part, grad, group, timing: UnitTiming, round: int = 0) -> tuple[torch.Tensor, ...]:
        """Round 0: ``grad`` is this rank's rows; a later round: what the previous round received."""
        if round == 0:
            self._check_restored_part(part)
        start = time.perf_counter()
        wires = part.codec.encode(grad, part.key, group) if round == 0 else part.codec.next_round(round, grad, part.key, group)
        if part.codec.compresses:
            end = time.perf_counter()
            timing.compress_s += end - start
            timing.events.append(("compress", start, end))
        return wires

    def _decode_part(self, part: _Part, received: Sequence[torch.Tensor], group, stats: ExchangeStats,
                     timing: Optional[UnitTiming] = None) -> torch.Tensor:
        start = time.perf_counter()
        values = part.codec.decode(received, part.numel, part.key, group, stats)
        if part.codec.compresses:
            end = time.perf_counter()
            stats.decode_s += end - start
            if timing is not None:
                timing.decode_s += end - start
                timing.events.append(("decode", start, end))
        return values

    # ------------------------------------------------------------------ the exchange in halves (traced path)

    def wire_row_bytes(self, segments: Sequence[Segment], chunk: int, world: int, dtype: torch.dtype) -> int:
        """Bytes per rank row of the one tensor :meth:`encode_bucket` returns (every part's wire
        tensors side by side, as bytes). Fixed by the settings, so a compiled graph can hold it."""
        return sum(wire.row_bytes for wire in self._wires(self._plan(tuple(segments), chunk, world), world, dtype))

    def _wires(self, plan: _BucketPlan, world: int, dtype: torch.dtype) -> list[Wire]:
        return [wire for part in plan.parts for wire in part.codec.wire(part.numel, world, dtype)]

    def traceable(self, segments: Sequence[Segment], chunk: int, world: int) -> bool:
        """Whether a bucket can be exchanged in halves around fixed-shape collectives now: its
        settings allow it (:meth:`traceable_settings`) and the warm-up is over (:attr:`warmed_up`)."""
        return self.warmed_up and self.traceable_settings(segments, chunk, world)

    def traceable_settings(self, segments: Sequence[Segment], chunk: int, world: int) -> bool:
        """Whether a bucket's settings allow the traced halves once the dense warm-up and the
        density ramp are over (their wire changes from step to step): it has compressed parts,
        and no setting needs data-dependent sizes (``fallback="raw"``) — otherwise the whole
        exchange stays one opaque call."""
        plan = self._plan(tuple(segments), chunk, world)
        return world > 1 and plan.compressed and all(p.codec.traceable() for p in plan.parts)

    @strict.counted
    def encode_bucket(self, packed: torch.Tensor, group, segments: Sequence[Segment],
                      local_factor: Optional[float] = 1.0) -> torch.Tensor:
        """First half: every part encoded, its wire tensors side by side as bytes (``uint8 [N, B]``):
        one all-to-all per bucket, whose wait a compiler can move past later compute.

        ``local_factor``: what puts this rank's row on the scale of the averaged result, for
        :attr:`local_gradients` (1 for a packed gradient); ``None``: the row is not this rank's own
        gradient (pieces, or a host's sum), as ``keep_local=False`` in :meth:`start`."""
        if not self._bound:
            self._note_bucket(segments)
        self.verify(group, packed.device)
        world = dist.get_world_size(group)
        self._check_codec_world(world)
        rows = packed.view(world, -1)
        plan = self._plan(tuple(segments), rows.shape[1], world)
        self._begin_bucket(plan.key)
        if local_factor is not None and self.keep_local_gradients and plan.compressed:
            self.local_gradients.keep(plan.chosen, rows[dist.get_rank(group)], local_factor)
        timing = UnitTiming(plan.key)
        wires = [w.contiguous().view(torch.uint8) for part in plan.parts
                 for w in self._encode_part(part, rows[:, part.index(rows.device)], group, timing)]
        self._record(ExchangeStats(compress_s=timing.compress_s), None)
        return torch.cat(wires, dim=1)

    @strict.counted
    def decode_bucket(self, received: torch.Tensor, group, segments: Sequence[Segment], chunk: int,
                      dtype: torch.dtype, op=dist.ReduceOp.AVG, topology: Optional[Topology] = None,
                      into: Optional[ExchangeStats] = None) -> torch.Tensor:
        """Second half: every rank's row of :meth:`encode_bucket`'s bytes (row ``j`` from rank ``j``)
        -> this rank's reduced ``chunk`` elements, in ``dtype`` (the packed input's).

        ``topology``: the whole group's, when ``group`` is its cross group (a hierarchical exchange):
        ``op`` then scales over the whole group, and the bytes count its intra-host step.
        ``into``: add the statistics there instead of recording them (a caller that decodes several
        chunks of one exchange records them once)."""
        world = dist.get_world_size(group)
        plan = self._plan(tuple(segments), chunk, world)
        whole = topology if topology is not None and topology.hierarchical else None
        full = whole.world if whole is not None else world
        stats = ExchangeStats(buckets=1, compressed_buckets=1, plain_equivalent_bytes=plain_bytes(full, chunk),
                              wire_bytes=(world - 1) * received.shape[1] + (whole.step1_bytes(chunk, dtype) if whole is not None else 0),
                              inter_host_bytes=self.topology(group).remote_rows * received.shape[1])
        summed = torch.zeros(chunk, dtype=torch.float32, device=received.device)
        at = 0
        for part in plan.parts:
            part_received = []
            for wire in part.codec.wire(part.numel, world, dtype):
                part_received.append(received[:, at : at + wire.row_bytes].contiguous().view(wire.dtype))
                at += wire.row_bytes
            summed[part.index(summed.device)] = self._decode_part(part, part_received, group, stats)
        output = torch.empty(chunk, dtype=dtype, device=summed.device)
        scale_into(output, summed, op_scale(op, full))
        if into is not None:
            into.add(stats)
        else:
            self._record(stats, None)
        if self.nonfinite == "raise" and bool(stats.nonfinite_parts):  # no host read under "propagate"
            raise FloatingPointError(f"a gradient in TAGC bucket {plan.key!r} is NaN/Inf on some rank (nonfinite='raise')")
        return output

    # ------------------------------------------------------------------ bookkeeping

    def _record(self, stats: ExchangeStats, timing: Optional[UnitTiming]) -> None:
        self._current.add(stats)
        self.total.add(stats)
        if timing is not None:
            self._units.append(timing)

    def end_step(self) -> None:
        """Close this step's statistics (``stats()["last_step"]``, ``stats()["units"]``). Optional: a
        bucket seen twice also starts a new step, but calling this after ``optimizer.step()`` is
        exact, e.g. with gradient accumulation."""
        if self._restored is not None and self.step_count >= self.dense_steps:
            self._restored = None  # a compressed step ran: every part found its state
        if not self._selection_checked and not self.warming_up:  # the first warmed-up step planned every bucket
            self._selection_checked = True
            warn_if_weak_selection(self)
        self.step_count += 1
        self.last_step = self._current
        self.last_units = self._units
        self._current = ExchangeStats()
        self._units = []
        self._seen_this_step.clear()

    def _begin_bucket(self, key: str) -> None:
        if key in self._seen_this_step:  # a bucket repeats: a new step began
            self.end_step()
        self._seen_this_step.add(key)

    def _plain_plan(self, key: str, chunk: int) -> _BucketPlan:
        return _BucketPlan(key=key, chunk=chunk, parts=[_Part(slice(0, chunk), chunk, self.plain, f"{key}/plain")])

    @property
    def step_count(self) -> int:
        """Steps completed (:meth:`end_step`)."""
        return self._step_count

    @step_count.setter
    def step_count(self, step: int) -> None:
        self._step_count = step
        self.warmed_up = not self.warming_up
        """Whether the dense warm-up and the density ramp are over: a plain attribute, kept with the
        step, so that a compiled graph guards on it (one graph for the warm-up, one for after it)."""

    @property
    def warming_up(self) -> bool:
        """Whether this step is in the dense warm-up or the density ramp (the bucket's wire differs)."""
        return self.step_count < self.dense_steps + self.ramp_steps

    def _plan(self, segments: tuple[Segment, ...], chunk: int, world: int, steps_into_ramp: Optional[int] = None) -> _BucketPlan:
        """The bucket's plan; ``steps_into_ramp``: the density ramp's plan for that step (its stage's ratios)."""
        stage = None if steps_into_ramp is None else ramp_stage(steps_into_ramp, self.ramp_steps)
        cache_key = (segments, chunk, world, stage)
        if cache_key not in self._plans:
            at = (lambda ratio: ratio) if stage is None else (lambda ratio: ramp_ratio(ratio, stage))
            self._plans[cache_key] = self._make_plan(segments, chunk, world, at)
        return self._plans[cache_key]

    def _codec_at(self, ratio: float) -> Codec:
        """The hook's codec at ``ratio`` (one object per ratio, all sharing the codec's state)."""
        if ratio not in self._codecs_at:
            self._codecs_at[ratio] = self.codec.at_ratio(ratio)
        return self._codecs_at[ratio]

    def _ratio_of(self, segment: Segment) -> Optional[float]:
        """``None``: the segment goes plain; else its compression ratio: the config's, or the one
        the ``select`` policy gave it (a number)."""
        chosen = self.select(segment.name, segment.module) if segment.selected is None else segment.selected
        if isinstance(chosen, bool) or chosen is None:
            return self.config.ratio if chosen else None
        if not isinstance(chosen, (int, float)) or not 1.0 < float(chosen) < float("inf"):
            raise ValueError(f"select returned {chosen!r} for {segment.name!r}: return True/False, or a compression ratio > 1")
        if not self.codec.uses_ratio:
            raise ValueError(f"select returned the ratio {chosen!r} for {segment.name!r}, but codec {self.codec.name!r} has no "
                             "ratio: return True/False (per-parameter ratios apply to tagc and topk)")
        return float(chosen)

    def _make_plan(self, segments: tuple[Segment, ...], chunk: int, world: int, at=lambda ratio: ratio) -> _BucketPlan:
        covered = sum(s.numel for s in segments)
        if covered > chunk:
            raise ValueError(f"segments cover {covered} elements of a {chunk}-element chunk")
        tail = [Segment("<padding>", covered, chunk - covered)] if covered < chunk else []
        ratios = {}
        if self.codec.compresses:
            ratios = {s: ratio for s in segments if (ratio := self._ratio_of(s)) is not None}
        chosen = list(ratios)
        compressed = sum(s.numel for s in chosen)
        if compressed < max(1, self.config.min_compress_numel):
            chosen, compressed = [], 0
        rest = [s for s in segments if s not in chosen] + tail
        key = f"{'|'.join(s.name for s in chosen) or '|'.join(s.name for s in segments)}#{chunk}"
        parts = []
        plain = _columns(rest)
        if plain is not None:
            parts.append(_Part(_selector(plain), plain.numel(), self.plain, f"{key}/plain"))
        if chosen and self.codec.whole_segments:  # one part: every selected parameter, whole
            at = [0] + list(itertools.accumulate(s.numel for s in chosen))
            self.codec.prepare(f"{key}/part0", [dataclasses.replace(s, start=a) for s, a in zip(chosen, at)], world)
            parts.append(_Part(_selector(_columns(chosen)), compressed, self.codec, f"{key}/part0"))
        elif chosen:  # the config's ratio first, then each other ratio in order of first use
            numbered = itertools.count()
            for ratio in dict.fromkeys(sorted(ratios.values(), key=lambda r: r != self.config.ratio)):
                group = [s for s in chosen if ratios[s] == ratio]
                columns = _columns(group)
                numel = columns.numel()
                n_parts = max(1, numel // self.min_part)
                bounds = [round(i * numel / n_parts) for i in range(n_parts + 1)]
                codec = self._codec_at(at(ratio))
                for a, b in zip(bounds, bounds[1:]):
                    parts.append(_Part(_selector(columns[a:b]), b - a, codec, f"{key}/part{next(numbered)}"))
        return _BucketPlan(key=key, chunk=chunk, parts=parts, chosen=tuple(chosen))


_PART_KEY = re.compile(r"^(.*?/part\d+)(?=$|[/#])")


def _part_key(state_key: str) -> str:
    """The bucket part a codec state entry belongs to: codecs key their state by the part's key
    (``"<parameters>#<chunk>/part<k>"``), some with a suffix (``/residual``, ``#steps``, ...)."""
    match = _PART_KEY.match(state_key)
    return match.group(1) if match else state_key


def _object_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where :meth:`TAGCHook.verify` puts its bytes when the caller names no device: the CPU on a gloo
    group, else this rank's current CUDA device."""
    if backend_of(group, torch.device("cpu")) == "gloo" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _all_gather_settings(settings: dict, group: Optional[dist.ProcessGroup], device: torch.device) -> list[dict]:
    """Every rank's ``settings`` (by group rank), through two all-gathers of tensors on ``device``:
    the lengths, then the pickled bytes padded to the longest. Once per group: its host reads are
    the settings check's, not the exchange's."""
    world = dist.get_world_size(group)
    payload = pickle.dumps(settings)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    length = torch.full((1,), len(payload), dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    with _peer_errors():
        dist.all_gather(lengths, length, group=group)
        sizes = torch.cat(lengths).cpu().tolist()
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
        padded[: len(payload)] = data
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=group)
    return [pickle.loads(row[:size].cpu().numpy().tobytes()) for row, size in zip(gathered, sizes)]


def _part_order(key: str) -> tuple[str, int]:
    bucket, _, index = key.rpartition("/part")
    return bucket, int(index) if index.isdigit() else -1
