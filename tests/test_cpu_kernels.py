"""The Numba CPU kernels (:mod:`tagc.kernels.cpu`) against the torch reference.

Fresh random inputs every run (the seed is printed on failure). Compression must match the
reference bit for bit (same threshold, index, residual and table); decoding must settle the
same positions in the same number of rounds, with values equal up to float rounding.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("numba", reason="numba is not installed")

from tagc.kernels import cpu, dispatch  # noqa: E402
from tagc.sketch import (  # noqa: E402
    SketchLayout,
    build_index,
    compress_,
    decode,
    encode,
    keep_limit,
    merge_index,
    plan_density,
    row_thresholds,
)


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = torch.seed()
    print(f"torch seed {seed}")
    yield seed


def _gradients(ranks: int, numel: int, zeros: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    grad = torch.randn(ranks, numel) * torch.rand(ranks, 1)
    residual = torch.randn(ranks, numel) * 0.1
    grad[torch.rand(ranks, numel) < zeros] = 0  # exact zeros never enter the index
    residual[grad == 0] = 0
    return grad, residual


def _both_compress(grad, residual, density, layout, bits, tau=None):
    ref_residual, cpu_residual = residual.clone(), residual.clone()
    expected = compress_(grad, ref_residual, density, layout, bits, tau=tau)
    got = cpu.compress_cpu(grad, cpu_residual, density, layout, bits, tau=tau)
    return expected, got, ref_residual, cpu_residual


@pytest.mark.parametrize("numel", [1, 37, 1000, 65_537, 300_001])
@pytest.mark.parametrize("bits", [1, 4])
def test_compress_equals_reference_bit_for_bit(numel, bits):
    layout = SketchLayout(numel, 10.0, seed=int(torch.randint(0, 2**31, ())))
    grad, residual = _gradients(3, numel)
    density = plan_density(10.0, 3)
    (index, table), (cpu_index, cpu_table), ref_residual, cpu_residual = _both_compress(
        grad, residual, density, layout, bits
    )
    assert torch.equal(cpu_index, index)
    assert torch.equal(cpu_residual, ref_residual)
    assert torch.equal(cpu_table, table)
    assert int(index.count_nonzero()) > 0 or numel < 8


@pytest.mark.parametrize("numel", [1000, 300_001])
@pytest.mark.parametrize("values", ["integer", "pm1", "equal"])
def test_compress_under_ties_equals_reference_bit_for_bit(numel, values):
    """Ties at the threshold: at most the limit kept, the first ones in index order, as the reference."""
    grad = torch.randint(-4, 5, (2, numel)).float()
    if values == "pm1":
        grad = grad.sign() + (grad == 0)
    elif values == "equal":
        grad = torch.full((2, numel), 0.25)
    residual = torch.randint(-1, 2, (2, numel)).float() * 0.5
    layout = SketchLayout(numel, 10.0)
    density = plan_density(10.0, 2)
    (index, table), (cpu_index, cpu_table), ref_residual, cpu_residual = _both_compress(
        grad, residual, density, layout, 1
    )
    assert torch.equal(cpu_index, index) and torch.equal(cpu_residual, ref_residual) and torch.equal(cpu_table, table)
    kept = ((grad + residual) != cpu_residual).sum(1)
    assert (kept <= keep_limit(numel, density) * 1.05).all(), kept


@settings(max_examples=25, deadline=None)
@given(numel=st.integers(1, 5000), ranks=st.integers(1, 4), density=st.floats(0.0, 1.0),
       ratio=st.floats(1.5, 40.0), bits=st.sampled_from([1, 4]), seed=st.integers(0, 2**31 - 1))
def test_compress_matches_reference_on_any_shape(numel, ranks, density, ratio, bits, seed):
    torch.manual_seed(seed)
    layout = SketchLayout(numel, ratio, seed=seed)
    grad, residual = _gradients(ranks, numel, zeros=0.2)
    (index, table), (cpu_index, cpu_table), ref_residual, cpu_residual = _both_compress(
        grad, residual, density, layout, bits
    )
    assert torch.equal(cpu_index, index) and torch.equal(cpu_residual, ref_residual) and torch.equal(cpu_table, table)


def test_compress_with_given_thresholds_and_bf16_gradients():
    layout = SketchLayout(20_000, 8.0)
    grad, residual = _gradients(2, 20_000)
    tau = torch.tensor([0.5, 1.5])
    (index, table), (cpu_index, cpu_table), ref_residual, cpu_residual = _both_compress(
        grad.bfloat16(), residual, 0.05, layout, 1, tau=tau)
    assert torch.equal(cpu_index, index) and torch.equal(cpu_residual, ref_residual) and torch.equal(cpu_table, table)


def test_compress_reads_strided_gradient_views():
    """The engine hands column slices of the packed buffer, not copies."""
    layout = SketchLayout(30_000, 8.0)
    packed = torch.randn(2, 50_000)
    grad = packed[:, 7_000:37_000]
    _, residual = _gradients(2, 30_000)
    (index, table), (cpu_index, cpu_table), ref_residual, cpu_residual = _both_compress(grad, residual, 0.05, layout, 1)
    assert not grad.is_contiguous()
    assert torch.equal(cpu_index, index) and torch.equal(cpu_residual, ref_residual) and torch.equal(cpu_table, table)


def test_bf16_residual_takes_the_reference():
    """A bf16 residual goes through the reference (the CPU kernels take float32 residuals): checked
    against the selection rule computed here, not against the reference itself."""
    torch.manual_seed(0)
    layout = SketchLayout(5000, 8.0)
    grad, residual = _gradients(2, 5000)
    residual = residual.bfloat16()
    a = (residual.float() + grad).bfloat16()  # the sum in the residual's dtype
    k = keep_limit(5000, 0.05)  # rows of <= MIN_SAMPLE: the exact threshold, the k-th largest |a|
    tau = torch.kthvalue(a.float().abs(), 5000 - k + 1, dim=1).values[:, None]
    above, tie = a.float().abs() > tau, a.float().abs() == tau
    kept = above | (tie & (tie.cumsum(1) <= k - above.sum(1, keepdim=True)))  # ties: the first, in index order
    sent = torch.where(kept, a, 0).float()
    got = residual.clone()
    index, table = cpu.compress_cpu(grad, got, 0.05, layout, 1)
    assert torch.equal(got, torch.where(kept, 0, a))
    assert all(torch.equal(index[r], build_index(sent[r], 1)) for r in range(2))
    assert all(torch.allclose(table[r], encode(sent[r], layout), atol=1e-6) for r in range(2))


@pytest.mark.parametrize("numel", [70_001, 1_000_003])
@pytest.mark.parametrize("density", [0.02, 0.05])
def test_thresholds_equal_reference(numel, density):
    grad, residual = _gradients(2, numel)
    assert torch.equal(cpu._row_thresholds(residual, grad, density), row_thresholds(residual, density, grad=grad))


def test_compress_rejects_mismatched_shapes():
    layout = SketchLayout(100, 4.0)
    with pytest.raises(ValueError, match="one shape"):
        cpu.compress_cpu(torch.randn(2, 100), torch.zeros(1, 100), 0.1, layout, 1)
    with pytest.raises(ValueError, match="density"):
        cpu.compress_cpu(torch.randn(1, 100), torch.zeros(1, 100), 1.5, layout, 1)


def _summed(layout, ranks, density, bits):
    """Every simulated rank's compression of fresh gradients -> (summed table, union index)."""
    index, table = compress_(*_gradients(ranks, layout.numel), density, layout, bits)
    union = index[0]
    for other in index[1:]:
        union = merge_index(union, other, bits)
    return table.sum(dim=0), union


