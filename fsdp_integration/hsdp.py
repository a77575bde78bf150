"""HSDP in SimpleFSDP: shard within a host, replicate across hosts (a 2-D ``(replicate, shard)`` mesh).

As torchtitan's SimpleFSDP does it (docs/layout.md, "HSDP in SimpleFSDP"), every parameter becomes a DTensor
with placements ``(Replicate(), Shard(0))``: mesh dim 0 replicates (the *replicate* group, one rank per host), dim 1
shards (the *shard* group, a host's ranks). A unit is gathered over the shard group only; its gradient is
reduce-scattered there, then all-reduced over the replicate group, both averaging. The hook point is unchanged
(:data:`fsdp_integration.simple_fsdp.CommHook`); a hook learns that it must reduce across replicas too from the
unit's bucket, an :class:`HSDPBucket` (``bucket.replicate``, ``bucket.replicas``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fsdp_integration.bucket import Bucket
from fsdp_integration.torch_internals import funcol


class HSDPBucket(Bucket):
    """A unit's bucket on a 2-D mesh: gathered and reduce-scattered over the shard group (``group``), the
    reduced chunk then all-reduced over ``replicate`` (the plain reduction; a comm hook replaces both)."""

    def __init__(self, *args, replicate: dist.ProcessGroup, **kwargs) -> None:
        self.replicate = replicate
        """The group of this rank's replicas (one rank per host): the chunk's all-reduce runs over it."""
        self.replicas = dist.get_world_size(replicate)
        super().__init__(*args, **kwargs)

    def plain_reduce_scatter(self, packed: torch.Tensor) -> torch.Tensor:
        reduced = funcol.reduce_scatter_single(packed, "avg", 0, self.group)
        return funcol.wait_tensor(funcol.all_reduce(reduced, "avg", self.replicate))

    def plain_reduce_scatter_start(self, packed: torch.Tensor) -> Callable[[], torch.Tensor]:
        reduced = funcol.reduce_scatter_single(packed, "avg", 0, self.group)
        summed = funcol.all_reduce(reduced, "avg", self.replicate)  # waits for the reduce-scatter, not for itself
        return lambda: funcol.wait_tensor(summed)


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """How :func:`fsdp_integration.simple_fsdp` places parameters on a mesh, and its groups."""

    placements: tuple[Placement, ...]
    shard: dist.ProcessGroup
    """The group a unit is gathered and reduce-scattered over."""
    replicate: Optional[dist.ProcessGroup] = None
    """HSDP: the group the reduced chunk is all-reduced over; ``None`` on a 1-D mesh."""

    def bucket(self, name: str, fqns: Sequence[str], shapes: Sequence[torch.Size], *args, **kwargs) -> Bucket:
        """The unit's bucket (``args``, ``kwargs``: :class:`~fsdp_integration.bucket.Bucket`'s, after the group)."""
        if self.replicate is None:
            return Bucket(name, fqns, shapes, self.shard, *args, **kwargs)
        return HSDPBucket(name, fqns, shapes, self.shard, *args, replicate=self.replicate, **kwargs)

    @property
    def groups(self) -> tuple[dist.ProcessGroup, ...]:
        """Every group of the mesh (an all-reduce over each in turn reaches every rank of the mesh)."""
        return (self.shard,) if self.replicate is None else (self.shard, self.replicate)


def mesh_layout(mesh: DeviceMesh) -> MeshLayout:
    """The placements and groups for ``mesh``: 1-D, ``Shard(0)`` (FSDP); 2-D ``(replicate, shard)``,
    ``(Replicate(), Shard(0))`` (HSDP, dims by position, as ``init_device_mesh("cuda", (hosts, per_host))``
    numbers a host's ranks consecutively). Anything else is a clear error."""
    if mesh.ndim == 1:
        return MeshLayout((Shard(0),), mesh.get_group())
    if mesh.ndim != 2:
        raise ValueError(f"simple_fsdp takes a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP: replicate "
                         f"across hosts, shard within one); got a {mesh.ndim}-D mesh")
    names = [name.lower() for name in mesh.mesh_dim_names or ()]
    if names and "shard" in names[0] and "replicate" in names[1]:
        raise ValueError(f"the 2-D mesh's dims are (replicate, shard) by position; got {tuple(mesh.mesh_dim_names)}: "
                         "make the mesh (hosts, ranks_per_host) with mesh_dim_names=('replicate', 'shard')")
    return MeshLayout((Replicate(), Shard(0)), mesh.get_group(1), mesh.get_group(0))
