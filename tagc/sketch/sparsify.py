"""Dynamic magnitude threshold and sparsification (DESIGN.md §2 items 2-3)."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch

MIN_SAMPLE = 65536
"""Tensors up to this size are thresholded exactly; larger ones on a sample."""

SAMPLE_HITS = 4096
"""The sample holds about this many kept elements, so the kept fraction is within a few
percent of the target (binomial relative error ~ 1/sqrt(SAMPLE_HITS))."""

_GOLDEN_FRACTION = 0.6180339887498949


def check_finite(x: torch.Tensor, what: str = "gradient") -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf (one reduction; a sync on GPUs)."""
    if x.numel() == 0:
        return
    low, high = torch.aminmax(x.detach().reshape(-1))  # NaN and Inf both surface in min/max
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        bad = "NaN" if bool(torch.isnan(x).any()) else "Inf"
        raise ValueError(
            f"{what} contains {bad}; TAGC cannot encode non-finite values (fix the loss scale or clip "
            "gradients, or let the hook send such buckets uncompressed)"
        )


def sample_positions(numel: int, size: int, device: torch.device) -> torch.Tensor:
    """``size`` well-spread positions in ``[0, numel)`` (golden-ratio stride, no RNG).

    The stride is irrational relative to any row length, so the sample does not alias with
    the rows or columns of the weight matrix the gradient came from.
    """
    i = torch.arange(size, dtype=torch.int64, device=device)
    return (i * sample_stride(numel)) % numel


def sample_stride(numel: int) -> int:
    """The stride of :func:`sample_positions`: odd, about ``0.618 * numel``."""
    return int(numel * _GOLDEN_FRACTION) | 1


def sample_size(numel: int, density: float) -> int:
    """How many entries :func:`row_thresholds` samples from a row of ``numel`` at ``density``."""
    wanted = SAMPLE_HITS / density  # a float: inf for denormal densities
    return numel if wanted >= numel else min(numel, max(MIN_SAMPLE, math.ceil(wanted)))


def row_thresholds(rows: torch.Tensor, density: float, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-row thresholds ``[N]`` of a ``[N, S]`` tensor (plus ``grad`` when given, added
    only where sampled): ~``density * S`` entries of each row have ``|x| >= tau``.

    Exact (k-th largest) for rows of up to :data:`MIN_SAMPLE` elements, otherwise the same
    quantile of a spread sample sized to hold ~:data:`SAMPLE_HITS` kept entries. Stays on
    the device: no ``.item()``.
    """
    n_rows, n = rows.shape
    if density >= 1.0 or n == 0:
        return torch.zeros(n_rows, dtype=torch.float32, device=rows.device)
    if density <= 0.0:
        return torch.full((n_rows,), math.inf, dtype=torch.float32, device=rows.device)
    size = sample_size(n, density)
    if size == n:
        sample = rows if grad is None else rows + grad
    else:
        positions = sample_positions(n, size, rows.device)
        sample = rows[:, positions] if grad is None else rows[:, positions] + grad[:, positions]
    keep = min(size, max(1, round(density * size)))
    return sample.abs().float().kthvalue(size - keep + 1, dim=1).values


def threshold(x: torch.Tensor, density: float) -> torch.Tensor:
    """A 0-d tensor ``tau`` with about ``density * numel`` entries of ``|x| >= tau``."""
    return row_thresholds(x.reshape(1, -1), density)[0]


def check_density(density: float) -> None:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be a fraction in [0, 1], got {density!r}")


def sparsify(x: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x`` into its ~``density`` largest-magnitude entries and the rest.

    Returns ``(kept, residual)`` with ``kept + residual == x`` exactly (every entry lands in
    exactly one of them). Raises ``ValueError`` on NaN/Inf.
    """
    check_density(density)
    check_finite(x)
    keep = keep_mask(x, threshold(x, density))
    return x.where(keep, 0), x.where(~keep, 0)


@functools.lru_cache(maxsize=8)
def _scratch(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two reusable bool buffers per shape: fresh large allocations page-fault on every call."""
    return torch.empty(shape, dtype=torch.bool, device=device), torch.empty(shape, dtype=torch.bool, device=device)


def positive_threshold(tau: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tau`` in ``dtype``, at least its smallest subnormal, so ``|x| >= tau`` never keeps an exact zero."""
    info = torch.finfo(dtype)
    return tau.to(dtype).clamp_min(info.tiny * info.eps)


def keep_mask(x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``(|x| >= tau) & (x != 0)`` without a full-size ``|x|`` temporary.

    The result lives in a scratch buffer reused by the next call of the same shape: consume
    it (or copy it) before calling again.
    """
    tau = positive_threshold(tau, x.dtype)
    above, below = _scratch(tuple(x.shape), x.device)
    torch.ge(x, tau, out=above)
    torch.le(x, -tau, out=below)
    return above.logical_or_(below)
