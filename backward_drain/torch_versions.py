"""The torch releases this project supports and was tested on, and the check every module that reaches torch
internals runs when it is imported (:func:`check_internals`; the scheme: docs/design.md §2).

A needed private name the running torch lacks (under every name a release gave it, ``"torch.a.b.new|old"``)
raises :class:`TorchInternalsError`, naming the version, the name and what to do; a torch outside
:data:`SUPPORTED` that has every name warns once per process: the names are there, but nobody checked that they
still mean what they meant. Names read from objects made at run time cannot be checked at import:
:func:`read_internal` reads them and raises the same error. This module lives in ``backward_drain`` because that
package depends on torch only and both ``tagc`` and ``fsdp_integration`` import it (neither may import the other).
"""

from __future__ import annotations

import importlib
import inspect
import threading
import types
import warnings
from collections.abc import Iterable
from typing import Any, Optional

import torch

SUPPORTED: tuple[str, str] = ("2.11", "2.15")
"""The oldest and the newest torch release (``major.minor``) supported, as ``pyproject.toml`` states them."""

TESTED_TORCH: tuple[str, ...] = ("2.11", "2.13", "2.15")
"""The releases whose internals every integration was run against (CI: the oldest and the newest of
:data:`SUPPORTED` on the integration tests, ``pytest -m torch_range``; the pinned 2.13 on the whole suite)."""

RANGE = f"torch {SUPPORTED[0]} to {SUPPORTED[1]}"
PIN = "install a torch of that range (pip install 'torch>=2.11,<2.16')"
"""What to do when the running torch is outside :data:`SUPPORTED` or lacks a name."""

_warned: set[str] = set()
_lock = threading.Lock()


class TorchInternalsError(ImportError):
    """The running torch lacks a private name an integration needs (the message says which, and what to do)."""


def torch_release(version: Optional[str] = None) -> str:
    """``major.minor`` of ``version`` (default: the running ``torch.__version__``): ``"2.13"`` for ``"2.13.0+cpu"``."""
    return ".".join((torch.__version__ if version is None else version).split("+")[0].split(".")[:2])


def supported(version: Optional[str] = None) -> bool:
    """Whether ``version``'s release (default: the running torch's) lies in :data:`SUPPORTED`, ends included."""
    def key(release: str) -> tuple[int, ...]:
        return tuple(int(part) for part in release.split("."))
    return key(SUPPORTED[0]) <= key(torch_release(version)) <= key(SUPPORTED[1])


def missing(integration: str, name: str, advice: str) -> TorchInternalsError:
    """The error for ``integration`` needing the private torch ``name`` that the running torch lacks."""
    return TorchInternalsError(
        f"{integration} needs torch's private {name}, which torch {torch.__version__} does not have "
        f"(supported: {RANGE}, tested with {', '.join(TESTED_TORCH)}): {PIN}, or {advice}")


def alternatives(spec: str) -> list[str]:
    """The dotted names ``spec`` stands for, the later release's first: ``torch.a.f|g`` is ``torch.a.f`` or
    ``torch.a.g`` (one thing under the names different releases give it); a spec without ``|`` is itself."""
    head, *names = spec.split("|")
    stem = head[:max(head.rfind("."), head.rfind(":")) + 1]
    return [head] + [stem + name for name in names]


def resolve(spec: str) -> Any:
    """The object a dotted name ``torch.a._b.C.d`` names: the longest importable module prefix, then attributes.
    ``torch.a.C:_x`` names an instance attribute ``_x`` that class ``C`` declares (an annotation, or a class
    attribute): it resolves to the class. ``torch.a.f|g``: the first of :func:`alternatives` that resolves.
    Raises ``AttributeError`` or ``ImportError`` when a part is missing (from every alternative)."""
    *later, last = alternatives(spec)
    for dotted in later:
        try:
            return _resolve(dotted)
        except (AttributeError, ImportError):
            continue
    return _resolve(last)


def namespace(specs: Iterable[str]) -> types.SimpleNamespace:
    """The objects ``specs`` name (:func:`resolve`), each under the name the latest release gives it (``torch.a.f|g``
    as ``f``): callers use one name on every supported release."""
    return types.SimpleNamespace(**{alternatives(spec)[0].rpartition(".")[2]: resolve(spec) for spec in specs})


def _resolve(dotted: str) -> Any:
    dotted, _, declared = dotted.partition(":")
    if declared:
        owner = _resolve(dotted)
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
    """Check that the running torch has every name in ``needs`` (a :func:`resolve` spec; else
    :class:`TorchInternalsError`), and warn once per process when its release is outside :data:`SUPPORTED`
    (module docstring). ``advice``: what to do besides changing torch (e.g. which other integration needs none of
    these names)."""
    for spec in needs:
        try:
            resolve(spec)
        except (AttributeError, ImportError):
            raise missing(integration, spec, advice) from None
    if supported():
        return
    with _lock:
        if _warned:
            return
        _warned.add(integration)
    warnings.warn(f"torch {torch.__version__} is outside the releases TAGC supports, {RANGE} (tested with "
                  f"{', '.join(TESTED_TORCH)}): {integration} and TAGC's other integrations reach torch internals "
                  f"that this release may have changed; if one misbehaves, {PIN}", RuntimeWarning, stacklevel=2)


def read_internal(obj: Any, name: str, integration: str, advice: str) -> Any:
    """``getattr(obj, name)`` for a private attribute torch sets at run time, with :func:`missing`'s error when
    ``obj`` (a ``type(obj).__name__``) has no such attribute."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing(integration, f"{type(obj).__name__}.{name}", advice) from None
