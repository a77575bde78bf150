"""SimpleFSDP: parameters as ``Shard(0)`` DTensors, all-gathered by a parametrization.

After Zhang et al., *SimpleFSDP: Simpler Fully Sharded Data Parallel with torch.compile*
(2024): every parameter stays a sharded DTensor in ``module._parameters`` (so ``state_dict``
keys and DCP work unchanged), and the attribute ``module.weight`` becomes a property that
returns the unsharded tensor. The all-gathers are plain functional collectives, so ``torch.compile``
traces them (fullgraph) and Inductor can bucket and reorder them.

Unlike the paper's per-parameter collectives, parameters are grouped in *units* — each
transformer block (every child of an ``nn.ModuleList``) and the root for the rest — with
one flat all-gather in forward and one reduce-scatter in backward per unit
(:mod:`fsdp_integration.bucket`). A unit's reduce-scatter is the hook point (docs/design.md §2):
``model.register_comm_hook(hook)`` hands each unit to ``hook``, which returns the unit's reduce-scatter
(:data:`CommHook`), so a hook sees one large aligned buffer per block. This package never imports ``tagc``. On a 2-D
``(replicate, shard)`` mesh the model is HSDP (:mod:`fsdp_integration.hsdp`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdp_integration.bucket import Bucket, PendingGradients, ReduceScatter, ReduceScatterStart
from fsdp_integration.hsdp import mesh_layout
from fsdp_integration.prefetch import Prefetcher
from fsdp_integration.reshard import GATHER_TAG, regather_saved_params


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: all-gather and compute dtype (``None``: the sharded parameter's, fp32).
    ``reduce_dtype``: gradient reduce-scatter dtype (``None``: the sharded parameter's, so
    bf16 compute still reduces in fp32). ``compute_dtype``: what the gathered parameters are
    cast to for compute (``None``: ``param_dtype``). On the CPU, where bf16 matrix products are
    slow, ``param_dtype=torch.bfloat16, compute_dtype=torch.float32`` halves the all-gather's
    bytes and computes in float32 with the bf16-rounded weights."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    compute_dtype: Optional[torch.dtype] = None


class Unit:
    """A group of parameters gathered and reduced together; binds them while its module runs."""

    def __init__(self, name: str, params: list[nn.Parameter], owner_modules: list[nn.Module], bucket: Bucket,
                 reshard: bool, prefetcher: Prefetcher) -> None:
        self.name = name
        self.params = params
        self.owner_modules = owner_modules  # the module holding each parameter (selection policies look at it)
        self.bucket = bucket
        self.reshard = reshard
        self.prefetcher = prefetcher  # shared by the model's units
        self.bound: Optional[tuple[torch.Tensor, ...]] = None

    def local_shards(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.params]

    def unsharded(self, index: int) -> torch.Tensor:
        if self.bound is not None:
            return self.bound[index]
        # Touched outside its unit's forward (e.g. inspecting model.lm_head.weight): gather the unit.
        return self.bucket.gather(self.local_shards())[index]

    def run(self, forward, args, kwargs):
        with fx_traceback.annotate({GATHER_TAG: self.reshard}):
            self.bound = self.bucket.gather(self.local_shards())
        eager = not torch.compiler.is_compiling()
        if eager:
            self.prefetcher.forward_started(self)
        try:
            if self.reshard and eager:
                with regather_saved_params(self):
                    return forward(*args, **kwargs)
            return forward(*args, **kwargs)
        finally:
            self.bound = None
            if eager:
                self.prefetcher.forward_finished(self)


def _units_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each child of every ``nn.ModuleList`` (the transformer blocks), then the root."""
    return [(f"{name}.{i}" if name else str(i), child) for name, module in model.named_modules()
            if isinstance(module, nn.ModuleList) for i, child in enumerate(module)] + [("", model)]


def _check_identical_across_ranks(model: nn.Module, groups: Sequence[dist.ProcessGroup]) -> None:
    """Sharding keeps each rank's own slice, so every rank must start from the same weights.

    The check all-reduces over the mesh's ``groups`` in turn (each dim of a 2-D mesh: together they reach
    every rank of the mesh, so every rank reaches the same verdict), with tensors on the parameters'
    device (the groups' own: NCCL takes no CPU tensor), never on another group or the host."""
    with torch.no_grad():
        sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    low, high = sums.clone(), sums.clone()
    for group in groups:
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        names = [n for (n, _), same in zip(model.named_parameters(), (low == high).tolist()) if not same]
        raise ValueError(f"parameters differ across ranks ({names[:3]}...): seed every rank the same "
                         "(torch.manual_seed) or broadcast the weights before simple_fsdp")


