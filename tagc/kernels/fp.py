"""Float helpers shared by the kernels.

``round_to_dtype`` rounds float32 to a narrower storage dtype with round-to-nearest-even,
the rounding torch applies when it stores ``residual + grad`` into a bf16 residual. For
bf16 it is done on the bits: the Triton interpreter truncates on ``.to(tl.bfloat16)`` (the
compiled GPU cast rounds to nearest even), so spelling it out keeps the two identical.
"""

import triton
import triton.language as tl


@triton.jit
def round_to_dtype(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype`` (RTNE), returned as float32."""
    if dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    elif dtype == tl.float32:
        return x
    else:
        return x.to(dtype).to(tl.float32)
