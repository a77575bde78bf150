"""CPU kernels (Numba): the fused compression pass and queue-driven peeling.

The torch reference is bound by its passes (about fifteen over a part in compress, several index operations per
peeling round); these kernels do the same arithmetic in one loop each:

* :func:`compress_cpu` - one pass per chunk: ``a = residual + grad``, the selection rule of
  :mod:`tagc.sketch.sparsify` (``tau`` from the reference's sample, :func:`row_thresholds`), then a second
  walk over the short list of candidates to settle the ties and the capacity; positions are added in the
  reference's order, so index, residual and table equal the reference's bit for bit.
* :func:`decode_parts_cpu` - unpack the union, count and id-sum every cell, then peel with a
  queue of pure cells, generation by generation (``rounds`` is the reference's round
  count). What peeling leaves goes to the reference's exact solve and fallback
  (:func:`tagc.sketch.codec.finish_decode`). Values equal the reference's up to float64
  rounding of the order of subtractions. The same index/table consistency check. A batch of
  parts peels part after part in one kernel call.
* :func:`list_kept_cpu` / :func:`sum_lists_cpu` - the ``topk`` peer: the same pass as
  :func:`compress_cpu` writing the kept entries into lists (:mod:`tagc.sketch.kept_list`)
  instead of a sketch, and the owner's scatter-add. Bit-identical to the reference.

Both release the GIL (``nogil``), so gloo's threads and Python keep running. Numba
compiles them once per machine (``cache=True``) and only when first called.
"""

from __future__ import annotations

import functools

import torch

from tagc.kernels.fallbacks import warn_fallback
from tagc.sketch.codec import DECODE_STATS, check_consistent, finish_decode, parts_of
from tagc.sketch.compress import check_compress_args
from tagc.sketch.index import check_bits, index_nbytes
from tagc.sketch.kept_list import POSITION_BLOCK, check_list_args, finite, position_blocks
from tagc.sketch.layout import SketchLayout
from tagc.sketch.positions import BLOCK_BITS, check_coded, code_blocks, coded_row_bytes
from tagc.sketch.sparsify import (
    capacity,
    check_density,
    check_finite,
    keep_limit,
    positive_threshold,
    row_thresholds,
    sample_size,
    sample_stride,
)


@functools.cache
def numba_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the CPU kernels take these tensors (CPU, and numba importable)."""
    return numba_available() and all(t.device.type == "cpu" for t in tensors)


def _kernels():
    from tagc.kernels import _numba

    return _numba


def _warn_reference(residual: torch.Tensor) -> None:
    warn_fallback("numba-residual", f"TAGC: the CPU kernels take contiguous float32 residuals; this one is "
                  f"{residual.dtype}{'' if residual.is_contiguous() else ', not contiguous'}, so the torch reference "
                  "compresses it (slower). Keep residual_dtype=torch.float32 for the CPU kernels.")


def _tables(layout: SketchLayout):
    t = layout.tables("cpu")
    return t.rows.numpy(), t.signs.numpy(), t.lane_xor.numpy()


def _row_thresholds(rows: torch.Tensor, grads: torch.Tensor, density: float) -> torch.Tensor:
    """:func:`tagc.sketch.sparsify.row_thresholds` of ``rows + grads``, sampling in the kernel."""
    n = rows.shape[1]
    size = sample_size(n, density) if 0.0 < density < 1.0 else n
    if size == n:  # no sample: the reference's exact path
        return row_thresholds(rows, density, grad=grads)
    keep = keep_limit(size, density)
    return torch.from_numpy(
        _kernels().sampled_kth(grads.numpy(), rows.numpy(), sample_stride(n), size, size - keep + 1)
    )


def row_thresholds_cpu(rows: torch.Tensor, density: float, grad: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`tagc.kernels.dispatch.row_thresholds` on the CPU: for float32 rows and gradient, the one-pass sample
    the fused kernels take (:func:`_row_thresholds`, the reference's values); anything else takes the reference."""
    check_density(density)
    x = rows.reshape(-1, rows.shape[-1])
    g = None if grad is None else grad.reshape(x.shape)
    if g is None or x.dtype != torch.float32 or g.dtype != torch.float32:
        return row_thresholds(x, density, grad=g)
    return _row_thresholds(x.contiguous(), g.contiguous(), density)


