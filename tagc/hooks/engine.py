"""The compressed reduce-scatter (DESIGN.md §2 items 1-9) behind every FSDP adapter.

An adapter hands :meth:`TAGCHook.reduce_scatter` the packed input (``[N, S]``: row ``j`` is
rank ``j``'s chunk), the output shard, the group, FSDP's reduce op, and the *segments* of a
chunk (each parameter's padded shard). Selected segments are compressed (error feedback,
threshold, index + sketch, exact OR / count-sum index exchange, summed sketches, decode);
the rest go through the fair plain exchange in the same step. The compressed columns are
cut into parts with their own layouts so part ``k+1`` is compressed while part ``k`` is on
the wire, and part ``k`` is decoded while later parts are still in flight.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc.config import TAGCConfig
from tagc.hooks.selection import SelectPolicy, resolve_policy
from tagc.hooks.stats import ExchangeStats
from tagc.hooks.transport import PIECE_BYTES, all_to_all_rows, any_rank, gather_from_owners, plain_reduce_scatter
from tagc.kernels.dispatch import compress_, decode
from tagc.sketch import SketchLayout
from tagc.sketch.index import merge_index

MIN_PART = 1 << 20
"""Compressed columns are split into pipeline parts of at least this many elements. Each part
samples its own threshold (:func:`tagc.sketch.sparsify.row_thresholds`, ~4096/density
entries per row), so parts much smaller than that sample pay a full selection each: 2^20
measured 30% cheaper compression than 2^18 on GPT-2 small, with the same step time at 2^21-2^22."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """One parameter's padded shard inside every rank's chunk."""

    name: str
    start: int
    numel: int
    module: Optional[nn.Module] = dataclasses.field(default=None, compare=False, hash=False)
    selected: Optional[bool] = None
    """Whether to compress it, when the adapter decided already; ``None`` asks the hook's policy."""


@dataclasses.dataclass
class _Part:
    columns: slice | torch.Tensor
    layout: SketchLayout


@dataclasses.dataclass
class _BucketPlan:
    key: str
    chunk: int
    plain_columns: Optional[slice | torch.Tensor]
    parts: list[_Part]


def op_scale(op, world_size: int) -> float:
    """The factor FSDP's reduce op applies to the sum (SUM 1, AVG 1/N, PREMUL_SUM its factor)."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = op.factor
        return float(factor.item() if isinstance(factor, torch.Tensor) else factor)
    raise ValueError(f"TAGC reduces with SUM, AVG or PREMUL_SUM; got {op}")


def _finite(x: torch.Tensor) -> bool:
    """No NaN/Inf in ``x``: one min/max pass (NaN propagates), no mask the size of ``x``."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _any_nonfinite(grads: Sequence[torch.Tensor]) -> bool:
    """Whether any of a bucket's compressed parts holds a NaN/Inf on this rank."""
    return any(not _finite(grad) for grad in grads)


def _scale_into(output: torch.Tensor, summed: torch.Tensor, scale: float) -> None:
    """``output = summed * scale``, rounded to ``output``'s (reduce) dtype first and scaled in it: FSDP's own order."""
    output.copy_(summed)
    if scale != 1.0:
        output.div_(1.0 / scale)


def _columns(segments: Sequence[Segment]) -> Optional[torch.Tensor]:
    if not segments:
        return None
    return torch.cat([torch.arange(s.start, s.start + s.numel) for s in segments])


def _selector(columns: torch.Tensor) -> slice | torch.Tensor:
    """A slice where ``columns`` are consecutive (indexing by it is a view, not a gather)."""
    if columns.numel() > 1 and not bool((columns[1:] - columns[:-1] == 1).all()):
        return columns
    return slice(int(columns[0]), int(columns[-1]) + 1)


def _count(columns: slice | torch.Tensor) -> int:
    return columns.stop - columns.start if isinstance(columns, slice) else columns.numel()


