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

The adapter installs itself through SimpleFSDP's reduce-scatter hook point
(``model.register_comm_hook``, :data:`fsdp_integration.simple_fsdp.CommHook`), which
:func:`tagc.register_comm_hook` calls with :func:`bind`; it reads a unit by duck typing
and never imports ``fsdp_integration``.

The data-dependent steps are ``torch.library`` custom ops with shape-only fake
implementations; the hook state (residuals, statistics) is reached through a small
registry keyed by an integer, since custom ops take only tensors and scalars. The registry
holds its entries weakly: an entry lives as long as the unit's installed reduce-scatter
(which holds it), and goes when the model (or a hook installed over it) lets that go. Settings
with data-dependent sizes (``fallback="raw"``, ``dense_steps``) and buckets with nothing to
compress run the whole exchange as the single op ``tagc::reduce_scatter`` instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tagc.hooks.segment import Segment


@dataclasses.dataclass(eq=False)
class _Binding:
    """What the custom ops reach through a handle: one unit's hook, group and segments."""

    hook: "tagc.hooks.engine.TAGCHook"  # named, not imported: the engine imports this module (TAGCHook.__call__)
    group: dist.ProcessGroup
    segments: tuple[Segment, ...]
    unit: str


_registry: "weakref.WeakValueDictionary[int, _Binding]" = weakref.WeakValueDictionary()
_handles = itertools.count()


def _world(handle: int) -> int:
    return dist.get_world_size(_registry[handle].group)


@torch.library.custom_op("tagc::reduce_scatter", mutates_args=())
def reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The averaged chunk of this rank from ``packed`` (``[world * S]``), through a TAGC hook."""
    binding = _registry[handle]
    output = packed.new_empty(packed.numel() // dist.get_world_size(binding.group))
    binding.hook.reduce_scatter(output, packed, binding.group, dist.ReduceOp.AVG, binding.segments, binding.unit)
    return output


@reduce_scatter.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    return packed.new_empty(packed.numel() // _world(handle))


@torch.library.custom_op("tagc::encode", mutates_args=())
def encode(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """Bytes for the all-to-all: every part's wire tensors side by side (updates the residuals)."""
    binding = _registry[handle]
    return binding.hook.encode_bucket(packed, binding.group, binding.segments)


@encode.register_fake
def _(packed: torch.Tensor, handle: int) -> torch.Tensor:
    binding = _registry[handle]
    world = _world(handle)
    return packed.new_empty(world, binding.hook.wire_row_bytes(binding.segments, packed.numel() // world, world, packed.dtype),
                            dtype=torch.uint8)


@torch.library.custom_op("tagc::decode", mutates_args=())
def decode(received: torch.Tensor, handle: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's row of bytes (row ``j`` from rank ``j``) -> this rank's averaged chunk."""
    binding = _registry[handle]
    return binding.hook.decode_bucket(received, binding.group, binding.segments, chunk, dtype)


@decode.register_fake
def _(received: torch.Tensor, handle: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    return received.new_empty(chunk, dtype=dtype)


def _all_to_all(rows: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, group))


def traced_reduce_scatter(packed: torch.Tensor, handle: int) -> torch.Tensor:
    """The exchange as custom ops around functional collectives (fixed shapes; see the module docstring)."""
    group = _registry[handle].group
    return _traced(packed, handle, group, dist.get_world_size(group))


def _traced(packed: torch.Tensor, handle: int, group, world: int) -> torch.Tensor:
    received = _all_to_all(encode(packed, handle), group)
    return decode(received, handle, packed.numel() // world, packed.dtype)


def bind(hook: "tagc.hooks.engine.TAGCHook", unit) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                                         Optional[Callable[[torch.Tensor], Callable[[], torch.Tensor]]]]:
    """SimpleFSDP's comm hook for ``unit`` through ``hook``: ``(reduce_scatter, start)``.

    ``unit`` is a SimpleFSDP unit: its ``name``, ``owner_modules`` (one module per parameter)
    and ``bucket`` (``entries`` with ``fqn``/``start``/``numel``/``shape``, ``group``, ``chunk``,
    ``world``). The returned ``reduce_scatter`` carries its registry ``handle``."""
    if not hasattr(hook, "encode_bucket"):  # duck-typed: the engine calls bind itself (no import cycle)
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(hook).__name__}")
    bucket = unit.bucket
    segments = tuple(
        Segment(entry.fqn, entry.start, entry.numel, module, shape=tuple(entry.shape))
        for entry, module in zip(bucket.entries, unit.owner_modules)
    )
    handle = next(_handles)
    binding = _Binding(hook, bucket.group, segments, unit.name)
    _registry[handle] = binding
    traced = hook.traceable(segments, bucket.chunk, bucket.world)

    def hooked(packed: torch.Tensor) -> torch.Tensor:
        if traced and torch.compiler.is_compiling():
            return _traced(packed, handle, bucket.group, bucket.world)  # no registry look-up in traced code
        return reduce_scatter(packed, handle)

    def hooked_start(packed: torch.Tensor) -> Callable[[], torch.Tensor]:
        output = packed.new_empty(bucket.chunk)
        return hook.start(output, packed, bucket.group, dist.ReduceOp.AVG, segments, unit.name).wait

    hooked.handle = handle
    hooked.binding = binding  # the registry's entry lives as long as this function
    return hooked, (hooked_start if hook.overlap else None)
