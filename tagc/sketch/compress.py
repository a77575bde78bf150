"""The whole per-step compression of a bucket in one pass (docs/design.md §3.2-3.5).

A bucket is ``N`` equal chunks, one per destination rank, viewed as ``[N, S]``. For every chunk: add the gradient
into the error-feedback residual, take the entries the selection rule keeps (:mod:`tagc.sketch.sparsify`) out of it,
and build their index and count sketch: :func:`split_kept`, :func:`build_index` and :func:`encode` composed, without
materialising the dense kept tensor.
"""

from __future__ import annotations

from typing import Optional

import torch

from tagc.sketch.index import pack_mask
from tagc.sketch.layout import SketchLayout
from tagc.sketch.sparsify import (
    capacity,
    check_density,
    check_sketch_dtype,
    held_back,
    keep_limit,
    keep_mask,
    row_thresholds,
)


def check_compress_args(grad: torch.Tensor, residual: torch.Tensor, density: float) -> None:
    """The argument checks every compress back end makes (clear ``ValueError``)."""
    check_density(density)
    if grad.shape != residual.shape:
        raise ValueError(f"grad {tuple(grad.shape)} and residual {tuple(residual.shape)} must have one shape")
    check_sketch_dtype(grad, "the gradient")
    check_sketch_dtype(residual, "the residual")


def compress_(grad: torch.Tensor, residual: torch.Tensor, density: float, layout: SketchLayout, bits: int,
              tau: Optional[torch.Tensor] = None, return_held: bool = False, cap: Optional[int] = None):
    """Compress ``grad + residual`` chunk by chunk; ``residual`` becomes what was not sent.

    Args:
        grad: ``[N, S]`` (or ``[S]``) gradient: float32, bfloat16 or float16 (float64 is rejected: cast it).
        residual: of the same shape and those dtypes, updated in place: ``grad + residual`` (rounded to its dtype)
            with the sent entries zeroed.
        density: fraction of each chunk to keep; layout: one chunk's (``layout.numel == S``); bits: 1 or 4.
        tau: per-chunk thresholds ``[N]`` instead of :func:`row_thresholds` (to replay another back end's).
        return_held: also return how many kept entries each chunk's capacity held back in the residual.
        cap: the most entries a chunk keeps (default :func:`capacity`; a wire that holds fewer passes its own).

    Returns:
        ``(index, table)``: uint8 ``[N, index_nbytes(S, bits)]`` and float32
        ``[N, layout.table_numel]``; row ``s`` goes to the owner of chunk ``s``. With
        ``return_held``, ``(index, table, held)``, ``held`` int64 ``[N]``.
    """
    check_compress_args(grad, residual, density)
    rows = residual.view(-1, layout.numel)
    rows.add_(grad.view_as(rows))
    n_chunks = rows.shape[0]
    tau = (row_thresholds(rows, density) if tau is None
           else tau.to(device=rows.device, dtype=torch.float32).reshape(n_chunks))
    cap = capacity(layout.numel, density) if cap is None else cap
    limit = keep_limit(layout.numel, density)
    held = held_back(rows, tau, limit, cap) if return_held else None
    mask = keep_mask(rows, tau[:, None], limit, cap)
    positions = mask.view(-1).nonzero().squeeze(1)
    chunk, local = positions // layout.numel, positions % layout.numel
    table = torch.zeros(n_chunks * layout.table_numel, dtype=torch.float32, device=rows.device)
    cells, signs = layout.cells(local)
    cells = cells + (chunk * layout.table_numel)[:, None]
    kept = rows.view(-1).index_select(0, positions).float()
    table.scatter_add_(0, cells.reshape(-1), (signs * kept[:, None]).reshape(-1))
    per_byte = 8 // bits  # each row padded to whole bytes, then every row packed in one pass
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, -layout.numel % per_byte))
    index = pack_mask(padded, bits).view(n_chunks, -1) if n_chunks else torch.zeros(0, 0, dtype=torch.uint8)
    rows.masked_fill_(mask, 0)
    table = table.view(n_chunks, layout.table_numel)
    return (index, table, held) if return_held else (index, table)
