"""Dynamic magnitude threshold and sparsification: the reference of the selection rule every back end keeps
(docs/design.md §3.3, "The selection rule", and why). A row ``a`` with threshold ``tau`` (:func:`row_thresholds`,
made positive by :func:`positive_threshold`) keeps the entries with ``|a| > tau`` and, of the ties ``|a| == tau``,
the first ``keep_limit(numel, density) - count(|a| > tau)`` in index order; of those the first ``cap`` in index order
(:func:`capacity`, or a wire's smaller one). Every other entry stays in the residual.
"""

from __future__ import annotations

import functools
import math

import torch

MIN_SAMPLE = 65536
"""Tensors up to this size are thresholded exactly; larger ones on a sample."""

SAMPLE_HITS = 4096
"""The sample holds about this many kept elements, so the kept fraction is within a few
percent of the target (binomial relative error ~ 1/sqrt(SAMPLE_HITS))."""

_GOLDEN_FRACTION = 0.6180339887498949


NONFINITE_HINT = ("TAGC cannot encode non-finite values (fix the loss scale or clip gradients, or let the hook send "
                  "such buckets uncompressed)")


def check_finite(x: torch.Tensor, what: str = "gradient") -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf (one reduction; a sync on GPUs)."""
    if x.numel() == 0:
        return
    low, high = torch.aminmax(x.detach().reshape(-1))  # NaN and Inf both surface in min/max
    if not bool(torch.isfinite(low) & torch.isfinite(high)):
        bad = "NaN" if bool(torch.isnan(x).any()) else "Inf"
        raise ValueError(f"{what} contains {bad}; {NONFINITE_HINT}")


def sample_positions(numel: int, size: int, device: torch.device) -> torch.Tensor:
    """``size`` well-spread positions in ``[0, numel)`` (golden-ratio stride, no RNG).

    The stride is irrational relative to any row length, so the sample does not alias with
    the rows or columns of the weight matrix the gradient came from.
    """
    i = torch.arange(size, dtype=torch.int64, device=device)
    return (i * sample_stride(numel)) % numel


@functools.lru_cache(maxsize=4096)
def sample_stride(numel: int) -> int:
    """The stride of :func:`sample_positions`: the first odd number from ``0.618 * numel`` up
    that is coprime with ``numel``, so a sample of any size holds distinct positions (why it matters:
    docs/design.md §3.3).
    """
    stride = int(numel * _GOLDEN_FRACTION) | 1
    while math.gcd(stride, numel) > 1:
        stride += 2
    return stride


def keep_limit(numel: int, density: float) -> int:
    """The planned count of a row of ``numel`` at ``density``: ``k = min(numel, max(1,
    round(density * numel)))`` for ``0 < density < 1``, ``numel`` at ``density >= 1``, ``0`` at
    ``density <= 0``.

    The one definition of the count: the rank :func:`row_thresholds` selects (applied to the
    sample size), and the most entries ties may fill a row up to (the selection rule).
    """
    if density >= 1.0:
        return numel
    return 0 if density <= 0.0 or numel == 0 else min(numel, max(1, round(density * numel)))


SLACK_SIGMAS = 4.0
"""Capacity covers the planned count plus this many standard deviations of the kept count."""
MARGIN = 8
"""A few more entries, for parts so small that the spread is below one element."""


def capacity(numel: int, density: float) -> int:
    """The most entries a row keeps (the selection rule's ``cap``): ``keep_limit(numel, density)`` for a row
    thresholded exactly, else ``ceil(mu + 4 sigma) + 8`` with ``sigma = sqrt(mu + mu^2 / h)``, the threshold's Beta
    spread and the row's binomial one (docs/design.md §3.3, §9)."""
    if not 0.0 < density < 1.0 or sample_size(numel, density) >= numel:
        return keep_limit(numel, density)
    hits = keep_limit(sample_size(numel, density), density)
    mean = density * numel
    sigma = math.sqrt(mean + mean * mean / hits)
    return min(numel, math.ceil(mean + SLACK_SIGMAS * sigma) + MARGIN)


def sample_size(numel: int, density: float) -> int:
    """How many entries :func:`row_thresholds` samples from a row of ``numel`` at ``density``."""
    wanted = SAMPLE_HITS / density  # a float: inf for denormal densities
    return numel if wanted >= numel else min(numel, max(MIN_SAMPLE, math.ceil(wanted)))


def row_thresholds(rows: torch.Tensor, density: float, grad: torch.Tensor | None = None) -> torch.Tensor:
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
    keep = keep_limit(size, density)
    return sample.abs().float().kthvalue(size - keep + 1, dim=1).values


def threshold(x: torch.Tensor, density: float) -> torch.Tensor:
    """A 0-d tensor ``tau`` with about ``density * numel`` entries of ``|x| >= tau``."""
    return row_thresholds(x.reshape(1, -1), density)[0]


def check_density(density: float) -> None:
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be a fraction in [0, 1], got {density!r}")


def split_kept(x: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x`` into its ~``density`` largest-magnitude entries and the rest.

    ``x`` is one row (flattened): the selection rule (module docstring), with ties at
    the threshold broken by flat index, at most ``keep_limit(x.numel(), density)`` of them,
    and at most ``capacity(x.numel(), density)`` in all. Returns ``(kept, residual)`` with
    ``kept + residual == x`` exactly (every entry lands in exactly one of them). Raises
    ``ValueError`` on NaN/Inf.
    """
    check_density(density)
    check_finite(x)
    rows = x.reshape(1, -1)
    limit, cap = keep_limit(x.numel(), density), capacity(x.numel(), density)
    keep = keep_mask(rows, row_thresholds(rows, density)[:, None], limit, cap).view(x.shape)
    return x.where(keep, 0), x.where(~keep, 0)


SKETCH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes a sketch takes: all convert to the float32 table losslessly."""


def check_sketch_dtype(x: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` unless ``x`` is float32, bfloat16 or float16: float64 is rejected rather than rounded
    silently (docs/design.md §5, item 3)."""
    if x.dtype not in SKETCH_DTYPES:
        hint = " (cast it: .float())" if x.is_floating_point() else ""
        raise ValueError(f"{what} is {x.dtype}; TAGC sketches hold float32 and take float32, bfloat16 or float16 "
                         f"input, which convert to float32 exactly{hint}")


@functools.lru_cache(maxsize=8)
def _scratch(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reusable bool buffers per shape: fresh large allocations page-fault on every call."""
    return tuple(torch.empty(shape, dtype=torch.bool, device=device) for _ in range(3))


def positive_threshold(tau: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tau`` in ``dtype``, at least its smallest subnormal, so ``|x| >= tau`` never keeps an exact zero."""
    info = torch.finfo(dtype)
    return tau.to(dtype).clamp_min(info.tiny * info.eps)


def keep_mask(rows: torch.Tensor, tau: torch.Tensor, limit: int, cap: int | None = None) -> torch.Tensor:
    """The kept entries (bool ``[N, S]``) of ``rows`` ``[N, S]`` under thresholds ``tau``
    (``[N, 1]`` or a scalar), the per-row limit ``limit`` (:func:`keep_limit`) and capacity
    ``cap`` (:func:`capacity`; ``None``: no capacity): the selection rule of the module docstring.

    No host synchronisation (ties and the capacity are ranked with cumulative sums). The
    result lives in a scratch buffer reused by the next call of the same shape: consume it
    (or copy it) before calling again.
    """
    tau = positive_threshold(tau, rows.dtype)
    keep, tie, other = _scratch(tuple(rows.shape), rows.device)
    torch.ge(rows, tau, out=keep)  # |a| >= tau, never 0 (tau > 0)
    torch.le(rows, -tau, out=other)
    keep.logical_or_(other)
    torch.eq(rows, tau, out=tie)
    torch.eq(rows, -tau, out=other)
    tie.logical_or_(other)
    rank = tie.cumsum(dim=-1, dtype=torch.int32)  # 1-based rank of each tie in its row
    room = limit - (keep.sum(dim=-1, keepdim=True, dtype=torch.int32) - rank[..., -1:])  # limit - count(|a| > tau)
    torch.gt(rank, room, out=other)
    keep.logical_and_(other.logical_and_(tie).logical_not_())
    if cap is not None and cap < rows.shape[-1]:
        keep.logical_and_(keep.cumsum(dim=-1, dtype=torch.int32) <= cap)
    return keep


def held_back(rows: torch.Tensor, tau: torch.Tensor, limit: int, cap: int) -> torch.Tensor:
    """Per row, the entries the selection rule would keep but the capacity ``cap`` held back
    (int64 ``[N]``): ``max(0, count(|a| > tau) + min(ties, max(0, limit - count(|a| > tau))) - cap)``."""
    level = positive_threshold(tau, rows.dtype).reshape(-1, 1)
    magnitude = rows.abs()
    above = (magnitude > level).sum(dim=-1)
    ties = (magnitude == level).sum(dim=-1)
    return (above + torch.minimum(ties, (limit - above).clamp(min=0)) - cap).clamp_(min=0)

