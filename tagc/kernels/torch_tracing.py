"""The one private torch name TAGC's kernels use under ``torch.compile``, in one place.

A cache of device tensors must not keep tensors made while tracing (they are fake: no data, and
they belong to one trace). ``torch._subclasses.fake_tensor.is_fake`` tells them apart, functional
and DTensor wrappers included; no public API does (``torch.compiler.is_compiling`` says whether
Dynamo traces, not whether a given tensor is fake, and is false while AOTAutograd traces a custom
op's fake implementation).

The name is checked against the tested torch versions at import (:func:`check_torch`).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake as _is_fake

from backward_drain.torch_versions import check_internals

INTEGRATION = "TAGC's compiled kernels (tagc.kernels.ops)"
ADVICE = "run without torch.compile"
NEEDS = ("torch._subclasses.fake_tensor.is_fake",)
"""The private names checked at import (:func:`check_torch`)."""

__all__ = ["check_torch", "is_fake"]


def check_torch() -> None:
    """Raise if the running torch lacks a name in :data:`NEEDS`; warn once if it is outside the range."""
    check_internals(INTEGRATION, NEEDS, ADVICE)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor of a trace (or wraps one), not a tensor with data."""
    return _is_fake(tensor)


check_torch()
