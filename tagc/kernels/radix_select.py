"""Device-side magnitude threshold: a two-pass radix select over the float bits.

For non-negative floats the int32 bit pattern orders like the value, so the ``k``-th largest ``|a|`` is found
digit by digit: pass 0 histograms the top 16 bits (sign cleared) of every sampled element and a cumulative sum from
the top picks the bin holding it; pass 1 histograms the low 16 bits of that bin's elements. No ``.item()``.

It samples and ranks exactly as :func:`tagc.sketch.row_thresholds` does, so the result is **bit-identical** to the
reference, and reads ``residual + grad`` on the fly (rounded to the residual's dtype). Entry point:
:func:`tagc.kernels.ops.row_thresholds_triton`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from tagc.kernels.fp import round_to_dtype
from tagc.sketch.sparsify import keep_limit, sample_size, sample_stride

HIGH_BINS = 1 << 15  # top 16 bits of a non-negative float32: the sign bit is always 0
LOW_BINS = 1 << 16
BLOCK = 1024


@triton.jit
def _radix_hist_kernel(res_ptr, grad_ptr, hist_ptr, prefix_ptr, numel, size, stride, HAS_GRAD: tl.constexpr,
                       SAMPLED: tl.constexpr, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram one 16-bit digit of ``|residual (+ grad)|`` for row ``program_id(1)``.

    Pass 0 bins the high digit; pass 1 bins the low digit of the elements whose high digit
    equals ``prefix[row]``. Sample ``i`` of a row reads position ``i * stride % numel``.
    """
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # axis 0: up to 2**31 - 1 programs
    row = tl.program_id(1).to(tl.int64)
    m = i < size
    if SAMPLED:
        pos = (i * stride) % numel
    else:
        pos = i
    r = tl.load(res_ptr + row * numel + pos, mask=m, other=0.0)
    if HAS_GRAD:
        g = tl.load(grad_ptr + row * numel + pos, mask=m, other=0.0)
        a = round_to_dtype(r.to(tl.float32) + g.to(tl.float32), res_ptr.dtype.element_ty)
    else:
        a = r.to(tl.float32)
    key = a.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if PASS == 0:
        tl.atomic_add(hist_ptr + row * 32768 + (key >> 16), 1, mask=m)
    else:
        prefix = tl.load(prefix_ptr + row)
        m = m & ((key >> 16) == prefix)
        tl.atomic_add(hist_ptr + row * 65536 + (key & 0xFFFF), 1, mask=m)


def _select_bin(hist: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bin holding the ``k``-th largest key of each row, and ``k`` within that bin.

    ``hist`` is ``[N, bins]`` int32, ``k`` is ``[N]`` int64 (1-based). Device ops only.
    """
    bins = hist.shape[1]
    from_top = hist.flip(1).cumsum(1)  # [:, j]: keys in the top j + 1 bins
    j = (from_top < k[:, None]).sum(1)  # top bins wholly above the k-th key
    above = torch.where(j > 0, from_top.gather(1, (j - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    return bins - 1 - j, k - above


def launch_row_thresholds(residual: torch.Tensor, grad: Optional[torch.Tensor], density: float,
                          wrap: Callable = lambda k: k) -> torch.Tensor:
    """Per-row thresholds ``[N]`` (float32) of ``residual (+ grad)``, both ``[N, S]`` contiguous.

    ``wrap`` is applied to each kernel before launch (``torch.library.wrap_triton`` when
    called from a registered op).
    """
    n_rows, numel = residual.shape
    device = residual.device
    if density >= 1.0 or numel == 0 or n_rows == 0:
        return torch.zeros(n_rows, dtype=torch.float32, device=device)
    if density <= 0.0:
        return torch.full((n_rows,), math.inf, dtype=torch.float32, device=device)
    size, stride = sample_size(numel, density), sample_stride(numel)  # the reference's sample and rank
    keep = keep_limit(size, density)
    grid = (triton.cdiv(size, BLOCK), n_rows)  # blocks on axis 0: a whole-chunk sample of any size launches
    common = dict(HAS_GRAD=grad is not None, SAMPLED=size != numel, BLOCK=BLOCK)
    g = grad if grad is not None else residual
    high = torch.zeros(n_rows, HIGH_BINS, dtype=torch.int32, device=device)
    wrap(_radix_hist_kernel)[grid](residual, g, high, high, numel, size, stride, PASS=0, **common)
    k = torch.full((n_rows,), keep, dtype=torch.int64, device=device)
    prefix, k_low = _select_bin(high, k)
    prefix = prefix.to(torch.int32)
    low = torch.zeros(n_rows, LOW_BINS, dtype=torch.int32, device=device)
    wrap(_radix_hist_kernel)[grid](residual, g, low, prefix, numel, size, stride, PASS=1, **common)
    low_bin, _ = _select_bin(low, k_low)
    return ((prefix << 16) | low_bin.to(torch.int32)).view(torch.float32)
