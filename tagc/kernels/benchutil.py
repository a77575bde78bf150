"""Timing helper shared by the kernel benchmarks (CUDA events on GPU, wall clock otherwise)."""

from __future__ import annotations

import time
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], warmup: int = 2, iters: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]
