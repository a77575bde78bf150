"""The one-line entry points: ``tagc.hook(...)``, ``tagc.register_comm_hook(model, hook)`` and, for
users who call DDP's own ``register_comm_hook``, ``tagc.ddp_hook(model, ...)``."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from tagc.hooks.adapters.ddp import DDPHookState, bind_ddp, register_ddp
from tagc.hooks.core.engine import TAGCHook
from tagc.hooks.core.selection import SelectPolicy
from tagc.hooks.core.settings import HookSettings


def hook(ratio: float | None = None, index_bits: int | None = None, sparsity: float | str | None = None,
         select: str | SelectPolicy = "non_attention_linear", **settings) -> TAGCHook:
    """A TAGC comm hook, its settings validated once into a :class:`~tagc.hooks.core.settings.HookSettings`, which
    documents every one of them.

    With no arguments, codec ``tagc`` runs :data:`~tagc.hooks.core.settings.RECOMMENDED` (its loss against plain:
    ``docs/evidence.md``), ``codec="topk"`` likewise; every argument given overrides its part of it, and
    ``tagc.hook(ratio=10, plain="fp32", feedback="classic", positions="bitmap", value_dtype="float32")`` is the TAGC
    paper's codec. A codec's own options (``block`` for ``int4``, ``rank`` for ``powersgd``) go in ``settings``."""
    return TAGCHook(HookSettings.from_arguments(ratio, index_bits, sparsity, select=select, **settings))


def ddp_hook(model: nn.parallel.DistributedDataParallel, *args, group: dist.ProcessGroup | None = None,
             **settings) -> tuple[DDPHookState, Callable]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(*tagc.ddp_hook(ddp_model))``: every codec of
    :func:`hook` as a DDP comm hook (:mod:`tagc.hooks.adapters.ddp`; docs/guide.md, "The hook", "DDP").
    ``model``: the DDP model (``select`` sees its parameter names, and the hook sees when DDP's buckets are final).
    ``group``: the group DDP reduces over (default: the DDP model's). ``*args, **settings``: :func:`hook`'s.
    ``state`` has ``state_dict``/``load_state_dict``/``stats``/``end_step``; ``state.hook`` is the :class:`TAGCHook`."""
    return bind_ddp(model, hook(*args, **settings), group)


def register_comm_hook(model: nn.Module, comm_hook: TAGCHook) -> nn.Module:
    """Install ``comm_hook`` on a SimpleFSDP, FSDP2 (``fully_shard``), FSDP1 or DDP
    (``DistributedDataParallel``: :mod:`tagc.hooks.adapters.ddp`) model; returns the model."""
    from tagc.hooks.adapters.fsdp2 import register_fsdp2

    if not isinstance(comm_hook, TAGCHook):
        raise TypeError(f"expected a hook from tagc.hook(...), got {type(comm_hook).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        register_ddp(model, comm_hook)
        return model
    if getattr(model, "_simple_fsdp_units", None) is not None:  # SimpleFSDP: through its reduce-scatter hook point
        from tagc.hooks.adapters.simple import bind

        return model.register_comm_hook(functools.partial(bind, comm_hook))
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):
        from tagc.hooks.adapters.fsdp1 import register_fsdp1

        register_fsdp1(model, comm_hook)
        return model
    if register_fsdp2(model, comm_hook) == 0:
        raise ValueError(
            "no FSDP module found: wrap the model first with fsdp_integration.simple_fsdp(...) (SimpleFSDP), "
            "fully_shard(...) (FSDP2), FullyShardedDataParallel (FSDP1) or DistributedDataParallel (DDP)"
        )
    return model
