"""FSDP2 (``fully_shard``) adapter: TAGC as each module's custom reduce-scatter.

``FSDPModule.set_custom_reduce_scatter`` hands a comm object the packed reduce-scatter
input: row ``j`` of its ``[world_size, S]`` view is rank ``j``'s chunk, the concatenation of
every parameter's padded shard in ``fsdp_params`` order. One adapter per module knows those
parameters, so it can tell the shared :class:`TAGCHook` where each segment lies.

**Overlap.** FSDP2 ignores what the comm object returns: on the CPU its ``foreach_reduce``
reads the output right after the call (on a GPU it reads it on the reduce-scatter stream).
So a ``Work`` cannot defer it. What FSDP2 does with the output, when a parameter has no
gradient yet, is to make the parameter's ``.grad`` a *view* of it. With ``overlap=True`` the
adapter therefore launches the exchange, returns at once, and fills the output in a final
callback of the backward pass (:class:`_Deferred`); the callback then checks every gradient
and copies the right values into any that is not such a view (a dtype cast). Where that is
not safe it waits before returning, as before: a parameter that already has a gradient
(accumulation: FSDP2 adds the output at once), post-accumulate-grad hooks, CPU offload, or
a reduction FSDP2 divides after the call (SUM: fp16, or ``set_force_sum_reduction_for_comms``).

**HSDP** (a 2-D ``(replicate, shard)`` mesh; docs/design.md §11, "FSDP2 HSDP"). FSDP2's all-reduce over
the replicate group is a hard-coded ``dist.all_reduce``, so :func:`register_fsdp2` gives each HSDP parameter
group an ``FSDPMeshInfo`` over the shard dimension alone: FSDP2 reduce-scatters over the shard group (plain,
:class:`TAGCReduceScatter`) and skips its all-reduce; the all-reduce hook (:class:`_ReplicaAllReduce`)
runs the replica exchange (:mod:`tagc.hooks.adapters.replicas`), written in place, averaged over ``H``
(summed when a gradient divide factor is set). With ``overlap=True`` it is deferred as above.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from backward_drain import BackwardDrain, in_backward_pass
from tagc.hooks.adapters.replicas import (
    GatheredWires,
    PendingAllReduce,
    Pieces,
    gathers_wires,
    model_parameters,
    replica_gather_dtype,
)
from tagc.hooks.adapters.torch_fsdp2 import (
    ReduceScatter,
    all_reduce_hook,
    has_post_accumulate_grad_hooks,
    hsdp_mesh_info,
    is_spmd_mesh,
    local_tensor,
    packed_segments,
    param_groups,
    reduce_over_shard_dim,
    set_all_reduce_hook,
)
from tagc.hooks.core.engine import PendingBucket, Segment, TAGCHook, op_scale, scale_into
from tagc.hooks.core.hierarchy import group_ranks, layout
from tagc.hooks.core.stats import ExchangeStats, plain_bytes
from tagc.hooks.core.transport import plain_reduce_scatter


class TAGCReduceScatter(ReduceScatter):
    """The comm object installed on one ``fully_shard`` module."""

    def __init__(self, hook: TAGCHook, module: FSDPModule) -> None:
        self.hook = hook
        self.module = module
        self._segments: Optional[tuple[Segment, ...]] = None
        self._label: Optional[str] = None
        self.replicate: Optional[dist.ProcessGroup] = None
        """HSDP: the replicate group; this object then reduce-scatters plainly inside the shard group."""
        self._op = None  # the last reduce-scatter's op (HSDP: whether the all-reduce may be deferred)
        self._host_stats: Optional[ExchangeStats] = None  # HSDP: the intra-host step's bytes, for the unit's stats

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def segments(self) -> tuple[Segment, ...]:
        if self._segments is None:
            self._segments = packed_segments(self.fsdp_params())
        return self._segments

    def fsdp_params(self) -> list:
        groups = param_groups(self.module)
        return list(groups[0].fsdp_params) if groups else []

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> Optional[dist.Work]:
        self._op = op
        if self.replicate is not None:  # HSDP: step 1 plain; the all-reduce hook compresses across hosts
            self._host_step(output_tensor, input_tensor, group, op)
            return None
        pending = self.hook.start(output_tensor, input_tensor, group, op, self.segments(), self.label)
        if self.hook.settings.overlap and self._can_defer(output_tensor, op):
            _DEFERRED.add(self, pending)
        else:
            pending.wait()
        return None  # FSDP2 ignores a returned Work

    def _host_step(self, output: torch.Tensor, input: torch.Tensor, group, op) -> None:
        """HSDP's intra-host reduce-scatter over the shard group: plain, fair, summed in float32 (blocking)."""
        self.hook.verify(group, input.device)
        world, chunk = dist.get_world_size(group), output.numel()
        begin = time.perf_counter()
        summed, sent = plain_reduce_scatter(input.view(world, chunk), group, self.hook.settings.piece_bytes)
        scale_into(output, summed, op_scale(op, world))
        remote = layout(group_ranks(group), dist.get_rank(), self.hook.settings.ranks_per_host,
                        dist.get_world_size())[1]
        self._host_stats = ExchangeStats(wire_bytes=sent, plain_equivalent_bytes=plain_bytes(world, chunk),
                                         inter_host_bytes=remote * chunk * input.element_size(),
                                         exposed_s=time.perf_counter() - begin)

    def take_host_stats(self) -> ExchangeStats:
        stats, self._host_stats = self._host_stats or ExchangeStats(), None
        return stats

    def _can_defer(self, output: torch.Tensor, op) -> bool:
        """Whether FSDP2 will only take views of ``output`` before the backward pass ends: it divides
        after the call when it reduces with SUM (fp16, or ``set_force_sum_reduction_for_comms``)."""
        if not in_backward_pass() or output.dtype not in (torch.float32, torch.bfloat16):
            return False
        if getattr(op, "op", op) == dist.ReduceOp.SUM:
            return False
        return all(p.sharded_param.grad is None and not has_post_accumulate_grad_hooks(p.sharded_param)
                   and not p.offload_to_cpu for p in self.fsdp_params())

    def fill_grads(self, output: torch.Tensor) -> None:
        """After a deferred exchange: make every parameter's ``.grad`` hold its part of ``output``."""
        with torch.no_grad():
            for fsdp_param, segment in zip(self.fsdp_params(), self.segments()):
                grad = fsdp_param.sharded_param.grad
                if grad is None:
                    continue
                local = local_tensor(grad)
                if local.numel() and local.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
                    continue  # a view of the output: already filled
                shard = torch.as_strided(output, size=fsdp_param.sharded_size,
                                         stride=fsdp_param.contiguous_sharded_stride,
                                         storage_offset=output.storage_offset() + segment.start)
                local.copy_(shard)

    @property
    def label(self) -> str:
        return type(self.module).__name__ if self._label is None else self._label


