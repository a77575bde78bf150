"""Batched decode (issue 61): ``P`` parts of one layout decoded in one call, each bit for bit as alone.

:func:`tagc.kernels.dispatch.decode_async` takes the parts' summed tables and union indexes as rows (``[P, T]``,
``[P, I]``) and :func:`tagc.kernels.dispatch.union_index` the parts' coded rows (row ``j * P + p``); on every back
end (the torch reference, Numba, Triton under its interpreter) the values, statistics and union bytes equal those
of the parts decoded one by one. The batches mix what a decode meets: loads below and above the peeling threshold
(stopping sets the exact solve takes, and more than it takes), ties (integer values), an empty support, a support
whose values cancel, odd sizes, 1- and 4-bit indexes; and, through :func:`tagc.hooks.core.nonfinite.decode_`, a
part whose table holds NaN/Inf.
"""

from __future__ import annotations

import functools
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest

from tagc.hooks.core import nonfinite
from tagc.hooks.core.stats import ExchangeStats
from tagc.kernels import cpu, dispatch
from tagc.sketch import (
    SketchLayout,
    build_index,
    compress_,
    decode,
    encode,
    index_positions,
    merge_index,
    plan_density,
)
from tagc.sketch.codec import EXACT_SOLVE_LIMIT
from tagc.sketch.positions import low_bits
from tagc.sketch.sparsify import capacity


def _backends() -> list[str]:
    backends = ["torch"]
    if cpu.numba_available():
        backends.append("numba")
    try:
        import triton  # noqa: F401
    except ImportError:
        return backends
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        backends.append("triton")
    return backends


def _on(backend: str, *more, slow: bool = False):
    """A test's parameters on ``backend``: Triton's marked ``triton`` (and ``slow`` where asked)."""
    marks = [pytest.mark.triton, *([pytest.mark.slow] if slow else [])] if backend == "triton" else []
    return pytest.param(backend, *more, marks=marks, id="-".join(map(str, (backend, *more))))


BACKENDS = [_on(backend) for backend in _backends()]


def _sparse(numel: int, load: float, layout: SketchLayout, g: torch.Generator, ties: bool = False) -> torch.Tensor:
    """About ``load`` non-zeros per sketch cell of a row: random normals, or small integers (ties everywhere)."""
    values = torch.randn(numel, generator=g)
    if ties:
        values = values.mul(2).round()
    values[torch.rand(numel, generator=g) >= load * layout.table_numel / (3 * numel)] = 0
    return values


def _part(values: torch.Tensor, layout: SketchLayout, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = build_index(values, bits)
    return encode(values, layout) if values.any() else torch.zeros(layout.table_numel), index


def _batch(numel: int, ratio: float, bits: int, seed: int, lane=None, loads=(0.5, 0.7, 1.0, 1.3, 3.0)):
    """One layout's parts: random at ``loads`` (the peeling threshold is 0.82), ties, an empty support, a support
    whose values cancel (x from one rank, -x from another), and a part that three ranks compressed."""
    layout = SketchLayout(numel, ratio, lane=lane, seed=seed)
    g = torch.Generator().manual_seed(seed)
    parts = [_part(_sparse(numel, load, layout, g), layout, bits) for load in loads]
    parts.append(_part(_sparse(numel, 0.7, layout, g, ties=True), layout, bits))
    parts.append(_part(torch.zeros(numel), layout, bits))
    cancel = _sparse(numel, 0.5, layout, g)
    parts.append((encode(cancel, layout) + encode(-cancel, layout), build_index(cancel, bits)))
    grad = torch.randn(3, numel, generator=g)
    index, table = compress_(grad, torch.zeros(3, numel), plan_density(ratio, 3), layout, bits)
    parts.append((table.sum(0), functools.reduce(lambda a, b: merge_index(a, b, bits), index.unbind(0))))
    tables, indexes = zip(*parts)
    return layout, torch.stack(tables), torch.stack(indexes)


def _stopping_sets(seed: int, tries: int = 400):
    """Small overloaded parts of one layout whose decode leaves stopping sets the exact solve partly takes."""
    layout = SketchLayout(300, 4.0, lane=1, seed=seed)
    g = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(tries):
        values = _sparse(300, 3.0, layout, g)
        table, index = _part(values, layout, 1)
        stats = decode(table, index, layout, 1)[1]
        if stats.solved and stats.unpeeled:
            found.append((table, index))
        if len(found) == 2:
            break
    assert len(found) == 2, "no stopping sets the solve partly takes"
    easy = _part(_sparse(300, 0.5, layout, g), layout, 1)
    tables, indexes = zip(found[0], easy, found[1])
    return layout, torch.stack(tables), torch.stack(indexes)


CASES = {
    "odd-4109": lambda: _batch(4096 + 13, 4.0, 1, 11, lane=2),
    "4bit-1000": lambda: _batch(1000, 8.0, 4, 12),
    "tiny-20": lambda: _batch(20, 10.0, 1, 13, loads=(0.7, 3.0)),
    "stopping-sets": lambda: _stopping_sets(14),
}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN included, and the sign of zero)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("backend,case", [_on(backend, case, slow=case != "stopping-sets")
                                          for backend in _backends() for case in sorted(CASES)])
