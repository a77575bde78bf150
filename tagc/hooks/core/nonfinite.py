"""TAGC's NaN/Inf policy and decode statistics on the device: no host read in a steady exchange.

The policy (docs/design.md §6): a non-finite part keeps its residual and sends a NaN table. Deciding that
with ``bool(finite(grad))`` waits for the GPU once per part; here the decision is a boolean tensor ``ok`` (0-d,
or one per part of a batch) and every branch is a ``torch.where``:

* encode: the gradient is zeroed where ``ok`` is false (``where(ok, grad, 0)``, one extra
  pass over the gradient part) and the per-row thresholds are ``+inf``, so the fused compress
  adds 0 to the residual and keeps nothing: the residual stays as it was (bit for bit, up to
  the sign of a zero), without a copy of it. The table sent is ``where(ok, table, NaN)``; the
  index is all zeros (nothing kept). The thresholds are those the fused compress computes
  itself (:func:`thresholds`), so a finite part is compressed exactly as before.
* decode (``fallback="estimate"``): the summed table is zeroed where it is not finite, decoded
  with :func:`tagc.kernels.dispatch.decode_async` (statistics as an int64 device tensor), the
  values are ``where(ok, values, NaN)``, and the statistics are added to the
  :class:`~tagc.hooks.core.stats.ExchangeStats` as device tensors (``* ok``: a non-finite part
  counts only ``nonfinite_parts``). They are read once, by ``stats()``.

``decode_async`` solves peeling's stopping sets on every back end (docs/design.md §3.7).
"""

from __future__ import annotations

import math

import torch

from tagc.hooks.core.stats import ExchangeStats
from tagc.kernels import dispatch
from tagc.sketch import SketchLayout
from tagc.sketch.kept_list import finite

DEVICE_STATS = ("support", "peeled", "unpeeled", "estimated")
"""The decode statistics the hook keeps (of :data:`tagc.kernels.dispatch.STAT_FIELDS`)."""


EXTREMES_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes whose rows :func:`finite_rows` checks by their extremes (the float8 ones take ``isfinite``)."""


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Whether each row of ``x`` (along its last dimension) is free of NaN/Inf: bool ``x.shape[:-1]``.

    NaN and Inf surface in a row's minimum or maximum, so one reduction decides it: ``amin`` and ``amax`` on a
    CPU, where torch's ``aminmax`` and ``isfinite(x).all()`` along a dimension are many times slower than they,
    and the fused ``aminmax`` elsewhere (one launch)."""
    if x.shape[-1] == 0 or x.dtype not in EXTREMES_DTYPES:
        return torch.isfinite(x).all(dim=-1)
    if x.device.type == "cpu":
        low, high = x.amin(dim=-1), x.amax(dim=-1)
    else:
        low, high = torch.aminmax(x, dim=-1)
    return torch.isfinite(low) & torch.isfinite(high)


def finite_parts(grad: torch.Tensor) -> torch.Tensor:
    """Whether each part of ``grad`` (``[N, P, n]``: part ``p``'s rows ``grad[:, p]``) is finite: bool ``[P]``."""
    return finite_rows(grad).all(dim=0)


def zero_unless_finite(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ok, grad zeroed where not ok)``: for one part's ``[N, n]``, ``ok`` a 0-d bool tensor, whether every entry
    is finite; for parts side by side, ``[N, P, n]``, ``ok`` per part (:func:`finite_parts`)."""
    ok = finite(grad) if grad.dim() < 3 else finite_parts(grad)
    return ok, torch.where(ok[..., None] if ok.dim() else ok, grad, torch.zeros((), dtype=grad.dtype,
                                                                                 device=grad.device))


def thresholds(residual: torch.Tensor, grad: torch.Tensor, density: float, numel: int) -> torch.Tensor:
    """The per-row thresholds the fused compress computes for ``residual + grad`` (``[N]``):
    its sample of the sum in the residual's dtype."""
    rows = residual.reshape(-1, numel)
    grads = grad.reshape(rows.shape)
    if residual.dtype != torch.float32 and torch.promote_types(residual.dtype, grad.dtype) != residual.dtype:
        # compress adds in place, rounding the sum to the residual's dtype before sampling it
        rows, grads = (rows + grads).to(residual.dtype), None
    return dispatch.row_thresholds(rows, density, grad=grads)


def compress_(ok: torch.Tensor, grad: torch.Tensor, residual: torch.Tensor, density: float, layout: SketchLayout,
              bits: int, cap: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused compress under the NaN/Inf policy; ``ok, grad`` from :func:`zero_unless_finite`.

    Several parts side by side (``[N, P, n]``, ``ok`` ``[P]``) are compressed in one call, each as alone: every
    back end works row by row. Returns ``(index, table, held)`` (rows ``[N * P, ...]``): ``held`` (int64 0-d)
    counts the entries the rows' capacity ``cap`` (:func:`tagc.sketch.sparsify.capacity`) left in the residual.
    """
    parts = ok.numel()
    tau = torch.where(ok, thresholds(residual, grad, density, layout.numel).view(-1, parts), math.inf)
    index, table, held = dispatch.compress_(grad, residual, density, layout, bits, tau=tau, return_held=True, cap=cap)
    table = torch.where(ok[..., None], table.view(-1, parts, layout.table_numel), math.nan)
    return index, table.view(-1, layout.table_numel), held.sum()


def decode_(summed: torch.Tensor, union: torch.Tensor, layout: SketchLayout, bits: int, fallback: str,
            stats: ExchangeStats) -> torch.Tensor:
    """Decode summed tables under the NaN/Inf policy; statistics added to ``stats`` on the device. One part's table
    ``[T]`` and union index, or several parts' ``[P, T]`` and ``[P, I]``, all in one decode call
    (:func:`tagc.kernels.dispatch.decode_async` of the parts as rows); the values side by side."""
    tables = summed.view(-1, layout.table_numel)
    ok = finite_parts(tables[None])
    clean = torch.where(ok[:, None], tables, 0.0)
    values, counts = dispatch.decode_async(clean, union.view(tables.shape[0], -1), layout, bits, fallback)
    counts = (counts * ok[:, None]).sum(dim=0)
    stats.count_nonfinite(ok)
    for name in DEVICE_STATS:
        stats.count(name, counts[dispatch.STAT_FIELDS.index(name)])
    return torch.where(ok[:, None], values, math.nan).view(-1)
