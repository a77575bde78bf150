"""How sparse each rank must be for the union of all ranks' supports to stay peelable."""

from __future__ import annotations

import math

PEELING_THRESHOLD = 0.8184
"""Load (non-zeros per row of a lane) below which 3-hypergraph peeling succeeds w.h.p."""

PLANNED_LOAD = 0.7
"""The union load :func:`plan_density` aims at: ~85% of the threshold, the margin that
finite lanes (thousands of rows) need; see ``python -m tagc.bench codec`` for the curve."""


def plan_density(ratio: float, world_size: int, load: float = PLANNED_LOAD) -> float:
    """Per-rank kept fraction so ``world_size`` independent supports peel with margin: their union loads each
    lane's rows to at most ``load`` (docs/design.md §3.3)."""
    if not isinstance(ratio, (int, float)) or not ratio > 1 or not math.isfinite(ratio):
        raise ValueError(f"ratio must be a finite number > 1, got {ratio!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not 0 < load < PEELING_THRESHOLD:
        raise ValueError(f"load must be in (0, {PEELING_THRESHOLD}), got {load!r}")
    union = min(1.0, load / ratio)
    return 1.0 - (1.0 - union) ** (1.0 / world_size)
