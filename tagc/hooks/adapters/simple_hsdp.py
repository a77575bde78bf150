"""SimpleFSDP HSDP adapter: a unit's gradients reduced plainly within a host, then all-reduced across
hosts through the replica exchange FSDP2's HSDP uses (:mod:`tagc.hooks.adapters.replicas`).

A SimpleFSDP model on a 2-D ``(replicate, shard)`` mesh (``fsdp_integration.hsdp``) hands a unit's
hook the packed gradients over the shard group (``[G * S]``, row ``j`` for shard rank ``j``) and names
the replicate group (``unit.bucket.replicate``, ``H`` replicas). The hook returns this rank's chunk
averaged over all ``G * H`` ranks, in the two steps of FSDP2's HSDP adapter (:mod:`tagc.hooks.adapters.fsdp2`,
docs/design.md §11): within the host plain (:func:`host_step`: the fair reduce-scatter over the shard group,
summed in float32, averaged over ``G``; blocking), then across hosts the replica exchange (:func:`start_replicas`:
gathered wires where they send fewer bytes, else a compressed reduce-scatter and a dense all-gather), averaged
over ``H``, with the bytes counted as FSDP2's HSDP counts them.

Eager with ``overlap=True``, step 2 is launched in the unit's backward and finished in the backward
pass's final callback (SimpleFSDP's ``PendingGradients``). Under ``torch.compile``, where the gathered
wires are the route (a compressing codec with fixed wire shapes on few hosts) and the warm-up is over,
the exchange is traced around fixed-shape functional collectives (a compiler may move their waits)::

    received = all_to_all_single(packed as [G, S], shard)   # step 1's bytes
    wire = tagc::replica_encode(received)                  # float32 host sum, averaged; pieces; encoded [H, B]
    gathered = all_gather_single(wire, replicate)          # every replica's wire [H * H, B]
    chunk = tagc::replica_decode(gathered, dtype)          # every piece decoded, averaged, put back in place

Otherwise (the dense warm-up, a non-compressing codec such as ``plain``, ``fallback="raw"``, or the
reduce-scatter route) the whole exchange is the one opaque op ``tagc::replica_reduce_scatter``, which
runs the eager code. Both compiled forms give the eager path's bits and count its bytes. The ops reach
the binding through a registry keyed by an integer and bump the unit's state token, as
:mod:`tagc.hooks.adapters.simple`'s do.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tagc.hooks.adapters.replicas import (
    GatheredWires,
    PendingAllReduce,
    Pieces,
    decodes_alike_on_every_replica,
    gathers_wires,
    replica_gather_dtype,
)
from tagc.hooks.adapters.torch_simple_fsdp import funcol
from tagc.hooks.core.hierarchy import group_ranks, layout
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.stats import ExchangeStats, plain_bytes
from tagc.hooks.core.transport import op_scale, plain_reduce_scatter, scale_into

AVG = dist.ReduceOp.AVG


@dataclasses.dataclass(eq=False)
class ReplicaBinding:
    """One HSDP unit's hook, groups, segments and pieces: what its exchange (and the custom ops) need."""

    hook: "tagc.hooks.core.engine.TAGCHook"  # noqa: F821  named, not imported: the engine imports tagc.hooks.adapters.simple
    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup
    segments: tuple[Segment, ...]
    pieces: Pieces
    unit: str
    chunk: int
    """``S``: elements of this rank's chunk of the unit."""
    state: torch.Tensor
    """The unit's state token (:class:`tagc.hooks.adapters.simple._Binding`'s)."""
    host_remote_rows: int
    """Ranks of the shard group on other hosts (0 when the shard group is one host, or the hosts are unknown)."""
    replica_remote_rows: int
    """Ranks of the replicate group on other hosts."""
    host_stats: Optional[ExchangeStats] = None
    """Compiled: step 1's statistics, from :func:`replica_encode` to :func:`replica_decode`."""

    @property
    def shards(self) -> int:
        return dist.get_world_size(self.shard)

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate)

    @property
    def piece(self) -> int:
        """Elements of one replica's piece of the chunk."""
        return self.pieces.index.shape[1]

    def gather_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dense all-gather's dtype (the reduce-scatter route): :func:`replica_gather_dtype`."""
        return replica_gather_dtype(self.hook.settings.plain, self.hook.codec, dtype)