def decode_numba(*args, **kwargs):
    return dispatch.decode(*args, **kwargs, backend="numba")


@pytest.mark.parametrize(
    "numel,ratio,overload", [(1000, 8.0, 1.0), (300_001, 10.0, 1.0), (300_001, 10.0, 2.5), (20, 10.0, 1.0)]
)
@pytest.mark.parametrize("bits", [1, 4])
def test_decode_equals_reference(numel, ratio, overload, bits):
    """Same support, same positions settled in the same rounds, same values up to rounding —
    also far above the peeling threshold (``overload``), where the fallback takes most."""
    layout = SketchLayout(numel, ratio, seed=int(torch.randint(0, 2**31, ())))
    table, union = _summed(layout, 3, min(1.0, overload * plan_density(ratio, 3)), bits)
    for fallback in ("estimate", "raw"):
        values, stats = decode(table, union, layout, bits, fallback=fallback)
        cpu_values, cpu_stats = decode_numba(table, union, layout, bits, fallback=fallback)
        assert cpu_stats.as_dict() == stats.as_dict()
        torch.testing.assert_close(cpu_values, values, rtol=1e-5, atol=1e-5)
        if stats.raw_positions is None:
            assert cpu_stats.raw_positions is None
        else:
            assert torch.equal(cpu_stats.raw_positions, stats.raw_positions)
    if overload > 1:
        assert stats.unpeeled > 0
        with pytest.raises(RuntimeError, match="could not recover"):
            decode_numba(table, union, layout, bits, fallback="error")


