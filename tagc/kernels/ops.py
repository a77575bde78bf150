"""The Triton kernels registered as torch operators, so ``torch.compile`` can trace them.

* Compiled Triton (CUDA): ``torch.library.triton_op`` whose bodies launch the kernels
  through ``torch.library.wrap_triton``; Inductor sees the kernels themselves.
* Triton interpreter (``TRITON_INTERPRET=1``, CPU): ``triton_op`` runs in eager mode, but
  tracing it hands fake tensors to the interpreter, which dereferences them; so there the
  ops are registered with ``torch.library.custom_op`` instead (opaque to the compiler,
  traceable thanks to the fake implementations, and still running the same kernels).

Every op has a fake (meta) implementation giving output shapes and dtypes. Below the ops, the Triton
path's entry points (``*_triton``, :func:`decode_async`) check arguments like the reference and call them.
The kernel modules are leaves (docs/design.md §2); importing this module imports triton.
"""

from __future__ import annotations

from typing import Optional

import torch

from tagc.kernels._triton import interpreting
from tagc.kernels.compress import blocks_by_row, launch_compress
from tagc.kernels.kept_list import launch_list_kept, launch_sum_lists
from tagc.kernels.peel import FALLBACK_CODES, PEEL_STATS, launch_peel
from tagc.kernels.positions import (
    launch_code_index,
    launch_decode_positions,
    launch_encode_positions,
    launch_union_index,
)
from tagc.kernels.radix_select import launch_row_thresholds
from tagc.kernels.torch_tracing import is_fake
from tagc.sketch.codec import (
    DECODE_STATS,
    EXACT_SOLVE_LIMIT,
    DecodeStats,
    check_consistent,
    parts_of,
    unrecovered_error,
)
from tagc.sketch.compress import check_compress_args
from tagc.sketch.index import check_bits, index_nbytes
from tagc.sketch.kept_list import check_list_args, list_positions, position_blocks
from tagc.sketch.layout import SketchLayout
from tagc.sketch.positions import MAX_LOW_BITS, check_coded, coded_row_bytes
from tagc.sketch.sparsify import NONFINITE_HINT, capacity, check_density, keep_limit, positive_threshold

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
def _compress_op(grad: torch.Tensor, residual: torch.Tensor, tau: torch.Tensor, rows: torch.Tensor, signs: torch.Tensor,
                 lane_xor: torch.Tensor, lane_bits: int, table_numel: int, bits: int, limit: int, cap: int,
                 by_row: torch.Tensor, row_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_compress(grad, residual, tau, rows, signs, lane_xor, lane_bits, table_numel, bits, limit, cap,
                           by_row=by_row, row_start=row_start, wrap=_wrap)


@_compress_op.register_fake
def _(grad, residual, tau, rows, signs, lane_xor, lane_bits, table_numel, bits, limit, cap, by_row, row_start):
    n_rows, numel = residual.shape
    index = residual.new_empty(n_rows, index_nbytes(numel, bits), dtype=torch.uint8)
    return (index, residual.new_empty(n_rows, table_numel, dtype=torch.float32),
            residual.new_empty(n_rows, dtype=torch.int64))


@_register("tagc::peel", mutates_args=())
def _peel_op(table: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, signs: torch.Tensor, lane_xor: torch.Tensor,
             numel: int, lane_bits: int, bits: int, fallback: int,
             tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_peel(table, index, rows, signs, lane_xor, numel, lane_bits, bits, fallback, tile=tile, wrap=_wrap)


@_peel_op.register_fake
def _(table, index, rows, signs, lane_xor, numel, lane_bits, bits, fallback, tile):
    parts = 1 if index.dim() == 1 else index.shape[0]
    return (table.new_empty(parts, numel, dtype=torch.float32), table.new_empty(parts, numel, dtype=torch.int8),
            table.new_empty(parts, len(PEEL_STATS), dtype=torch.int64),
            table.new_empty(parts, EXACT_SOLVE_LIMIT, dtype=torch.int64))


@_register("tagc::code_index", mutates_args=())
def _code_index_op(index: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    return launch_code_index(index, numel, cap, low, wrap=_wrap)


@_code_index_op.register_fake
def _(index, numel, cap, low):
    return index.new_empty(index.shape[0], coded_row_bytes(numel, cap, low), dtype=torch.uint8)


@_register("tagc::encode_positions", mutates_args=())
def _encode_positions_op(positions: torch.Tensor, count: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    return launch_encode_positions(positions, count, numel, cap, low, wrap=_wrap)


@_encode_positions_op.register_fake
def _(positions, count, numel, cap, low):
    return positions.new_empty(positions.shape[0], coded_row_bytes(numel, cap, low), dtype=torch.uint8)


@_register("tagc::decode_positions", mutates_args=())
def _decode_positions_op(code: torch.Tensor, numel: int, cap: int, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_decode_positions(code, numel, cap, low, wrap=_wrap)


@_decode_positions_op.register_fake
def _(code, numel, cap, low):
    rows = code.shape[0]
    return code.new_empty(rows, cap, dtype=torch.int64), code.new_empty(rows, dtype=torch.int64)


@_register("tagc::union_index", mutates_args=())
def _union_index_op(code: torch.Tensor, numel: int, cap: int, low: int, parts: int = 1) -> torch.Tensor:
    return launch_union_index(code, numel, cap, low, parts, wrap=_wrap)


@_union_index_op.register_fake
def _(code, numel, cap, low, parts=1):
    return code.new_empty(parts * index_nbytes(numel, 1), dtype=torch.uint8)


@_register("tagc::list_kept", mutates_args=("residual",))
def _list_kept_op(grad: torch.Tensor, residual: torch.Tensor, tau: torch.Tensor, cap: int,
                  limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_list_kept(grad, residual, tau, cap, limit, wrap=_wrap)


@_list_kept_op.register_fake
def _(grad, residual, tau, cap, limit):
    rows, numel = residual.shape
    return (residual.new_empty(rows, position_blocks(numel) + 1, dtype=torch.int32),
            residual.new_empty(rows, cap, dtype=torch.uint16), residual.new_empty(rows, cap, dtype=torch.float32))


@_register("tagc::sum_lists", mutates_args=())
def _sum_lists_op(counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    return launch_sum_lists(counts, offsets, values, numel, wrap=_wrap)


@_sum_lists_op.register_fake
def _(counts, offsets, values, numel):
    return values.new_empty(numel, dtype=torch.float32)


def row_thresholds(residual: torch.Tensor, grad: Optional[torch.Tensor], density: float) -> torch.Tensor:
    """``torch.ops.tagc.row_thresholds``: thresholds ``[N]`` of ``residual (+ grad)``."""
    return torch.ops.tagc.row_thresholds(residual, grad, density)


def compress_(grad, residual, tau, rows, signs, lane_xor, lane_bits: int, table_numel: int, bits: int, limit: int,
              cap: int, by_row: Optional[torch.Tensor] = None, row_start: Optional[torch.Tensor] = None):
    """``torch.ops.tagc.compress``: the fused kernels (updates ``residual``); ``tau`` positive, ``limit``
    and ``cap`` from :func:`tagc.sketch.sparsify.keep_limit` and :func:`~tagc.sketch.sparsify.capacity`,
    ``by_row, row_start`` :func:`tagc.kernels.compress.blocks_by_row` of ``rows`` (computed when not
    given). Returns ``(index, table, held)``."""
    if by_row is None or row_start is None:
        by_row, row_start = blocks_by_row(rows, table_numel >> lane_bits)
    return torch.ops.tagc.compress(grad, residual, tau, rows, signs, lane_xor, lane_bits, table_numel, bits, limit,
                                   cap, by_row, row_start)


_INVERSES: dict[tuple[SketchLayout, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def sketch_inverse(layout: SketchLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tagc.kernels.compress.blocks_by_row` of ``layout`` on ``device``, made once per layout and device
    (never kept when made of fake tensors, under tracing)."""
    key = (layout, torch.device(device))
    if key not in _INVERSES:
        inverse = blocks_by_row(layout.tables(device).rows, layout.rows)
        if any(is_fake(t) for t in inverse):
            return inverse
        if len(_INVERSES) >= 256:
            _INVERSES.clear()
        _INVERSES[key] = inverse
    return _INVERSES[key]


def peel(table, index, rows, signs, lane_xor, numel: int, lane_bits: int, bits: int, fallback: int, tile: int = 0):
    """``torch.ops.tagc.peel``: the device decode of one part or of parts as rows
    (:func:`tagc.kernels.peel.launch_peel`; ``tile`` 0 is its default). Returns ``(values, state, stats, rest)``,
    a row per part."""
    return torch.ops.tagc.peel(table, index, rows, signs, lane_xor, numel, lane_bits, bits, fallback, tile)


# ---------------------------------------------------------------- the Triton path's entry points


def row_thresholds_triton(rows: torch.Tensor, density: float, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton twin of :func:`tagc.sketch.row_thresholds` (bit-identical result).

    ``rows`` is ``[N, S]`` (or ``[S]``, giving ``[1]``); with ``grad`` the thresholds are of
    ``rows + grad`` (rounded to ``rows.dtype``), which is not materialised.
    """
    check_density(density)
    return row_thresholds(rows.reshape(-1, rows.shape[-1]).contiguous(), grad, float(density))


def compress_triton(grad: torch.Tensor, residual: torch.Tensor, density: float, layout: SketchLayout, bits: int,
                    tau: Optional[torch.Tensor] = None, return_held: bool = False, cap: Optional[int] = None):
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
    index, table, held = compress_(g, rows, tau, t.rows, t.signs, t.lane_xor, layout.lane_bits, layout.table_numel,
                                   bits, keep_limit(layout.numel, float(density)),
                                   capacity(layout.numel, float(density)) if cap is None else cap,
                                   *sketch_inverse(layout, rows.device))
    return (index, table, held) if return_held else (index, table)


def _peel_chunk(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str,
                tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`peel` of one part (``[T]``, ``[I]``) or of parts as rows (``[P, T]``, ``[P, I]``): a row per part."""
    tables, indexes = parts_of(table, index, layout, bits, fallback)
    t = layout.tables(table.device)
    return peel(tables.contiguous(), indexes.contiguous(), t.rows, t.signs, t.lane_xor, layout.numel,
                layout.lane_bits, bits, FALLBACK_CODES[fallback], tile)


def decode_async(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate",
                 tile: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The device decode with no host synchronisation: ``(values, stats)``; of one part (``[T]``, ``[I]`` ->
    ``[numel]``, ``[F]``) or of parts as rows (``[P, T]``, ``[P, I]`` -> ``[P, numel]``, ``[P, F]``), in one set of
    launches, each part exactly as alone.

    The same values as :func:`decode_triton` (peeling, the exact solve of the stopping sets, the
    fallback), bit for bit from run to run; ``stats`` is an int64 device tensor in
    :data:`tagc.kernels.STAT_FIELDS` order. ``"error"`` cannot raise without a sync, so it
    leaves what is unrecovered at 0, as ``"raw"`` does, without counting it as raw. Nothing
    raises on a table holding NaN/Inf nor on an inconsistent table and index (that would
    sync): the caller decides (:func:`decode_triton` raises on both).
    """
    out, _state, stats, _rest = _peel_chunk(table, index, layout, bits, fallback, tile)
    if index.dim() == 1:
        return out[0], stats[0, : len(DECODE_STATS)]
    return out, stats[:, : len(DECODE_STATS)]


def decode_triton(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate",
                  tile: int = 0) -> tuple[torch.Tensor, DecodeStats]:
    """Triton twin of :func:`tagc.sketch.decode`: same arguments, results and statistics.

    Everything runs on the device (:func:`tagc.kernels.peel.launch_peel`: peeling, the exact
    solve of the stopping sets, the fallback, the NaN/Inf and consistency checks); then one host
    read, of the statistics (``DecodeStats`` holds ints), from which it raises what the
    reference raises. With ``fallback="raw"`` the unrecovered positions come from the solve's
    list when it ran, else from a ``nonzero_static`` sized by that read: no second sync.
    """
    out, state, dev_stats, rest = (row[0] for row in _peel_chunk(table, index.reshape(-1), layout, bits, fallback,
                                                                  tile))
    host = dict(zip(PEEL_STATS, dev_stats.tolist()))  # the one host read
    if host["nan_cells"] or host["inf_cells"]:
        bad = "NaN" if host["nan_cells"] else "Inf"
        raise ValueError(f"sketch table contains {bad}; {NONFINITE_HINT}")
    check_consistent(host["inconsistent"], layout)
    stats = DecodeStats(**{name: host[name] for name in DECODE_STATS})
    if stats.unpeeled and fallback == "error":
        raise unrecovered_error(stats.unpeeled, stats.support, layout)
    if fallback == "raw":
        if stats.raw <= rest.numel():  # the solve ran (or nothing is left): its list, in order
            stats.raw_positions = rest[: stats.raw]
        else:
            stats.raw_positions = torch.nonzero_static(state == 1, size=stats.raw).squeeze(1)
    return out, stats


# ---------------------------------------------------------------- coded positions (tagc.sketch.positions)


def _check_code_settings(numel: int, cap: int, low: int) -> None:
    if numel < 0 or cap < 0 or not 0 <= low <= MAX_LOW_BITS:
        raise ValueError(f"coded positions need numel >= 0, cap >= 0 and 0 <= low <= {MAX_LOW_BITS}, "
                         f"got numel {numel}, cap {cap}, low {low}")


def code_index_triton(index: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    """Triton twin of :func:`tagc.sketch.positions.code_index` (the same bytes): each row's first
    ``cap`` set positions of a packed 1-bit index, coded."""
    _check_code_settings(numel, cap, low)
    if index.dtype != torch.uint8 or index.dim() != 2 or index.shape[1] < index_nbytes(numel, 1):
        raise ValueError(f"a coded index takes uint8 [R, >= {index_nbytes(numel, 1)}] rows, "
                         f"got {index.dtype}{tuple(index.shape)}")
    return torch.ops.tagc.code_index(index.contiguous(), numel, cap, low)


def encode_positions_triton(positions: torch.Tensor, count: torch.Tensor, numel: int, cap: int,
                            low: int) -> torch.Tensor:
    """Triton twin of :func:`tagc.sketch.positions.encode_positions` (the same bytes)."""
    _check_code_settings(numel, cap, low)
    if positions.dim() != 2 or positions.shape[1] != cap or count.numel() != positions.shape[0]:
        raise ValueError(f"positions must be [R, cap={cap}] with one count per row, got {tuple(positions.shape)} "
                         f"and {count.numel()} counts")
    return torch.ops.tagc.encode_positions(positions.to(torch.int64).contiguous(),
                                           count.to(torch.int64).reshape(-1).contiguous(), numel, cap, low)


def decode_positions_triton(code: torch.Tensor, numel: int, cap: int, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`tagc.sketch.positions.decode_positions` (the same positions and counts)."""
    check_coded(code, numel, cap, low)
    return torch.ops.tagc.decode_positions(code.contiguous(), numel, cap, low)


def union_index_triton(code: torch.Tensor, numel: int, cap: int, low: int, parts: int = 1) -> torch.Tensor:
    """Triton twin of :func:`tagc.sketch.positions.union_index` (the same bytes)."""
    check_coded(code, numel, cap, low)
    return torch.ops.tagc.union_index(code.contiguous(), numel, cap, low, parts)


# ---------------------------------------------------------------- topk's kept list (tagc.sketch.kept_list)


def list_kept_triton(grad: torch.Tensor, residual: torch.Tensor, density: float, cap: int,
                     tau: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`tagc.sketch.kept_list.list_kept_` (same arguments, same results bit for bit).

    ``tau`` by default is :func:`row_thresholds_triton` of ``residual + grad`` (the reference's
    threshold). No host synchronisation.
    """
    check_list_args(grad, residual, density, cap)
    if not residual.is_contiguous():
        raise ValueError("residual must be contiguous (it is updated in place)")
    g = grad.contiguous()
    if tau is None:
        tau = row_thresholds(residual, g, float(density))
    # compared as the reference does, in the residual's dtype, never below its smallest subnormal
    tau = tau.to(residual.device).reshape(-1)
    tau = positive_threshold(tau.expand(residual.shape[0]) if tau.numel() == 1 else tau, residual.dtype)
    return torch.ops.tagc.list_kept(g, residual, tau.to(torch.float32).contiguous(), cap,
                                    keep_limit(residual.shape[1], float(density)))


def list_positions_triton(counts: torch.Tensor, offsets: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tagc.sketch.kept_list.list_positions` as it is: on the device it is a cumsum, a searchsorted and
    two selects, each one launch with no host read, so it needs no kernel of its own."""
    return list_positions(counts, offsets, numel)


def sum_lists_triton(counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Triton twin of :func:`tagc.sketch.kept_list.sum_lists`: the same sums bit for bit (rows added in rank order)."""
    if offsets.dim() != 2 or values.shape != offsets.shape or counts.dim() != 2 or counts.shape[0] != offsets.shape[0]:
        raise ValueError(f"lists are counts [N, nb + 1], offsets and values [N, cap]; got {tuple(counts.shape)}, "
                         f"{tuple(offsets.shape)}, {tuple(values.shape)}")
    return torch.ops.tagc.sum_lists(counts.contiguous(), offsets.contiguous(), values.to(torch.float32).contiguous(),
                                    numel)
