"""FSDP2 (``fully_shard``) adapter: TAGC as each module's custom reduce-scatter.

``FSDPModule.set_custom_reduce_scatter`` hands a comm object the packed reduce-scatter
input: row ``j`` of its ``[world_size, S]`` view is rank ``j``'s chunk, the concatenation of
every parameter's padded shard in ``fsdp_params`` order. One adapter per module knows those
parameters, so it can tell the shared :class:`TAGCHook` where each segment lies.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from tagc.hooks.engine import Segment, TAGCHook


class TAGCReduceScatter(ReduceScatter):
    """The comm object installed on one ``fully_shard`` module."""

    def __init__(self, hook: TAGCHook, module: FSDPModule) -> None:
        self.hook = hook
        self.module = module
        self._segments: Optional[tuple[Segment, ...]] = None

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
                segments.append(Segment(name, start, numel, info.module))
                start += numel
            self._segments = tuple(segments)
        return self._segments

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> Optional[dist.Work]:
        self.hook.reduce_scatter(output_tensor, input_tensor, group, op, self.segments())
        return None  # finished before returning (FSDP2 on the CPU needs that)


def register_fsdp2(model: nn.Module, hook: TAGCHook) -> int:
    """Install ``hook`` on every ``fully_shard`` module of ``model``; returns how many."""
    installed = 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if not state._fsdp_param_groups:
                continue
            group = state._fsdp_param_groups[0].mesh_info
            if getattr(group, "replicate_mesh_dim", None) is not None:
                raise ValueError("TAGC does not support HSDP (replicate + shard meshes) yet; use a 1-D FSDP mesh")
            module.set_custom_reduce_scatter(TAGCReduceScatter(hook, module))
            installed += 1
    return installed
