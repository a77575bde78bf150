"""PowerSGD (Vogels et al., 2019) under FSDP's reduce-scatter: a rank-``r`` approximation of each
selected weight matrix, with error feedback and a warm-started ``Q``.

The algorithm of PyTorch's DDP hook (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``),
on the full (unsharded) matrix each rank contributes, read from the packed ``[N, S]`` input:
the concatenation over ranks of the parameter's segment starts with the parameter
(:attr:`tagc.hooks.core.engine.Segment.shape`). Per matrix ``(m, n)`` (a tensor of more dimensions
is viewed as ``(shape[0], -1)``, as the DDP hook does):

1. ``M = grad + residual`` (float32); ``P = M @ orthonormal(Q)``;
2. sum ``P`` over ranks; ``P = orthonormal(P)`` (QR in float32 of the same bits on every rank);
3. ``Q = M.T @ P``; sum ``Q`` over ranks;
4. the summed approximation ``P @ Q.T``; each owner keeps its shard (the engine applies
   FSDP's op scale). Error feedback as the DDP hook's: ``residual = M - P @ (Q / N).T``, this
   rank's own ``M`` minus the averaged approximation (summed over ranks, the residuals hold
   exactly what the summed approximation missed). ``Q / N`` is kept for the next step's
   warm start.

Each sum over ranks is an all-reduce of two all-to-all rounds (docs/design.md §7: a ring all-reduce's volume),
every rank adding the same values in the same order, so the orthonormalisation sees identical input everywhere:
four rounds in all (:attr:`PowerSGDCodec.rounds`). Selected segments that are no matrix (biases) ride plain in
round 0, and so do those whose shape the adapter cannot give (FSDP1's multi-parameter units), with a warning.

Bytes per bucket: docs/design.md §7. ``value_dtype="bfloat16"`` halves them (as DDP's ``bf16_compress_wrapper``):
P, Q and the plain columns travel in bf16 and are summed in float32; the summed slices go back in bf16, so every
rank still orthonormalises the same values, and error feedback absorbs the rounding.

NaN/Inf: the approximation of a matrix whose summed ``Q`` is not finite reaches every owner as
NaN (as a plain reduce-scatter would); its residual and ``Q`` stay as they were on every rank.
Every rank counts it in ``nonfinite_parts`` (a device count: no host read), so
``nonfinite="raise"`` raises on every rank. NaN/Inf in the plain columns reaches the owner as it is.

Where every rank needs the whole average (DDP): :class:`SummedFactors`, torch's DDP hook itself.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zlib
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from tagc.config import is_int
from tagc.hooks.codecs.codec import Codec, finite, resolve_value_dtype
from tagc.hooks.core.allreduce import AllReduceForm, Collectives, Summands, by_dtype, ring
from tagc.hooks.core.flights import complete, future_of
from tagc.hooks.core.stats import ExchangeStats
from tagc.hooks.core.transport import op_scale, scale_into
from tagc.kernels.fallbacks import warn_fallback

if TYPE_CHECKING:
    from tagc.hooks.core.segment import Segment

DEFAULT_RANK = 4
"""Vogels et al.'s language-model rank (docs/design.md §9); the DDP hook's default 1 is its most aggressive."""


@dataclasses.dataclass(frozen=True)
class _Matrix:
    """One parameter compressed as a matrix: its place in the part and its shape."""

    name: str
    start: int
    numel: int  # columns per rank row (the padded shard)
    rows: int
    cols: int
    rank: int


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A part: its matrices and the (start, numel) column ranges it sends plain."""

    world: int
    matrices: tuple[_Matrix, ...]
    plain: tuple[tuple[int, int], ...]

    @property
    def p_sizes(self) -> list[int]:
        return [m.rows * m.rank for m in self.matrices]

    @property
    def q_sizes(self) -> list[int]:
        return [m.cols * m.rank for m in self.matrices]