class TAGCHook:
    """One TAGC comm hook: settings, error-feedback residuals and statistics.

    Build it with :func:`tagc.hook`; install it with :func:`tagc.register_comm_hook` (FSDP2,
    FSDP1) or ``model.register_comm_hook`` (SimpleFSDP).

    Memory: the residual of a compressed bucket has the bucket's *unsharded* size (every
    rank keeps what it did not send to each owner), i.e. ``world_size`` times the sharded
    gradient of the compressed parameters, in ``residual_dtype`` (``torch.bfloat16``
    halves it at some loss of what error feedback carries). ``fallback="raw"`` keeps one more
    such copy per bucket during the exchange, to re-send what decode cannot recover exactly
    (one small gather per part: counts, positions, then the values).
    """

    def __init__(
        self,
        config: TAGCConfig,
        select: Union[str, SelectPolicy] = "non_attention_linear",
        nonfinite: str = "plain",
        residual_dtype: torch.dtype = torch.float32,
        min_part: int = MIN_PART,
        piece_bytes: int = PIECE_BYTES,
        dense_steps: int = 0,
    ) -> None:
        if nonfinite not in ("plain", "raise"):
            raise ValueError(f"nonfinite must be 'plain' (send the bucket uncompressed) or 'raise', got {nonfinite!r}")
        if residual_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual_dtype must be torch.float32 or torch.bfloat16, got {residual_dtype}")
        if not isinstance(min_part, int) or min_part < 1:
            raise ValueError(f"min_part must be a positive integer, got {min_part!r}")
        if not isinstance(dense_steps, int) or dense_steps < 0:
            raise ValueError(f"dense_steps must be a non-negative integer, got {dense_steps!r}")
        self.config = config
        self.select = resolve_policy(select)
        self.nonfinite = nonfinite
        self.residual_dtype = residual_dtype
        self.min_part = min_part
        self.piece_bytes = piece_bytes
        self.dense_steps = dense_steps
        self.residuals: dict[str, list[torch.Tensor]] = {}  # bucket key -> one [N, part] tensor per part
        self.step_count = 0
        self._seen_this_step: set[str] = set()
        self._verified: set[int] = set()
        self.last_step = ExchangeStats()
        self._current = ExchangeStats()
        self.total = ExchangeStats()

    # ------------------------------------------------------------------ public

    def stats(self) -> dict:
        """``{"step": n, "last_step": {...}, "total": {...}}``: bytes this rank put on the wire
        next to what a plain reduce-scatter would send, peel success, fallbacks, times."""
        return {"step": self.step_count, "last_step": self.last_step.as_dict(), "total": self.total.as_dict()}

    def state_dict(self) -> dict:
        """Residuals (this rank's, keyed by bucket and rank) and the step counter."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {
            "step": self.step_count,
            "config": repr(self.config.fingerprint()),
            **{
                f"residual.rank{rank}.{key}.part{i}": part
                for key, parts in self.residuals.items()
                for i, part in enumerate(parts)
            },
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != repr(self.config.fingerprint()):
            raise ValueError(f"checkpoint was written with TAGC settings {state.get('config')}, this hook has {self.config}")
        rank = dist.get_rank() if dist.is_initialized() else 0
        prefix = f"residual.rank{rank}."
        residuals: dict[str, list[torch.Tensor]] = {}
        for name, value in sorted(state.items(), key=lambda kv: kv[0]):
            if name.startswith(prefix):
                key, part = name[len(prefix) :].rsplit(".part", 1)
                residuals.setdefault(key, []).insert(int(part), value.clone())
        self.step_count = int(state["step"])
        self.residuals = residuals

    def verify(self, group: Optional[dist.ProcessGroup]) -> None:
        """Check once per group that every rank has the same settings (clear error otherwise)."""
        if id(group) in self._verified or not dist.is_initialized():
            return
        world = dist.get_world_size(group)
        if self.config.index_bits == 4 and world > 15:
            raise ValueError(f"index_bits=4 counts ranks in 4 bits and is exact for at most 15 ranks; this group has {world}: use index_bits=1")
        mine = (self.config.fingerprint(), self.select.__name__ if hasattr(self.select, "__name__") else repr(self.select))
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError(f"TAGC settings differ across ranks: this rank has {mine}, rank {rank} has {theirs}")
        self._verified.add(id(group))

    # ------------------------------------------------------------------ the exchange

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Optional[dist.ProcessGroup],
        op,
        segments: Sequence[Segment],
    ) -> None:
        """Write into ``output`` (one chunk) FSDP's reduce op over ranks of ``input``'s chunk."""
        world = dist.get_world_size(group)
        chunk = input.numel() // world
        if chunk * world != input.numel() or output.numel() != chunk:
            raise ValueError(f"reduce-scatter input of {input.numel()} elements does not split into {world} chunks of {output.numel()}")
        scale = op_scale(op, world)
        rows = input.view(world, chunk)
        if world == 1:
            output.copy_(rows[0] * scale)
            return
        self.verify(group)
        plan = self._plan(tuple(segments), chunk, world)
        self._begin_bucket(plan.key)
        if self.step_count < self.dense_steps:  # dense warm-up: the whole bucket goes plain
            plan = _BucketPlan(key=plan.key, chunk=chunk, plain_columns=slice(0, chunk), parts=[])
        stats = ExchangeStats(buckets=1, plain_equivalent_bytes=(world - 1) * chunk * 4)
        summed = torch.zeros(chunk, dtype=torch.float32, device=input.device)

        grads = [rows[:, part.columns] for part in plan.parts]  # views where the part's columns are contiguous
        bad = False
        if grads:  # agree on NaN/Inf before the plain columns queue up on the group (the flag would wait behind them)
            start = time.perf_counter()
            bad = any_rank(_any_nonfinite(grads), group)
            stats.comm_wait_s += time.perf_counter() - start
        plain_pending = None
        if plan.plain_columns is not None:
            plain_pending = all_to_all_rows(rows[:, plan.plain_columns], group, self.piece_bytes)
            stats.wire_bytes += plain_pending.sent_bytes
        if grads and bad:
            self._nonfinite(grads, plan, group, summed, stats)
        elif grads:
            self._compressed(grads, plan, group, world, summed, stats)
        if plain_pending is not None:
            start = time.perf_counter()
            summed[plan.plain_columns] = plain_pending.wait().sum(dim=0, dtype=torch.float32)
            stats.comm_wait_s += time.perf_counter() - start
        _scale_into(output, summed, scale)
        self._record(stats)

    def _compressed(self, grads: list[torch.Tensor], plan: _BucketPlan, group, world: int, summed: torch.Tensor,
                    stats: ExchangeStats) -> None:
        start = time.perf_counter()
        residuals = self._residuals(plan, grads)
        density = self.config.density(world)
        bits = self.config.index_bits
        pending = []
        resend = self.config.fallback == "raw"
        accumulated = []  # with fallback="raw": grad + residual, to re-send what decode cannot recover
        for grad, residual, part in zip(grads, residuals, plan.parts):
            if resend:
                accumulated.append(residual.clone().add_(grad))
            index, table = compress_(grad, residual, density, part.layout, bits)
            pending.append((all_to_all_rows(index, group, self.piece_bytes), all_to_all_rows(table, group, self.piece_bytes)))
            stats.wire_bytes += pending[-1][0].sent_bytes + pending[-1][1].sent_bytes
        stats.compress_s += time.perf_counter() - start
        for i, ((index_x, table_x), part) in enumerate(zip(pending, plan.parts)):
            start = time.perf_counter()
            indexes, tables = index_x.wait(), table_x.wait()
            stats.comm_wait_s += time.perf_counter() - start
            values, decoded = self._decode_part(indexes, tables, part, stats)
            if resend:  # every rank takes part, also with nothing to ask for
                start = time.perf_counter()
                wanted = decoded.raw_positions if decoded.raw_positions is not None else torch.zeros(0, dtype=torch.int64)
                raw_values, sent = gather_from_owners(wanted, accumulated[i] - residuals[i], group)
                values[wanted] = raw_values
                stats.wire_bytes += sent
                stats.raw += int(decoded.raw)
                stats.comm_wait_s += time.perf_counter() - start
            summed[part.columns] = values
        stats.compressed_buckets += 1

    def _decode_part(self, indexes: torch.Tensor, tables: torch.Tensor, part: _Part, stats: ExchangeStats):
        """Every rank's index and table of one part (``[N, ...]``) -> the decoded sum and its stats."""
        start = time.perf_counter()
        bits = self.config.index_bits
        union = functools.reduce(lambda a, b: merge_index(a, b, bits), indexes.unbind(0))
        values, decoded = decode(tables.sum(dim=0), union, part.layout, bits, fallback=self.config.fallback)
        stats.decode_s += time.perf_counter() - start
        stats.support += int(decoded.support)
        stats.peeled += int(decoded.peeled)
        stats.unpeeled += int(decoded.unpeeled)
        stats.estimated += int(decoded.estimated)
        return values, decoded

    # ------------------------------------------------------------------ the exchange in halves (traced path)

    def wire_shapes(self, segments: Sequence[Segment], chunk: int, world: int) -> tuple[int, int, int]:
        """Columns per rank row of the three tensors :meth:`encode_bucket` returns: plain values,
        index bytes, sketch cells. Fixed by the settings, so a compiled graph can hold them."""
        plan = self._plan(tuple(segments), chunk, world)
        plain = 0 if plan.plain_columns is None else _count(plan.plain_columns)
        columns = [self._wire_columns(part) for part in plan.parts]
        return plain, sum(index for index, _ in columns), sum(table for _, table in columns)

    def _wire_columns(self, part: _Part) -> tuple[int, int]:
        """(index bytes, sketch cells) a part puts in each rank row."""
        return -(-part.layout.numel * self.config.index_bits // 8), part.layout.table_numel

    def traceable(self, segments: Sequence[Segment], chunk: int, world: int) -> bool:
        """Whether a bucket can be exchanged in halves around fixed-shape collectives: it has
        compressed parts, and no setting needs data-dependent sizes (``fallback="raw"``, a
        dense warm-up) — otherwise the whole exchange stays one opaque call."""
        return (world > 1 and self.config.fallback != "raw" and self.dense_steps == 0
                and bool(self._plan(tuple(segments), chunk, world).parts))

    def local_nonfinite(self, packed: torch.Tensor, group, segments: Sequence[Segment]) -> torch.Tensor:
        """``int32[1]``: whether this rank's compressed columns hold a NaN/Inf (all-reduce it with MAX)."""
        self.verify(group)
        world = dist.get_world_size(group)
        rows = packed.view(world, -1)
        plan = self._plan(tuple(segments), rows.shape[1], world)
        bad = _any_nonfinite([rows[:, part.columns] for part in plan.parts])
        return torch.tensor([int(bad)], dtype=torch.int32, device=packed.device)

    def encode_bucket(self, packed: torch.Tensor, bad: bool, group, segments: Sequence[Segment]):
        """First half: ``(plain [N, P], index [N, B] uint8, table [N, C] float32)`` to all-to-all.

        ``bad`` (a NaN/Inf on some rank) leaves the residuals untouched and sends zeros; the
        second half then returns NaN in the compressed columns (``nonfinite="raise"`` raises).
        """
        world = dist.get_world_size(group)
        rows = packed.view(world, -1)
        plan = self._plan(tuple(segments), rows.shape[1], world)
        self._begin_bucket(plan.key)
        plain = rows[:, plan.plain_columns] if plan.plain_columns is not None else rows.new_empty(world, 0)
        if bad:
            if self.nonfinite == "raise":
                raise FloatingPointError(f"a gradient in TAGC bucket {plan.key!r} is NaN/Inf on some rank (nonfinite='raise')")
            _, index_cols, table_cols = self.wire_shapes(segments, rows.shape[1], world)
            return (plain, torch.zeros(world, index_cols, dtype=torch.uint8, device=packed.device),
                    torch.zeros(world, table_cols, dtype=torch.float32, device=packed.device))
        start = time.perf_counter()
        grads = [rows[:, part.columns] for part in plan.parts]
        residuals = self._residuals(plan, grads)
        density = self.config.density(world)
        encoded = [compress_(g, r, density, part.layout, self.config.index_bits) for g, r, part in zip(grads, residuals, plan.parts)]
        self._record(ExchangeStats(compress_s=time.perf_counter() - start))
        return plain, torch.cat([i for i, _ in encoded], dim=1), torch.cat([t for _, t in encoded], dim=1)

    def decode_bucket(self, plain: torch.Tensor, index: torch.Tensor, table: torch.Tensor, bad: bool, group,
                      segments: Sequence[Segment], chunk: int, op=dist.ReduceOp.AVG) -> torch.Tensor:
        """Second half: every rank's rows of the three tensors (row ``j`` from rank ``j``) -> this
        rank's reduced ``chunk`` elements, in ``plain``'s dtype."""
        world = dist.get_world_size(group)
        plan = self._plan(tuple(segments), chunk, world)
        stats = ExchangeStats(buckets=1, compressed_buckets=1, plain_equivalent_bytes=(world - 1) * chunk * 4,
                              wire_bytes=(world - 1) * (plain[0].numel() * plain.element_size() + index.shape[1] + table.shape[1] * 4))
        summed = torch.zeros(chunk, dtype=torch.float32, device=plain.device)
        if plan.plain_columns is not None:
            summed[plan.plain_columns] = plain.sum(dim=0, dtype=torch.float32)
        index_at = table_at = 0
        for part in plan.parts:
            index_cols, table_cols = self._wire_columns(part)
            if bad:
                summed[part.columns] = float("nan")
            else:
                values, _ = self._decode_part(index[:, index_at : index_at + index_cols], table[:, table_at : table_at + table_cols], part, stats)
                summed[part.columns] = values
            index_at, table_at = index_at + index_cols, table_at + table_cols
        if bad:
            stats.nonfinite_buckets, stats.compressed_buckets = 1, 0
        output = plain.new_empty(chunk)
        _scale_into(output, summed, op_scale(op, world))
        self._record(stats)
        return output

    def _nonfinite(self, grads, plan: _BucketPlan, group, summed: torch.Tensor, stats: ExchangeStats) -> None:
        """Some rank's gradient has NaN/Inf: every rank sends this bucket plain (or raises)."""
        if self.nonfinite == "raise":
            raise FloatingPointError(f"a gradient in TAGC bucket {plan.key!r} is NaN/Inf on some rank (nonfinite='raise')")
        stats.nonfinite_buckets += 1
        residuals = self.residuals.get(plan.key)
        for i, (grad, part) in enumerate(zip(grads, plan.parts)):
            dense = grad.to(torch.float32, copy=True)  # grad may be a view of the input
            if residuals is not None:
                dense += residuals[i]
                residuals[i].zero_()
            result, sent = plain_reduce_scatter(dense, group, self.piece_bytes)
            summed[part.columns] = result
            stats.wire_bytes += sent

    # ------------------------------------------------------------------ bookkeeping

    def _record(self, stats: ExchangeStats) -> None:
        self._current.add(stats)
        self.total.add(stats)

    def _residuals(self, plan: _BucketPlan, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        if plan.key not in self.residuals:
            self.residuals[plan.key] = [torch.zeros(g.shape, dtype=self.residual_dtype, device=g.device) for g in grads]
        return self.residuals[plan.key]

    def end_step(self) -> None:
        """Close this step's statistics (``stats()["last_step"]``). Optional: a bucket seen twice
        also starts a new step, but calling this after ``optimizer.step()`` is exact, e.g. with
        gradient accumulation."""
        self.step_count += 1
        self.last_step = self._current
        self._current = ExchangeStats()
        self._seen_this_step.clear()

    def _begin_bucket(self, key: str) -> None:
        if key in self._seen_this_step:  # a bucket repeats: a new step began
            self.end_step()
        self._seen_this_step.add(key)

    @functools.lru_cache(maxsize=1024)
    def _plan(self, segments: tuple[Segment, ...], chunk: int, world: int) -> _BucketPlan:
        covered = sum(s.numel for s in segments)
        if covered > chunk:
            raise ValueError(f"segments cover {covered} elements of a {chunk}-element chunk")
        tail = [Segment("<padding>", covered, chunk - covered)] if covered < chunk else []
        chosen = [s for s in segments if (self.select(s.name, s.module) if s.selected is None else s.selected)]
        compressed = sum(s.numel for s in chosen)
        if compressed < max(1, self.config.min_compress_numel):
            chosen, compressed = [], 0
        rest = [s for s in segments if s not in chosen] + tail
        parts = []
        if chosen:
            columns = _columns(chosen)
            n_parts = max(1, compressed // self.min_part)
            bounds = [round(i * compressed / n_parts) for i in range(n_parts + 1)]
            for a, b in zip(bounds, bounds[1:]):
                parts.append(_Part(_selector(columns[a:b]), SketchLayout(b - a, self.config.ratio, self.config.lane, self.config.seed)))
        key = "|".join(s.name for s in chosen) or "|".join(s.name for s in segments)
        plain = _columns(rest)
        return _BucketPlan(key=f"{key}#{chunk}", chunk=chunk, plain_columns=None if plain is None else _selector(plain), parts=parts)
