"""How the kernels are launched and which back end runs, checked without a GPU and without running a kernel.

* **Launch geometry.** CUDA allows 2**31 - 1 programs on grid axis 0 and 65,535 on axes 1 and 2.
  Every launcher of :mod:`tagc.kernels` is called on ``meta`` tensors (shapes, no memory) for a
  chunk of 70M columns (more than 65,535 programs of 1,024) with a ``wrap`` that records the grid
  instead of launching: every axis must be within CUDA's limits.
* **Launch size.** The peel's setup programs follow the work and the device's multiprocessors.
* **Fallbacks warn.** Taking the torch reference because triton or numba does not import (or a
  residual the CPU kernels do not take) warns once per kind, saying what to install or change.
"""

import os
import warnings
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (the later test files run kernels)

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from tagc.kernels import cpu, dispatch, fallbacks, peel  # noqa: E402
from tagc.kernels.compress import launch_compress  # noqa: E402
from tagc.kernels.kept_list import launch_list_kept, launch_sum_lists  # noqa: E402
from tagc.kernels.positions import (  # noqa: E402
    launch_code_index,
    launch_decode_positions,
    launch_encode_positions,
    launch_union_index,
)
from tagc.kernels.radix_select import launch_row_thresholds  # noqa: E402
from tagc.sketch import SketchLayout  # noqa: E402
from tagc.sketch.index import index_nbytes  # noqa: E402
from tagc.sketch.kept_list import position_blocks  # noqa: E402
from tagc.sketch.positions import coded_row_bytes  # noqa: E402

COLUMNS = 70_000_000
"""More than 65,535 programs of 1,024 elements: a grid with blocks on axis 1 or 2 cannot launch."""
RANKS = 2
PARTS = 64
"""A batch of parts (issue 61): one more grid axis of the decode kernels."""
AXIS_LIMITS = (2**31 - 1, 65_535, 65_535)


class _Recorder:
    """A ``wrap`` for the launchers: ``wrap(kernel)[grid](...)`` records ``(name, grid)`` and runs nothing."""

    def __init__(self):
        self.launches: list[tuple[str, tuple]] = []

    def __call__(self, kernel):
        recorder = self

        class _Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    recorder.launches.append((kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__,
                                              tuple(grid)))
                return launch

        return _Launch()


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _every_launcher(record: _Recorder) -> None:
    n, bits, cap, low = COLUMNS, 1, 300_000, 6
    layout = SketchLayout(n, 10.0, lane=1024)
    rows, signs, xor = (_meta(layout.blocks, 3, dtype=torch.int64), _meta(layout.blocks, 3),
                        _meta(layout.blocks, dtype=torch.int64))
    grad, residual, tau = _meta(RANKS, n), _meta(RANKS, n), _meta(RANKS)
    launch_row_thresholds(residual, grad, 1e-5, wrap=record)  # a sample of the whole chunk
    launch_row_thresholds(residual, grad, 0.03, wrap=record)  # a strided sample
    launch_compress(grad, residual, tau, rows, signs, xor, layout.lane_bits, layout.table_numel, bits, 2_000_000, cap,
                    wrap=record)
    launch_compress(grad, residual, tau, _meta(n, 3, dtype=torch.int64), _meta(n, 3), _meta(n, dtype=torch.int64), 0,
                    SketchLayout(n, 10.0, lane=1).table_numel, 4, 2_000_000, cap, wrap=record)  # lane 1: 7M table rows
    table, index = _meta(layout.table_numel), _meta(index_nbytes(n, bits), dtype=torch.uint8)
    peel.launch_peel(table, index, rows, signs, xor, n, layout.lane_bits, bits, 0, wrap=record)
    narrow = SketchLayout(n, 10.0, lane=1)
    peel.launch_peel(_meta(narrow.table_numel), index, _meta(n, 3, dtype=torch.int64), _meta(n, 3),
                     _meta(n, dtype=torch.int64), n, 0, bits, 0, wrap=record)
    peel.launch_peel(_meta(PARTS, layout.table_numel), _meta(PARTS, index_nbytes(n, bits), dtype=torch.uint8), rows,
                     signs, xor, n, layout.lane_bits, bits, 0, wrap=record)  # a batch: parts on a grid axis
    bitmap = _meta(RANKS, index_nbytes(n, 1), dtype=torch.uint8)
    launch_code_index(bitmap, n, cap, low, wrap=record)
    launch_encode_positions(_meta(RANKS, cap, dtype=torch.int64), _meta(RANKS, dtype=torch.int64), n, cap, low,
                            wrap=record)
    code = _meta(RANKS, coded_row_bytes(n, cap, low), dtype=torch.uint8)
    launch_decode_positions(code, n, cap, low, wrap=record)
    launch_union_index(code, n, cap, low, wrap=record)
    launch_union_index(_meta(RANKS * PARTS, coded_row_bytes(n, cap, low), dtype=torch.uint8), n, cap, low, PARTS,
                       wrap=record)
    launch_list_kept(grad, residual, tau, cap, 2_000_000, wrap=record)
    launch_sum_lists(_meta(RANKS, position_blocks(n) + 1, dtype=torch.int32), _meta(RANKS, cap, dtype=torch.uint16),
                     _meta(RANKS, cap), n, wrap=record)