@dataclasses.dataclass
class _Step:
    """One part's exchange between rounds: this rank's ``M``, the ``Q`` it used, the summed parts."""

    ms: list[torch.Tensor]
    qs: list[torch.Tensor]
    ps: list[torch.Tensor] = dataclasses.field(default_factory=list)
    plain: Optional[torch.Tensor] = None


def orthonormal(matrix: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``matrix``'s (reduced QR, float32; zero columns stay finite)."""
    return torch.linalg.qr(matrix.float()).Q


def right_times(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``m @ q`` for a factor ``q`` of few columns (``P = M Q``), formed as ``(q^T m^T)^T``: CPU BLAS is faster with
    the thin factor on the left (its kernels for a thin right-hand operand are not tuned for it); the same sums in
    another order, so equal up to float32 rounding."""
    return (q.T @ m.T).T


def left_times(m: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``m^T @ p`` for a factor ``p`` of few columns (``Q = M^T P``), formed as ``(p^T m)^T``: CPU BLAS is much slower
    with the transposed ``m`` on the left (as :func:`right_times`); equal up to float32 rounding."""
    return (p.T @ m).T


def _owner_rows(flat: torch.Tensor, world: int) -> torch.Tensor:
    """``flat`` zero-padded and cut into ``world`` rows: row ``j`` is the slice rank ``j`` sums."""
    columns = -(-flat.numel() // world)
    padded = flat.new_zeros(world * columns)
    padded[: flat.numel()] = flat
    return padded.view(world, columns)


def _flat(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float32, device=device)
    return torch.cat([t.reshape(-1) for t in tensors])


class PowerSGDCodec(Codec):
    """Rank-``rank`` PowerSGD with error feedback; four all-to-all rounds per bucket.

    State per matrix, keyed by its part and name: the residual ``[m, n]`` (``residual_dtype``)
    and the warm-start ``Q`` ``[n, rank]`` (float32; with ``warm_start=False`` a draw counter
    instead, for a fresh ``Q`` every step), all in :meth:`state_dict`. Memory: the residuals
    are the matrices' unsharded size (as TAGC's); a bucket in flight holds one more float32
    copy of its matrices (this rank's ``M``) until its last round is decoded.
    """

    name = "powersgd"
    error_feedback = True
    compresses = True
    rounds = 4
    whole_segments = True
    feedback_at = "decode"  # r = M - P Q^T / N, made in decode (EF21: decode_shifted)

    def __init__(self, rank: int = DEFAULT_RANK, warm_start: bool = True,
                 residual_dtype: torch.dtype = torch.float32, value_dtype="float32") -> None:
        if not is_int(rank) or rank < 1:
            raise ValueError(f"powersgd rank must be a positive integer, got {rank!r}")
        if not isinstance(warm_start, bool):
            raise ValueError(f"powersgd warm_start must be True or False, got {warm_start!r}")
        self.value_dtype = resolve_value_dtype(value_dtype)
        self.rank = rank
        self.warm_start = warm_start
        self.residual_dtype = residual_dtype
        self.residuals: dict[str, torch.Tensor] = {}
        self.qs: dict[str, torch.Tensor] = {}
        self.draws: dict[str, int] = {}
        self._layouts: dict[str, _Layout] = {}
        self._steps: dict[str, _Step] = {}
        self._columns: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # decode_shifted: per column
        self._bucket_runs: dict[str, tuple] = {}  # part key -> its runs in a DDP bucket (SummedFactors)

    # ------------------------------------------------------------------ plan

    def prepare(self, key: str, segments: Sequence["Segment"], world: int) -> None:
        matrices, plain = [], []
        for s in segments:
            if s.shape is None or len(s.shape) < 2 or math.prod(s.shape) == 0:
                if s.shape is None:  # a selected matrix whose shape the adapter cannot give: not what was asked for
                    warn_fallback("powersgd-no-shape", f"powersgd sends the selected {s.name!r} uncompressed: its "
                              "matrix shape is unknown here (an FSDP1 unit of several parameters, FSDP2 "
                              "Shard(dim > 0), or an HSDP piece); wrap it as its own unit, shard it on dim 0, or pick "
                              "another codec")
                plain.append((s.start, s.numel))
                continue
            rows, cols = s.shape[0], math.prod(s.shape[1:])
            if rows * cols > world * s.numel:
                raise ValueError(f"segment {s.name!r} of {s.numel} elements per rank cannot hold a parameter of shape "
                                 f"{tuple(s.shape)} over {world} ranks")
            if self.rank > min(rows, cols):
                raise ValueError(f"powersgd rank={self.rank} exceeds the smaller side of parameter {s.name!r} of "
                                 f"shape {tuple(s.shape)} (as a {rows} x {cols} matrix): lower rank or leave it out "
                                 "of select")
            matrices.append(_Matrix(s.name, s.start, s.numel, rows, cols, self.rank))
        self._layouts[key] = _Layout(world, tuple(matrices), tuple(plain))

    def residual_keys(self, key: str) -> list[str]:
        """The residual (and ``Q``) entries of part ``key``'s matrices, as :meth:`encode` names them."""
        return [f"{key}/{mat.name}" for mat in self._layouts[key].matrices]

    def wire(self, numel, world, dtype):
        raise NotImplementedError("powersgd's wire follows the parameters' shapes and takes 4 rounds: "
                                  "it is not traceable")

    def traceable(self) -> bool:
        return False

    # ------------------------------------------------------------------ rounds

    def encode(self, grad, key, group):
        """Round 0: this rank's ``P = M Q`` of every matrix, cut into owner slices; the plain columns."""
        layout = self._layouts[key]
        ms, qs = [], []
        for mat in layout.matrices:
            name = f"{key}/{mat.name}"
            full = grad[:, mat.start : mat.start + mat.numel].reshape(-1)[: mat.rows * mat.cols]
            m = full.view(mat.rows, mat.cols).to(torch.float32, copy=True)  # the input buffer may be reused
            residual = self.residuals.get(name)
            if residual is not None:
                m.add_(residual)
            ms.append(m)
            qs.append(orthonormal(self._q(name, mat, m.device)))
        self._steps[key] = _Step(ms, qs)
        plain = [grad[:, start : start + numel] for start, numel in layout.plain]
        plain_wire = torch.cat(plain, dim=1) if plain else grad.new_zeros(grad.shape[0], 0)
        p_wire = _owner_rows(_flat([m @ q for m, q in zip(ms, qs)], grad.device), layout.world)
        return p_wire.to(self.value_dtype), plain_wire.to(self._plain_dtype(grad.dtype))

    def next_round(self, round, received, key, group):
        """Rounds 1 and 3 finish an all-reduce (sum this rank's slice, send it to all); round 2
        orthonormalises the summed ``P`` and sends this rank's ``Q = M.T P``."""
        layout, step = self._layouts[key], self._steps[key]
        if round == 1:
            step.plain = received[1].sum(dim=0, dtype=torch.float32)
        if round in (1, 3):  # every rank receives the same summed values (in the wire dtype)
            return (received[0].sum(dim=0, dtype=torch.float32).to(self.value_dtype).expand(layout.world, -1),)
        summed = received[0].reshape(-1)[: sum(layout.p_sizes)].float()
        step.ps = [orthonormal(p.view(mat.rows, mat.rank))
                   for p, mat in zip(summed.split(layout.p_sizes), layout.matrices)]
        q_rows = _owner_rows(_flat([m.T @ p for m, p in zip(step.ms, step.ps)], summed.device), layout.world)
        return (q_rows.to(self.value_dtype),)

    def decode(self, received, numel, key, group, stats: ExchangeStats):
        """The summed approximation's columns of this rank (and the plain ones); new residuals and ``Q``."""
        layout, step = self._layouts[key], self._steps.pop(key)
        me = dist.get_rank(group)
        summed = received[0].reshape(-1)[: sum(layout.q_sizes)].float()
        values = torch.zeros(numel, dtype=torch.float32, device=received[0].device)
        for mat, m, q_used, p, q in zip(layout.matrices, step.ms, step.qs, step.ps, summed.split(layout.q_sizes)):
            approx = self.approximate(f"{key}/{mat.name}", m, p, q.view(mat.cols, mat.rank), q_used, layout.world,
                                      stats)
            low, high = me * mat.numel, min((me + 1) * mat.numel, mat.rows * mat.cols)
            if high > low:
                values[mat.start : mat.start + high - low] = approx.reshape(-1)[low:high]
        at = 0
        for start, count in layout.plain:
            values[start : start + count] = step.plain[at : at + count]
            at += count
        return values

    def decode_shifted(self, received, numel, key, group, stats) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode` for EF21 (:mod:`tagc.hooks.codecs.feedback`): each matrix's residual turned from
        ``M - P Q^T / N`` into ``r - P Q^T / N`` (``M = g + r``; unchanged where the summed ``Q`` is not finite);
        ``shifted`` marks this rank's columns of the matrices whose summed ``Q`` is finite (not the plain ones)."""
        layout, step = self._layouts[key], self._steps[key]  # decode pops the step: read it first
        names = self.residual_keys(key)
        before = [self.residuals.get(n) for n in names]
        summed_q = received[0].reshape(-1)[: sum(layout.q_sizes)].float()
        oks = [finite(q) for q in summed_q.split(layout.q_sizes)]  # decode's own test, the same on every rank
        values = self.decode(received, numel, key, group, stats)
        for n, m, old, ok in zip(names, step.ms, before, oks):
            kept = self.residuals[n]  # M - P Q^T / N where ok, else the residual as it was
            shifted = kept - m if old is None else (kept - m).add_(old)
            self.residuals[n] = torch.where(ok, shifted, kept)
        matrix, on_matrix = self._matrix_columns(key, numel, dist.get_rank(group), values.device)
        ok_columns = torch.stack([*oks, torch.ones((), dtype=torch.bool, device=values.device)])[matrix] & on_matrix
        return values, ok_columns

    def _matrix_columns(self, key: str, numel: int, me: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For each of this rank's ``numel`` columns of part ``key``, its matrix's index (the number of matrices where
        none: a plain column or padding), and whether it is a matrix column."""
        if (key, me) not in self._columns:
            layout = self._layouts[key]
            count = len(layout.matrices)
            matrix = torch.full((numel,), count, dtype=torch.int64, device=device)
            for index, mat in enumerate(layout.matrices):
                low, high = me * mat.numel, min((me + 1) * mat.numel, mat.rows * mat.cols)
                if high > low:
                    matrix[mat.start : mat.start + high - low] = index
            self._columns[(key, me)] = (matrix, matrix < count)
        return self._columns[(key, me)]

    def approximate(self, name: str, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor, q_used: torch.Tensor,
                    world: int, stats: ExchangeStats) -> torch.Tensor:
        """Matrix ``name``'s summed rank-r approximation ``p q^T``, from the orthonormal summed ``p`` and the
        summed ``q``; keeps the residual and the next warm start as :meth:`_keep` says."""
        approx = p @ q.T
        self._keep(name, m - approx / world, q, q_used, world, stats)
        return approx

    def average_into(self, name: str, m: torch.Tensor, p: torch.Tensor, q: torch.Tensor, q_used: torch.Tensor,
                     world: int, out: torch.Tensor, stats: ExchangeStats) -> None:
        """:meth:`approximate` for an all-reduce where every rank needs the whole average: ``out`` (float32, ``m``'s
        shape, e.g. the matrix's place in a DDP bucket) receives the averaged approximation ``p q^T / world``, and
        the residual is ``m - out`` (the same bits as :meth:`approximate`'s ``m - p q^T / world``). Written in place:
        the product into ``out``, the residual into ``m``'s memory (this step's own copy), no matrix-sized temporary."""
        torch.matmul(p, q.T, out=out)
        out.div_(world)
        self._keep(name, m.sub_(out), q, q_used, world, stats, out=m)

    def _keep(self, name: str, residual: torch.Tensor, q: torch.Tensor, q_used: torch.Tensor, world: int,
              stats: ExchangeStats, out: torch.Tensor | None = None) -> None:
        """Keep ``residual`` as matrix ``name``'s residual and ``q / world`` as its next warm start; both as they
        were where the summed ``q`` (the same on every rank) is not finite, counted in ``stats.nonfinite_parts``.
        ``out``: where the kept residual is written (``residual``'s own memory, to make no temporary)."""
        ok = finite(q)
        stats.count_nonfinite(ok)
        old = self.residuals.get(name)
        kept = torch.where(ok, residual, old if old is not None else residual.new_zeros(()), out=out)
        self.residuals[name] = kept.to(self.residual_dtype)
        if self.warm_start:
            self.qs[name] = torch.where(ok, q / world, self.qs.get(name, q_used))

    def _plain_dtype(self, reduce_dtype: torch.dtype) -> torch.dtype:
        """The shape-less columns ride in the reduce dtype, or in bf16 with ``value_dtype="bfloat16"``."""
        return reduce_dtype if self.value_dtype == torch.float32 else self.value_dtype

    def _q(self, name: str, mat: _Matrix, device: torch.device) -> torch.Tensor:
        """The warm-start ``Q``, or a draw from a seed that depends only on the name (and the draw)."""
        if self.warm_start and name in self.qs:
            return self.qs[name]
        draw = self.draws.get(name, 0)
        self.draws[name] = draw + 1
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + (draw << 32))
        # the CPU generator: the same draw on every device
        return torch.randn(mat.cols, mat.rank, generator=generator, device="cpu").to(device)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"{name}/residual": value for name, value in self.residuals.items()}
        state.update({f"{name}/q": value for name, value in self.qs.items()})
        state.update({f"{name}/draws": torch.tensor(value, device="cpu") for name, value in self.draws.items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Replace the state with copies of ``state``'s, in the same dicts (as
        :class:`~tagc.hooks.codecs.codec.ResidualCodec` does); an unknown entry leaves the state as it was."""
        residuals, qs, draws = {}, {}, {}
        for key, value in state.items():
            name, _, kind = key.rpartition("/")
            if kind == "residual":
                residuals[name] = value.clone()
            elif kind == "q":
                qs[name] = value.clone()
            elif kind == "draws":
                draws[name] = int(value)
            else:
                raise ValueError(f"unknown powersgd state entry {key!r}")
        for held, loaded in ((self.residuals, residuals), (self.qs, qs), (self.draws, draws)):
            held.clear()
            held.update(loaded)

    # ------------------------------------------------------------------ the all-reduce form

    def all_reduce_form(self, parts, plain, plain_codec) -> Optional["SummedFactors"]:
        """:class:`SummedFactors` for the one part of a bucket (this codec's own feedback), where the plain columns
        add up (``plain`` ``"fp32"`` or ``"bf16"``; ``fp8``/``int4``'s blockwise scales do not)."""
        if len(parts) != 1 or not isinstance(parts[0].codec, PowerSGDCodec) or plain_codec.summed_dtype is None:
            return None
        return SummedFactors(parts[0], list(plain), plain_codec.summed_dtype)


class SummedFactors(AllReduceForm):
    """PowerSGD's all-reduce form, torch's DDP hook on the codec's state: ``P`` (with the uncompressed columns)
    launched by :meth:`start`, ``Q`` by the flight's ``launch`` once ``P`` is summed (on the backward's thread),
    ``P Q^T`` formed in ``Q``'s callback.

    Each tensor travels in its dtype and is summed in it by the all-reduce, as torch's ``bf16_compress_hook`` sums
    in bf16: ``P`` and ``Q`` in the codec's ``value_dtype``, its shape-less columns in the same 16-bit dtype (fp32
    with float32 values), the plain parts in the plain codec's :attr:`~tagc.hooks.codecs.codec.Codec.summed_dtype`. The
    first round is one all-reduce per dtype, ``P``'s first; every rank receives the same summed bits, so every rank
    orthonormalises the same ``P``. The codec's error feedback holds this rank's ``M`` minus the averaged
    approximation formed from the rounded, summed ``P`` and ``Q``: the rounding of the 16-bit wire lands in the
    residual, as on the flat lean wire.

    Each matrix is a contiguous run of the bucket (:meth:`_runs`), read as a view and overwritten with the averaged
    approximation (:meth:`PowerSGDCodec.average_into`): no gather, no matrix-sized temporaries, as torch's hook.

    Bytes each rank sends: ``ring(v (sum m r + p)) + ring(v sum n r)``, ``v`` bytes per value (one ``ring`` per
    dtype of the first all-reduces)."""

    def __init__(self, part, plain: list, plain_dtype: torch.dtype) -> None:
        self.codec: PowerSGDCodec = part.codec
        self.part, self.plain = part, plain
        self.dtypes = (self.codec.value_dtype, self.codec._plain_dtype(torch.float32), plain_dtype)  # P/Q, cols, plain
        self.shapes = self.codec._layouts[part.key]

    def planned_bytes(self, group, device) -> int:
        world, (values, columns, plain), shapes = dist.get_world_size(group), self.dtypes, self.shapes
        first = by_dtype([(values, sum(shapes.p_sizes)), (columns, sum(count for _, count in shapes.plain)),
                          (plain, sum(p.numel for p in self.plain))])
        return (sum(ring(dtype.itemsize * sum(counts), world) for dtype, counts in first.items())
                + ring(values.itemsize * sum(shapes.q_sizes), world))

    def start(self, buffer: torch.Tensor, collectives: Collectives) -> None:
        codec, part, plain, shapes = self.codec, self.part, self.plain, self.shapes
        values_dtype, columns_dtype, plain_dtype = self.dtypes
        matrix_at, columns_at = self._runs()
        device, world, flight = buffer.device, collectives.world, collectives.flight
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
        first = Summands([(values_dtype, p_flat), *((columns_dtype, t) for t in uncompressed),
                          *((plain_dtype, p.take(buffer)) for p in plain)])
        collectives.release()
        summed_first = [collectives.all_reduce(tensor) for tensor in first.flat.values()]  # P's dtype first
        flight.future = future_of(buffer)
        scale = op_scale(dist.ReduceOp.AVG, world)

        def launch() -> None:
            begin = time.perf_counter()
            summed_first[0].wait()
            flight.waited_s += time.perf_counter() - begin
            summed_ps = first.summed(0).split(shapes.p_sizes)
            ps = [orthonormal(p.view(mat.rows, mat.rank)) for p, mat in zip(summed_ps, shapes.matrices)]
            second = (torch.cat([left_times(m, p).reshape(-1) for m, p in zip(ms, ps)]) if ms
                      else p_flat.new_zeros(0)).to(values_dtype)
            launched = [*summed_first[1:], collectives.all_reduce(second)]

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

            complete(flight.future, collectives.decoded(launched, decode, device))

        flight.launch = launch

    def _runs(self) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """Where the matrices start in the bucket, and the shape-less columns' ``(start, count)`` runs there: each is a
        whole parameter (the codec takes whole segments), so a contiguous run of the buffer. Found once per part from
        its column list (on the host), kept by the codec."""
        part, shapes = self.part, self.shapes
        runs = self.codec._bucket_runs.get(part.key)
        if runs is None:
            columns = part.columns

            def start(at: int, count: int) -> int:
                if isinstance(columns, slice) or count == 0:  # an empty parameter: any start
                    return (columns.start if isinstance(columns, slice) else 0) + at
                first, last = int(columns[at]), int(columns[at + count - 1])
                if last - first != count - 1:
                    raise RuntimeError(f"powersgd part {part.key!r}: a parameter is not one run of the DDP bucket "
                                       "(the codec takes whole parameters); please report this")
                return first

            runs = (tuple(start(m.start, m.rows * m.cols) for m in shapes.matrices),
                    tuple((start(at, count), count) for at, count in shapes.plain))
            self.codec._bucket_runs[part.key] = runs
        return runs