def _host_stats(binding: ReplicaBinding, sent: int, itemsize: int, exposed_s: float) -> ExchangeStats:
    """Step 1's statistics, as FSDP2's HSDP adapter counts them."""
    chunk = binding.chunk
    return ExchangeStats(wire_bytes=sent, plain_equivalent_bytes=plain_bytes(binding.shards, chunk),
                         inter_host_bytes=binding.host_remote_rows * chunk * itemsize, exposed_s=exposed_s)


def _average_host(summed: torch.Tensor, binding: ReplicaBinding, dtype: torch.dtype) -> torch.Tensor:
    host = torch.empty(binding.chunk, dtype=dtype, device=summed.device)
    scale_into(host, summed, op_scale(AVG, binding.shards))
    return host


def host_step(binding: ReplicaBinding, packed: torch.Tensor) -> tuple[torch.Tensor, ExchangeStats]:
    """Step 1, plain and blocking: ``packed`` (``[G * S]``) -> this rank's chunk averaged over its host's
    ranks (summed in float32 by the fair reduce-scatter), and the step's statistics."""
    binding.hook.verify(binding.shard, packed.device)
    begin = time.perf_counter()
    summed, sent = plain_reduce_scatter(packed.view(binding.shards, binding.chunk), binding.shard,
                                        binding.hook.settings.piece_bytes)
    host = _average_host(summed, binding, packed.dtype)
    return host, _host_stats(binding, sent, packed.element_size(), time.perf_counter() - begin)


def start_replicas(binding: ReplicaBinding, host: torch.Tensor, host_stats: ExchangeStats):
    """Step 2: launch the all-reduce of ``host`` across the replicas; the returned object's ``wait()`` writes
    the average over every rank into ``host`` and returns it (FSDP2's HSDP route,
    :mod:`tagc.hooks.adapters.replicas`)."""
    hook, group, hosts = binding.hook, binding.replicate, binding.replicas
    rows = binding.pieces.cut(host)
    chunk = host.new_empty(binding.piece)
    gather_dtype = binding.gather_dtype(host.dtype)
    if gathers_wires(hook, binding.pieces.segments, chunk, hosts, gather_dtype, group):
        return GatheredWires(hook, rows, host, binding.pieces, group, AVG, host_stats)
    return PendingAllReduce.start(hook, chunk, rows, host, binding.pieces, group, AVG, gather_dtype, binding.unit,
                                  host_stats, binding.replica_remote_rows)


