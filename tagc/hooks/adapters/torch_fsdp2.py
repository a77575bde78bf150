"""Every private torch name TAGC's FSDP2 (``fully_shard``) adapter uses, in one place.

FSDP2's public surface (``FSDPModule.set_custom_reduce_scatter``, ``set_all_reduce_hook``) hands
a comm object the packed reduce-scatter buffer, but not what the adapter must know to use it:

* which parameters lie where in the buffer, under which names and shapes (an FSDP unit's parameter
  group and its parameters' records: ``_get_fsdp_state``, ``_fsdp_param_groups`` (torch 2.11: the one
  ``_fsdp_param_group``), ``_param_fqn``, ``_module_info``, ``_orig_size``), and the group's mixed-precision policy
  (the group's ``mp_policy``; from torch 2.15 on, its parameters');
* the base class of a comm object (``_fully_shard._fsdp_api.ReduceScatter``);
* for HSDP, a parameter group's mesh info (``_fsdp_common.FSDPMeshInfo`` / ``HSDPMeshInfo``; torch 2.11's has
  no ``is_spmd_mesh`` and no ``reduce_scatter_process_group``), replaced by one over the shard dimension alone,
  and its all-reduce hook (``_all_reduce_hook``) set per group, since FSDP2's own all-reduce cannot be replaced
  (``tagc.hooks.adapters.fsdp2``'s docstring);
* a DTensor gradient's local tensor (``DTensor._local_tensor``: written in place without autograd,
  where ``to_local()`` may hand back a new view), and whether a tensor has post-accumulate-grad
  hooks (``Tensor._post_accumulate_grad_hooks``: no public way to ask).

Module-level names and declared attributes are checked at import (:func:`check_torch`); attributes
torch sets on objects at run time are read through
:func:`backward_drain.torch_versions.read_internal`, which names a missing one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
from torch.distributed.tensor import DTensor

from backward_drain.torch_versions import check_internals, read_internal
from tagc.hooks.core.segment import Segment

INTEGRATION = "TAGC's FSDP2 adapter (tagc.hooks.adapters.fsdp2)"
ADVICE = "use another integration (SimpleFSDP: fsdp_integration.simple_fsdp, or DDP)"
NEEDS = ("torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter",
         "torch.distributed.fsdp._fully_shard._fsdp_common.FSDPMeshInfo",
         "torch.distributed.fsdp._fully_shard._fsdp_common.HSDPMeshInfo",
         "torch.distributed.fsdp.FSDPModule._get_fsdp_state",
         "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam:_orig_size",
         "torch.distributed.tensor.DTensor:_local_tensor",
         "torch.Tensor._post_accumulate_grad_hooks")
"""The private names checked at import (:func:`check_torch`). Read at run time, and checked there:
``_fsdp_param_groups`` (FSDPState; ``_fsdp_param_group`` on torch 2.11), ``_param_fqn`` and ``_module_info``
(FSDPParam), ``_all_reduce_hook`` (FSDPParamGroup)."""

_ORIGINAL_MESH_INFO = "_tagc_hsdp_mesh_info"
"""TAGC's own attribute on a parameter group whose HSDP mesh info it replaced: the original."""

__all__ = ["ReduceScatter", "all_reduce_hook", "check_torch", "has_post_accumulate_grad_hooks", "hsdp_mesh_info",
           "is_spmd_mesh", "local_tensor", "mp_policy", "packed_segments", "param_fqn", "param_groups", "param_owner",
           "param_shape", "reduce_over_shard_dim", "set_all_reduce_hook"]


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if it is outside the range."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


def _read(obj: Any, name: str) -> Any:
    return read_internal(obj, name, INTEGRATION, ADVICE)


def param_groups(module: FSDPModule) -> list:
    """The ``FSDPParamGroup`` objects of a ``fully_shard`` module (empty when it holds no parameter of its own).
    Torch 2.13 keeps a list (``_fsdp_param_groups``); torch 2.11 at most one group (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    group = _read(state, "_fsdp_param_group")
    return [] if group is None else [group]


def param_fqn(fsdp_param: Any) -> Optional[str]:
    """An ``FSDPParam``'s name from the root module (``None`` until the root's lazy init names it)."""
    return _read(fsdp_param, "_param_fqn")


def param_owner(fsdp_param: Any) -> tuple[nn.Module, str]:
    """The module that registers an ``FSDPParam``'s parameter, and the attribute name there."""
    info = _read(fsdp_param, "_module_info")
    return info.module, info.param_name