class _Deferred:
    """Exchanges launched by FSDP2's reduce-scatters, finished in a final callback of the backward pass
    (:class:`backward_drain.BackwardDrain`), each then filling its parameters' gradients."""

    def __init__(self) -> None:
        self._drain = BackwardDrain()

    def add(self, comm: TAGCReduceScatter, pending: PendingBucket) -> None:
        def complete(fill: bool) -> None:
            output = pending.wait()
            if fill:
                comm.fill_grads(output)

        self._drain.add(complete)


_DEFERRED = _Deferred()


class _ReplicaAllReduce:
    """HSDP's all-reduce hook: the host-reduced shard all-reduced across the replicate group, compressed
    (the engine's reduce-scatter over the replicas, then a dense all-gather), in place."""

    def __init__(self, comm: TAGCReduceScatter, param_group) -> None:
        self.comm = comm
        self.param_group = param_group
        self._pieces: dict[tuple, Pieces] = {}

    def __call__(self, reduce_output: torch.Tensor) -> None:
        comm, hook, group = self.comm, self.comm.hook, self.comm.replicate
        if not self.param_group.all_reduce_grads:
            raise ValueError("TAGC on an HSDP mesh all-reduces every backward: set_requires_all_reduce(False) "
                             "(accumulating without the all-reduce) is not supported")
        hosts = dist.get_world_size(group)
        numel = reduce_output.numel()
        key = (numel, hosts, reduce_output.device)
        if key not in self._pieces:
            self._pieces[key] = Pieces.build(comm.segments(), numel, hosts, reduce_output.device)
        pieces = self._pieces[key]
        rows = pieces.cut(reduce_output.reshape(-1))
        chunk = reduce_output.new_empty(pieces.index.shape[1])
        # FSDP2 already applied a divide factor of its own to the reduce-scatter: then the replicas sum
        op = dist.ReduceOp.AVG if self.param_group.gradient_divide_factor is None else dist.ReduceOp.SUM
        gather_dtype = replica_gather_dtype(hook.settings.plain, hook.codec, chunk.dtype)
        if gathers_wires(hook, pieces.segments, chunk, hosts, gather_dtype, group):
            finish = GatheredWires(hook, rows, reduce_output, pieces, group, op, comm.take_host_stats())
        else:
            remote = layout(group_ranks(group), dist.get_rank(), hook.settings.ranks_per_host,
                            dist.get_world_size())[1]
            finish = PendingAllReduce.start(hook, chunk, rows, reduce_output, pieces, group, op, gather_dtype,
                                            comm.label, comm.take_host_stats(), remote)
        if hook.settings.overlap and comm._can_defer(reduce_output, comm._op):
            _DEFERRED.add(comm, finish)
        else:
            finish.wait()


