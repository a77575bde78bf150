"""Triton (GPU) and Numba (CPU) kernels for the TAGC codec, and the dispatch that picks them or the reference.

``from tagc.kernels import compress_, decode, row_thresholds`` works everywhere: triton is imported only when a
Triton path runs (CUDA tensors, ``TAGC_BACKEND=triton`` or ``backend="triton"``), numba only when a CPU kernel runs.
One idea per module (each says which in its docstring; what each back end does: docs/design.md §8): the Triton
kernels (``radix_select``, ``compress``, ``peel``, ``positions``, ``kept_list``) and their torch operators
(``ops``), the Numba ones (``cpu``, ``_numba``), the choice between them and the reference (``dispatch``) and the
once-per-kind warning when a slower path is taken (``fallbacks``).
"""

from tagc.kernels._triton import interpreting, triton_available
from tagc.kernels.dispatch import (
    STAT_FIELDS,
    compress_,
    decode,
    decode_async,
    resolve_backend,
    row_thresholds,
    threshold,
)

__all__ = ["STAT_FIELDS", "compress_", "decode", "decode_async", "interpreting", "resolve_backend", "row_thresholds",
           "threshold", "triton_available"]
