"""The settings of TAGC's selection and sketch: :class:`TAGCConfig`, validated at construction.

The ``tagc`` and ``topk`` codecs read them (ratio, index bits, sparsity, ...); the hook nests them
in its own settings (:class:`tagc.hooks.core.settings.HookSettings`, everything :func:`tagc.hook`
takes), so a bad value fails once, at construction, with a message that says what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Union

Fallback = Literal["estimate", "raw", "error"]
FALLBACKS: tuple[str, ...] = ("estimate", "raw", "error")
INDEX_BITS: tuple[int, ...] = (1, 4)
MAX_RATIO = 1000.0
MAX_LANE = 1024


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def is_int(value: object) -> bool:
    """Whether ``value`` is an ``int`` (``True`` and ``False`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class TAGCConfig:
    """Settings of the TAGC codec (nested in the hook's :class:`~tagc.hooks.core.settings.HookSettings`).

    Args:
        ratio: count-sketch compression ratio (gradient elements per sketch cell), in ``(1, 1000]``.
        index_bits: 1 (packed bitmap, merged by OR) or 4 (rank counts, merged by sum: at most 15 ranks).
        sparsity: fraction of each gradient chunk zeroed before encoding (the paper's term), in ``[0, 1)``, or
            ``"auto"``: from ``ratio`` and the group size by :func:`tagc.sketch.plan_density` (docs/design.md §3.3).
        lane: sketch lane width (a power of two <= 1024), or ``None``: picked per chunk (docs/design.md §3.5).
        seed: hash seed; must be identical on every rank.
        fallback: what decode does with positions neither peeling nor the exact solve recovers: ``"estimate"``,
            ``"raw"`` or ``"error"`` (docs/design.md §3.8).
        min_compress_numel: chunks (per-rank shard lengths) smaller than this always take the plain
            reduce-scatter; fixed costs dominate there.
    """

    ratio: float = 10.0
    index_bits: int = 1
    sparsity: Union[float, str] = "auto"
    lane: Optional[int] = None
    seed: int = 0
    fallback: Fallback = "estimate"
    min_compress_numel: int = 65536

    def __post_init__(self) -> None:
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio):
            raise ValueError(f"ratio must be a finite number in (1, {MAX_RATIO:g}], got {ratio!r}")
        if not 1.0 < float(ratio) <= MAX_RATIO:
            raise ValueError(f"ratio must be in (1, {MAX_RATIO:g}] (sketch cells per element < 1), got {ratio!r}")
        object.__setattr__(self, "ratio", float(ratio))
        if self.index_bits not in INDEX_BITS or isinstance(self.index_bits, bool):
            raise ValueError(f"index_bits must be 1 or 4, got {self.index_bits!r}")
        sparsity = self.sparsity
        if isinstance(sparsity, str):
            if sparsity != "auto":
                raise ValueError(f"sparsity must be a fraction in [0, 1) or 'auto', got {sparsity!r}")
        elif isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) < 1.0:
            raise ValueError(f"sparsity must be a fraction in [0, 1) or 'auto', got {sparsity!r}")
        else:
            object.__setattr__(self, "sparsity", float(sparsity))
        if self.lane is not None and (not is_int(self.lane) or not is_power_of_two(self.lane) or self.lane > MAX_LANE):
            raise ValueError(f"lane must be None or a power of two <= {MAX_LANE}, got {self.lane!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if not is_int(self.min_compress_numel) or self.min_compress_numel < 0:
            raise ValueError(f"min_compress_numel must be a non-negative integer, got {self.min_compress_numel!r}")

    def density(self, world_size: int) -> float:
        """Per-rank fraction of entries kept, for a group of ``world_size`` ranks."""
        if self.sparsity == "auto":
            from tagc.sketch.plan import plan_density

            return plan_density(self.ratio, world_size)
        return 1.0 - float(self.sparsity)

    def replace(self, **changes) -> "TAGCConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def fingerprint(self) -> tuple:
        """The fields as a tuple: what a checkpoint records (:mod:`tagc.hooks.core.checkpoint`)."""
        return dataclasses.astuple(self)


SELECTION_FIELDS = ("min_compress_numel",)
"""The :class:`TAGCConfig` fields that say how columns are planned: they apply to every codec."""
SKETCH_FIELDS = tuple(field.name for field in dataclasses.fields(TAGCConfig) if field.name not in SELECTION_FIELDS)
"""The other fields, TAGC's own: the ``tagc`` codec takes them all, another codec those its spec names."""