def _split_hsdp(param_group, comm: TAGCReduceScatter) -> None:
    """Make an HSDP parameter group reduce-scatter over its shard group only, and all-reduce across the
    replicas through ``comm``'s hook (module docstring). Idempotent: a second hook replaces the first."""
    info = hsdp_mesh_info(param_group)
    if is_spmd_mesh(info):
        raise ValueError("TAGC's HSDP support takes a (replicate, shard) mesh, not an SPMD mesh with dp_mesh_dims")
    current = all_reduce_hook(param_group)
    if current is not None and not isinstance(current, _ReplicaAllReduce):
        raise ValueError("this HSDP module already has an all-reduce hook (set_all_reduce_hook): "
                         "TAGC needs that hook point")
    reduce_over_shard_dim(param_group)  # the first TAGC hook on this group replaces its mesh info; later ones keep it
    comm.replicate = info.replicate_process_group
    set_all_reduce_hook(param_group, _ReplicaAllReduce(comm, param_group))


def register_fsdp2(model: nn.Module, hook: TAGCHook) -> int:
    """Install ``hook`` on every ``fully_shard`` module of ``model``; returns how many. HSDP modules
    reduce in two steps: plainly inside the shard group, compressed across the replicas."""
    installed = 0
    paths = {id(module): name for name, module in model.named_modules()}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = param_groups(module)
            if not groups:
                continue
            comm = TAGCReduceScatter(hook, module)
            comm._label = paths.get(id(module)) or "<root>"
            hsdp = [g for g in groups if hsdp_mesh_info(g) is not None]
            if hsdp and len(groups) > 1:
                raise ValueError("TAGC supports HSDP modules with one parameter group (no per-parameter meshes)")
            if hsdp:
                _split_hsdp(groups[0], comm)
            module.set_custom_reduce_scatter(comm)
            installed += 1
    if installed:
        hook.note_parameters(model_parameters(model))  # the settings check compares what select picks, not its name
    return installed
