"""The Triton kernels registered as torch operators, so ``torch.compile`` can trace them.

* Compiled Triton (CUDA): ``torch.library.triton_op`` whose bodies launch the kernels
  through ``torch.library.wrap_triton``; Inductor sees the kernels themselves.
* Triton interpreter (``TRITON_INTERPRET=1``, CPU): ``triton_op`` runs in eager mode, but
  tracing it hands fake tensors to the interpreter, which dereferences them; so there the
  ops are registered with ``torch.library.custom_op`` instead (opaque to the compiler,
  traceable thanks to the fake implementations, and still running the same kernels).

Every op has a fake (meta) implementation giving output shapes and dtypes. Below the ops,
the Triton path's entry points (:func:`row_thresholds_triton`, :func:`compress_triton`,
:func:`decode_triton`, :func:`decode_async`) check arguments like the reference and call them.

The kernel modules (:mod:`~tagc.kernels.radix_select`, :mod:`~tagc.kernels.compress`,
:mod:`~tagc.kernels.peel`) are leaves: this module and :mod:`tagc.kernels.dispatch` import
them, never the reverse. Importing this module imports triton; :mod:`tagc.kernels.dispatch`
imports it only on a Triton path.
"""

from __future__ import annotations

from typing import Optional

import torch

from tagc.kernels._triton import interpreting
from tagc.kernels.compress import launch_compress
from tagc.kernels.peel import FALLBACK_CODES, PEEL_STATS, launch_peel
from tagc.kernels.radix_select import launch_row_thresholds
from tagc.sketch.codec import DecodeStats, check_consistent, check_decode_args, finish_decode
from tagc.sketch.compress import check_compress_args
from tagc.sketch.index import check_bits, index_nbytes
from tagc.sketch.layout import SketchLayout
from tagc.sketch.sparsify import check_density, check_finite, keep_limit, positive_threshold

TRACEABLE_KERNELS = not interpreting()
"""True when the ops are ``triton_op`` (the compiler traces into the kernels)."""


def _identity(kernel):
    return kernel


if TRACEABLE_KERNELS:
    _register = torch.library.triton_op
    _wrap = torch.library.wrap_triton
else:
    _register = torch.library.custom_op
    _wrap = _identity


@_register("tagc::row_thresholds", mutates_args=())
def _row_thresholds_op(residual: torch.Tensor, grad: Optional[torch.Tensor], density: float) -> torch.Tensor:
    return launch_row_thresholds(residual, grad, density, wrap=_wrap)


@_row_thresholds_op.register_fake
def _(residual: torch.Tensor, grad: Optional[torch.Tensor], density: float) -> torch.Tensor:
    return residual.new_empty(residual.shape[0], dtype=torch.float32)


