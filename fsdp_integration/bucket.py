"""One flat all-gather and one reduce-scatter per unit (a transformer block, or the root), of the packed chunk
FSDP2 hands its reduce-scatter too (docs/design.md §4, "The packed chunk"): every local ``Shard(0)`` shard padded to
``R = ceil(dim0 / world)`` rows. The all-gather sends the chunk in ``param_dtype`` (or the parameters' dtype).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from backward_drain import BackwardDrain
from fsdp_integration.torch_internals import funcol, tensor_version


@dataclasses.dataclass(frozen=True)
class BucketEntry:
    """One parameter's place in the packed chunk."""

    fqn: str
    shape: torch.Size
    rows: int  # R: padded rows per rank
    local_rows: int  # rows this rank really holds (<= R)
    start: int  # offset in the chunk
    numel: int  # R * prod(shape[1:])

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


def bucket_layout(fqns: Sequence[str], shapes: Sequence[torch.Size], world: int,
                  rank: int) -> tuple[list[BucketEntry], int]:
    """Entries of a unit's packed chunk and the chunk size ``S``."""
    entries, start = [], 0
    for fqn, shape in zip(fqns, shapes):
        if len(shape) == 0:
            raise ValueError(f"parameter {fqn!r} is 0-dimensional; SimpleFSDP shards dim 0: reshape it to shape (1,)")
        rows = -(-shape[0] // world)
        local_rows = max(0, min(rows, shape[0] - rank * rows))
        numel = rows * math.prod(shape[1:])
        entries.append(BucketEntry(fqn, torch.Size(shape), rows, local_rows, start, numel))
        start += numel
    return entries, start


ReduceScatter = Callable[[torch.Tensor], torch.Tensor]
"""``packed [world * S] -> this rank's averaged chunk [S]``."""

ReduceScatterStart = Callable[[torch.Tensor], Callable[[], torch.Tensor]]
"""``packed [world * S] -> finish``: launches the reduce-scatter; ``finish()`` returns this rank's averaged chunk."""


class PendingGradients:
    """Reduce-scatters launched in backward, finished in a final callback of the same backward pass
    (:class:`backward_drain.BackwardDrain`): a unit's backward returns no gradient for its shards, and the callback
    accumulates each into its parameter's ``.grad`` as autograd would have (gradient accumulation unchanged), oldest
    first. Post-accumulate-grad hooks of the parameters do not run for these gradients."""

    def __init__(self) -> None:
        self._drain = BackwardDrain()

    def add(self, bucket: "Bucket", finish: Callable[[], torch.Tensor], dtypes: list[torch.dtype]) -> None:
        """Hold ``bucket``'s launched reduce-scatter (``finish()`` waits for its chunk) until the pass ends."""

        def complete(accumulate: bool) -> None:
            chunk = finish()
            if accumulate:
                with torch.no_grad():
                    for param, grad in zip(bucket.params, bucket.unpack_shards(chunk, dtypes)):
                        _accumulate(param, grad)

        self._drain.add(complete)

    def finish(self) -> None:
        """Finish every exchange launched in this backward pass and accumulate the gradients."""
        self._drain.finish()


def _accumulate(param: torch.Tensor, local_grad: torch.Tensor) -> None:
    """``param.grad += local_grad`` for a ``Shard(0)`` DTensor parameter (``=`` when it has none)."""
    if not param.requires_grad:
        return
    from torch.distributed.tensor import DTensor

    grad = DTensor.from_local(local_grad, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


class Bucket:
    """A unit's layout, process group, dtypes and reduce-scatter (plain or a comm hook)."""

    def __init__(self, name: str, fqns: Sequence[str], shapes: Sequence[torch.Size], group: dist.ProcessGroup,
                 param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
                 pending: Optional[PendingGradients] = None, compute_dtype: Optional[torch.dtype] = None) -> None:
        self.name = name
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.entries, self.chunk = bucket_layout(fqns, shapes, self.world, self.rank)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.compute_dtype = compute_dtype  # the gathered parameters are cast to it (None: as gathered)
        self.reduce_scatter: ReduceScatter = self.plain_reduce_scatter
        self.pending = pending  # shared by a model's buckets; None: every reduce-scatter blocks in its backward
        self.reduce_scatter_start: Optional[ReduceScatterStart] = self.plain_reduce_scatter_start if pending else None
        self.params: list[torch.Tensor] = []  # the unit's DTensor parameters (the overlapped path sets their .grad)
        self.regathered: Optional[list[torch.Tensor]] = None  # eager resharding's backward all-gather
        self._prefetched: Optional[tuple[tuple[int, ...], torch.Tensor]] = None  # (shard versions, gather in flight)

    def plain_reduce_scatter(self, packed: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.reduce_scatter_single(packed, "avg", 0, self.group))

    def plain_reduce_scatter_start(self, packed: torch.Tensor) -> Callable[[], torch.Tensor]:
        reduced = funcol.reduce_scatter_single(packed, "avg", 0, self.group)
        return lambda: funcol.wait_tensor(reduced)

    # ------------------------------------------------------------------ packing

    def pack_shards(self, shards: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Local shards -> this rank's chunk ``[S]`` (padded rows are zero)."""
        flat = [F.pad(shard.reshape(-1).to(dtype), (0, entry.numel - entry.local_rows * entry.row_numel))
                for shard, entry in zip(shards, self.entries)]
        return torch.cat(flat) if len(flat) > 1 else flat[0]

    def unpack_full(self, gathered: torch.Tensor) -> list[torch.Tensor]:
        """Gathered ``[world * S]`` -> every unsharded parameter."""
        rows = gathered.view(self.world, self.chunk)
        full = [rows[:, e.start : e.start + e.numel].reshape(self.world * e.rows, *e.shape[1:])[: e.shape[0]]
                for e in self.entries]
        return [p.to(self.compute_dtype) for p in full] if self.compute_dtype is not None else full

    def pack_grads(self, grads: Sequence[Optional[torch.Tensor]], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """Unsharded gradients -> the reduce-scatter input ``[world * S]`` (row ``j`` for rank ``j``)."""
        pieces = []
        for grad, e in zip(grads, self.entries):
            if grad is None:
                pieces.append(torch.zeros(self.world, e.numel, dtype=dtype, device=device))
                continue
            grad = grad.to(dtype).reshape(e.shape[0], e.row_numel)
            grad = F.pad(grad, (0, 0, 0, self.world * e.rows - e.shape[0]))
            pieces.append(grad.reshape(self.world, e.numel))
        return torch.cat(pieces, dim=1).reshape(-1)

    def unpack_shards(self, chunk: torch.Tensor, dtypes: Sequence[torch.dtype]) -> list[torch.Tensor]:
        """This rank's reduced chunk ``[S]`` -> a gradient per local shard."""
        return [chunk[e.start : e.start + e.local_rows * e.row_numel].view(e.local_rows, *e.shape[1:]).to(dtype)
                for e, dtype in zip(self.entries, dtypes)]

    # ------------------------------------------------------------------ the collective pair

    def gather(self, shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """All-gather the unit (differentiable: its backward is this bucket's reduce-scatter)."""
        return _GatherBucket.apply(self, *shards)

    def gather_detached(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The same all-gather outside autograd (recomputed in backward when resharding)."""
        return self.unpack_full(self._all_gather([s.detach() for s in shards]))

    def prefetch(self, shards: Sequence[torch.Tensor]) -> None:
        """Start this unit's all-gather now, without waiting; the next gather of the same,
        unchanged shards takes its result (see :mod:`fsdp_integration.prefetch`)."""
        if self._prefetched is None:
            wire = self.pack_shards([s.detach() for s in shards], self.param_dtype or shards[0].dtype)
            self._prefetched = (_versions(shards), funcol.all_gather_single(wire, 0, self.group))

    def _all_gather(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The gathered ``[world * S]`` buffer: the prefetched one if still valid, else gathered now."""
        dtype = self.param_dtype or shards[0].dtype
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None:
            gathered = funcol.wait_tensor(prefetched[1])  # every rank started it: finish it either way
            if prefetched[0] == _versions(shards):
                return gathered
        wire = self.pack_shards(shards, dtype)
        return funcol.wait_tensor(funcol.all_gather_single(wire, 0, self.group))


def _versions(shards: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """In-place updates (the optimizer's) bump these: a prefetch of older values is stale."""
    return tuple(tensor_version(s) for s in shards)


class GatheredUnit(Protocol):
    """What the prefetcher and the re-gather hooks need of a unit (:class:`fsdp_integration.simple_fsdp.Unit`),
    so that they do not import the module that builds units."""

    bucket: Bucket
    reshard: bool
    bound: Optional[tuple[torch.Tensor, ...]]
    prefetcher: Any

    def local_shards(self) -> list[torch.Tensor]: ...


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bucket: Bucket, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.dtypes = [s.dtype for s in shards]
        ctx.device = shards[0].device
        return tuple(bucket.unpack_full(bucket._all_gather(shards)))

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        bucket: Bucket = ctx.bucket
        if not torch.compiler.is_compiling():  # eager resharding only: a compiled graph recomputes its gathers
            bucket.regathered = None  # every user of the parameters is done (torch 2.11's Dynamo refuses this write)
        dtype = bucket.reduce_dtype or ctx.dtypes[0]
        packed = bucket.pack_grads(grads, dtype, ctx.device)
        if bucket.pending is not None and bucket.reduce_scatter_start is not None and not torch.compiler.is_compiling():
            bucket.pending.add(bucket, bucket.reduce_scatter_start(packed), ctx.dtypes)
            return (None,) * (1 + len(grads))  # the final callback sets the shards' .grad
        reduced = bucket.reduce_scatter(packed)
        return (None, *bucket.unpack_shards(reduced, ctx.dtypes))
