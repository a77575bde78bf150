"""Every private torch name SimpleFSDP (``fsdp_integration``) uses, in one place.

* ``torch.distributed._functional_collectives`` (:data:`funcol`): semi-public. The module is
  underscored, but it is the documented home of the traceable collectives that ``torch.compile``
  and DTensor use; no public module offers collectives that return tensors a graph can hold.
  :data:`funcol` holds them under torch 2.13's names on every supported release (torch 2.11 calls
  the gather and the reduce-scatter ``all_gather_tensor`` and ``reduce_scatter_tensor``).
* ``torch._functorch.config.joint_custom_pass`` (:func:`joint_graph_pass`): the only hook that
  sees the joint forward-backward graph before the partitioner (where the resharding pass marks
  all-gathers for recomputation).
* ``torch._dynamo.lookup_backend`` and ``torch._inductor.compile_fx.compile_fx``
  (:func:`named_backend`, :func:`inductor_backend`): ``torch.compile`` takes a backend name, but
  wrapping a backend (to patch the joint pass around it) needs the callable behind the name.
  These two are checked when first used, so that importing the package does not load Inductor.
* ``Tensor._version`` (:func:`tensor_version`): the in-place update counter autograd keeps; no
  public API tells that a tensor changed since it was read.

The names are checked when this module is imported (:func:`backward_drain.torch_versions.check_internals`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch._functorch.config as _functorch_config

from backward_drain.torch_versions import check_internals, namespace

INTEGRATION = "SimpleFSDP (fsdp_integration)"
ADVICE = "wrap the model with torch's fully_shard (FSDP2) instead"
FUNCOL = ("torch.distributed._functional_collectives.all_gather_single|all_gather_tensor",
          "torch.distributed._functional_collectives.all_reduce",
          "torch.distributed._functional_collectives.reduce_scatter_single|reduce_scatter_tensor",
          "torch.distributed._functional_collectives.wait_tensor")
"""The traceable collectives :data:`funcol` holds: ``new|old`` where releases name one differently."""
NEEDS = (*FUNCOL, "torch._functorch.config.joint_custom_pass")
"""The private names checked at import (:func:`check_torch`)."""

COMPILE_NEEDS = {"inductor": ("torch._inductor.compile_fx.compile_fx",), "named": ("torch._dynamo.lookup_backend",)}
"""The private names :func:`compile_model`'s backends need, checked at first use."""

__all__ = ["funcol", "inductor_backend", "joint_graph_pass", "named_backend", "tensor_version"]


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if it is outside the range."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


@contextlib.contextmanager
def joint_graph_pass(graph_pass: Callable) -> Iterator[None]:
    """Within this block, AOTAutograd runs ``graph_pass`` on every joint forward-backward graph it partitions."""
    with _functorch_config.patch(joint_custom_pass=graph_pass):
        yield


def inductor_backend(config_patches: dict) -> Callable:
    """Inductor's backend callable (``compile_fx``) with ``config_patches`` applied to each graph it compiles."""
    check_internals(INTEGRATION, COMPILE_NEEDS["inductor"], ADVICE)
    from torch._inductor.compile_fx import compile_fx

    return lambda gm, inputs: compile_fx(gm, inputs, config_patches=config_patches)


def named_backend(name: str) -> Callable:
    """The callable behind the ``torch.compile`` backend called ``name`` (``"aot_eager"``, ...)."""
    check_internals(INTEGRATION, COMPILE_NEEDS["named"], ADVICE)
    return torch._dynamo.lookup_backend(name)


def tensor_version(tensor: torch.Tensor) -> int:
    """How many in-place updates ``tensor``'s storage has had (autograd's counter): it changes whenever one runs."""
    return tensor._version


check_torch()
funcol = namespace(FUNCOL)
"""The collectives of :data:`FUNCOL`, each under its torch 2.13 name (``funcol.all_gather_single``)."""