def _swap_class(
    module: nn.Module, params: dict[str, tuple[Unit, int]], unit: Optional[Unit], extra: Optional[dict] = None
) -> None:
    """Give ``module`` a subclass whose parameter attributes are unsharding properties and,
    for a unit's module, whose ``forward`` binds the unit's gathered parameters."""
    base = type(module)
    namespace: dict = {name: property(lambda self, u=u, i=i: u.unsharded(i)) for name, (u, i) in params.items()}
    if unit is not None:
        def forward(self, *args, **kwargs):
            return unit.run(super(cls, self).forward, args, kwargs)

        namespace["forward"] = forward
    namespace.update(extra or {})
    cls = type(f"SimpleFSDP{base.__name__}", (base,), namespace)
    module.__class__ = cls


def simple_fsdp(model: nn.Module, mesh: Optional[DeviceMesh] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), reshard_after_forward: bool = True,
                units: Optional[Sequence[str]] = None, prefetch: bool = True,
                overlap: bool = True) -> "SimpleFSDPModel":
    """Shard ``model`` in place (SimpleFSDP) and return it with ``register_comm_hook``.

    Args:
        model: an ``nn.Module`` with plain (non-DTensor) parameters, identical on every rank.
        mesh: a 1-D device mesh (default: every rank of the default group, on the parameters' device type), or
            a 2-D ``(replicate, shard)`` mesh for HSDP (:mod:`fsdp_integration.hsdp`), e.g.
            ``init_device_mesh("cpu", (hosts, ranks_per_host), mesh_dim_names=("replicate", "shard"))``.
        mp_policy: compute / reduction dtypes.
        reshard_after_forward: free each block's gathered parameters after its forward and all-gather them again
            in backward (:mod:`fsdp_integration.reshard`).
        units: module names to gather as one unit each (default: every child of every
            ``nn.ModuleList``); the root takes the parameters no unit holds.
        prefetch: in eager mode, start the next unit's all-gather while this one computes, forward and backward
            (:mod:`fsdp_integration.prefetch`); holds up to two units' parameters at once.
        overlap: in eager mode, launch each unit's reduce-scatter in its backward and finish them all in a final
            callback of the backward pass (:class:`~fsdp_integration.bucket.PendingGradients`); ``False`` waits in
            each unit's backward. A comm hook may decline (it returns no ``start``: ``tagc.hook(overlap=False)``).
    """
    if not dist.is_initialized():
        raise RuntimeError("simple_fsdp needs torch.distributed: call dist.init_process_group(...) first")
    if getattr(model, "_simple_fsdp_units", None) is not None:
        raise ValueError("this model is already wrapped by simple_fsdp")
    device_type = next(model.parameters()).device.type
    mesh = mesh or DeviceMesh(device_type, list(range(dist.get_world_size())))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh (init_device_mesh(...)), got {type(mesh).__name__}")
    layout = mesh_layout(mesh)  # 1-D: FSDP; 2-D (replicate, shard): HSDP; else a clear error
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"parameter {name!r} is already a DTensor; simple_fsdp wants plain parameters")

    _check_identical_across_ranks(model, layout.groups)

    named = dict(model.named_modules())
    missing = [n for n in units or () if n not in named]
    if missing:
        raise ValueError(f"units {missing} are not modules of this model; pick names from model.named_modules()")
    chosen = [(n, named[n]) for n in units] if units is not None else _units_of(model)
    if units is not None and "" not in units:
        chosen.append(("", model))
    owner: dict[int, str] = {}  # parameter id -> unit name (deepest unit wins; tied parameters once)
    for unit_name, unit_module in chosen:
        for p in unit_module.parameters():
            owner.setdefault(id(p), unit_name)

    sharded: dict[int, nn.Parameter] = {}
    # unit -> (fqn, module, attr, id)
    uses: dict[str, list[tuple[str, nn.Module, str, int]]] = {n: [] for n, _ in chosen}
    for module_name, module in model.named_modules():
        for attr, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if id(p) not in sharded:
                shard = distribute_tensor(p.detach(), mesh, list(layout.placements))
                sharded[id(p)] = nn.Parameter(shard, requires_grad=p.requires_grad)
                fqn = f"{module_name}.{attr}" if module_name else attr
                uses[owner[id(p)]].append((fqn, module, attr, id(p)))
            else:
                uses[owner[id(p)]].append((None, module, attr, id(p)))
            module.register_parameter(attr, sharded[id(p)])

    prefetcher = Prefetcher(enabled=prefetch)
    pending = PendingGradients() if overlap else None
    unit_objects: list[Unit] = []
    slots: dict[int, dict[str, tuple[Unit, int]]] = {}  # module id -> attr -> (unit, index)
    unit_of_module: dict[int, Unit] = {}
    for unit_name, unit_module in chosen:
        firsts = [(fqn, module, pid) for fqn, module, _, pid in uses[unit_name] if fqn is not None]
        if not firsts:
            continue
        params = [(fqn, sharded[pid]) for fqn, _, pid in firsts]
        bucket = layout.bucket(unit_name or "<root>", [f for f, _ in params], [p.shape for _, p in params],
                               mp_policy.param_dtype, mp_policy.reduce_dtype, pending, mp_policy.compute_dtype)
        bucket.params = [p for _, p in params]
        unit = Unit(unit_name or "<root>", [p for _, p in params], [m for _, m, _ in firsts], bucket,
                    reshard_after_forward and unit_name != "", prefetcher)
        index = {pid: i for i, (_, _, pid) in enumerate(firsts)}
        for _, module, attr, pid in uses[unit_name]:
            slots.setdefault(id(module), {})[attr] = (unit, index[pid])
        unit_objects.append(unit)
        unit_of_module[id(unit_module)] = unit

    for module in model.modules():
        if module is model:
            extra = {"register_comm_hook": register_comm_hook}
            _swap_class(module, slots.get(id(module), {}), unit_of_module.get(id(module)), extra)
        elif id(module) in slots or id(module) in unit_of_module:
            _swap_class(module, slots.get(id(module), {}), unit_of_module.get(id(module)))
    model._simple_fsdp_units = unit_objects
    return model


