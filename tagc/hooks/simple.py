"""SimpleFSDP adapter: a unit's reduce-scatter becomes the custom op ``tagc::reduce_scatter``.

SimpleFSDP (``fsdp_integration``) reduces each unit's gradients from one packed buffer
(row ``j`` = rank ``j``'s chunk, each parameter a segment), so the adapter only names the
segments and swaps the unit's reduce-scatter for the hook's. The exchange runs inside one
``torch.library`` custom op with a fake (shape-only) implementation: ``torch.compile``
traces it as a single opaque node per unit (fullgraph, no graph break) while its
data-dependent steps — thresholds, index merge, peeling, the NaN agreement — run eagerly
inside. The hook object is found through a small registry keyed by an integer, since
custom ops take only tensors and scalars.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tagc.hooks.engine import Segment, TAGCHook

if TYPE_CHECKING:
    from fsdp_integration.simple_fsdp import Unit

_registry: dict[int, tuple[TAGCHook, dist.ProcessGroup, tuple[Segment, ...]]] = {}
_handles = itertools.count()


@torch.library.custom_op("tagc::reduce_scatter", mutates_args=())
def reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The averaged chunk of this rank from ``packed`` (``[world * S]``), through a TAGC hook."""
    hook, group, segments = _registry[handle]
    output = packed.new_empty(packed.numel() // dist.get_world_size(group))
    hook.reduce_scatter(output, packed, group, dist.ReduceOp.AVG, segments)
    return output


@reduce_scatter.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    _, group, _ = _registry[handle]
    return packed.new_empty(packed.numel() // dist.get_world_size(group))


def install(hook: TAGCHook, unit: "Unit") -> None:
    """Route ``unit``'s gradient reduce-scatter through ``hook``."""
    if not isinstance(hook, TAGCHook):
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(hook).__name__}")
    bucket = unit.bucket
    segments = tuple(
        Segment(entry.fqn, entry.start, entry.numel, module)
        for entry, module in zip(bucket.entries, unit.owner_modules)
    )
    handle = next(_handles)
    _registry[handle] = (hook, bucket.group, segments)
    bucket.reduce_scatter = lambda packed: reduce_scatter(packed, handle)
    bucket.hook = hook
