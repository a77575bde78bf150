"""One entry point per codec operation; each picks the Triton kernels, the CPU kernels or the torch reference.

The back end is picked as docs/design.md §8 says (a fallback to the reference is warned once,
:func:`~tagc.kernels.fallbacks.warn_fallback`; ``"reference"`` is an alias of ``"torch"``); every operation is one
lookup in one table (operation -> back end -> implementation), each taking the same arguments. Nothing here imports
triton or numba until their path is taken.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Optional

import torch

from tagc.kernels import cpu as _cpu
from tagc.kernels._triton import require_triton, triton_available
from tagc.kernels.fallbacks import warn_fallback
from tagc.sketch import codec as _ref_codec
from tagc.sketch import compress as _ref_compress
from tagc.sketch import kept_list as _ref_kept_list
from tagc.sketch import positions as _ref_positions
from tagc.sketch import sparsify as _ref_sparsify
from tagc.sketch.codec import DecodeStats
from tagc.sketch.layout import SketchLayout

BACKENDS = ("auto", "triton", "numba", "torch", "reference")
STAT_FIELDS = _ref_codec.DECODE_STATS  # the one list of decode statistics, in DecodeStats field order


def resolve_backend(*tensors: torch.Tensor, backend: Optional[str] = None) -> str:
    """``"triton"``, ``"numba"`` or ``"torch"``: the back end an operation on ``tensors`` will use."""
    choice = (backend or os.environ.get("TAGC_BACKEND") or "auto").lower()
    if choice not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (argument or TAGC_BACKEND), got {choice!r}")
    if choice == "reference":
        choice = "torch"
    if choice == "auto":
        on_cuda = any(t.device.type == "cuda" for t in tensors)
        if on_cuda:
            choice = "triton" if triton_available() else "torch"
            if choice == "torch":
                warn_fallback("triton-missing", "TAGC: CUDA tensors, but triton does not import: the torch "
                              "reference runs instead of the Triton kernels (slower, and its decode reads the device "
                              "on the host). Install triton (pip install triton, or tagc[triton]).")
        else:
            choice = "numba" if _cpu.supports(*tensors) else "torch"
            if choice == "torch" and not _cpu.numba_available():
                warn_fallback("numba-missing", "TAGC: numba does not import: the torch reference runs instead of the "
                              "CPU kernels (several times slower). Install numba (pip install numba, or tagc[numba]).")
    if choice == "triton":
        require_triton(*tensors)
    if choice == "numba" and not _cpu.supports(*tensors):
        raise RuntimeError("backend 'numba' needs numba installed (pip install numba) and CPU tensors")
    return choice


Implementation = Callable[..., Any]


def _triton(name: str) -> Implementation:
    """The Triton path's entry point ``name`` of :mod:`tagc.kernels.ops`, imported at its first call:
    importing ``ops`` imports triton, which only a Triton path may need."""

    def run(*args: Any, **kwargs: Any) -> Any:
        from tagc.kernels import ops

        return getattr(ops, name)(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    return run


def _row_thresholds_reference(
    rows: torch.Tensor, density: float, grad: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The reference's thresholds of ``rows`` viewed as ``[N, n]``."""
    _ref_sparsify.check_density(density)
    x = rows.reshape(-1, rows.shape[-1])
    return _ref_sparsify.row_thresholds(x, density, grad=None if grad is None else grad.reshape(x.shape))


_IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {
    # operation -> {back end -> implementation}; an operation's implementations take the same arguments
    "row_thresholds": {"triton": _triton("row_thresholds_triton"), "numba": _cpu.row_thresholds_cpu,
                       "torch": _row_thresholds_reference},
    "compress_": {"triton": _triton("compress_triton"), "numba": _cpu.compress_cpu, "torch": _ref_compress.compress_},
    "list_kept_": {"triton": _triton("list_kept_triton"), "numba": _cpu.list_kept_cpu,
                   "torch": _ref_kept_list.list_kept_},
    "list_positions": {"triton": _triton("list_positions_triton"), "numba": _cpu.list_positions_cpu,
                       "torch": _ref_kept_list.list_positions},
    "sum_lists": {"triton": _triton("sum_lists_triton"), "numba": _cpu.sum_lists_cpu,
                  "torch": _ref_kept_list.sum_lists},
    "encode_positions": {"triton": _triton("encode_positions_triton"), "numba": _cpu.code_positions_cpu,
                         "torch": _ref_positions.encode_positions},
    "decode_positions": {"triton": _triton("decode_positions_triton"), "numba": _cpu.decode_positions_cpu,
                         "torch": _ref_positions.decode_positions},
    "code_index": {"triton": _triton("code_index_triton"), "numba": _cpu.code_index_cpu,
                   "torch": _ref_positions.code_index},
    "union_index": {"triton": _triton("union_index_triton"), "numba": _cpu.union_index_cpu,
                    "torch": _ref_positions.union_index},
    "decode": {"triton": _triton("decode_triton"), "numba": functools.partial(_ref_codec.decode,
                                                                              parts=_cpu.decode_parts_cpu),
               "torch": _ref_codec.decode},
    "decode_async": {"triton": _triton("decode_async"), "torch": _ref_codec.decode_async,
                     "numba": functools.partial(_ref_codec.decode_async, parts=_cpu.decode_parts_cpu)},
}
"""The one back-end table: every public operation below is one lookup in it (:func:`_run`)."""


def _run(operation: str, tensors: tuple[torch.Tensor, ...], backend: Optional[str], *args: Any, **kwargs: Any) -> Any:
    """``operation``'s implementation on the back end :func:`resolve_backend` picks for ``tensors``, called."""
    return _IMPLEMENTATIONS[operation][resolve_backend(*tensors, backend=backend)](*args, **kwargs)


