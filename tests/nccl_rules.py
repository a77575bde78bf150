"""A CPU stand-in for NCCL's rules, for the tests on gloo ranks: what a first GPU run would reject.

On a GPU, NCCL takes only device tensors (a CPU tensor handed to a NCCL collective is an error),
and reading a device tensor on the host (``.item()``, ``bool(t)``, ``.tolist()``, ...) waits for the
device. On this machine every tensor is a CPU tensor, so :class:`NcclRules` *pretends*: while it is
open, the CPU plays the device, and a tensor counts as **on the host** when the code put it there:

* made by a factory with no tensor input and no ``device=`` (the default device is the host), or
  with a literal ``device="cpu"``; ``torch.tensor(...)``, ``torch.frombuffer``, ``torch.from_numpy``;
* moved there: ``.cpu()``, ``.to("cpu")``;
* computed only from host tensors (a result with any device input is a device tensor, as on a GPU).

Tensors made before it opened (the model's parameters, ``device=x.device`` of a device tensor ``x``)
are device tensors. ``device=torch.device("cpu")`` given as an object is taken for a device (it is
what ``x.device`` returns here), so only literal strings and the default device mark the host.

It records, as :attr:`NcclRules.violations` (``"rule: where"``, the first frame outside torch):

* **collective on a host tensor**: every ``torch.distributed`` collective and functional collective
  given a host tensor. Object collectives (``all_gather_object``, ...) are NCCL-legal (torch moves
  their bytes to the current device) and are not looked into;
* **host read of a device tensor** inside :meth:`NcclRules.exchange` (the steady steps), made from
  code under ``watch`` (``tagc`` and ``fsdp_integration``), outside the Numba CPU back end (which
  runs only on CPU tensors; on a GPU the Triton kernels run), and the operations that read on the
  host by themselves on a GPU (``nonzero``, ``equal``, boolean-mask indexing, ...).

With ``backend="nccl"`` (the default) the transport also takes its NCCL decisions
(:func:`tagc.hooks.core.transport.backend_of` answers ``"nccl"``): whole all-to-alls, and
``reduce_scatter_single`` for plain columns, which gloo runs too.

What it cannot show: CUDA streams and their races, NCCL's own limits beyond tensor placement, a
``torch.device("cpu")`` object built in the code, host reads made inside torch's C++ (``torch.equal``
is caught by name, others are not), and the cost of anything.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
WATCH = (str(ROOT / "tagc"), str(ROOT / "fsdp_integration"))
BACKEND_FILES = (os.path.join("tagc", "kernels", "cpu.py"), os.path.join("tagc", "kernels", "_numba.py"))
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "broadcast",
               "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")
FUNCTIONAL_HELPERS = ("wait_tensor", "_wrap_tensor_autograd")
"""Functional-collective ops that move no data."""
READS = ("__bool__", "item", "__int__", "__float__", "tolist", "__index__")
SYNCING_OPS = ("nonzero", "argwhere", "equal", "allclose", "masked_select", "unique", "unique_consecutive")
"""Operations whose result needs the device's values on the host (a data-dependent size or a Python bool)."""
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)


