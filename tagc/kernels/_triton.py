"""Lazy access to Triton: nothing here imports triton until a Triton path is taken.

Kernels are compiled for CUDA tensors, or run by Triton's interpreter on CPU tensors when
``TRITON_INTERPRET=1`` was set before triton was first imported (how they are tested on
machines without a GPU).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether ``import triton`` works (never raises)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    if not triton_available():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


def require_triton(*tensors: torch.Tensor) -> None:
    """Raise a clear error if the Triton path cannot run on ``tensors``."""
    if not triton_available():
        raise RuntimeError("the Triton back end needs the `triton` package; use backend='torch'")
    for t in tensors:
        if t.device.type == "cuda":
            continue
        if t.device.type == "cpu" and interpreting():
            continue
        raise RuntimeError(f"Triton kernels need CUDA tensors (got {t.device}); on the CPU they run only under the "
                           "interpreter: set TRITON_INTERPRET=1 before triton is imported, or use backend='torch'")
