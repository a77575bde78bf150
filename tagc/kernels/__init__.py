"""Triton (GPU) and Numba (CPU) kernels for the TAGC codec, and the dispatch that picks them or the reference.

``from tagc.kernels import compress_, decode, row_thresholds`` works everywhere: triton is
imported only when a Triton path runs (CUDA tensors, ``TAGC_BACKEND=triton`` or
``backend="triton"``), numba only when a CPU kernel runs. One idea per module:

* :mod:`~tagc.kernels.radix_select` - radix select of the magnitude threshold on the device;
* :mod:`~tagc.kernels.compress` - fused residual / sparsify / index / sketch pass;
* :mod:`~tagc.kernels.peel` - the device decode: lane-parallel peeling with the round loop in the
  kernel, the exact solve of stopping sets, no host read, the same bits on every run;
* :mod:`~tagc.kernels.positions` - the coded positions' wire (Elias-Fano per block), one
  program per block: code an index or a list, decode, union;
* :mod:`~tagc.kernels.kept_list` - ``topk``'s kept list and the owner's rank-ordered sum;
* :mod:`~tagc.kernels.ops` - the kernels registered as torch operators (``torch.compile``);
* :mod:`~tagc.kernels.cpu` - the CPU kernels (Numba, :mod:`~tagc.kernels._numba`): one-pass
  compress and queue-driven peeling, the production path on CPU tensors;
* :mod:`~tagc.kernels.dispatch` - one function per operation: Triton, CPU kernels or reference;
* :mod:`~tagc.kernels.fallbacks` - the once-per-kind warning when a slower path is taken.
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
