"""The reference TAGC codec in plain, vectorised PyTorch: the semantics every back end matches."""

from tagc.sketch.compress import compress_
from tagc.sketch.codec import (
    DecodeStats,
    InconsistentSketchError,
    decode,
    encode,
    encode_positions,
)
from tagc.sketch.index import build_index, index_nbytes, index_positions, index_to_mask, merge_index, pack_mask, unpack_counts
from tagc.sketch.layout import SketchLayout, choose_lane
from tagc.sketch.plan import PEELING_THRESHOLD, PLANNED_LOAD, plan_density, union_density
from tagc.sketch.sparsify import keep_limit, row_thresholds, sparsify, threshold

__all__ = [
    "DecodeStats",
    "InconsistentSketchError",
    "PEELING_THRESHOLD",
    "PLANNED_LOAD",
    "SketchLayout",
    "build_index",
    "compress_",
    "choose_lane",
    "decode",
    "encode",
    "encode_positions",
    "index_nbytes",
    "index_positions",
    "index_to_mask",
    "keep_limit",
    "merge_index",
    "pack_mask",
    "plan_density",
    "row_thresholds",
    "sparsify",
    "threshold",
    "union_density",
    "unpack_counts",
]
