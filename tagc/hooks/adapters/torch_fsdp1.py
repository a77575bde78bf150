"""Every private torch name TAGC's FSDP1 (``FullyShardedDataParallel``) adapter uses, in one place.

``FullyShardedDataParallel.register_comm_hook`` takes one state for the whole model and refuses a
second registration, while TAGC needs one state per unit (each unit's flat buffer holds different
parameters): the adapter sets each unit's hook and state itself (``_comm_hook``,
``_comm_hook_state``), as ``register_comm_hook`` does. Which parameters a unit's flat buffer holds,
and their shapes, are on its ``FlatParameter`` (``_handle``, ``_fqns``, ``_shapes``, ``_numels``,
``_sharded_size``), and the dtype it reduces in on its handle (``_reduce_dtype``): FSDP1 has no public
accessor for any of these.

The ``FlatParameter`` fields are checked at import (:func:`check_torch`); the unit's attributes,
which FSDP1 sets at run time, are read through :func:`backward_drain.torch_versions.read_internal`,
which names a missing one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from backward_drain.torch_versions import check_internals, read_internal

INTEGRATION = "TAGC's FSDP1 adapter (tagc.hooks.adapters.fsdp1)"
ADVICE = "use another integration (FSDP2: fully_shard, SimpleFSDP, or DDP)"
NEEDS = ("torch.distributed.fsdp._flat_param.FlatParameter:_fqns",
         "torch.distributed.fsdp._flat_param.FlatParameter:_shapes",
         "torch.distributed.fsdp._flat_param.FlatParameter:_numels",
         "torch.distributed.fsdp._flat_param.FlatParameter:_sharded_size")
"""The private names checked at import (:func:`check_torch`). Read at run time, and checked there: a unit's
``_handle``, ``_comm_hook`` and ``_comm_hook_state``, its handle's ``_reduce_dtype``."""

__all__ = ["check_torch", "comm_hook", "comm_hook_state", "flat_param", "install_comm_hook", "param_entries",
           "reduce_dtype", "sharded_numel"]


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if it is outside the range."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


def _read(obj: Any, name: str) -> Any:
    return read_internal(obj, name, INTEGRATION, ADVICE)


def flat_param(unit: FSDP) -> Optional[torch.nn.Parameter]:
    """A unit's ``FlatParameter`` (``None`` when the unit manages no parameter of its own)."""
    handle = _read(unit, "_handle")
    return handle.flat_param if handle is not None else None


def param_entries(flat: Optional[torch.nn.Parameter]) -> list[tuple[str, tuple[int, ...], int]]:
    """``(name within the unit, shape, numel)`` of every parameter in a ``FlatParameter``, in buffer order."""
    return [] if flat is None else [(fqn, tuple(shape), numel)
            for fqn, shape, numel in zip(flat._fqns, flat._shapes, flat._numels, strict=True)]


def sharded_numel(flat: torch.nn.Parameter) -> int:
    """How many elements of a ``FlatParameter`` each rank holds (its padded shard)."""
    return flat._sharded_size.numel()


def reduce_dtype(unit: FSDP) -> torch.dtype:
    """The dtype a unit reduces its gradients in: its mixed-precision ``reduce_dtype``, else its flat buffer's."""
    handle = _read(unit, "_handle")
    return _read(handle, "_reduce_dtype") or handle.flat_param.dtype


def comm_hook(unit: FSDP) -> Optional[Callable]:
    """The communication hook registered on a unit (``None`` when none is)."""
    return _read(unit, "_comm_hook")


def comm_hook_state(unit: FSDP) -> Any:
    """The state a unit hands its communication hook (TAGC's per-unit state, where TAGC registered it)."""
    return _read(unit, "_comm_hook_state")


def install_comm_hook(unit: FSDP, hook: Callable, state: Any) -> None:
    """Make ``unit`` call ``hook(state, grad, output)`` instead of its reduce-scatter: what
    ``FullyShardedDataParallel.register_comm_hook`` does, with a state of the unit's own."""
    _read(unit, "_comm_hook")  # a torch that renamed it raises here, rather than set a dead attribute
    unit._comm_hook = hook
    unit._comm_hook_state = state


check_torch()
