"""The Triton kernels registered as torch operators, so ``torch.compile`` can trace them.

* Compiled Triton (CUDA): ``torch.library.triton_op`` whose bodies launch the kernels
  through ``torch.library.wrap_triton``; Inductor sees the kernels themselves.
* Triton interpreter (``TRITON_INTERPRET=1``, CPU): ``triton_op`` runs in eager mode, but
  tracing it hands fake tensors to the interpreter, which dereferences them; so there the
  ops are registered with ``torch.library.custom_op`` instead (opaque to the compiler,
  traceable thanks to the fake implementations, and still running the same kernels).

Every op has a fake (meta) implementation giving output shapes and dtypes. Importing this
module imports triton; :mod:`tagc.kernels.dispatch` imports it only on a Triton path.
"""

from __future__ import annotations

from typing import Optional

import torch

from tagc.kernels._triton import interpreting
from tagc.kernels.compress import launch_compress
from tagc.kernels.peel import PEEL_STATS, launch_peel
from tagc.kernels.radix_select import launch_row_thresholds
from tagc.sketch.index import index_nbytes

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