def compress_cpu(grad: torch.Tensor, residual: torch.Tensor, density: float, layout: SketchLayout, bits: int, tau=None,
                 return_held: bool = False, cap=None):
    """:func:`tagc.sketch.compress_` in one pass per chunk (same arguments, same results).

    A residual that is not float32 (``residual_dtype=torch.bfloat16``) takes the reference.
    """
    check_compress_args(grad, residual, density)
    check_bits(bits)
    if residual.dtype != torch.float32 or not residual.is_contiguous():
        _warn_reference(residual)
        from tagc.sketch.compress import compress_

        return compress_(grad, residual, density, layout, bits, tau=tau, return_held=return_held, cap=cap)
    rows = residual.view(-1, layout.numel)
    grads = grad.reshape(rows.shape).to(torch.float32)  # a strided view is fine
    n_chunks = rows.shape[0]
    if tau is None:
        tau = _row_thresholds(rows, grads, density)
    tau = positive_threshold(tau, torch.float32).reshape(n_chunks)
    index = torch.zeros(n_chunks, index_nbytes(layout.numel, bits), dtype=torch.uint8)
    table = torch.zeros(n_chunks, layout.table_numel, dtype=torch.float32)
    held = torch.empty(n_chunks, dtype=torch.int64)
    _kernels().compress_rows(grads.numpy(), rows.numpy(), tau.numpy(), keep_limit(layout.numel, density),
                             capacity(layout.numel, density) if cap is None else cap, *_tables(layout),
                             layout.lane_bits, bits, index.numpy(), table.numpy(), held.numpy())
    return (index, table, held) if return_held else (index, table)


