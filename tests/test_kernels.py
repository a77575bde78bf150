"""Triton kernels against the torch reference, run by Triton's interpreter on the CPU, or
compiled on a GPU (``python -m tagc.bench gpu-check`` runs this file there).

Inputs are fresh random tensors every run (the seed is printed on failure). Sizes are
small because the interpreter is slow: a few thousand elements, lane widths of 1-2 so a
chunk still has hundreds of sketch rows per lane.

**What holds on a device** (what these tests assert, on the CPU and on a GPU alike):

* exact (bit for bit): thresholds (an order statistic of the sample), the index (the
  support), the residual (element-wise arithmetic), decode statistics (support, peeled,
  unpeeled, ...) and the decoded support (``values != 0``); tables of integer values (sums
  of small integers are exact in any order);
* within float32 rounding, not bit-identical: sketch tables and decoded values. On a GPU a
  cell is summed by atomic adds in an order that differs from the reference's (and from run
  to run), so a table matches to ``rtol ~1e-6`` of the magnitudes summed into its cells and
  the decoded values to ``1e-6`` of the chunk's norm.

Under the interpreter programs run one after another, so races between programs, the order of
atomic adds and barriers are not exercised here: only a GPU run shows them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton; a GPU compiles the kernels

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.triton

triton = pytest.importorskip("triton", reason="triton is not installed")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from tagc.kernels import STAT_FIELDS, dispatch, ops  # noqa: E402
from tagc.kernels.peel import PEEL_STATS  # noqa: E402
from tagc.sketch import (  # noqa: E402
    SketchLayout,
    build_index,
    compress_,
    decode,
    encode,
    index_to_mask,
    merge_index,
    keep_limit,
    plan_density,
    row_thresholds,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [5, 1000, 4096 + 13]
TRITON = {"backend": "triton"}


@pytest.fixture(autouse=True)
def fresh_seed():
    """A new random seed per test, printed so a failure can be replayed."""
    seed = torch.seed()
    print(f"torch seed {seed}")
    yield seed


def _layout(numel: int, ratio: float = 8.0) -> SketchLayout:
    return SketchLayout(numel, ratio, lane=None if numel < 64 else 2)


def _sparse(numel: int, load: float, layout: SketchLayout) -> torch.Tensor:
    """A random chunk with about ``load`` non-zeros per sketch row of a lane."""
    values = torch.randn(numel, device=DEVICE)
    values[torch.rand(numel, device=DEVICE) >= load * layout.table_numel / numel] = 0
    return values


# ---------------------------------------------------------------- backend selection


def test_import_and_reference_path_without_triton():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # import triton now raises ImportError
        import torch, tagc.kernels as k
        from tagc.sketch import SketchLayout
        assert not k.triton_available()
        # Seeded: at 10 of 100 kept, about 1 draw in 40 leaves an unpeelable pair (a property of the code).
        torch.manual_seed(0)
        layout = SketchLayout(100, 4.0, lane=1)
        grad = torch.randn(1, 100)
        index, table = k.compress_(grad.clone(), torch.zeros(1, 100), 0.1, layout, 1)
        values, stats = k.decode(table[0], index[0], layout, 1)
        assert stats.unpeeled == 0 and stats.support == 10, stats
        kept = grad[0].abs().topk(10).indices
        assert torch.equal(values[kept], grad[0, kept]) and int((values != 0).sum()) == 10
        try:
            k.compress_(torch.randn(1, 100), torch.zeros(1, 100), 0.1, layout, 1, backend="triton")
        except RuntimeError as e:
            assert "triton" in str(e)
        else:
            raise AssertionError("backend='triton' without triton must raise")
        print("OK")
        """
    )
    env = {**os.environ, "TAGC_BACKEND": "auto"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr


def test_resolve_backend(monkeypatch):
    x = torch.zeros(3, device=DEVICE)
    monkeypatch.delenv("TAGC_BACKEND", raising=False)
    assert dispatch.resolve_backend(x) == ("triton" if DEVICE == "cuda" else "numba")
    assert dispatch.resolve_backend(x, backend="triton") == "triton"
    assert dispatch.resolve_backend(x, backend="reference") == "torch"
    monkeypatch.setenv("TAGC_BACKEND", "triton")
    assert dispatch.resolve_backend(x) == "triton"
    assert dispatch.resolve_backend(x, backend="torch") == "torch"
    with pytest.raises(ValueError, match="backend"):
        dispatch.resolve_backend(x, backend="cuda")


# ---------------------------------------------------------------- threshold


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("density", [0.01, 0.07, 0.5])
def test_thresholds_equal_reference(numel, density):
    rows = torch.randn(3, numel, device=DEVICE) * torch.rand(3, 1, device=DEVICE) * 10
    rows[:, ::7] = 0  # ties at zero and a zero threshold for dense settings
    got = dispatch.row_thresholds(rows, density, **TRITON)
    torch.testing.assert_close(got, row_thresholds(rows, density), rtol=0, atol=0)


@pytest.mark.parametrize("res_dtype", [torch.float32, torch.bfloat16])
def test_thresholds_of_sum_equal_reference(res_dtype):
    residual = torch.randn(2, 3000, device=DEVICE).to(res_dtype)
    grad = torch.randn(2, 3000, device=DEVICE).to(torch.bfloat16)
    got = dispatch.row_thresholds(residual, 0.05, grad=grad, **TRITON)
    torch.testing.assert_close(got, row_thresholds(residual + grad, 0.05), rtol=0, atol=0)


def test_thresholds_sampled_row_and_kept_fraction():
    """Rows longer than the sample: same sampled order statistic, kept fraction near target."""
    density = 0.05
    rows = torch.randn(1, 200_003, device=DEVICE).exp()
    tau = dispatch.row_thresholds(rows, density, **TRITON)
    torch.testing.assert_close(tau, row_thresholds(rows, density), rtol=0, atol=0)
    kept = (rows.abs() >= tau[:, None]).float().mean().item()
    assert abs(kept - density) < 0.1 * density, kept


def test_threshold_edge_densities():
    x = torch.randn(2, 50, device=DEVICE)
    assert torch.equal(dispatch.row_thresholds(x, 1.0, **TRITON), torch.zeros(2, device=DEVICE))
    assert torch.isinf(dispatch.row_thresholds(x, 0.0, **TRITON)).all()
    assert dispatch.threshold(x, 0.1, **TRITON).shape == ()
    with pytest.raises(ValueError):
        dispatch.row_thresholds(x, 1.5, **TRITON)


# ---------------------------------------------------------------- fused compress


def _compress_both(grad, residual, density, layout, bits, tau=None):
    res_k, res_r = residual.clone(), residual.clone()
    got = dispatch.compress_(grad, res_k, density, layout, bits, tau=tau, **TRITON)
    want = compress_(grad, res_r, density, layout, bits, tau=tau)
    return got, want, res_k, res_r


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16-grad", "bf16-both"])
def test_compress_matches_reference(numel, bits, dtypes):
    grad_dtype, res_dtype = dtypes
    layout = _layout(numel)
    grad = torch.randn(3, numel, device=DEVICE).to(grad_dtype)
    residual = (torch.randn(3, numel, device=DEVICE) * 0.5).to(res_dtype)
    (index, table), (index_r, table_r), res_k, res_r = _compress_both(grad, residual, 0.06, layout, bits)
    assert index.dtype == torch.uint8 and index.shape == index_r.shape
    assert torch.equal(index, index_r), "index differs from the reference"
    assert torch.equal(res_k, res_r), "residual differs from the reference"
    assert table.shape == table_r.shape and table.dtype == torch.float32
    scale = (residual.float() + grad.float()).abs().max().item()
    torch.testing.assert_close(table, table_r, rtol=1e-6, atol=1e-6 * scale)
    assert index.any() and table.abs().sum() > 0  # something was kept


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bits", [1, 4])
def test_compress_under_ties_matches_reference(numel, bits):
    """Integer gradients and residuals: massive ties at the threshold, broken identically (the
    first in index order, across program blocks), at most the limit kept; sums are exact, so
    the table matches bit for bit too."""
    layout = _layout(numel)
    grad = torch.randint(-3, 4, (3, numel), device=DEVICE).float()
    residual = torch.randint(-1, 2, (3, numel), device=DEVICE).float()
    (index, table), (index_r, table_r), res_k, res_r = _compress_both(grad, residual, 0.06, layout, bits)
    assert torch.equal(index, index_r) and torch.equal(res_k, res_r) and torch.equal(table, table_r)
    kept = ((grad + residual) != res_k).sum(1)
    assert (kept <= keep_limit(numel, 0.06)).all(), kept


@pytest.mark.parametrize("bits", [1, 4])
def test_compress_with_explicit_tau(bits):
    layout = _layout(2500)
    grad = torch.randn(2, 2500, device=DEVICE)
    residual = torch.randn(2, 2500, device=DEVICE)
    tau = torch.tensor([0.5, 2.0], device=DEVICE)
    (index, table), (index_r, table_r), res_k, res_r = _compress_both(grad, residual, 0.1, layout, bits, tau=tau)
    assert torch.equal(index, index_r) and torch.equal(res_k, res_r)
    torch.testing.assert_close(table, table_r, rtol=1e-6, atol=1e-5)
    kept = index_to_mask(index[1], 2500, bits)
    assert torch.equal(kept, (residual[1] + grad[1]).abs() >= 2.0)


# ---------------------------------------------------------------- peeling decode


def _assert_decodes_equal(got, want):
    (values, stats), (values_r, stats_r) = got, want
    # within 1e-6 relative (norm-wise, as the codec tests): positions settled by the exact solve
    # inherit the float32 table's rounding, amplified a little differently on each back end
    assert (values.double() - values_r.double()).norm() <= 1e-6 * values_r.double().norm() + 1e-12
    assert torch.equal(values != 0, values_r != 0)
    assert stats.as_dict() == stats_r.as_dict()
    if stats_r.raw_positions is not None:
        assert torch.equal(stats.raw_positions, stats_r.raw_positions)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("load", [0.5, 0.75])
def test_decode_matches_reference(numel, bits, load):
    layout = _layout(numel)
    values = _sparse(numel, load, layout)
    table, index = encode(values, layout), build_index(values, bits)
    got = dispatch.decode(table, index, layout, bits, **TRITON)
    want = decode(table, index, layout, bits)
    _assert_decodes_equal(got, want)
    assert got[1].support == int((values != 0).sum())


@pytest.mark.parametrize("fallback", ["estimate", "raw"])
def test_decode_overloaded_matches_reference(fallback):
    """Above the peeling threshold: stuck positions, exact solve, then the fallback."""
    layout = SketchLayout(3000, 4.0, lane=1)
    values = _sparse(3000, 0.95, layout)
    table, index = encode(values, layout), build_index(values, 1)
    got = dispatch.decode(table, index, layout, 1, fallback, **TRITON)
    want = decode(table, index, layout, 1, fallback)
    assert want[1].unpeeled > 0  # the case under test
    _assert_decodes_equal(got, want)
    with pytest.raises(RuntimeError, match="could not recover"):
        dispatch.decode(table, index, layout, 1, "error", **TRITON)


def test_decode_async_stats_on_device():
    layout = _layout(4096 + 13)
    values = _sparse(layout.numel, 0.6, layout)
    table, index = encode(values, layout), build_index(values, 1)
    out, stats = dispatch.decode_async(table, index, layout, 1, **TRITON)
    assert stats.device == table.device and stats.dtype == torch.int64
    _, stats_r = decode(table, index, layout, 1)
    if stats_r.solved == 0:
        assert dict(zip(STAT_FIELDS, stats.tolist())) == stats_r.as_dict()
    torch.testing.assert_close(out, values, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- round trip over ranks


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_over_ranks(ranks, bits, dtype):
    """compress on every rank -> sum tables, merge indexes -> decode: lossless at plan density."""
    n_chunks, numel, ratio = 2, 4096 + 13, 8.0
    layout = SketchLayout(numel, ratio, lane=2)
    density = plan_density(ratio, ranks)
    tables, indexes, kept = [], [], torch.zeros(n_chunks, numel, dtype=torch.float64, device=DEVICE)
    for _ in range(ranks):
        grad = torch.randn(n_chunks, numel, device=DEVICE).to(dtype)
        residual = torch.randn(n_chunks, numel, device=DEVICE) * 0.1
        before = residual + grad.float()
        index, table = dispatch.compress_(grad, residual, density, layout, bits, **TRITON)
        kept += (before - residual).double()  # exactly the sent entries
        tables.append(table)
        indexes.append(index)
    table = torch.stack(tables).sum(0)
    for chunk in range(n_chunks):  # each chunk's owner decodes it
        index = indexes[0][chunk]
        for other in indexes[1:]:
            index = merge_index(index, other[chunk], bits)
        values, stats = dispatch.decode(table[chunk], index, layout, bits, **TRITON)
        assert stats.unpeeled == 0 and stats.support == int((kept[chunk] != 0).sum()), stats
        scale = kept[chunk].abs().max().item()
        torch.testing.assert_close(values.double(), kept[chunk], rtol=1e-5, atol=1e-6 * scale)


# ---------------------------------------------------------------- torch.library registration


def test_ops_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = _layout(1000)
    t = layout.tables("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True):
        grad, residual = torch.empty(2, 1000), torch.empty(2, 1000)
        assert ops.row_thresholds(residual, grad, 0.1).shape == (2,)
        index, table = ops.compress_(grad, residual, torch.empty(2), t.rows, t.signs, t.lane_xor, layout.lane_bits, layout.table_numel, 4, 100)
        assert index.shape == (2, 500) and index.dtype == torch.uint8 and table.shape == (2, layout.table_numel)
        out, state, work, stats = ops.peel(table[0], index[0], t.rows, t.signs, t.lane_xor, 1000, layout.lane_bits, 4, 0)
        assert out.shape == (1000,) and work.dtype == torch.float64 and stats.shape == (len(PEEL_STATS),)


def test_ops_under_torch_compile():
    layout = _layout(1000)
    t = layout.tables(DEVICE)

    def step(grad, residual):
        tau = torch.ops.tagc.row_thresholds(residual, grad, 0.05)
        return torch.ops.tagc.compress(grad, residual, tau, t.rows, t.signs, t.lane_xor, layout.lane_bits, layout.table_numel, 1,
                                       keep_limit(1000, 0.05))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grad = torch.randn(2, 1000, device=DEVICE)
    residual = torch.randn(2, 1000, device=DEVICE)
    res_ref = residual.clone()
    index, table = compiled(grad, residual)
    index_r, table_r = compress_(grad, res_ref, 0.05, layout, 1)
    assert torch.equal(index, index_r) and torch.equal(residual, res_ref)
    torch.testing.assert_close(table, table_r, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------- GPU code generation


def test_kernels_compile_for_sm90():
    """Without a GPU, still compile every kernel to a cubin for sm_90 (catches GPU-only errors)."""
    if "nvidia" not in __import__("triton.backends", fromlist=["backends"]).backends:
        pytest.skip("triton has no CUDA back end here")
    code = textwrap.dedent(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "0"
        import triton
        from triton.backends.compiler import GPUTarget
        from tagc.kernels import compress, peel, radix_select

        def build(fn, sig, consts):
            sig = {**sig, **{k: "constexpr" for k in consts}}
            triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

        for grad in ("*fp32", "*bf16"):
            for p in (0, 1):
                build(radix_select._radix_hist_kernel, dict(res_ptr="*fp32", grad_ptr=grad, hist_ptr="*i32", prefix_ptr="*i32", numel="i32", size="i32", stride="i32"), dict(HAS_GRAD=True, SAMPLED=p == 1, PASS=p, BLOCK=1024))
            for bits in (1, 4):
                build(compress._compress_kernel, dict(grad_ptr=grad, res_ptr="*fp32", tau_ptr="*fp32", index_ptr="*u8", table_ptr="*fp32", counts_ptr="*i32", rows_ptr="*i64", signs_ptr="*fp32", xor_ptr="*i64", numel="i32", nbytes="i32", table_numel="i32"), dict(LANE_BITS=6, BITS=bits, BLOCK=1024))
                build(compress._ties_kernel, dict(res_ptr=grad, tau_ptr="*fp32", index_ptr="*u8", table_ptr="*fp32", counts_ptr="*i32", before_ptr="*i32", room_ptr="*i32", rows_ptr="*i64", signs_ptr="*fp32", xor_ptr="*i64", numel="i32", nbytes="i32", table_numel="i32"), dict(LANE_BITS=6, BITS=bits, BLOCK=1024))
        for bits, fallback, lane_bits, group in ((1, 0, 10, 4), (4, 1, 0, 1)):
            build(peel._peel_kernel, dict(work_ptr="*fp64", counts_ptr="*i32", index_ptr="*u8", out_ptr="*fp32", state_ptr="*i8", stats_ptr="*i64", list_ptr="*i32", rows_ptr="*i64", signs_ptr="*fp32", xor_ptr="*i64", numel="i32", blocks="i32", table_rows="i32"), dict(LANE_BITS=lane_bits, BITS=bits, G=group, BLOCK_B=1024 // group, TILE=1024, FALLBACK=fallback))
        print("OK")
        """
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------- benchmark smoke test


def test_bench_kernels_runs(tmp_path, capsys):
    import json

    from tagc.bench.kernels import main

    out = tmp_path / "kernels.json"
    main(["--sizes", "1K", "--no-reference", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["rows"][0]["checked"] and result["rows"][0]["numel"] == 1024
    if DEVICE == "cpu":
        assert result["meta"]["interpreter"] and "NOT meaningful" in capsys.readouterr().out
