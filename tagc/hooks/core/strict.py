"""Strict sync mode: count the host reads of tensors an exchange makes (``TAGC_STRICT_SYNC=1``).

On a GPU every host read of a tensor (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``.tolist()``,
``t.__index__()``) waits for the device: the host stops queueing work and the overlap of compression, wire and
backward collapses. The engine's steady state makes none; flags and statistics stay on the device until
:meth:`~tagc.hooks.core.engine.TAGCHook.end_step` / :meth:`~tagc.hooks.core.engine.TAGCHook.stats`.

:func:`count_host_reads` patches those six methods of ``torch.Tensor`` while it is open and counts the calls made
on the thread that opened it (gloo's and NCCL's threads make none). With ``TAGC_STRICT_SYNC=1`` (or
``hook.strict_sync = True``) the engine opens one around each entry point (:func:`counted`) and adds the counts to
its statistics: ``host_reads``, the reads a GPU run would pay (where from: ``hook.host_read_sites``, ``"file:line"
-> count``), and ``backend_host_reads``, made inside the Numba CPU back end (:mod:`tagc.kernels.cpu`), which only
runs on CPU tensors, where a read costs no synchronisation.

Host reads left by design (none in a steady ``propagate`` exchange): plan building (a bucket's first step), the
settings check (once per group), ``nonfinite="raise"`` (one per bucket, to raise), ``fallback="raw"``
(data-dependent re-send sizes) and ``"error"`` (to raise), and the torch reference decode when Triton is missing on
a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import threading
from typing import Callable, Iterator

import torch

ENV = "TAGC_STRICT_SYNC"
READS = ("__bool__", "item", "__int__", "__float__", "tolist", "__index__")
BACKEND_FILES = (os.path.join("tagc", "kernels", "cpu.py"), os.path.join("tagc", "kernels", "_numba.py"))
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


def enabled() -> bool:
    """Whether ``TAGC_STRICT_SYNC`` asks for strict sync mode (any value but empty or ``0``)."""
    return os.environ.get(ENV, "0").strip() not in ("", "0")


class HostReads:
    """What one counting window saw."""

    def __init__(self) -> None:
        self.count = 0
        """Host reads outside the CPU-only back end: each one a device synchronisation on a GPU."""
        self.backend = 0
        """Host reads inside the Numba CPU back end (CPU tensors only; free of synchronisation)."""
        self.sites: collections.Counter[str] = collections.Counter()

    def record(self, site: str, backend: bool) -> None:
        if backend:
            self.backend += 1
            self.sites[f"{site} (cpu back end)"] += 1
        else:
            self.count += 1
            self.sites[site] += 1


_lock = threading.Lock()
_installed = 0
_originals: dict[str, Callable] = {}
_thread = threading.local()


def _site() -> tuple[str, bool]:
    """The first caller outside torch and this module, and whether the CPU back end is on the stack."""
    frame = inspect.currentframe().f_back.f_back  # the read's caller: past this function and the read
    site, backend = "?", False
    while frame is not None:
        filename = frame.f_code.co_filename
        if site == "?" and not filename.startswith(_TORCH_DIR) and os.path.abspath(filename) != _HERE:
            site = f"{os.path.relpath(filename) if not filename.startswith('<') else filename}:{frame.f_lineno}"
        if filename.endswith(BACKEND_FILES):
            backend = True
            break
        frame = frame.f_back
    return site, backend


def _counting(name: str, original: Callable) -> Callable:
    @functools.wraps(original)
    def read(self, *args, **kwargs):
        windows = getattr(_thread, "windows", None)
        if not windows or getattr(_thread, "inside", False):
            return original(self, *args, **kwargs)
        site, backend = _site()
        for window in windows:
            window.record(site, backend)
        _thread.inside = True  # a read made by a read (e.g. __format__ -> item) is one read
        try:
            return original(self, *args, **kwargs)
        finally:
            _thread.inside = False

    return read


def _install() -> None:
    global _installed
    with _lock:
        if _installed == 0:
            for name in READS:
                _originals[name] = vars(torch.Tensor).get(name)  # None: inherited from TensorBase
                setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name)))
        _installed += 1


def _uninstall() -> None:
    global _installed
    with _lock:
        _installed -= 1
        if _installed == 0:
            for name in READS:
                original = _originals.pop(name)
                if original is None:
                    delattr(torch.Tensor, name)  # inherited again
                else:
                    setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the host reads of tensors made on this thread while the block runs.

    >>> with count_host_reads() as reads:
    ...     bool(torch.ones(1))
    >>> reads.count
    1
    """
    reads = HostReads()
    _install()
    windows = _thread.__dict__.setdefault("windows", [])
    windows.append(reads)
    try:
        yield reads
    finally:
        windows.remove(reads)
        _uninstall()


def counted(method: Callable) -> Callable:
    """Decorate an engine entry point: in strict sync mode, its host reads go to the hook's statistics. Nested
    entry points (``start`` calls ``poll``) count once, in the outermost."""

    @functools.wraps(method)
    def entry(self, *args, **kwargs):
        hook = getattr(self, "hook", self)
        if not getattr(hook, "strict_sync", False) or getattr(hook, "counting_reads", False):
            return method(self, *args, **kwargs)
        hook.counting_reads = True
        try:
            with count_host_reads() as reads:
                return method(self, *args, **kwargs)
        finally:
            hook.counting_reads = False
            hook.note_host_reads(reads)

    return entry
