"""SimpleFSDP adapter: a unit's reduce-scatter through a TAGC hook, eager or traced.

SimpleFSDP (``fsdp_integration``) reduces each unit's gradients from one packed buffer
(row ``j`` = rank ``j``'s chunk, each parameter a segment), so the adapter only names the
segments and swaps the unit's reduce-scatter for the hook's.

Under ``torch.compile`` the exchange is traced in halves around fixed-shape functional
collectives (the wire sizes follow from the settings alone)::

    flag = tagc::nonfinite(packed)                  # this rank's compressed columns: NaN/Inf?
    flag = all_reduce(flag, "max")
    plain, index, table = tagc::encode(packed, flag) # error feedback, threshold, index, sketch
    plain, index, table = all_to_all_single(...)    # row j to / from rank j
    chunk = tagc::decode(plain, index, table, flag) # index merge, summed sketch, peeling

The data-dependent steps are ``torch.library`` custom ops with shape-only fake
implementations; the hook state (residuals, statistics) is reached through a small
registry keyed by an integer, since custom ops take only tensors and scalars. Settings
with data-dependent sizes (``fallback="raw"``, ``dense_steps``) and buckets with nothing to
compress run the whole exchange as the single op ``tagc::reduce_scatter`` instead; so does
eager mode, where it is the engine's pipelined exchange.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tagc.hooks.engine import Segment, TAGCHook

if TYPE_CHECKING:
    from fsdp_integration.simple_fsdp import Unit

_registry: dict[int, tuple[TAGCHook, dist.ProcessGroup, tuple[Segment, ...]]] = {}
_handles = itertools.count()


def _world(handle: int) -> int:
    return dist.get_world_size(_registry[handle][1])


@torch.library.custom_op("tagc::reduce_scatter", mutates_args=())
def reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The averaged chunk of this rank from ``packed`` (``[world * S]``), through a TAGC hook."""
    hook, group, segments = _registry[handle]
    output = packed.new_empty(packed.numel() // dist.get_world_size(group))
    hook.reduce_scatter(output, packed, group, dist.ReduceOp.AVG, segments)
    return output


@reduce_scatter.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    return packed.new_empty(packed.numel() // _world(handle))


@torch.library.custom_op("tagc::nonfinite", mutates_args=())
def nonfinite(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """``int32[1]``: 1 when this rank's compressed columns hold a NaN/Inf."""
    hook, group, segments = _registry[handle]
    return hook.local_nonfinite(packed, group, segments)


@nonfinite.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    return packed.new_empty(1, dtype=torch.int32)


def _shapes(packed: torch.Tensor, handle: int) -> tuple[int, int, int, int]:
    hook, _, segments = _registry[handle]
    world = _world(handle)
    return (world, *hook.wire_shapes(segments, packed.numel() // world, world))


@torch.library.custom_op("tagc::encode", mutates_args=())
def encode(packed: torch.Tensor, flag: torch.Tensor, handle: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows for the all-to-all: plain columns, index bytes, sketch cells (updates the residuals)."""
    hook, group, segments = _registry[handle]
    plain, index, table = hook.encode_bucket(packed, bool(flag), group, segments)
    return plain.contiguous(), index, table


@encode.register_fake
def _(packed: torch.Tensor, flag: torch.Tensor, handle: int):
    world, plain, index, table = _shapes(packed, handle)
    return (packed.new_empty(world, plain), packed.new_empty(world, index, dtype=torch.uint8),
            packed.new_empty(world, table, dtype=torch.float32))


@torch.library.custom_op("tagc::decode", mutates_args=())
def decode(plain: torch.Tensor, index: torch.Tensor, table: torch.Tensor, flag: torch.Tensor, handle: int, chunk: int) -> torch.Tensor:
    """Every rank's rows (row ``j`` from rank ``j``) -> this rank's averaged chunk."""
    hook, group, segments = _registry[handle]
    return hook.decode_bucket(plain, index, table, bool(flag), group, segments, chunk)


@decode.register_fake
def _(plain, index, table, flag, handle: int, chunk: int) -> torch.Tensor:
    return plain.new_empty(chunk)


def _all_to_all(rows: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, group))


def traced_reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The exchange as custom ops around functional collectives (fixed shapes; see the module docstring)."""
    _, group, _ = _registry[handle]
    flag = funcol.wait_tensor(funcol.all_reduce(nonfinite(packed, handle), "max", group))
    plain, index, table = encode(packed, flag, handle)
    received = [_all_to_all(rows, group) for rows in (plain, index, table)]
    return decode(*received, flag, handle, packed.numel() // _world(handle))


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
    traced = hook.traceable(segments, bucket.chunk, bucket.world)

    def hooked(packed: torch.Tensor) -> torch.Tensor:
        if traced and torch.compiler.is_compiling():
            return traced_reduce_scatter(packed, handle)
        return reduce_scatter(packed, handle)

    bucket.reduce_scatter = hooked
    bucket.hook_handle = handle
