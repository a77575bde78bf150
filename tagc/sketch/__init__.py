"""The reference TAGC codec in plain, vectorised PyTorch: the semantics every back end matches.

``tagc.sketch.sparsify`` is the selection rule's module; its split of a tensor into the kept
entries and the residual is :func:`split_kept`.
"""

from tagc.sketch.codec import DecodeStats, InconsistentSketchError, decode, encode, encode_positions
from tagc.sketch.compress import compress_
from tagc.sketch.index import (
    build_index,
    index_nbytes,
    index_positions,
    index_to_mask,
    merge_index,
    pack_mask,
    unpack_counts,
)
from tagc.sketch.layout import SketchLayout, choose_lane
from tagc.sketch.plan import PEELING_THRESHOLD, PLANNED_LOAD, plan_density
from tagc.sketch.sparsify import keep_limit, row_thresholds, split_kept, threshold

__all__ = ["PEELING_THRESHOLD", "PLANNED_LOAD", "DecodeStats", "InconsistentSketchError", "SketchLayout", "build_index",
           "choose_lane", "compress_", "decode", "encode", "encode_positions", "index_nbytes", "index_positions",
           "index_to_mask", "keep_limit", "merge_index", "pack_mask", "plan_density", "row_thresholds", "split_kept",
           "threshold", "unpack_counts"]