def param_shape(fsdp_param: Any) -> tuple[int, ...]:
    """An ``FSDPParam``'s unsharded shape."""
    return tuple(fsdp_param._orig_size)


def mp_policy(param_group: Any) -> Any:
    """A parameter group's ``MixedPrecisionPolicy``: the group's own up to torch 2.13; torch 2.15 keeps it on each
    parameter's record (one reduce dtype for the whole group, which FSDP2 checks)."""
    return param_group.mp_policy if hasattr(param_group, "mp_policy") else param_group.fsdp_params[0].mp_policy


def packed_segments(fsdp_params: list, names: Optional[dict[int, str]] = None) -> tuple[Segment, ...]:
    """The segments of one FSDP2 parameter group's packed reduce-scatter chunk: each parameter's padded shard, in
    ``fsdp_params`` order, named from the root (before the root's lazy init names them: ``names``, by the sharded
    parameter's id, else the owner's type and attribute), with its shape where it is sharded on dim 0 (a
    ``Shard(k>0)`` parameter's chunks are transposed: no shape)."""
    segments, start = [], 0
    for fsdp_param in fsdp_params:
        numel = fsdp_param.padded_sharded_param_size.numel()
        module, attr = param_owner(fsdp_param)
        name = (param_fqn(fsdp_param) or (names or {}).get(id(fsdp_param.sharded_param))
                or f"{type(module).__name__}.{attr}")
        shape = param_shape(fsdp_param) if fsdp_param.fsdp_placement.dim == 0 else None
        segments.append(Segment(name, start, numel, module, shape=shape))
        start += numel
    return tuple(segments)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (to write in place), else ``tensor``."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has hooks registered by ``register_post_accumulate_grad_hook``."""
    return bool(tensor._post_accumulate_grad_hooks)


def hsdp_mesh_info(param_group: Any) -> Optional[HSDPMeshInfo]:
    """A parameter group's HSDP mesh info (the original where :func:`reduce_over_shard_dim` replaced it), or
    ``None`` when the group is not HSDP."""
    original = getattr(param_group, _ORIGINAL_MESH_INFO, None)
    if original is not None:
        return original
    return param_group.mesh_info if isinstance(param_group.mesh_info, HSDPMeshInfo) else None


def is_spmd_mesh(info: HSDPMeshInfo) -> bool:
    """Whether an HSDP mesh info is an SPMD mesh's (``fully_shard(..., dp_mesh_dims=...)``, torch 2.13 on; torch 2.11
    has none)."""
    return getattr(info, "is_spmd_mesh", False)


def reduce_over_shard_dim(param_group: Any) -> HSDPMeshInfo:
    """Make an HSDP parameter group reduce-scatter over its shard group only (same mesh; FSDP2 then skips its
    own all-reduce); returns the original HSDP mesh info. Idempotent. Its parameters keep their own mesh info."""
    info = hsdp_mesh_info(param_group)
    if getattr(param_group, _ORIGINAL_MESH_INFO, None) is None:
        shard = FSDPMeshInfo(mesh=info.mesh, shard_mesh_dim=info.shard_mesh_dim)
        if hasattr(info, "reduce_scatter_process_group"):  # torch 2.13 on; torch 2.11 reduces in the shard group
            shard.reduce_scatter_process_group = info.reduce_scatter_process_group
        if param_group.post_forward_mesh_info is param_group.mesh_info:
            param_group.post_forward_mesh_info = shard  # else FSDP2 would see a different post-forward mesh
        param_group.mesh_info = shard
        setattr(param_group, _ORIGINAL_MESH_INFO, info)
    return info


def all_reduce_hook(param_group: Any) -> Any:
    """The all-reduce hook set on a parameter group (``None`` when none is)."""
    return _read(param_group, "_all_reduce_hook")


def set_all_reduce_hook(param_group: Any, hook: Any) -> None:
    """Set a parameter group's all-reduce hook (``FSDPModule.set_all_reduce_hook`` does this for every group of a
    module, with a stream argument that HSDP does not use)."""
    _read(param_group, "_all_reduce_hook")  # a torch that renamed it raises here, rather than set a dead attribute
    param_group._all_reduce_hook = hook


check_torch()
