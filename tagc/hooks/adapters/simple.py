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
backward compute (it does not sink a wait past a later collective). On several hosts (docs/design.md §11)
:func:`bind` creates the local and cross subgroups, and the traced exchange first reduces inside the host
(``all_to_all_single(packed as [G, H*S], local).sum(0)`` in float32, the eager engine's arithmetic), then runs
the three steps above on the cross group. An HSDP mesh's units: :mod:`tagc.hooks.adapters.simple_hsdp`.

The adapter installs itself through SimpleFSDP's reduce-scatter hook point
(:data:`fsdp_integration.simple_fsdp.CommHook`) and reads a unit by duck typing: it never imports
``fsdp_integration``. The custom ops have shape-only fake implementations, reach the hook through a registry
keyed by an integer (held weakly) and take the unit's *state token* (:attr:`_Binding.state`), which they bump
and declare mutated (docs/design.md §2, "The traced path's state"). Settings with data-dependent sizes
(``fallback="raw"``), buckets with nothing to compress and the dense warm-up run the whole exchange as the
single op ``tagc::reduce_scatter`` (the graph guards on ``hook.warmed_up``, so it is made again, with the
traced halves, once the warm-up is over).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tagc.hooks.adapters.torch_simple_fsdp import funcol
from tagc.hooks.core.hierarchy import Topology
from tagc.hooks.core.segment import Segment


@dataclasses.dataclass(eq=False)
class _Binding:
    """What the custom ops reach through a handle: one unit's hook, group and segments."""

    hook: "tagc.hooks.core.engine.TAGCHook"  # noqa: F821  named, not imported: the engine imports this module (TAGCHook.__call__)
    group: dist.ProcessGroup
    segments: tuple[Segment, ...]
    unit: str
    topology: Optional[Topology] = None
    """The group's topology (hierarchical: the codec's halves run on its cross group)."""
    state: Optional[torch.Tensor] = None
    """The unit's state token: every op that changes the hook's state (residuals, statistics) for this
    unit bumps it and declares it mutated, so a compiler can neither drop, merge nor reorder those calls."""

    @property
    def codec_group(self) -> dist.ProcessGroup:
        """The group :func:`encode` and :func:`decode` exchange over: the cross group when hierarchical."""
        return self.topology.cross if self.topology is not None and self.topology.hierarchical else self.group


_registry: "weakref.WeakValueDictionary[int, _Binding]" = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("tagc::reduce_scatter", mutates_args=("state",))
def reduce_scatter(packed: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    """The averaged chunk of this rank from ``packed`` (``[world * S]``), through a TAGC hook
    (updates the residuals and statistics: bumps ``state``)."""
    binding = _registry[handle]
    output = packed.new_empty(packed.numel() // dist.get_world_size(binding.group))
    binding.hook.reduce_scatter(output, packed, binding.group, dist.ReduceOp.AVG, binding.segments, binding.unit)
    state.add_(1)
    return output


@reduce_scatter.register_fake
def _(packed: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    return packed.new_empty(packed.numel() // dist.get_world_size(_registry[handle].group))


@torch.library.custom_op("tagc::encode", mutates_args=("state",))
def encode(packed: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    """Bytes for the all-to-all: every part's wire tensors side by side (updates the residuals and
    statistics: bumps ``state``)."""
    binding = _registry[handle]
    wire = binding.hook.encode_bucket(packed, binding.codec_group, binding.segments)
    state.add_(1)
    return wire


@encode.register_fake
def _(packed: torch.Tensor, state: torch.Tensor, handle: int) -> torch.Tensor:
    binding = _registry[handle]
    world = dist.get_world_size(binding.codec_group)
    row_bytes = binding.hook.wire_row_bytes(binding.segments, packed.numel() // world, world, packed.dtype)
    return packed.new_empty(world, row_bytes, dtype=torch.uint8)


@torch.library.custom_op("tagc::decode", mutates_args=("state",))
def decode(received: torch.Tensor, state: torch.Tensor, handle: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's row of bytes (row ``j`` from rank ``j``) -> this rank's averaged chunk (updates
    the statistics: bumps ``state``)."""
    binding = _registry[handle]
    output = binding.hook.decode_bucket(received, binding.codec_group, binding.segments, chunk, dtype,
                                        topology=binding.topology)
    state.add_(1)
    return output


@decode.register_fake
def _(received: torch.Tensor, state: torch.Tensor, handle: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    return received.new_empty(chunk, dtype=dtype)


def _all_to_all(rows: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, group))


def _traced(packed: torch.Tensor, handle: int, state: torch.Tensor, group, world: int) -> torch.Tensor:
    """The exchange as custom ops around functional collectives (fixed shapes; see the module docstring)."""
    received = _all_to_all(encode(packed, state, handle), group)
    return decode(received, state, handle, packed.numel() // world, packed.dtype)


def _traced_hierarchical(packed: torch.Tensor, handle: int, state: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Step 1 with a functional all-to-all on the local group (row ``l`` of the ``[G, H*S]`` view
    to local rank ``l``) and a float32 sum, as :func:`tagc.hooks.core.hierarchy.host_reduce`; step 2,
    the codec's halves on the cross group."""
    hosts, per = topo.hosts, topo.per_host
    chunk = packed.numel() // topo.world
    send = packed.view(hosts, per, chunk).transpose(0, 1).reshape(per, hosts * chunk)
    block = _all_to_all(send, topo.local).sum(dim=0, dtype=torch.float32).to(packed.dtype)
    return _traced(block, handle, state, topo.cross, hosts)


def bind(
    hook: "tagc.hooks.core.engine.TAGCHook",  # noqa: F821  named, not imported (the engine imports this module)
    unit,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Optional[Callable[[torch.Tensor], Callable[[], torch.Tensor]]]]:
    """SimpleFSDP's comm hook for ``unit`` through ``hook``: ``(reduce_scatter, start)``.

    ``unit`` is a SimpleFSDP unit: its ``name``, ``owner_modules`` (one module per parameter)
    and ``bucket`` (``entries`` with ``fqn``/``start``/``numel``/``shape``, ``group``, ``chunk``,
    ``world``; on an HSDP mesh also ``replicate``: then :func:`tagc.hooks.adapters.simple_hsdp.bind_replicated`).
    The returned ``reduce_scatter`` carries its registry ``handle``."""
    if not hasattr(hook, "encode_bucket"):  # duck-typed: the engine calls bind itself (no import cycle)
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(hook).__name__}")
    bucket = unit.bucket
    segments = tuple(Segment(entry.fqn, entry.start, entry.numel, module, shape=tuple(entry.shape))
                     for entry, module in zip(bucket.entries, unit.owner_modules))
    hook.note_parameters(segments)  # the settings check compares what select picks, not its name
    device = unit.params[0].device if getattr(unit, "params", None) else torch.device("cpu")
    if getattr(bucket, "replicate", None) is not None:  # HSDP: plain within the host, the codec across replicas
        from tagc.hooks.adapters.simple_hsdp import bind_replicated

        return bind_replicated(hook, unit, segments, torch.zeros(1, dtype=torch.int64, device=device))
    handle = next(_handles)
    # every rank binds the same units in the same order: the subgroups of a hierarchical topology are made here
    topo = hook.topology(bucket.group) if bucket.world > 1 else None
    binding = _Binding(hook, bucket.group, segments, unit.name, topo, torch.zeros(1, dtype=torch.int64, device=device))
    _registry[handle] = binding
    hierarchical = topo is not None and topo.hierarchical
    traced = hook.traceable_settings(segments, bucket.chunk, topo.hosts if hierarchical else bucket.world)

    def hooked(packed: torch.Tensor) -> torch.Tensor:
        # no registry look-up in traced code; during the warm-up (its wire changes shape) one opaque op
        if traced and hook.warmed_up and torch.compiler.is_compiling():
            if hierarchical:
                return _traced_hierarchical(packed, handle, binding.state, topo)
            return _traced(packed, handle, binding.state, bucket.group, bucket.world)
        return reduce_scatter(packed, binding.state, handle)

    def hooked_start(packed: torch.Tensor) -> Callable[[], torch.Tensor]:
        output = packed.new_empty(bucket.chunk)
        return hook.start(output, packed, bucket.group, dist.ReduceOp.AVG, segments, unit.name).wait

    hooked.handle = handle
    hooked.binding = binding  # the registry's entry lives as long as this function
    return hooked, (hooked_start if hook.settings.overlap else None)