def row_thresholds(
    rows: torch.Tensor, density: float, *, grad: Optional[torch.Tensor] = None, backend: Optional[str] = None
) -> torch.Tensor:
    """Per-row magnitude thresholds ``[N]`` of ``rows`` (``+ grad`` if given), on the device.

    Every back end gives the same values (the kernels are radix selects of the reference's
    sample); see :func:`tagc.sketch.row_thresholds`.
    """
    return _run("row_thresholds", (rows,), backend, rows, density, grad=grad)


def threshold(x: torch.Tensor, density: float, *, backend: Optional[str] = None) -> torch.Tensor:
    """A 0-d threshold with about ``density * numel`` entries of ``|x| >= tau``."""
    return row_thresholds(x.reshape(1, -1), density, backend=backend)[0]


def compress_(grad: torch.Tensor, residual: torch.Tensor, density: float, layout: SketchLayout, bits: int, *,
              tau: Optional[torch.Tensor] = None, return_held: bool = False, cap: Optional[int] = None,
              backend: Optional[str] = None):
    """Fused error feedback + sparsify + index + sketch; see :func:`tagc.sketch.compress_`.

    Returns ``(index [N, nbytes] uint8, table [N, table_numel] float32)`` and updates
    ``residual`` in place; with ``return_held`` also ``held`` (int64 ``[N]``, the entries the
    capacity left in the residual). ``tau`` optionally fixes the per-chunk thresholds, ``cap``
    the capacity (default :func:`tagc.sketch.sparsify.capacity`).
    """
    return _run("compress_", (grad, residual), backend, grad, residual, density, layout, bits, tau=tau,
                return_held=return_held, cap=cap)


def list_kept_(grad: torch.Tensor, residual: torch.Tensor, density: float, cap: int, *,
               tau: Optional[torch.Tensor] = None,
               backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Error feedback + TAGC's selection, the kept entries as position lists; see
    :func:`tagc.sketch.kept_list.list_kept_`.

    Returns ``(counts [N, nb + 1] int32, offsets [N, cap] uint16, values [N, cap] float32)``
    and updates ``residual`` in place. Every back end gives the same results bit for bit.
    """
    return _run("list_kept_", (grad, residual), backend, grad, residual, density, cap, tau=tau)


def list_positions(
    counts: torch.Tensor, offsets: torch.Tensor, numel: int, *, backend: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The listed entries' positions ``[N, cap]`` (``numel`` for padding) and which are listed; see
    :func:`tagc.sketch.kept_list.list_positions`."""
    return _run("list_positions", (counts, offsets), backend, counts, offsets, numel)


def sum_lists(
    counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int, *, backend: Optional[str] = None
) -> torch.Tensor:
    """Every rank's list scatter-added, in rank order; see :func:`tagc.sketch.kept_list.sum_lists`."""
    return _run("sum_lists", (counts, offsets, values), backend, counts, offsets, values, numel)


def encode_positions(
    positions: torch.Tensor, count: torch.Tensor, numel: int, cap: int, low: int, *, backend: Optional[str] = None
) -> torch.Tensor:
    """Rows' sorted position lists -> Elias-Fano coded rows; see :func:`tagc.sketch.positions.encode_positions`.
    Every back end gives the same bytes (the wire is exchanged between ranks)."""
    return _run("encode_positions", (positions, count), backend, positions, count, numel, cap, low)


def decode_positions(
    code: torch.Tensor, numel: int, cap: int, low: int, *, backend: Optional[str] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coded rows -> ``(positions [R, cap], count [R])``; see :func:`tagc.sketch.positions.decode_positions`."""
    return _run("decode_positions", (code,), backend, code, numel, cap, low)


def code_index(index: torch.Tensor, numel: int, cap: int, low: int, *, backend: Optional[str] = None) -> torch.Tensor:
    """Rows of a 1-bit index -> coded rows; see :func:`tagc.sketch.positions.code_index`."""
    return _run("code_index", (index,), backend, index, numel, cap, low)


def union_index(code: torch.Tensor, numel: int, cap: int, low: int, parts: int = 1, *,
                backend: Optional[str] = None) -> torch.Tensor:
    """Coded rows -> the 1-bit index of their union, per part (row ``j * parts + p`` is part ``p``'s from rank
    ``j``; the parts' indexes back to back), in one call whatever ``parts``; see
    :func:`tagc.sketch.positions.union_index`."""
    return _run("union_index", (code,), backend, code, numel, cap, low, parts)


def decode(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate", *,
           backend: Optional[str] = None) -> tuple[torch.Tensor, DecodeStats]:
    """Recover a chunk from its summed table and union index; see :func:`tagc.sketch.decode`.

    On the Triton path everything runs on the device (peeling, the exact solve of the stopping
    sets, the fallback, the checks; bit-identical from run to run) and the host reads the
    statistics once, at the end (``DecodeStats`` holds ints).
    """
    return _run("decode", (table, index), backend, table, index, layout, bits, fallback)


def decode_async(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate",
                 *, backend: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode with statistics as an int64 tensor (:data:`STAT_FIELDS` order): one part (``[T]``, ``[I]`` ->
    ``[numel]``, ``[F]``), or ``P`` parts of one layout as rows (``[P, T]``, ``[P, I]`` -> ``[P, numel]``, ``[P, F]``),
    each exactly as alone (:func:`tagc.sketch.codec.decode_parts`). Triton: no host synchronisation
    (:func:`tagc.kernels.ops.decode_async` says what it cannot raise); CPU back ends: the full
    :func:`tagc.sketch.decode`, its statistics packed into a tensor.
    """
    return _run("decode_async", (table, index), backend, table, index, layout, bits, fallback)
