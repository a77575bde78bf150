"""Imported once by the tests' fork server (``tests/distributed.py``): loads Numba and the CPU kernels from their
on-disk cache, so that every rank forked from the server starts with them instead of loading them again (about a
second per rank). Nothing depends on it: where a kernel was not loaded here, a rank loads it on first use."""

from __future__ import annotations

import torch


def _warm() -> None:
    from tagc.kernels import cpu
    from tagc.sketch import SketchLayout, kept_list, merge_index, plan_density

    if not cpu.numba_available():
        return
    numel, density = 5000, plan_density(10.0, 2)
    layout = SketchLayout(numel, 10.0, seed=1)
    for bits in (1, 4):
        grad = torch.randn(2, numel, generator=torch.Generator().manual_seed(bits))
        index, table = cpu.compress_cpu(grad, torch.zeros(2, numel), density, layout, bits)
        cpu.decode_parts_cpu(table.sum(0, keepdim=True), merge_index(*index, bits)[None], layout, bits)
    cap = kept_list.capacity(numel, density)
    counts, offsets, values = cpu.list_kept_cpu(grad, torch.zeros(2, numel), density, cap)
    positions, listed = cpu.list_positions_cpu(counts, offsets, numel)
    cpu.sum_lists_cpu(counts, offsets, values, numel)
    code = cpu.code_positions_cpu(positions, listed.sum(1), numel, cap, 4)
    cpu.decode_positions_cpu(code, numel, cap, 4)
    cpu.union_index_cpu(code, numel, cap, 4)


try:
    _warm()
except Exception:  # noqa: BLE001 (a warm-up only: the ranks load whatever it missed)
    pass
