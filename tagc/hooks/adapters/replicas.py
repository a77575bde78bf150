"""The replica all-reduce shared by FSDP2's HSDP path and DDP: a shard (or bucket) cut into one piece
per replica, reduced by the engine's compressed reduce-scatter plus a dense all-gather, or by
gathering every replica's wire (:class:`GatheredWires`), so every replica ends bit-identical."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from tagc.hooks.core.callback_stream import on_own_stream
from tagc.hooks.core.eager import PendingBucket
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.stats import ExchangeStats, plain_bytes
from tagc.hooks.core.transport import all_gather_single
from tagc.kernels import dispatch
from tagc.kernels.fallbacks import warn_fallback

if TYPE_CHECKING:
    from tagc.hooks.codecs.codec import Codec


@dataclasses.dataclass
class Pieces:
    """A shard of ``numel`` elements cut for ``hosts`` replicas: each parameter's segment padded to a
    multiple of ``hosts`` and cut into ``hosts`` pieces, so replica ``h``'s chunk holds piece ``h`` of
    every parameter (the selection policy still sees parameters)."""

    index: torch.Tensor  # [hosts, chunk]: positions in the shard, ``numel`` for padding (a zero appended)
    inverse: torch.Tensor  # [numel]: where each shard position is in the flattened [hosts, chunk]
    segments: tuple[Segment, ...]

    @classmethod
    def build(cls, segments: tuple[Segment, ...], numel: int, hosts: int, device: torch.device) -> "Pieces":
        if sum(s.numel for s in segments) != numel:  # e.g. parameters without a gradient: one segment
            covered = sum(s.numel for s in segments)
            warn_fallback("hsdp-one-segment", f"TAGC on HSDP: a shard of {numel} elements does not match its "
                      f"parameters' segments ({covered} elements): it is exchanged as one segment '<shard>', which "
                      "select sees without the parameters' names (e.g. some parameters have no gradient)")
            segments = (Segment("<shard>", 0, numel),)
        columns, pieces, at = [], [], 0
        for s in segments:
            if s.numel == 0:
                continue
            per = -(-s.numel // hosts)
            offsets = torch.arange(hosts * per, device="cpu")
            columns.append(torch.where(offsets < s.numel, s.start + offsets, numel).view(hosts, per))
            pieces.append(Segment(s.name, at, per, s.module, selected=s.selected))  # a piece is no matrix: no shape
            at += per
        index = torch.cat(columns, dim=1)
        flat = index.reshape(-1)
        kept = (flat < numel).nonzero().squeeze(1)
        inverse = torch.empty(numel, dtype=torch.int64, device="cpu")
        inverse[flat[kept]] = kept
        return cls(index.to(device), inverse.to(device), tuple(pieces))

    def cut(self, flat: torch.Tensor) -> torch.Tensor:
        """The shard ``flat`` as ``[hosts, chunk]`` rows, padding zero. ``index_select``, not ``flat[index]``: the
        same gather, faster on the CPU."""
        return torch.cat([flat, flat.new_zeros(1)]).index_select(0, self.index.view(-1)).view(self.index.shape)

    def join(self, rows: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """The shard from its ``[hosts, chunk]`` rows (any shape of that many elements), :meth:`cut` undone:
        written into ``into`` (of the shard's size) when given, with no temporary where it can."""
        flat = rows.reshape(-1)
        if into is None:
            return flat.index_select(0, self.inverse)
        if into.is_contiguous() and into.dtype == flat.dtype:
            torch.index_select(flat, 0, self.inverse, out=into.view(-1))
            return into
        return into.copy_(flat.index_select(0, self.inverse).view_as(into))


class PendingAllReduce:
    """A replica all-reduce in flight: :meth:`wait` finishes the compressed reduce-scatter, all-gathers
    the reduced pieces and writes the shard in place."""

    def __init__(self, pending: PendingBucket, output: torch.Tensor, pieces: Pieces, group,
                 dtype: torch.dtype) -> None:
        self.pending, self.output, self.pieces, self.group, self.dtype = pending, output, pieces, group, dtype

    @classmethod
    def start(cls, hook: "tagc.hooks.core.engine.TAGCHook", chunk: torch.Tensor,  # noqa: F821  named, not imported
              rows: torch.Tensor, output: torch.Tensor, pieces: Pieces, group, op, dtype: torch.dtype,
              unit: str | None = None, host_stats: ExchangeStats | None = None,
              remote_rows: int = 0) -> PendingAllReduce:
        """Launch the engine's compressed reduce-scatter of ``rows`` over ``group`` into ``chunk`` and count
        the dense all-gather that :meth:`wait` will make (a ring all-gather's volume in ``dtype``; ``remote_rows``
        of its rows cross hosts), with ``host_stats``, the bytes of the step before, on the same bucket."""
        pending = hook.start(chunk, rows.reshape(-1), group, op, pieces.segments, unit)
        replicas = dist.get_world_size(group)
        row_bytes = chunk.numel() * dtype.itemsize
        if host_stats is not None:
            pending.stats.add(host_stats)
        pending.stats.add(ExchangeStats(wire_bytes=(replicas - 1) * row_bytes,
                                        plain_equivalent_bytes=plain_bytes(replicas, chunk.numel()),
                                        inter_host_bytes=remote_rows * row_bytes))
        return cls(pending, output, pieces, group, dtype)

    def wait(self) -> torch.Tensor:
        chunk = self.pending.wait().to(self.dtype)
        begin = time.perf_counter()
        gathered = chunk.new_empty(dist.get_world_size(self.group) * chunk.numel())
        all_gather_single(gathered, chunk, group=self.group)
        self._write(gathered)
        self.pending.hook.record(ExchangeStats(exposed_s=time.perf_counter() - begin), None)
        return self.output

    def gather(self) -> torch.futures.Future:
        """:meth:`wait` without waiting for the all-gather: finish the compressed reduce-scatter (blocking),
        launch the all-gather and return a future of the output, written in the all-gather's callback.
        The caller records the time it waits for the future."""
        chunk = self.pending.wait().to(self.dtype)
        gathered = chunk.new_empty(dist.get_world_size(self.group) * chunk.numel())
        work = all_gather_single(gathered, chunk, group=self.group, async_op=True)

        def write(future: torch.futures.Future) -> torch.Tensor:
            future.wait()  # on CUDA: the callback's stream waits for the all-gather's
            return self._write(gathered)

        return work.get_future().then(on_own_stream(write, gathered.device))

    def _write(self, gathered: torch.Tensor) -> torch.Tensor:
        return self.pieces.join(gathered, into=self.output)  # every replica, its own piece too


def replica_gather_dtype(plain: str, codec: Codec | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype the ``rs+ag`` route all-gathers each replica's reduced piece in, for chunks of ``dtype``: bf16 for
    ``plain="bf16"`` and for a compressing ``codec`` that keeps no residual (``int4``, ``fp8``, ``bf16``: its
    quantization errs by bf16's relative 2^-8 or more, and nothing accounts for either); else ``dtype``. An
    error-feedback codec's reduced values are gathered as decoded, so what the ranks sent and kept still adds up
    to their gradients, and the route gives the gathered wires' bits."""
    lean = plain == "bf16" or (codec is not None and codec.compresses and not codec.error_feedback)
    return torch.bfloat16 if lean and dtype.itemsize > 2 else dtype


def decodes_alike_on_every_replica(chunk: torch.Tensor) -> bool:
    """Whether every replica decodes ``chunk``'s wires to the same bits: on the CPU and on the Triton
    kernels always; on CUDA without Triton (the torch reference's scatter-add) only under
    ``torch.use_deterministic_algorithms(True)``."""
    return (chunk.device.type != "cuda" or dispatch.resolve_backend(chunk) == "triton"
            or torch.are_deterministic_algorithms_enabled())


def gathers_wires(hook: "tagc.hooks.core.engine.TAGCHook",  # noqa: F821  named, not imported: the engine imports this module
                  segments: tuple[Segment, ...], chunk: torch.Tensor, hosts: int,
                  gather_dtype: torch.dtype, group) -> bool:
    """Whether to all-reduce by gathering every replica's wire (:class:`GatheredWires`) instead of a
    compressed reduce-scatter plus a dense all-gather: when it sends fewer bytes (``H`` wire rows
    against one row plus one dense chunk: TAGC and the sparse or quantized peers, not a dense
    warm-up), every codec of the bucket keeps fixed wire shapes, and every replica's decode gives
    the same bits: on the CPU and on the Triton kernels (no float atomics: the same bits on every
    run), or with ``torch.use_deterministic_algorithms(True)`` on the torch reference's CUDA path (its
    scatter-add sums in any order, and replicas must stay identical)."""
    if hook.warming_up or not hook.codec.compresses:
        return False
    if not decodes_alike_on_every_replica(chunk):
        return False
    plan = hook.plan(segments, chunk.numel(), hosts)
    if not plan.compressed or not all(part.codec.traceable() for part in plan.parts):
        return False
    row_bytes = hook.wire_row_bytes(segments, chunk.numel(), hosts, chunk.dtype)
    return hosts * row_bytes < row_bytes + chunk.numel() * gather_dtype.itemsize


class GatheredWires:
    """A replica all-reduce that gathers wires: each replica encodes its ``[H, chunk]`` pieces once
    (:meth:`TAGCHook.encode_bucket`), one all-gather hands every replica every wire, and every
    replica decodes all ``H`` pieces (:meth:`TAGCHook.decode_bucket`). The same bytes, decoded by
    the same deterministic code, give bit-identical replicas; the decoded values are exact where
    the codec is (TAGC: the support, and each value within the cells' float32 rounding)."""

    def __init__(self, hook: "tagc.hooks.core.engine.TAGCHook",  # noqa: F821  named, not imported
                 rows: torch.Tensor, output: torch.Tensor, pieces: Pieces, group, op,
                 host_stats: ExchangeStats) -> None:
        self.hook, self.output, self.pieces, self.group, self.op = hook, output, pieces, group, op
        self.chunk = rows.shape[1]
        self.dtype = rows.dtype
        # uint8 [H, B]: piece h's row for replica h (records its encode time)
        wire = hook.encode_bucket(rows.reshape(-1), group, pieces.segments)
        self.gathered = wire.new_empty(dist.get_world_size(group), *wire.shape)  # [from replica, piece, B]
        self.work = all_gather_single(self.gathered.view(-1), wire.reshape(-1), group=group, async_op=True)
        self.stats = host_stats
        self.done = False

    def wait(self) -> torch.Tensor:
        if self.done:
            return self.output
        begin = time.perf_counter()
        self.work.wait()
        self.stats.add(ExchangeStats(exposed_s=time.perf_counter() - begin))
        self.decode()
        self.hook.record(self.stats, None)
        self.done = True
        return self.output

    def decode(self) -> torch.Tensor:
        """Decode every replica's wires into the output once the all-gather (:attr:`work`) is done, adding
        the statistics to :attr:`stats` without recording them: :meth:`wait` records them; a caller that
        decodes in the all-gather's callback (another thread, on gloo) records them on its own thread."""
        hosts = self.gathered.shape[0]
        pieces = ExchangeStats()
        decoded = torch.stack([self.hook.decode_bucket(self.gathered[:, h], self.group, self.pieces.segments,
                                                       self.chunk, self.dtype, self.op, into=pieces)
                               for h in range(hosts)])
        # one exchange: H decodes of one bucket, each counting the (H-1) rows it received, are what every rank sent
        pieces.buckets, pieces.compressed_buckets = 1, 1
        # a fp32 ring all-reduce, as the other path counts
        pieces.plain_equivalent_bytes = 2 * plain_bytes(hosts, self.chunk)
        self.stats.add(pieces)
        self.pieces.join(decoded, into=self.output)
        return self.output


def model_parameters(model: nn.Module) -> list[Segment]:
    """Every parameter of ``model`` (once, by its name), with the module that holds it: what ``select`` sees."""
    modules = dict(model.named_modules())
    return [Segment(name, 0, param.numel(), modules[name.rpartition(".")[0]], shape=tuple(param.shape))
            for name, param in model.named_parameters()]