def decode_parts_cpu(
    table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tagc.sketch.codec.decode_parts` with queue-driven peeling, part after part in one kernel call (same
    arguments, same results)."""
    tables, indexes = parts_of(table, index, layout, bits, fallback)
    check_finite(tables, "sketch table")
    work = tables.reshape(-1).to(torch.float64, copy=True).view(tables.shape)  # contiguous, the caller's untouched
    out = torch.zeros(tables.shape[0], layout.numel, dtype=torch.float32)
    stuck, support, rounds, inconsistent = _kernels().peel_parts(
        indexes.contiguous().numpy(), layout.numel, bits, work.numpy(), out.numpy(), *_tables(layout),
        layout.lane_bits)
    check_consistent(int(inconsistent.sum()), layout)
    stats = torch.zeros(tables.shape[0], len(DECODE_STATS), dtype=torch.int64)
    stats[:, DECODE_STATS.index("support")] = torch.from_numpy(support)
    stats[:, DECODE_STATS.index("rounds")] = torch.from_numpy(rounds)
    rest_positions, rest_values, rest = finish_decode(work.view(-1), torch.from_numpy(stuck), layout, stats, fallback)
    out.view(-1).index_copy_(0, rest_positions, rest_values.float())
    return out, stats, rest


def list_kept_cpu(grad: torch.Tensor, residual: torch.Tensor, density: float, cap: int,
                  tau=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tagc.sketch.kept_list.list_kept_` in one pass per row (same arguments, same results).

    A residual that is not float32 (``residual_dtype=torch.bfloat16``) takes the reference.
    """
    check_list_args(grad, residual, density, cap)
    if residual.dtype != torch.float32 or not residual.is_contiguous():
        _warn_reference(residual)
        from tagc.sketch.kept_list import list_kept_

        return list_kept_(grad, residual, density, cap, tau=tau)
    n_rows, numel = residual.shape
    counts = torch.zeros(n_rows, position_blocks(numel) + 1, dtype=torch.int32)
    offsets = torch.zeros(n_rows, cap, dtype=torch.uint16)
    values = torch.zeros(n_rows, cap, dtype=torch.float32)
    if not bool(finite(grad)):  # the residual stays as it was; the owner sees NaN
        return counts, offsets, values.fill_(float("nan"))
    grads = grad.to(torch.float32)
    if tau is None:
        tau = _row_thresholds(residual, grads, density)
    tau = positive_threshold(tau, torch.float32).reshape(n_rows)
    _kernels().list_rows(grads.numpy(), residual.numpy(), tau.numpy(), keep_limit(numel, density),
                         POSITION_BLOCK.bit_length() - 1, counts.numpy(), offsets.numpy(), values.numpy())
    return counts, offsets, values


def list_positions_cpu(counts: torch.Tensor, offsets: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tagc.sketch.kept_list.list_positions` in one walk per row (same results for the counts
    :func:`list_kept_cpu` writes)."""
    positions = torch.empty(offsets.shape, dtype=torch.int64)
    listed = torch.empty(offsets.shape, dtype=torch.bool)
    _kernels().list_positions(counts.contiguous().numpy(), offsets.contiguous().numpy(),
                              POSITION_BLOCK.bit_length() - 1, numel, positions.numpy(), listed.numpy())
    return positions, listed


def sum_lists_cpu(counts: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """:func:`tagc.sketch.kept_list.sum_lists` in one walk (same arguments, same results)."""
    out = torch.zeros(numel, dtype=torch.float32)
    _kernels().sum_lists(counts.contiguous().numpy(), offsets.contiguous().numpy(), values.float().contiguous().numpy(),
                         POSITION_BLOCK.bit_length() - 1, out.numpy())
    return out


def code_positions_cpu(positions: torch.Tensor, count: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    """:func:`tagc.sketch.positions.encode_positions` in one walk per row (same bytes)."""
    out = torch.zeros(positions.shape[0], coded_row_bytes(numel, cap, low), dtype=torch.uint8)
    _kernels().code_positions(positions.contiguous().numpy(), count.to(torch.int64).contiguous().numpy(),
                              code_blocks(numel), low, BLOCK_BITS, out.numpy())
    return out


def code_index_cpu(index: torch.Tensor, numel: int, cap: int, low: int) -> torch.Tensor:
    """:func:`tagc.sketch.positions.code_index` in one walk per row (same bytes)."""
    out = torch.zeros(index.shape[0], coded_row_bytes(numel, cap, low), dtype=torch.uint8)
    _kernels().code_bitmap(index.contiguous().numpy(), numel, cap, code_blocks(numel), low, BLOCK_BITS, out.numpy())
    return out


def decode_positions_cpu(code: torch.Tensor, numel: int, cap: int, low: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tagc.sketch.positions.decode_positions` in one walk per row (same results)."""
    check_coded(code, numel, cap, low)
    positions = torch.empty(code.shape[0], cap, dtype=torch.int64)
    count = torch.empty(code.shape[0], dtype=torch.int64)
    _kernels().decode_positions(code.contiguous().numpy(), code_blocks(numel), low, BLOCK_BITS, numel,
                                positions.numpy(), count.numpy())
    return positions, count


def union_index_cpu(code: torch.Tensor, numel: int, cap: int, low: int, parts: int = 1) -> torch.Tensor:
    """:func:`tagc.sketch.positions.union_index` in one walk per row (same bytes)."""
    check_coded(code, numel, cap, low)
    index = torch.zeros(parts, index_nbytes(numel, 1), dtype=torch.uint8)
    _kernels().union_bitmap(code.contiguous().numpy(), code_blocks(numel), low, BLOCK_BITS, numel, cap, index.numpy())
    return index.view(-1)
