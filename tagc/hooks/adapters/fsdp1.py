"""FSDP1 (``FullyShardedDataParallel``) adapter for existing pipelines.

FSDP1 flattens each wrapped unit into one buffer and splits it across ranks *by position*,
so one parameter may span several ranks' chunks; selection is therefore per unit: a unit is
compressed when the policy selects (nearly) all of its elements — wrap the layers you want
compressed as their own units, e.g. an auto-wrap policy over the linears. A policy that returns
a ratio (:func:`tagc.hooks.core.selection.ratio_for`) gives the unit the smallest ratio its parameters
ask for. FSDP1 calls a registered hook instead of its reduce-scatter and applies no divide
factors around it, so the hook averages itself. The exchange blocks (``overlap`` does not apply):
FSDP1 reads the output as soon as the hook returns, to accumulate or cast the sharded gradient.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

from tagc.hooks.adapters.torch_fsdp1 import comm_hook, flat_param, install_comm_hook, param_entries
from tagc.hooks.core.engine import Segment, TAGCHook
from tagc.kernels.fallbacks import warn_fallback

_SHARDED = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)

FSDP1_SELECTED_FRACTION = 0.95
"""A unit is compressed when the policy selects parameters holding at least this fraction of
its elements (a linear's bias rides along with its weight)."""


class _UnitState:
    """Per-unit state FSDP1 passes back to the hook."""

    def __init__(self, hook: TAGCHook, unit: FSDP, prefix: str = "") -> None:
        self.hook = hook
        self.unit = unit
        self.prefix = prefix
        self.group = unit.process_group
        self._segments: dict[int, tuple[Segment, ...]] = {}

    def segments(self, chunk: int) -> tuple[Segment, ...]:
        if chunk not in self._segments:
            entries = param_entries(flat_param(self.unit))
            names = [self.prefix + fqn for fqn, _, _ in entries]
            numels = [numel for _, _, numel in entries]
            choices = [self.hook.settings.select(name, None) for name in names]
            selected = unit_selection(choices, numels, self.hook.settings.config.ratio)
            label = "+".join(names) or "<empty>"
            if selected is False and any(choices) and self.hook.codec.compresses:
                share = sum(n for choice, n in zip(choices, numels) if choice) / sum(numels)
                unit = self.prefix.rstrip(".") or "<root>"
                warn_fallback("fsdp1-unit-plain", f"TAGC on FSDP1: unit {unit!r} goes plain although select picks "
                          f"{share:.0%} of its elements (a unit is compressed only when select picks at least "
                          f"{FSDP1_SELECTED_FRACTION:.0%}): wrap the layers to compress as their own FSDP units")
            shape = entries[0][1] if len(names) == 1 else None  # one parameter: the flat buffer starts with it
            self._segments[chunk] = (Segment(label, 0, chunk, selected=selected, shape=shape),)
        return self._segments[chunk]


def unit_selection(choices: list, numels: list[int], default_ratio: float) -> Union[bool, float]:
    """What an FSDP1 unit's one segment is given, from its parameters' ``select`` answers
    (``choices``, one per parameter of ``numels`` elements): ``False`` unless the answers select
    at least :data:`FSDP1_SELECTED_FRACTION` of its elements; ``True`` (the hook's ratio) when
    none is a number; else the smallest ratio asked for (``True`` counting as ``default_ratio``),
    so that no parameter in the shared flat buffer is compressed harder than its policy asked.
    An answer that is neither ``bool`` nor a number is passed on for the hook to name
    (:meth:`tagc.hooks.core.plan.Planner.ratio_of`)."""
    chosen = sum(n for choice, n in zip(choices, numels) if choice)
    if not numels or chosen < FSDP1_SELECTED_FRACTION * sum(numels):
        return False
    asked = [choice for choice in choices if choice is not None and choice is not False]
    invalid = [choice for choice in asked if choice is not True and not isinstance(choice, (int, float))]
    if invalid:
        return invalid[0]
    if all(choice is True for choice in asked):
        return True
    return min(default_ratio if choice is True else float(choice) for choice in asked)


def _tagc_fsdp1_hook(state: _UnitState, grad: torch.Tensor, output: torch.Tensor) -> None:
    """FSDP1 comm hook: ``grad`` is the padded flat gradient, ``output`` this rank's shard."""
    state.hook.reduce_scatter(output, grad, state.group, dist.ReduceOp.AVG, state.segments(output.numel()),
                              state.prefix.rstrip(".") or "<root>")


def register_fsdp1(model: FSDP, hook: TAGCHook) -> None:
    """Install ``hook`` on every unit of an FSDP1 root, each with its own segment state."""
    if not model.check_is_root():
        raise ValueError("register the TAGC hook on the FSDP1 root module")
    units = FSDP.fsdp_modules(model)
    for unit in units:
        if unit.sharding_strategy not in _SHARDED:
            raise ValueError(f"TAGC supports FSDP1 FULL_SHARD and SHARD_GRAD_OP; got {unit.sharding_strategy.name} "
                             "(hybrid strategies reduce over two groups: use a 1-D sharding strategy)")
        if comm_hook(unit) is not None:
            raise ValueError("a communication hook is already registered on this FSDP1 model")
    paths = {id(module): _clean(name) for name, module in model.named_modules()}
    parameters = []
    for unit in units:  # what FSDP.register_comm_hook does, but with a state per unit
        path = paths.get(id(unit), "")
        install_comm_hook(unit, _tagc_fsdp1_hook, _UnitState(hook, unit, f"{path}." if path else ""))
        parameters += [Segment(f"{path}.{fqn}" if path else fqn, 0, numel)
                       for fqn, _, numel in param_entries(flat_param(unit))]
    hook.note_parameters(parameters)  # the settings check compares what select picks, not its name


def _clean(name: str) -> str:
    """A module path without FSDP1's wrapper components (``_fsdp_wrapped_module``)."""
    wrappers = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
    return ".".join(part for part in name.split(".") if part not in wrappers)
