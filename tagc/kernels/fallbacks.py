"""Warn once per kind where TAGC gives the user something other than what was asked for.

:mod:`tagc.kernels.dispatch` and :mod:`tagc.kernels.cpu` call :func:`warn_fallback` where they
take the torch reference instead of the kernels the tensors would get with the right packages
or settings (a silent fallback costs speed and, on a GPU, host reads); the hooks call it where a
parameter the user selected goes plain. One warning per kind and process, not per bucket or step.
"""

from __future__ import annotations

import threading
import warnings

_warned: set[str] = set()
_lock = threading.Lock()


def warn_fallback(kind: str, message: str) -> None:
    """``warnings.warn(message, RuntimeWarning)`` the first time a fallback of ``kind`` happens in this process."""
    with _lock:
        if kind in _warned:
            return
        _warned.add(kind)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
