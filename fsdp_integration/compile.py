"""Compiling a SimpleFSDP model: every compiler setting in one place.

``compile_model(model)`` is ``torch.compile(model, fullgraph=True)`` with a backend that

* runs :func:`fsdp_integration.reshard.mark_all_gathers_for_recompute` on the joint graph
  (reshard after forward: blocks' all-gathers are recomputed in the backward graph), and
* for Inductor, turns on its all-gather / reduce-scatter bucketing passes and its
  compute/communication reordering for the plain collectives (the hooked reduce-scatters
  are ``tagc::reduce_scatter`` custom ops, which Inductor leaves alone: they are already
  one per block).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from fsdp_integration.reshard import mark_all_gathers_for_recompute
from fsdp_integration.torch_internals import inductor_backend, joint_graph_pass, named_backend

INDUCTOR_OPTIONS: dict[str, Any] = {
    "bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all", "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]}
"""Inductor's configuration under :func:`compile_model`: every all-gather and reduce-scatter bucketed, and the
compute/communication reordering on, with its passes (empty by default in torch 2.13, which makes the reordering
a no-op; these move each launch up to its input and each wait down to its first use)."""


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """How :func:`compile_model` compiles: ``backend`` ``"inductor"`` (default, with :data:`INDUCTOR_OPTIONS`) or any
    ``torch.compile`` backend name (``"aot_eager"`` traces the same graphs without code generation: quick, for
    checks)."""

    backend: str = "inductor"


def with_resharding(backend: Callable) -> Callable:
    """Wrap a ``torch.compile`` backend callable so its joint graphs get the resharding pass."""

    def compile_with_resharding(gm: torch.fx.GraphModule, example_inputs):
        with joint_graph_pass(mark_all_gathers_for_recompute):
            return backend(gm, example_inputs)

    return compile_with_resharding


def compile_model(model: nn.Module, settings: CompileSettings = CompileSettings()) -> nn.Module:
    """``torch.compile`` a :func:`~fsdp_integration.simple_fsdp` model, whole (``fullgraph``)."""
    if getattr(model, "_simple_fsdp_units", None) is None:
        raise ValueError("compile_model expects a simple_fsdp model: call fsdp_integration.simple_fsdp(model) first")
    backend = inductor_backend(INDUCTOR_OPTIONS) if settings.backend == "inductor" else named_backend(settings.backend)
    return torch.compile(model, backend=with_resharding(backend), fullgraph=True)