SimpleFSDPModel = nn.Module
"""A model returned by :func:`simple_fsdp` (its class gains ``register_comm_hook``)."""


def units(model: nn.Module) -> list[Unit]:
    """The units of a ``simple_fsdp`` model, in the order they were built (blocks, then root)."""
    found = getattr(model, "_simple_fsdp_units", None)
    if found is None:
        raise ValueError("not a simple_fsdp model: wrap it with fsdp_integration.simple_fsdp(model) first")
    return found


CommHook = Callable[[Unit], tuple[ReduceScatter, Optional[ReduceScatterStart]]]
"""A unit -> its gradient reduce-scatter and, optionally, the launcher that overlaps it.

``reduce_scatter(packed)`` gets the unit's packed gradients ``[world * S]`` (row ``j`` for rank
``j``, laid out as ``unit.bucket.entries`` say) and returns this rank's averaged chunk ``[S]``; on an
HSDP mesh (``unit.bucket`` is an :class:`~fsdp_integration.hsdp.HSDPBucket`) ``world`` is the shard
group's and the chunk is averaged over every rank of the mesh: across ``bucket.replicate`` too;
it also runs under ``torch.compile``. ``start(packed)`` (eager, ``overlap=True``) launches the
same exchange and returns the function that finishes it; ``None`` makes every backward wait for
its unit's ``reduce_scatter``."""


def register_comm_hook(model: nn.Module, hook: CommHook) -> nn.Module:
    """The reduce-scatter hook point: route every unit's gradient reduce-scatter through
    ``hook(unit)`` (:data:`CommHook`; a TAGC hook is one: ``model.register_comm_hook(tagc.hook(...))``)."""
    if not callable(hook):
        raise TypeError(f"a SimpleFSDP comm hook is a callable unit -> (reduce_scatter, start) (e.g. tagc.hook(...)), "
                        f"got {type(hook).__name__}")
    for unit in units(model):
        unit.bucket.reduce_scatter, unit.bucket.reduce_scatter_start = hook(unit)
    return model
