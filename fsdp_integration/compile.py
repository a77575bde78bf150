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


@dataclasses.dataclass(frozen=True)
class CompileSettings:
    """How :func:`compile_model` compiles.

    ``backend``: ``"inductor"`` (default) or any ``torch.compile`` backend name
    (``"aot_eager"`` traces the same graphs without code generation: quick, for checks).
    The other fields are Inductor's (ignored by other backends).
    """

    backend: str = "inductor"
    fullgraph: bool = True
    bucket_all_gathers: str = "all"  # inductor.config.bucket_all_gathers_fx: none | all | only_fsdp
    bucket_reduce_scatters: str = "all"  # inductor.config.bucket_reduce_scatters_fx: none | all
    reorder_for_overlap: bool = True  # inductor.config.reorder_for_compute_comm_overlap
    overlap_passes: tuple[str, ...] = ("sink_waits", "raise_comms", "reorder_compute_for_overlap")
    """inductor.config.reorder_for_compute_comm_overlap_passes: empty by default in torch 2.13, which makes
    ``reorder_for_overlap`` a no-op; these move each launch up to its input and each wait down to its first use."""

    def __post_init__(self) -> None:
        if self.bucket_all_gathers not in ("none", "all", "only_fsdp"):
            raise ValueError(f"bucket_all_gathers must be 'none', 'all' or 'only_fsdp', "
                             f"got {self.bucket_all_gathers!r}")
        if self.bucket_reduce_scatters not in ("none", "all"):
            raise ValueError(f"bucket_reduce_scatters must be 'none' or 'all', got {self.bucket_reduce_scatters!r}")

    def inductor_options(self) -> dict[str, Any]:
        return {
            "bucket_all_gathers_fx": self.bucket_all_gathers,
            "bucket_reduce_scatters_fx": self.bucket_reduce_scatters,
            "reorder_for_compute_comm_overlap": self.reorder_for_overlap,
            "reorder_for_compute_comm_overlap_passes": list(self.overlap_passes),
        }


def with_resharding(backend: Callable) -> Callable:
    """Wrap a ``torch.compile`` backend callable so its joint graphs get the resharding pass."""

    def compile_with_resharding(gm: torch.fx.GraphModule, example_inputs):
        with joint_graph_pass(mark_all_gathers_for_recompute):
            return backend(gm, example_inputs)

    return compile_with_resharding


def backend_for(settings: CompileSettings = CompileSettings()) -> Callable:
    """The ``torch.compile`` backend :func:`compile_model` uses."""
    if settings.backend == "inductor":
        return with_resharding(inductor_backend(settings.inductor_options()))
    return with_resharding(named_backend(settings.backend))


def compile_model(model: nn.Module, settings: CompileSettings = CompileSettings()) -> nn.Module:
    """``torch.compile`` a :func:`~fsdp_integration.simple_fsdp` model (fullgraph by default)."""
    if getattr(model, "_simple_fsdp_units", None) is None:
        raise ValueError("compile_model expects a simple_fsdp model: call fsdp_integration.simple_fsdp(model) first")
    return torch.compile(model, backend=backend_for(settings), fullgraph=settings.fullgraph)
