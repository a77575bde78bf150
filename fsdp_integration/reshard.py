"""Reshard after forward: keep no unsharded parameter between a block's forward and backward.

Both modes recompute the block's all-gather in backward instead of saving its output:

* eager — :func:`regather_saved_params`: while a unit runs, autograd's saved tensors that
  live in the unit's gathered storage are replaced by a small record; in backward the first
  one unpacked all-gathers the unit again (once), the rest are views of that.
* compiled — :func:`mark_all_gathers_for_recompute`, a joint-graph pass: the nodes traced
  under :data:`GATHER_TAG` (the packing, the all-gather and the unpacking views of units
  that reshard) are tagged ``MUST_RECOMPUTE``, so the partitioner recomputes them in the
  backward graph rather than saving full parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_integration.bucket import GatheredUnit

GATHER_TAG = "simple_fsdp_gather"
"""``node.meta["custom"]`` key of the nodes of a unit's forward all-gather (value: reshard?)."""


@dataclasses.dataclass(frozen=True)
class _Regather:
    unit: GatheredUnit
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@contextlib.contextmanager
def regather_saved_params(unit: GatheredUnit):
    """Eager resharding for the duration of ``unit``'s forward (see the module docstring)."""
    storages = {full.untyped_storage().data_ptr(): i for i, full in enumerate(unit.bound)}

    def pack(tensor: torch.Tensor):
        index = storages.get(tensor.untyped_storage().data_ptr()) if tensor.layout == torch.strided else None
        if index is None:
            return tensor
        return _Regather(unit, index, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(saved):
        if not isinstance(saved, _Regather):
            return saved
        bucket = saved.unit.bucket
        if bucket.regathered is None:
            bucket.regathered = bucket.gather_detached(saved.unit.local_shards())
            saved.unit.prefetcher.backward_started(saved.unit)
        return bucket.regathered[saved.index].as_strided(saved.size, saved.stride, saved.offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes that depend on a tangent (the backward half of a joint graph)."""
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and "tangent" in node.name) or any(a in backward for a in node.all_input_nodes):
            backward.add(node)
    return backward


def mark_all_gathers_for_recompute(gm: torch.fx.GraphModule, *args) -> torch.fx.GraphModule:
    """Joint-graph pass: recompute (``MUST_RECOMPUTE``) the forward all-gathers of resharding
    units in backward."""
    backward = _backward_nodes(gm.graph)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        if not node.meta.get("custom", {}).get(GATHER_TAG):
            continue  # not a gather, or a unit that keeps its parameters: the partitioner decides
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        node.meta["ac_graph_id"] = 100_000  # one region of its own, away from user checkpoints
    gm.recompile()
    return gm
