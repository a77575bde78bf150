"""The torch versions this project was tested on, and the check every module that reaches torch internals runs.

Private torch names (an underscored attribute, a ``torch._*`` module) can change in any release.
Each integration reads them in one module of its own (``tagc.hooks.torch_fsdp2``,
``tagc.hooks.torch_fsdp1``, ``tagc.hooks.torch_ddp``, ``tagc.hooks.torch_simple_fsdp``,
``tagc.kernels.torch_tracing``, ``fsdp_integration.torch_internals``, ``backward_drain.torch_autograd``),
which calls :func:`check_internals` when it is imported:

* a needed name that the running torch lacks raises :class:`TorchInternalsError`, naming the
  version, the name and what to do: the integration cannot run without it;
* a torch whose ``major.minor`` is not in :data:`TESTED_TORCH` but has every name warns once
  (``RuntimeWarning``): the names are there, so the integration may well work, but nobody checked
  that they still mean what they meant.

Names read from objects made at run time (an FSDP unit's state, a parameter's record) cannot be
checked at import: :func:`read_internal` reads them and raises the same error when one is missing.

This module lives in ``backward_drain`` because that package depends on torch only and both
``tagc`` and ``fsdp_integration`` import it (neither may import the other).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import warnings
from collections.abc import Iterable
from typing import Any, Optional

import torch

TESTED_TORCH: tuple[str, ...] = ("2.13",)
"""The torch releases (``major.minor``) whose internals every integration was checked against."""

PIN = "pin torch==2.13.*"
"""What to do when the running torch is not one of :data:`TESTED_TORCH`."""

_warned: set[str] = set()
_lock = threading.Lock()


class TorchInternalsError(ImportError):
    """The running torch lacks a private name an integration needs (the message says which, and what to do)."""


def torch_release(version: Optional[str] = None) -> str:
    """``major.minor`` of ``version`` (default: the running ``torch.__version__``): ``"2.13"`` for ``"2.13.0+cpu"``."""
    return ".".join((torch.__version__ if version is None else version).split("+")[0].split(".")[:2])


def missing(integration: str, name: str, advice: str) -> TorchInternalsError:
    """The error for ``integration`` needing the private torch ``name`` that the running torch lacks."""
    return TorchInternalsError(
        f"{integration} needs torch's private {name}, which torch {torch.__version__} does not have "
        f"(tested with torch {', '.join(TESTED_TORCH)}): {PIN}, or {advice}")


def resolve(dotted: str) -> Any:
    """The object a dotted name ``torch.a._b.C.d`` names: the longest importable module prefix, then attributes.
    ``torch.a.C:_x`` names an instance attribute ``_x`` that class ``C`` declares (an annotation, or a class
    attribute): it resolves to the class. Raises ``AttributeError`` or ``ImportError`` when a part is missing."""
    dotted, _, declared = dotted.partition(":")
    if declared:
        owner = resolve(dotted)
        if not any(declared in inspect.get_annotations(cls) for cls in owner.__mro__) and not hasattr(owner, declared):
            raise AttributeError(f"{dotted} declares no {declared}")
        return owner
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            if end == 1:
                raise
            continue
        for part in parts[end:]:
            found = getattr(found, part)
        return found
    raise ImportError(dotted)


def check_internals(integration: str, needs: Iterable[str], advice: str) -> None:
    """Check that the running torch has every dotted name in ``needs`` (else :class:`TorchInternalsError`), and
    warn once per ``integration`` when its ``major.minor`` is not in :data:`TESTED_TORCH` (module docstring).
    ``advice``: what to do besides pinning torch (e.g. which other integration needs none of these names)."""
    for dotted in needs:
        try:
            resolve(dotted)
        except (AttributeError, ImportError):
            raise missing(integration, dotted, advice) from None
    release = torch_release()
    if release in TESTED_TORCH:
        return
    with _lock:
        if integration in _warned:
            return
        _warned.add(integration)
    warnings.warn(f"{integration} reaches torch internals checked on torch {', '.join(TESTED_TORCH)} only; this is "
                  f"torch {torch.__version__}, where they are present but unchecked: if it misbehaves, {PIN}, or "
                  f"{advice}", RuntimeWarning, stacklevel=2)


def read_internal(obj: Any, name: str, integration: str, advice: str) -> Any:
    """``getattr(obj, name)`` for a private attribute torch sets at run time, with :func:`missing`'s error when
    ``obj`` (a ``type(obj).__name__``) has no such attribute."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing(integration, f"{type(obj).__name__}.{name}", advice) from None