@_register("tagc::compress", mutates_args=("residual",))
def _compress_op(
    grad: torch.Tensor,
    residual: torch.Tensor,
    tau: torch.Tensor,
    rows: torch.Tensor,
    signs: torch.Tensor,
    lane_xor: torch.Tensor,
    lane_bits: int,
    table_numel: int,
    bits: int,
    limit: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_compress(grad, residual, tau, rows, signs, lane_xor, lane_bits, table_numel, bits, limit, wrap=_wrap)


@_compress_op.register_fake
def _(grad, residual, tau, rows, signs, lane_xor, lane_bits, table_numel, bits, limit):
    n_rows, numel = residual.shape
    index = residual.new_empty(n_rows, index_nbytes(numel, bits), dtype=torch.uint8)
    return index, residual.new_empty(n_rows, table_numel, dtype=torch.float32)


@_register("tagc::peel", mutates_args=())
def _peel_op(
    table: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    signs: torch.Tensor,
    lane_xor: torch.Tensor,
    numel: int,
    lane_bits: int,
    bits: int,
    fallback: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_peel(table, index, rows, signs, lane_xor, numel, lane_bits, bits, fallback, wrap=_wrap)


@_peel_op.register_fake
def _(table, index, rows, signs, lane_xor, numel, lane_bits, bits, fallback):
    return (
        table.new_empty(numel, dtype=torch.float32),
        table.new_empty(numel, dtype=torch.int8),
        table.new_empty(table.numel(), dtype=torch.float64),
        table.new_empty(len(PEEL_STATS), dtype=torch.int64),
    )


def row_thresholds(residual: torch.Tensor, grad: Optional[torch.Tensor], density: float) -> torch.Tensor:
    """``torch.ops.tagc.row_thresholds``: thresholds ``[N]`` of ``residual (+ grad)``."""
    return torch.ops.tagc.row_thresholds(residual, grad, density)


def compress_(grad, residual, tau, rows, signs, lane_xor, lane_bits: int, table_numel: int, bits: int, limit: int):
    """``torch.ops.tagc.compress``: the fused kernels (updates ``residual``); ``tau`` positive, ``limit``
    from :func:`tagc.sketch.sparsify.keep_limit`."""
    return torch.ops.tagc.compress(grad, residual, tau, rows, signs, lane_xor, lane_bits, table_numel, bits, limit)


def peel(table, index, rows, signs, lane_xor, numel: int, lane_bits: int, bits: int, fallback: int):
    """``torch.ops.tagc.peel``: the peeling kernel."""
    return torch.ops.tagc.peel(table, index, rows, signs, lane_xor, numel, lane_bits, bits, fallback)


# ---------------------------------------------------------------- the Triton path's entry points


def row_thresholds_triton(rows: torch.Tensor, density: float, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton twin of :func:`tagc.sketch.row_thresholds` (bit-identical result).

    ``rows`` is ``[N, S]`` (or ``[S]``, giving ``[1]``); with ``grad`` the thresholds are of
    ``rows + grad`` (rounded to ``rows.dtype``), which is not materialised.
    """
    check_density(density)
    return row_thresholds(rows.reshape(-1, rows.shape[-1]).contiguous(), grad, float(density))


def compress_triton(grad: torch.Tensor, residual: torch.Tensor, density: float, layout: SketchLayout, bits: int,
                    tau: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`tagc.sketch.compress_` (same arguments, same results).

    ``tau`` (``[N]`` float32 on the device) skips the threshold selection; by default it
    is :func:`row_thresholds_triton` of ``residual + grad``, which equals the reference's
    threshold. No host synchronisation.
    """
    check_compress_args(grad, residual, density)
    check_bits(bits)
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous (it is updated in place)")
    rows = residual.view(-1, layout.numel)
    g = grad.reshape(rows.shape).contiguous()
    if tau is None:
        tau = row_thresholds(rows, g, float(density))
    tau = tau.to(device=rows.device, dtype=torch.float32).reshape(rows.shape[0])
    # compared as the reference does, in the residual's dtype, never below its smallest subnormal
    tau = positive_threshold(tau, rows.dtype).to(torch.float32).contiguous()
    t = layout.tables(rows.device)
    return compress_(g, rows, tau, t.rows, t.signs, t.lane_xor, layout.lane_bits, layout.table_numel, bits,
                     keep_limit(layout.numel, float(density)))


def decode_async(
    table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Peel on the device with no host synchronisation: ``(values, stats)``.

    ``stats`` is an int64 device tensor in :data:`tagc.kernels.STAT_FIELDS` order. No exact
    solve of stopping sets: what peeling leaves gets the fallback directly (``"error"`` cannot be
    raised without a sync, so it behaves like ``"raw"`` here, and is not counted as raw).
    Does not check the table for NaN/Inf, nor raise on an inconsistent table and index
    (that would sync): the latter's count is not part of ``stats``; :func:`decode_triton`
    checks both.
    """
    check_decode_args(table, index, layout, bits, fallback)
    t = layout.tables(table.device)
    out, _state, _work, stats = peel(
        table.reshape(-1).contiguous(), index, t.rows, t.signs, t.lane_xor, layout.numel, layout.lane_bits, bits,
        FALLBACK_CODES[fallback],
    )
    return out, stats[:-1]  # DecodeStats's fields, without the inconsistent count


def decode_triton(
    table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate"
) -> tuple[torch.Tensor, DecodeStats]:
    """Triton twin of :func:`tagc.sketch.decode`: same arguments, results and statistics.

    Peeling (and the median estimate) run in the kernel; then one host read of the stats,
    and only if peeling left positions, the reference's exact solve of the stopping sets in
    torch, then the fallback for what is still undetermined.
    """
    check_decode_args(table, index, layout, bits, fallback)
    check_finite(table, "sketch table")
    t = layout.tables(table.device)
    out, state, work, dev_stats = peel(
        table.reshape(-1).contiguous(), index, t.rows, t.signs, t.lane_xor, layout.numel, layout.lane_bits, bits,
        FALLBACK_CODES[fallback],
    )
    host = dict(zip(PEEL_STATS, dev_stats.tolist()))  # the one sync: DecodeStats holds ints
    check_consistent(host["inconsistent"], layout)
    stats = DecodeStats(support=host["support"], rounds=host["rounds"])
    stuck = (state == 1).nonzero().squeeze(1) if host["unpeeled"] else torch.empty(0, dtype=torch.int64, device=out.device)
    rest_positions, rest_values = finish_decode(work, stuck, layout, stats, fallback)
    out.index_copy_(0, rest_positions, rest_values.float())
    return out, stats