def test_a_batch_decodes_as_its_parts_alone(backend, case):
    layout, tables, indexes = CASES[case]()
    bits = 4 if case.startswith("4bit") else 1
    for fallback in ("estimate", "raw"):
        values, stats = dispatch.decode_async(tables, indexes, layout, bits, fallback, backend=backend)
        assert values.shape == (len(tables), layout.numel) and stats.shape == (len(tables), len(dispatch.STAT_FIELDS))
        for p in range(len(tables)):
            alone, alone_stats = dispatch.decode_async(tables[p], indexes[p], layout, bits, fallback, backend=backend)
            assert _equal(values[p], alone), (case, fallback, p)
            assert torch.equal(stats[p], alone_stats), (case, fallback, p, stats[p], alone_stats)
    field = {name: stats[:, i] for i, name in enumerate(dispatch.STAT_FIELDS)}
    assert (field["unpeeled"] == 0).any()
    assert (field["unpeeled"] > 0).any() or case == "tiny-20"  # 20 positions peel at any load
    if case == "stopping-sets":
        assert (field["solved"] > 0).sum() == 2
    else:
        assert (field["support"] == 0).any()  # the empty part
    if case == "odd-4109":
        assert (field["unpeeled"] > EXACT_SOLVE_LIMIT).any()  # more than the solve takes


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_of_one_part_is_the_part(backend):
    """One part as a batch of one: the same values and statistics as the 1-D call."""
    layout, tables, indexes = CASES["tiny-20"]()
    values, stats = dispatch.decode_async(tables[:1], indexes[:1], layout, 1, backend=backend)
    alone, alone_stats = dispatch.decode_async(tables[0], indexes[0], layout, 1, backend=backend)
    assert _equal(values[0], alone) and torch.equal(stats[0], alone_stats)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_the_cpu_back_ends_raise_for_any_part_of_a_batch(backend):
    if backend == "numba" and not cpu.numba_available():
        pytest.skip("numba is not installed")
    layout, tables, indexes = CASES["stopping-sets"]()
    stray = tables.clone()
    used = layout.cells(index_positions(indexes[1], layout.numel, 1))[0].unique()
    free = torch.ones(layout.table_numel, dtype=torch.bool)
    free[used] = False
    stray[1, free.nonzero()[0]] = 1.0  # a cell no position of the middle part maps to
    with pytest.raises(RuntimeError, match="disagree"):
        dispatch.decode_async(stray, indexes, layout, 1, backend=backend)
    with pytest.raises(RuntimeError, match="could not recover"):
        dispatch.decode_async(tables, indexes, layout, 1, "error", backend=backend)
    with pytest.raises(ValueError, match="per part"):
        dispatch.decode_async(tables[:, 1:], indexes, layout, 1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("numel", [20, 4096 + 13])
def test_the_union_of_a_batch_is_each_parts_union(backend, numel):
    """Coded rows of ``P`` parts from ``N`` ranks (row ``j * P + p``): one call, each part's union bytes as alone."""
    world, parts = 3, 4
    density = 0.1
    cap, low = capacity(numel, density), low_bits(density)
    g = torch.Generator().manual_seed(numel)
    mask = torch.rand(world * parts, numel, generator=g) < density
    mask[1::parts] = False  # part 1: nothing from any rank
    mask[2, :] = True  # part 2 of rank 0: past the capacity
    index = torch.stack([build_index(row, 1) for row in mask])
    code = dispatch.code_index(index, numel, cap, low, backend="torch")
    union = dispatch.union_index(code, numel, cap, low, parts, backend=backend)
    assert union.shape == (parts * -(-numel // 8),)
    for p, got in enumerate(union.view(parts, -1)):
        assert torch.equal(got, dispatch.union_index(code[p::parts].contiguous(), numel, cap, low, backend=backend)), p
    assert not union.view(parts, -1)[1].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_decode_of_a_batch_is_its_parts_alone(backend, monkeypatch):
    """A part whose summed table holds NaN (another Inf) comes out NaN and counts only ``nonfinite_parts``; the
    others decode as alone; the statistics are the sums of the parts' own."""
    monkeypatch.setenv("TAGC_BACKEND", backend)
    layout, tables, indexes = CASES["stopping-sets"]()
    tables = tables.clone()
    tables[0, 3] = float("nan")
    tables[2, 5] = float("inf")
    batched = ExchangeStats()
    values = nonfinite.decode_(tables, indexes, layout, 1, "estimate", batched)
    alone = ExchangeStats()
    parts = [nonfinite.decode_(t, i, layout, 1, "estimate", alone) for t, i in zip(tables, indexes)]
    assert _equal(values, torch.cat(parts))
    assert values.view(len(tables), -1)[[0, 2]].isnan().all() and not values.view(len(tables), -1)[1].isnan().any()
    assert batched.as_dict() == alone.as_dict()
    assert batched.as_dict()["nonfinite_parts"] == 2 and batched.as_dict()["support"] > 0


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.values[0] != "torch"])
def test_a_batch_decodes_in_one_set_of_launches_and_ops(backend, monkeypatch):
    """The host work of a batch's decode and union does not follow its parts: the aten ops dispatched and the
    Triton kernels launched for one part and for eight are the same (parts that all peel: the CPU back ends solve
    the stopping sets part by part, and the torch reference, left out, runs a pass of ops per peeling round)."""
    from tagc.bench.launches import HostWork, instrument

    if backend == "triton":
        import tagc.kernels.ops  # noqa: F401  (instrument() counts its launches)
    monkeypatch.setenv("TAGC_BACKEND", backend)
    layout = SketchLayout(1000, 8.0, lane=2, seed=21)
    g = torch.Generator().manual_seed(21)
    parts = [_part(_sparse(1000, 0.4, layout, g), layout, 1) for _ in range(8)]
    tables, indexes = (torch.stack(t) for t in zip(*parts))
    world, density = 2, 0.05
    cap, low = capacity(1000, density), low_bits(density)
    code = dispatch.code_index(torch.stack([build_index(torch.rand(1000, generator=g) < density, 1)
                                            for _ in range(world * 8)]), 1000, cap, low, backend="torch")
    counts = []
    for n in (1, 8):
        with instrument(HostWork()) as work:
            dispatch.union_index(code[: world * n], 1000, cap, low, n)
            stats = ExchangeStats()
            nonfinite.decode_(tables[:n], indexes[:n], layout, 1, "estimate", stats)
        assert stats.as_dict()["unpeeled"] == 0 and stats.as_dict()["support"] > 0
        counts.append((work.count("other"), work.launch_count()))
    assert counts[0] == counts[1], counts
    assert counts[0][1] == (6 if backend == "triton" else 0), counts
    if backend == "triton":  # and no host read: the statistics stay on the device
        from tagc.hooks.core.strict import count_host_reads

        with count_host_reads() as reads:
            dispatch.union_index(code, 1000, cap, low, 8)
            nonfinite.decode_(tables, indexes, layout, 1, "estimate", ExchangeStats())
        assert reads.count == 0, dict(reads.sites)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finite_rows_is_isfinite_all_on_every_row(dtype):
    """The extremes decide a row exactly as ``isfinite(x).all(-1)`` does: NaN, +Inf and -Inf alone or together, at
    a row's ends and inside it, values at the dtype's largest finite magnitude, rows of one entry and of none."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 257, generator=g).to(dtype)
    big = torch.finfo(dtype).max
    cases = {(0, 0, 0): math.nan, (0, 1, 256): math.inf, (0, 2, 100): -math.inf, (1, 3, 7): big, (1, 3, 8): -big,
             (2, 0, 9): math.nan, (2, 0, 10): math.inf, (2, 4, 0): -math.inf, (2, 4, 1): math.inf}
    for where, value in cases.items():
        x[where] = value
    for rows in (x, x[..., :1], x[..., :0], x.transpose(0, 1)):
        assert torch.equal(nonfinite.finite_rows(rows), torch.isfinite(rows).all(dim=-1))
    assert nonfinite.finite_parts(x).tolist() == [False, False, False, True, False]  # part 3: only the largest


def test_a_parts_columns_are_taken_and_put_as_by_indexing():
    from tagc.hooks.codecs.codec import PlainCodec
    from tagc.hooks.core.plan import Part

    rows = torch.randn(2, 40)
    for columns in (slice(3, 17), torch.tensor([0, 5, 6, 7, 30, 39])):
        numel = len(range(40)[columns]) if isinstance(columns, slice) else len(columns)
        part = Part(columns, numel, PlainCodec(), "p")
        assert torch.equal(part.take(rows), rows[:, columns])
        out, expected = torch.zeros(40), torch.zeros(40)
        values = torch.arange(numel, dtype=torch.float64)  # put casts to out's dtype, as indexing does
        part.put(out, values)
        expected[columns] = values.float()
        assert torch.equal(out, expected)
