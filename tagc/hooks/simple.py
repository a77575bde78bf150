"""SimpleFSDP adapter: a unit's reduce-scatter through a TAGC hook, eager (overlapped) or traced.

SimpleFSDP (``fsdp_integration``) reduces each unit's gradients from one packed buffer
(row ``j`` = rank ``j``'s chunk, each parameter a segment), so the adapter only names the
segments and gives the unit's bucket the hook's exchange:

* eager, ``overlap=True``: ``bucket.reduce_scatter_start`` launches the exchange in the
  unit's backward and returns the function that finishes it, which the bucket calls in a
  final callback of the backward pass (:class:`fsdp_integration.bucket.PendingGradients`);
* eager, ``overlap=False``: ``bucket.reduce_scatter`` runs it to the end (one opaque op);
* under ``torch.compile`` the exchange is traced in halves around fixed-shape functional
  collectives (the wire sizes follow from the settings alone)::

    wire = tagc::encode(packed)             # every part encoded, its wire tensors side by side as bytes
    wire = all_to_all_single(wire)          # row j to / from rank j: one collective per bucket
    chunk = tagc::decode(wire, chunk, dtype)  # index merge, summed sketch, peeling

One collective per bucket lets Inductor's ``sink_waits`` move its wait past the next block's
backward compute (it does not sink a wait past a later collective).

The data-dependent steps are ``torch.library`` custom ops with shape-only fake
implementations; the hook state (residuals, statistics) is reached through a small
registry keyed by an integer, since custom ops take only tensors and scalars. Settings
with data-dependent sizes (``fallback="raw"``, ``dense_steps``) and buckets with nothing to
compress run the whole exchange as the single op ``tagc::reduce_scatter`` instead.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tagc.hooks.engine import Segment, TAGCHook

if TYPE_CHECKING:
    from fsdp_integration.simple_fsdp import Unit

_registry: dict[int, tuple[TAGCHook, dist.ProcessGroup, tuple[Segment, ...], str]] = {}
_handles = itertools.count()


def _world(handle: int) -> int:
    return dist.get_world_size(_registry[handle][1])


@torch.library.custom_op("tagc::reduce_scatter", mutates_args=())
def reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The averaged chunk of this rank from ``packed`` (``[world * S]``), through a TAGC hook."""
    hook, group, segments, unit = _registry[handle]
    output = packed.new_empty(packed.numel() // dist.get_world_size(group))
    hook.reduce_scatter(output, packed, group, dist.ReduceOp.AVG, segments, unit)
    return output


@reduce_scatter.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    return packed.new_empty(packed.numel() // _world(handle))


@torch.library.custom_op("tagc::encode", mutates_args=())
def encode(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """Bytes for the all-to-all: every part's wire tensors side by side (updates the residuals)."""
    hook, group, segments, _ = _registry[handle]
    return hook.encode_bucket(packed, group, segments)


@encode.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    hook, _, segments, _ = _registry[handle]
    world = _world(handle)
    return packed.new_empty(world, hook.wire_row_bytes(segments, packed.numel() // world, world, packed.dtype),
                            dtype=torch.uint8)


@torch.library.custom_op("tagc::decode", mutates_args=())
def decode(received: torch.Tensor, handle: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's row of bytes (row ``j`` from rank ``j``) -> this rank's averaged chunk."""
    hook, group, segments, _ = _registry[handle]
    return hook.decode_bucket(received, group, segments, chunk, dtype)


@decode.register_fake
def _(received: torch.Tensor, handle: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    return received.new_empty(chunk, dtype=dtype)


def _all_to_all(rows: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, group))


def traced_reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The exchange as custom ops around functional collectives (fixed shapes; see the module docstring)."""
    _, group, _, _ = _registry[handle]
    received = _all_to_all(encode(packed, handle), group)
    return decode(received, handle, packed.numel() // _world(handle), packed.dtype)


def install(hook: TAGCHook, unit: "Unit") -> None:
    """Route ``unit``'s gradient reduce-scatter through ``hook``."""
    if not isinstance(hook, TAGCHook):
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(hook).__name__}")
    bucket = unit.bucket
    segments = tuple(
        Segment(entry.fqn, entry.start, entry.numel, module, shape=tuple(entry.shape))
        for entry, module in zip(bucket.entries, unit.owner_modules)
    )
    handle = next(_handles)
    _registry[handle] = (hook, bucket.group, segments, unit.name)
    traced = hook.traceable(segments, bucket.chunk, bucket.world)

    def hooked(packed: torch.Tensor) -> torch.Tensor:
        if traced and torch.compiler.is_compiling():
            return traced_reduce_scatter(packed, handle)
        return reduce_scatter(packed, handle)

    def hooked_start(packed: torch.Tensor) -> Callable[[], torch.Tensor]:
        output = packed.new_empty(bucket.chunk)
        return hook.start(output, packed, bucket.group, dist.ReduceOp.AVG, segments, unit.name).wait

    bucket.reduce_scatter = hooked
    bucket.reduce_scatter_start = hooked_start if hook.overlap else None
    bucket.hook_handle = handle