def test_decode_rejects_bad_input():
    layout = SketchLayout(1000, 8.0)
    table, union = _summed(layout, 2, 0.05, 1)
    with pytest.raises(ValueError, match="table must have"):
        decode_numba(table[:-1], union, layout, 1)
    with pytest.raises(ValueError, match="index"):
        decode_numba(table, union[:-1], layout, 1)
    with pytest.raises(ValueError, match="fallback"):
        decode_numba(table, union, layout, 1, fallback="guess")
    bad = table.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        decode_numba(bad, union, layout, 1)


def test_dispatch_picks_numba_on_cpu_and_falls_back_without_it(monkeypatch):
    monkeypatch.delenv("TAGC_BACKEND", raising=False)
    x = torch.zeros(3)
    assert dispatch.resolve_backend(x) == "numba"
    assert dispatch.resolve_backend(x, backend="torch") == "torch"
    code = textwrap.dedent(
        """
        import sys
        sys.modules["numba"] = None  # import numba now raises ImportError
        import torch, tagc.kernels as k
        from tagc.sketch import SketchLayout
        x = torch.zeros(3)
        assert k.resolve_backend(x) == "torch"
        try:
            k.resolve_backend(x, backend="numba")
        except RuntimeError as e:
            assert "numba" in str(e)
        else:
            raise AssertionError("backend='numba' without numba must raise")
        # Seeded: at 10 of 100 kept, about 1 draw in 40 leaves an unpeelable pair (a property of the code).
        torch.manual_seed(0)
        layout = SketchLayout(100, 4.0, lane=1)
        grad = torch.randn(1, 100)
        index, table = k.compress_(grad.clone(), torch.zeros(1, 100), 0.1, layout, 1)
        values, stats = k.decode(table[0], index[0], layout, 1)
        assert stats.unpeeled == 0 and stats.support == 10, stats
        kept = grad[0].abs().topk(10).indices
        assert torch.equal(values[kept], grad[0, kept]) and int((values != 0).sum()) == 10
        print("OK")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TAGC_BACKEND"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr


# ----------------------------------------------------------------------------- the topk peer's lists


def _both_lists(grad, residual, density, cap, tau=None):
    from tagc.sketch.kept_list import list_kept_

    ref_residual, cpu_residual = residual.clone(), residual.clone()
    expected = list_kept_(grad, ref_residual, density, cap, tau=tau)
    got = cpu.list_kept_cpu(grad, cpu_residual, density, cap, tau=tau)
    return expected, got, ref_residual, cpu_residual


def _tie_gradients(kind: str, ranks: int, numel: int) -> torch.Tensor:
    if kind == "integer":
        return torch.randint(-3, 4, (ranks, numel)).float()
    if kind == "pm1":
        return torch.where(torch.rand(ranks, numel) < 0.5, -1.0, 1.0)
    if kind == "equal":
        return torch.full((ranks, numel), 0.25)
    return torch.randn(ranks, numel) * torch.logspace(-30, 30, numel)[torch.randperm(numel)]  # mixed magnitudes


@pytest.mark.parametrize("numel", [1, 37, 1000, 65_536, 65_537, 300_001])
@pytest.mark.parametrize("kind", ["randn", "integer", "pm1", "equal", "mixed"])
def test_kept_lists_equal_reference_bit_for_bit(numel, kind):
    from tagc.sketch.kept_list import capacity

    ranks = 3
    grad, residual = (
        _gradients(ranks, numel) if kind == "randn" else (_tie_gradients(kind, ranks, numel), torch.zeros(ranks, numel))
    )
    density = plan_density(10.0, ranks)
    cap = capacity(numel, density)
    expected, got, ref_residual, cpu_residual = _both_lists(grad, residual, density, cap)
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and torch.equal(e, g)
    assert torch.equal(cpu_residual, ref_residual)
    counts, _, values = got
    listed = counts[:, :-1].sum(dim=1)
    assert (listed <= cap).all() and (listed >= ((grad + residual) != 0).any(dim=1).int()).all()
    assert torch.equal((values != 0).sum(dim=1), listed)  # a kept value is never 0: the threshold is positive
    sent = grad + residual - cpu_residual
    assert torch.equal(torch.sort(sent[sent != 0].abs()).values, torch.sort(values[values != 0].abs()).values)


@pytest.mark.parametrize("numel", [5000, 200_000])
def test_kept_lists_overflow_and_strided_gradients_equal_reference(numel):
    ranks = 2
    packed = torch.randn(ranks, 2 * numel)
    grad = packed[:, ::2]  # a strided view, as a part of a packed bucket can be
    residual = torch.randn(ranks, numel) * 0.01
    density = 0.05
    cap = int(density * numel) // 2  # half the planned count: every row overflows
    tau = torch.zeros(ranks)  # keep every non-zero entry: all of them are above the threshold
    expected, got, ref_residual, cpu_residual = _both_lists(grad, residual, density, cap, tau=tau)
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
    assert torch.equal(cpu_residual, ref_residual)
    assert torch.equal(got[0][:, -1], torch.full((ranks,), numel - cap, dtype=torch.int32))


def test_kept_lists_leave_the_residual_of_a_nonfinite_gradient_alone():
    grad, residual = _gradients(2, 3000)
    grad[1, 7] = float("inf")
    expected, got, ref_residual, cpu_residual = _both_lists(grad, residual, 0.05, 200)
    assert torch.equal(cpu_residual, residual) and torch.equal(ref_residual, residual)
    for e, g in zip(expected, got):
        assert torch.equal(e, g) or (e.isnan().all() and g.isnan().all())
    assert got[2].isnan().all() and not got[0].any()


@pytest.mark.parametrize("numel", [1, 1000, 65_536 * 3 + 17])
def test_summed_lists_equal_reference_bit_for_bit(numel):
    from tagc.sketch.kept_list import capacity, sum_lists

    ranks = 4
    density = plan_density(10.0, ranks)
    cap = capacity(numel, density)
    lists = [cpu.list_kept_cpu(*_gradients(1, numel)[::-1], density, cap) for _ in range(ranks)]
    counts, offsets, values = (torch.cat(parts) for parts in zip(*lists))
    values = values * torch.logspace(-20, 20, ranks)[:, None]  # mixed magnitudes: the order of the sum shows
    assert torch.equal(cpu.sum_lists_cpu(counts, offsets, values, numel), sum_lists(counts, offsets, values, numel))
    corrupt = counts.clone()
    corrupt[:, 0] += cap  # more entries claimed than the list holds: both stop at the capacity
    assert torch.equal(cpu.sum_lists_cpu(corrupt, offsets, values, numel), sum_lists(corrupt, offsets, values, numel))


@pytest.mark.parametrize("numel", [1, 1000, 65_536 * 3 + 17])
@pytest.mark.parametrize("density", [0.001, 0.35, 1.0])
def test_listed_positions_equal_reference(numel, density):
    """The encode's positions from the lists (the walk against the reference's search), full, overflowing, empty
    and past-the-end lists included."""
    from tagc.sketch.kept_list import capacity, list_positions

    cap = capacity(numel, density)
    lists = [cpu.list_kept_cpu(*_gradients(1, numel)[::-1], density, size) for size in (cap, max(1, cap // 3))]
    for counts, offsets, _ in lists:
        got, want = cpu.list_positions_cpu(counts, offsets, numel), list_positions(counts, offsets, numel)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    counts, offsets, _ = lists[0]
    empty = torch.zeros_like(counts)
    assert not cpu.list_positions_cpu(empty, offsets, numel)[1].any()
    beyond = counts.clone()
    beyond[:, -2] += cap  # the last block claims more than the list holds, its offsets past numel: both stop at cap
    got, want = cpu.list_positions_cpu(beyond, offsets, numel), list_positions(beyond, offsets, numel)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", ["torch", "numba", None])
def test_dispatch_row_thresholds_on_the_cpu_is_the_references(backend):
    """The CPU entry of dispatch.row_thresholds (it once resolved the re-exported function, not the module)."""
    gen = torch.Generator().manual_seed(2)
    rows, grad = torch.randn(2, 50_000, generator=gen), torch.randn(2, 50_000, generator=gen)
    k = keep_limit(50_000, 0.05)  # rows of <= MIN_SAMPLE: the exact k-th largest magnitude, computed here
    assert torch.equal(dispatch.row_thresholds(rows, 0.05, backend=backend),
                       torch.kthvalue(rows.abs(), 50_000 - k + 1, dim=1).values)
    assert torch.equal(dispatch.row_thresholds(rows, 0.05, grad=grad, backend=backend),
                       torch.kthvalue((rows + grad).abs(), 50_000 - k + 1, dim=1).values)
    with pytest.raises(ValueError, match="density"):
        dispatch.row_thresholds(rows, 1.5, backend=backend)