class NcclRules:
    """Open it on every rank around the code under test (model wrapping, hook registration, steps).

    >>> rules = NcclRules()
    >>> with rules:
    ...     model = simple_fsdp(model)
    ...     with rules.exchange():
    ...         model(x).sum().backward()
    >>> rules.violations
    []
    """

    def __init__(self, backend: Optional[str] = "nccl", watch: Sequence[str] = WATCH) -> None:
        self.backend = backend
        self.watch = tuple(watch)
        self.violations: list[str] = []
        self.collectives: dict[str, int] = {}
        """Collectives seen (by name), each call once: evidence that the rules were in the path."""
        self._host: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._armed = 0
        self._paused = 0
        self._inside_read = False
        self._undo: list = []

    # ------------------------------------------------------------------ placement

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` counts as a host tensor (module docstring)."""
        return self._host.get(id(tensor)) is tensor

    def _mark(self, value, host: bool) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                if host:
                    self._host[id(leaf)] = leaf
                elif self._host.get(id(leaf)) is leaf:
                    del self._host[id(leaf)]

    # ------------------------------------------------------------------ open / close

    def __enter__(self) -> "NcclRules":
        for names, wrap in ((COLLECTIVES, self._collective), (OBJECT_COLLECTIVES, self._object_collective)):
            for name in names:
                wrapped = {}  # one wrapper per function, under both of its names
                for module in (dist, c10d):
                    original = getattr(module, name, None)
                    if original is not None:
                        self._patch(module, name, wrapped.setdefault(id(original), wrap(name, original)))
        for name in READS:
            self._patch(torch.Tensor, name, self._read(getattr(torch.Tensor, name)), own=name in vars(torch.Tensor))
        if self.backend is not None:
            from tagc.hooks.core import transport

            self._patch(transport, "backend_of", lambda group, device: self.backend)
        self._mode = _Placement(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        for target, name, original, own in reversed(self._undo):
            if own:
                setattr(target, name, original)
            else:
                delattr(target, name)  # inherited again
        self._undo.clear()

    def _patch(self, target, name: str, replacement, own: bool = True) -> None:
        self._undo.append((target, name, getattr(target, name) if own else None, own))
        setattr(target, name, replacement)

    @contextlib.contextmanager
    def exchange(self) -> Iterator[None]:
        """The steady steps: host reads of device tensors by watched code are violations in here."""
        self._armed += 1
        try:
            yield
        finally:
            self._armed -= 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Neither placement nor reads are tracked (inside object collectives, or test bookkeeping)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # ------------------------------------------------------------------ the rules

    def _violation(self, rule: str) -> None:
        self.violations.append(f"{rule}: {_site()[0]}")

    def _collective(self, name: str, original):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            if self._paused:
                return original(*args, **kwargs)
            self.collectives[name] = self.collectives.get(name, 0) + 1
            host = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self.on_host(t)]
            if host:
                self._violation(f"{name} on a host tensor (NCCL takes device tensors only)")
            with self.paused():  # a collective built on another is checked once, by its name
                return original(*args, **kwargs)

        return collective

    def _object_collective(self, name: str, original):
        @functools.wraps(original)
        def collective(*args, **kwargs):
            with self.paused():
                return original(*args, **kwargs)

        return collective

    def _read(self, original):
        @functools.wraps(original)
        def read(tensor, *args, **kwargs):
            if self._armed and not self._paused and not self._inside_read and not self.on_host(tensor):
                self._check_read(f"host read .{original.__name__}() of a device tensor")
            self._inside_read = True  # a read made by a read (__format__ -> item) is one read
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside_read = False

        return read

    def _check_read(self, rule: str) -> None:
        site, path, backend = _site()
        if not backend and path.startswith(self.watch):
            self.violations.append(f"{rule} (a device synchronisation): {site}")


def _site() -> tuple[str, str, bool]:
    """``(file:line, absolute path)`` of the first caller outside torch and this module, and whether
    the Numba CPU back end is on the stack."""
    frame = sys._getframe(1)
    site, path, backend = "?", "", False
    while frame is not None:
        filename = frame.f_code.co_filename
        absolute = os.path.abspath(filename)
        if site == "?" and not filename.startswith(_TORCH_DIR) and absolute != _HERE and not filename.startswith("<"):
            site, path = f"{os.path.relpath(filename, ROOT)}:{frame.f_lineno}", absolute
        if filename.endswith(BACKEND_FILES):
            backend = True
            break
        frame = frame.f_back
    return site, path, backend


def _is_cpu_literal(device) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class _Placement(TorchFunctionMode):
    """Marks the results of torch functions as host or device tensors (:class:`NcclRules`' rules),
    and checks functional collectives and the operations that read on the host by themselves."""

    def __init__(self, rules: NcclRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rules = self.rules
        if rules._paused:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        qualified = getattr(func, "_qualified_op_name", None)
        if qualified is None:
            qualified = func.name() if isinstance(func, torch._ops.OpOverload) else ""
        namespace, _, op = qualified.partition("::")
        if namespace in ("_c10d_functional", "c10d_functional") and op not in FUNCTIONAL_HELPERS:
            rules.collectives[f"funcol.{name}"] = rules.collectives.get(f"funcol.{name}", 0) + 1
            if any(rules.on_host(t) for t in inputs):
                rules._violation(f"functional {name} on a host tensor (NCCL takes device tensors only)")
        if rules._armed and name.split(".")[0] in SYNCING_OPS and inputs and not all(rules.on_host(t) for t in inputs):
            rules._check_read(f"{name} of a device tensor")
        if (rules._armed and name in ("__getitem__", "__setitem__") and inputs and not rules.on_host(inputs[0])
                and any(t.dtype == torch.bool for t in tree_leaves(args[1:2]) if isinstance(t, torch.Tensor))):
            rules._check_read(f"boolean-mask {name} of a device tensor")
        result = func(*args, **kwargs)
        host = self._host_result(func, name, args, kwargs, inputs)
        if host is not None:
            moved = name in ("cpu", "to")  # a move to where the tensor is returns it: it takes the new place
            outputs = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)
                       and (moved or not any(leaf is t for t in inputs))]  # in place: the target keeps its place
            rules._mark(outputs, host)
        return result

    def _host_result(self, func, name: str, args, kwargs, inputs) -> Optional[bool]:
        """``True``: the result is a host tensor; ``False``: a device tensor; ``None``: leave it unmarked."""
        rules = self.rules
        if name == "cpu":
            return True
        device = kwargs.get("device")
        if device is None and name == "to":
            device = next((a for a in args[1:] if isinstance(a, (str, torch.device, torch.Tensor))), None)
        if isinstance(device, torch.Tensor):  # .to(other): other's place
            return rules.on_host(device)
        if device is not None:
            return _is_cpu_literal(device)  # a torch.device object is what x.device gives: the device
        if not inputs:  # a factory without device=: the default device, the host
            return True
        return all(rules.on_host(t) for t in inputs)