def test_every_kernel_launches_a_70m_column_chunk_within_cuda_grid_limits():
    record = _Recorder()
    _every_launcher(record)
    names = {name for name, _ in record.launches}
    expected = {"_radix_hist_kernel", "_count_kernel", "_compress_kernel", "_table_kernel", "_setup_kernel",
                "_list_kernel", "_check_kernel", "_peel_kernel", "_solve_kernel", "_code_bitmap_kernel",
                "_code_list_kernel", "_decode_kernel", "_list_count_kernel", "_list_write_kernel", "_sum_lists_kernel"}
    assert expected <= names, f"launchers not exercised: {expected - names}"
    over = [(name, grid) for name, grid in record.launches
            if len(grid) > 3 or any(not 1 <= extent <= limit for extent, limit in zip(grid, AXIS_LIMITS))]
    assert not over, f"grids past CUDA's limits (axis 0 < 2**31, axes 1-2 <= 65,535): {over}"
    assert max(grid[0] for _, grid in record.launches) > AXIS_LIMITS[1]  # the case under test: past axis 1's limit


def test_peel_setup_fills_the_device(monkeypatch):
    """A 1M-element chunk of 16 lanes: setup programs for four per multiprocessor of a 132-SM GPU (the
    round kernel runs one program per column); the interpreter takes the widest programs."""
    monkeypatch.setattr(peel, "multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    layout = SketchLayout(1 << 20, 10.0, lane=16)
    rows = peel.setup_rows(layout.lanes, layout.blocks, cuda)
    assert rows & (rows - 1) == 0 and rows * layout.lanes <= peel.SETUP_TILE
    assert -(-layout.blocks // rows) >= peel.PROGRAMS_PER_SM * 132
    big = SketchLayout(1 << 26, 10.0, lane=1024)  # plenty of work: full-size programs
    assert peel.setup_rows(big.lanes, big.blocks, cuda) * big.lanes == peel.SETUP_TILE
    assert peel.setup_rows(1, 3, cuda) == 1  # tiny: one block per program
    assert peel.setup_rows(16, 1 << 16, torch.device("cpu")) * 16 == peel.INTERPRETER_TILE


# ---------------------------------------------------------------- fallbacks warn once


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(fallbacks, "_warned", set())
    monkeypatch.delenv("TAGC_BACKEND", raising=False)


def _caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_cuda_tensors_without_triton_warn_once(fresh_warnings, monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    on_gpu = SimpleNamespace(device=torch.device("cuda"))  # resolve_backend reads only .device
    first = _caught(lambda: dispatch.resolve_backend(on_gpu))
    assert len(first) == 1 and "install triton" in first[0].lower(), first
    assert dispatch.resolve_backend(on_gpu) == "torch"
    assert _caught(lambda: dispatch.resolve_backend(on_gpu)) == []  # once per kind
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert _caught(lambda: dispatch.resolve_backend(torch.zeros(1), backend="torch")) == []  # asked for: no warning


def test_cpu_tensors_without_numba_warn_once(fresh_warnings, monkeypatch):
    monkeypatch.setattr(cpu, "numba_available", lambda: False)
    first = _caught(lambda: dispatch.resolve_backend(torch.zeros(3)))
    assert len(first) == 1 and "install numba" in first[0].lower(), first
    assert _caught(lambda: dispatch.resolve_backend(torch.zeros(3))) == []


def test_a_residual_the_cpu_kernels_do_not_take_warns_once(fresh_warnings):
    pytest.importorskip("numba")
    layout = SketchLayout(1000, 8.0, lane=2)
    grad = torch.randn(2, 1000)

    def compress(dtype):
        return lambda: dispatch.compress_(grad, torch.zeros(2, 1000, dtype=dtype), 0.05, layout, 1, backend="numba")

    assert _caught(compress(torch.float32)) == []
    first = _caught(compress(torch.bfloat16))
    assert len(first) == 1 and "float32" in first[0], first
    assert _caught(compress(torch.bfloat16)) == []