def traces_gathered_wires(binding: ReplicaBinding, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a compiled graph can hold the exchange in halves once the warm-up is over: the route is the
    gathered wires (:func:`gathers_wires` less its warm-up test, which the graph guards on) for chunks of
    ``dtype``."""
    hook, hosts = binding.hook, binding.replicas
    if hosts < 2 or not hook.codec.compresses:
        return False
    if not decodes_alike_on_every_replica(torch.empty(0, device=device)):
        return False
    if not hook.traceable_settings(binding.pieces.segments, binding.piece, hosts):
        return False
    row_bytes = hook.wire_row_bytes(binding.pieces.segments, binding.piece, hosts, dtype)
    return hosts * row_bytes < row_bytes + binding.piece * binding.gather_dtype(dtype).itemsize


# ----------------------------------------------------------------------------- the custom ops

_registry: "weakref.WeakValueDictionary[int, ReplicaBinding]" = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("tagc::replica_reduce_scatter", mutates_args=("state",))
def replica_reduce_scatter(packed: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    """The whole HSDP exchange, eager code in one op: ``packed`` (``[G * S]``) -> this rank's chunk averaged
    over every rank (updates the residuals and statistics: bumps ``state``)."""
    binding = _registry[handle]
    host, stats = host_step(binding, packed)
    output = start_replicas(binding, host, stats).wait()
    state.add_(1)
    return output


@replica_reduce_scatter.register_fake
def _(packed: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    return packed.new_empty(_registry[handle].chunk)


@torch.library.custom_op("tagc::replica_encode", mutates_args=("state",))
def replica_encode(received: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    """Compiled first half: step 1's received rows (``[G, S]``, row ``j`` from shard rank ``j``) summed in
    float32 and averaged, cut into pieces and every piece encoded (``uint8 [H, B]``; bumps ``state``)."""
    binding = _registry[handle]
    binding.hook.verify(binding.shard, received.device)
    host = _average_host(received.sum(dim=0, dtype=torch.float32), binding, received.dtype)
    sent = (binding.shards - 1) * binding.chunk * received.element_size()  # the fair reduce-scatter's count
    binding.host_stats = _host_stats(binding, sent, received.element_size(), 0.0)
    rows = binding.pieces.cut(host)
    wire = binding.hook.encode_bucket(rows.reshape(-1), binding.replicate, binding.pieces.segments)
    state.add_(1)
    return wire


@replica_encode.register_fake
def _(received: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    binding = _registry[handle]
    row_bytes = binding.hook.wire_row_bytes(binding.pieces.segments, binding.piece, binding.replicas, received.dtype)
    return received.new_empty(binding.replicas, row_bytes, dtype=torch.uint8)


@torch.library.custom_op("tagc::replica_decode", mutates_args=("state",))
def replica_decode(gathered: torch.Tensor, state: torch.Tensor, handle: int, dtype: torch.dtype) -> torch.Tensor:
    """Compiled second half: every replica's wire (``[H * H, B]``: replica ``r``'s ``H`` piece rows, ``r`` by
    ``r``) -> this rank's chunk averaged over every rank, every piece decoded as :class:`GatheredWires`
    decodes it, with its statistics (bumps ``state``)."""
    binding = _registry[handle]
    hook, hosts = binding.hook, binding.replicas
    gathered = gathered.view(hosts, hosts, -1)  # [from replica, piece, B]
    pieces = ExchangeStats()
    decoded = torch.stack([hook.decode_bucket(gathered[:, h], binding.replicate, binding.pieces.segments,
                                              binding.piece, dtype, AVG, into=pieces) for h in range(hosts)])
    pieces.buckets, pieces.compressed_buckets = 1, 1  # one exchange (GatheredWires.wait counts it so)
    pieces.plain_equivalent_bytes = 2 * plain_bytes(hosts, binding.piece)  # a fp32 ring all-reduce
    stats, binding.host_stats = binding.host_stats or ExchangeStats(), None
    stats.add(pieces)
    hook.record(stats, None)
    output = binding.pieces.join(decoded)
    state.add_(1)
    return output


@replica_decode.register_fake
def _(gathered: torch.Tensor, state: torch.Tensor, handle: int, dtype: torch.dtype) -> torch.Tensor:
    return gathered.new_empty(_registry[handle].chunk, dtype=dtype)


def _traced(packed: torch.Tensor, handle: int, binding: ReplicaBinding) -> torch.Tensor:
    send = packed.view(binding.shards, binding.chunk)
    received = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, binding.shard))
    wire = replica_encode(received, binding.state, handle)
    gathered = funcol.wait_tensor(funcol.all_gather_single(wire, 0, binding.replicate))
    return replica_decode(gathered, binding.state, handle, packed.dtype)


def bind_replicated(
    hook: "tagc.hooks.core.engine.TAGCHook",  # noqa: F821  named, not imported (the engine imports tagc.hooks.adapters.simple)
    unit,
    segments: tuple[Segment, ...],
    state: torch.Tensor,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Optional[Callable[[torch.Tensor], Callable[[], torch.Tensor]]]]:
    """SimpleFSDP's comm hook for an HSDP ``unit`` (its bucket has ``replicate``): ``(reduce_scatter, start)``,
    as :func:`tagc.hooks.adapters.simple.bind` returns them; ``state``: the unit's state token."""
    bucket = unit.bucket
    device = state.device
    hosts = dist.get_world_size(bucket.replicate)
    me, world = dist.get_rank(), dist.get_world_size()
    binding = ReplicaBinding(
        hook, bucket.group, bucket.replicate, segments, Pieces.build(segments, bucket.chunk, hosts, device),
        unit.name, bucket.chunk, state,
        host_remote_rows=layout(group_ranks(bucket.group), me, hook.settings.ranks_per_host, world)[1],
        replica_remote_rows=layout(group_ranks(bucket.replicate), me, hook.settings.ranks_per_host, world)[1])
    handle = next(_handles)
    _registry[handle] = binding
    dtype = bucket.reduce_dtype or (unit.params[0].dtype if getattr(unit, "params", None) else torch.float32)
    traced = traces_gathered_wires(binding, dtype, device)

    def hooked(packed: torch.Tensor) -> torch.Tensor:
        # no registry look-up in traced code; during the warm-up (its wire changes shape) one opaque op
        if traced and hook.warmed_up and packed.dtype == dtype and torch.compiler.is_compiling():
            return _traced(packed, handle, binding)
        return replica_reduce_scatter(packed, binding.state, handle)

    def hooked_start(packed: torch.Tensor) -> Callable[[], torch.Tensor]:
        host, stats = host_step(binding, packed)
        return start_replicas(binding, host, stats).wait

    hooked.handle = handle
    hooked.binding = binding  # the registry's entry lives as long as this function
    return hooked, (hooked_start if hook.settings.overlap else None)
