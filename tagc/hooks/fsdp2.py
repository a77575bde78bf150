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
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from tagc.hooks.engine import PendingBucket, Segment, TAGCHook


class TAGCReduceScatter(ReduceScatter):
    """The comm object installed on one ``fully_shard`` module."""

    def __init__(self, hook: TAGCHook, module: FSDPModule) -> None:
        self.hook = hook
        self.module = module
        self._segments: Optional[tuple[Segment, ...]] = None
        self._label: Optional[str] = None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def segments(self) -> tuple[Segment, ...]:
        if self._segments is None:
            groups = self.module._get_fsdp_state()._fsdp_param_groups
            segments, start = [], 0
            for fsdp_param in groups[0].fsdp_params if groups else []:
                numel = fsdp_param.padded_sharded_param_size.numel()
                info = fsdp_param._module_info
                name = fsdp_param._param_fqn or f"{type(info.module).__name__}.{info.param_name}"
                shape = tuple(fsdp_param._orig_size) if fsdp_param.fsdp_placement.dim == 0 else None  # Shard(k>0): chunks are transposed
                segments.append(Segment(name, start, numel, info.module, shape=shape))
                start += numel
            self._segments = tuple(segments)
        return self._segments

    def fsdp_params(self) -> list:
        groups = self.module._get_fsdp_state()._fsdp_param_groups
        return list(groups[0].fsdp_params) if groups else []

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> Optional[dist.Work]:
        pending = self.hook.start(output_tensor, input_tensor, group, op, self.segments(), self.label)
        if self.hook.overlap and self._can_defer(output_tensor, op):
            _DEFERRED.add(self, pending)
        else:
            pending.wait()
        return None  # FSDP2 ignores a returned Work

    def _can_defer(self, output: torch.Tensor, op) -> bool:
        """Whether FSDP2 will only take views of ``output`` before the backward pass ends: it divides
        after the call when it reduces with SUM (fp16, or ``set_force_sum_reduction_for_comms``)."""
        if torch._C._current_graph_task_id() == -1 or output.dtype not in (torch.float32, torch.bfloat16):
            return False
        if getattr(op, "op", op) == dist.ReduceOp.SUM:
            return False
        return all(p.sharded_param.grad is None and not getattr(p.sharded_param, "_post_accumulate_grad_hooks", None)
                   and not p.offload_to_cpu for p in self.fsdp_params())

    def fill_grads(self, output: torch.Tensor) -> None:
        """After a deferred exchange: make every parameter's ``.grad`` hold its part of ``output``."""
        with torch.no_grad():
            for fsdp_param, segment in zip(self.fsdp_params(), self.segments()):
                grad = fsdp_param.sharded_param.grad
                if grad is None:
                    continue
                local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
                if local.numel() and local.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
                    continue  # a view of the output: already filled
                shard = torch.as_strided(output, size=fsdp_param.sharded_size, stride=fsdp_param.contiguous_sharded_stride,
                                         storage_offset=output.storage_offset() + segment.start)
                local.copy_(shard)

    @property
    def label(self) -> str:
        return type(self.module).__name__ if self._label is None else self._label


class _Deferred:
    """Exchanges launched by FSDP2's reduce-scatters, finished in a final callback of the backward pass."""

    def __init__(self) -> None:
        self._items: list[tuple[TAGCReduceScatter, PendingBucket]] = []
        self._task = None

    def add(self, comm: TAGCReduceScatter, pending: PendingBucket) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:  # the first deferral of this backward pass
            self._drain(fill=False)  # a backward pass that failed left these: finish the collectives, drop the values
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._items.append((comm, pending))

    def finish(self) -> None:
        self._task = None
        self._drain(fill=True)

    def _drain(self, fill: bool) -> None:
        items, self._items = self._items, []
        error = None
        for comm, pending in items:  # finish all, even after an error: no collective is left behind
            try:
                output = pending.wait()
                if fill:
                    comm.fill_grads(output)
            except Exception as exc:  # noqa: BLE001 - re-raised below
                error = error or exc
        if error is not None:
            raise error


_DEFERRED = _Deferred()


def register_fsdp2(model: nn.Module, hook: TAGCHook) -> int:
    """Install ``hook`` on every ``fully_shard`` module of ``model``; returns how many."""
    installed = 0
    paths = {id(module): name for name, module in model.named_modules()}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if not state._fsdp_param_groups:
                continue
            group = state._fsdp_param_groups[0].mesh_info
            if getattr(group, "replicate_mesh_dim", None) is not None:
                raise ValueError("TAGC does not support HSDP (replicate + shard meshes) yet; use a 1-D FSDP mesh")
            comm = TAGCReduceScatter(hook, module)
            comm._label = paths.get(id(module)) or "<root>"
            module.set_custom_reduce_scatter(comm)
            installed += 1
    return installed
