"""The back-end table of :mod:`tagc.kernels.dispatch`: every operation is one lookup in it.

Checked without running a kernel: each public operation, with each back end forced, must call
that back end's table entry with the arguments it was given and return what the entry returns;
the table holds every operation on every back end; the Triton entries name real entry points of
:mod:`tagc.kernels.ops` (read from its source, so triton is never imported here). That the back
ends compute the same values is checked by the kernel tests (``test_kernels``, ``test_positions``,
``test_cpu_kernels``).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from tagc.kernels import dispatch
from tagc.sketch import SketchLayout

BACKENDS = ("triton", "numba", "torch")
LAYOUT = SketchLayout(64, 4.0, lane=2)


def _calls() -> dict[str, tuple]:
    """Per operation: ``(public function, positional args, keyword args, the args the entry must get)``."""
    grad, residual, tau = torch.randn(2, 64), torch.zeros(2, 64), torch.ones(2)
    counts, offsets = torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.uint16)
    values = torch.ones(2, 5)
    code, index, table = torch.zeros(2, 9, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8), torch.ones(16)
    positions, count = torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    held = {"tau": tau, "return_held": True, "cap": 7}
    return {
        "row_thresholds": (dispatch.row_thresholds, (residual, 0.25), {"grad": grad},
                           ((residual, 0.25), {"grad": grad})),
        "compress_": (dispatch.compress_, (grad, residual, 0.25, LAYOUT, 1), held,
                      ((grad, residual, 0.25, LAYOUT, 1), held)),
        "list_kept_": (dispatch.list_kept_, (grad, residual, 0.25, 5), {"tau": tau},
                       ((grad, residual, 0.25, 5), {"tau": tau})),
        "list_positions": (dispatch.list_positions, (counts, offsets, 64), {}, ((counts, offsets, 64), {})),
        "sum_lists": (dispatch.sum_lists, (counts, offsets, values, 64), {}, ((counts, offsets, values, 64), {})),
        "encode_positions": (dispatch.encode_positions, (positions, count, 64, 5, 2), {},
                             ((positions, count, 64, 5, 2), {})),
        "decode_positions": (dispatch.decode_positions, (code, 64, 5, 2), {}, ((code, 64, 5, 2), {})),
        "code_index": (dispatch.code_index, (code, 64, 5, 2), {}, ((code, 64, 5, 2), {})),
        "union_index": (dispatch.union_index, (code, 64, 5, 2, 2), {}, ((code, 64, 5, 2, 2), {})),
        "decode": (dispatch.decode, (table, index, LAYOUT, 1, "raw"), {}, ((table, index, LAYOUT, 1, "raw"), {})),
        "decode_async": (dispatch.decode_async, (table, index, LAYOUT, 1), {},
                         ((table, index, LAYOUT, 1, "estimate"), {})),
    }


def test_the_table_holds_every_operation_on_every_back_end():
    assert set(dispatch._IMPLEMENTATIONS) == set(_calls())
    for operation, by_backend in dispatch._IMPLEMENTATIONS.items():
        assert set(by_backend) == set(BACKENDS), operation
        assert all(callable(fn) for fn in by_backend.values()), operation


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("operation", sorted(_calls()))
def test_each_operation_calls_its_back_ends_entry(operation, backend, monkeypatch):
    if backend == "numba":
        pytest.importorskip("numba")
    monkeypatch.setattr(dispatch, "require_triton", lambda *tensors: None)  # CPU tensors: no interpreter needed here
    public, args, kwargs, (want_args, want_kwargs) = _calls()[operation]
    seen, result = [], object()

    def entry(*got_args, **got_kwargs):
        seen.append((got_args, got_kwargs))
        return result

    for other in BACKENDS:  # any other back end's entry would fail the test
        monkeypatch.setitem(dispatch._IMPLEMENTATIONS[operation], other,
                            entry if other == backend else (lambda *a, _o=other, **k: pytest.fail(f"ran {_o}")))
    assert public(*args, **kwargs, backend=backend) is result
    assert len(seen) == 1
    got_args, got_kwargs = seen[0]
    assert len(got_args) == len(want_args) and all(g is w for g, w in zip(got_args, want_args)), operation
    assert got_kwargs.keys() == want_kwargs.keys() and all(got_kwargs[k] is v for k, v in want_kwargs.items())


def test_triton_entries_name_entry_points_of_ops():
    source = Path(inspect.getfile(dispatch)).with_name("ops.py").read_text()
    defined = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    names = {by_backend["triton"].__name__ for by_backend in dispatch._IMPLEMENTATIONS.values()}
    assert names <= defined, names - defined
    assert len(names) == len(dispatch._IMPLEMENTATIONS)  # one entry point per operation


def test_decode_async_on_a_cpu_back_end_packs_decodes_statistics():
    layout = SketchLayout(256, 4.0, lane=2, seed=3)
    grad = torch.zeros(1, 256)
    grad[0, torch.randperm(256, generator=torch.Generator().manual_seed(0))[:12]] = torch.arange(1.0, 13.0)
    index, table = dispatch.compress_(grad, torch.zeros(1, 256), 12 / 256, layout, 1, backend="torch")
    values, stats = dispatch.decode(table[0], index[0], layout, 1, backend="torch")
    packed_values, packed = dispatch.decode_async(table[0], index[0], layout, 1, backend="torch")
    assert torch.equal(packed_values, values)
    assert packed.dtype == torch.int64 and packed.tolist() == [stats[f] for f in dispatch.STAT_FIELDS]
    assert stats["support"] == 12  # a decode that recovered something: the packed counts are not all zeros
