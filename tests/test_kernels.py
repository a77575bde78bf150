"""Triton kernels against the torch reference, run by Triton's interpreter on the CPU, or
compiled on a GPU (``python -m tagc.bench gpu-check`` runs this file there).

Inputs are fresh random tensors every run (the seed is printed on failure). Sizes are
small because the interpreter is slow: a few thousand elements, lane widths of 1-2 so a
chunk still has hundreds of sketch rows per lane.

**What holds on a device** (what these tests assert, on the CPU and on a GPU alike):

* exact (bit for bit): thresholds (an order statistic of the sample), the index (the
  support), the residual (element-wise arithmetic), the sketch table (each cell summed in the
  reference's order, without atomics), decode statistics (support, peeled, solved, unpeeled,
  ...) and the decoded support (``values != 0``);
* bit for bit from run to run, and across the decode's tile and launch sizes: the decoded
  values (no float atomics: ``test_sketch_and_decode_kernels_have_no_float_atomics``);
* within float32 rounding of the CPU back ends: the decoded values, stopping sets included
  (the device solves them exactly too; a position owning several pure cells may read another
  of them than the reference does, and the solve eliminates where the reference takes an SVD).

Under the interpreter programs run one after another, so races between programs and barriers
are not exercised here: only a GPU run shows them.
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
    keep_limit,
    kept_list,
    merge_index,
    plan_density,
    row_thresholds,
)
from tagc.sketch import positions as coded  # noqa: E402
from tagc.sketch.index import pack_mask  # noqa: E402
from tagc.sketch.kept_list import capacity  # noqa: E402
from tests.params import spread  # noqa: E402

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


@pytest.mark.parametrize("numel, density", spread(SIZES, [0.01, 0.07, 0.5]))
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


def _cpu_reference(grad, residual, density, layout, bits, tau=None, **kwargs):
    """The reference :func:`compress_` on CPU copies, whose ``scatter_add_`` adds a cell's values in index
    order (on CUDA its atomics add them in whatever order they land): its outputs and the residual it
    leaves, on :data:`DEVICE`; ``residual`` itself is untouched."""
    res = residual.to("cpu", copy=True)
    out = compress_(grad.cpu(), res, density, layout, bits, tau=None if tau is None else tau.cpu(), **kwargs)
    return tuple(o.to(DEVICE) for o in out), res.to(DEVICE)


def _compress_both(grad, residual, density, layout, bits, tau=None):
    """The Triton kernels on :data:`DEVICE` and the reference on the CPU (:func:`_cpu_reference`)."""
    res_k = residual.clone()
    got = dispatch.compress_(grad, res_k, density, layout, bits, tau=tau, **TRITON)
    want, res_r = _cpu_reference(grad, residual, density, layout, bits, tau=tau)
    return got, want, res_k, res_r


@pytest.mark.parametrize("numel, bits, dtypes", spread(
    SIZES, [1, 4], [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]))
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
    assert torch.equal(table, table_r), "table differs from the reference (summed in its order: the same bits)"
    assert index.any() and table.abs().sum() > 0  # something was kept


@pytest.mark.parametrize("numel, bits", spread(SIZES, [1, 4]))
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
    assert torch.equal(table, table_r)
    kept = index_to_mask(index[1], 2500, bits)
    above = (residual[1] + grad[1]).abs() > 2.0  # ~390 of 2,500: past the capacity (250), the first 250 are kept
    assert torch.equal(kept, above & (above.cumsum(0) <= capacity(2500, 0.1)))


# ---------------------------------------------------------------- peeling decode


def _assert_close_normwise(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-6 relative, norm-wise (as the codec tests): positions peeled from other cells or
    settled by the exact solve inherit the float32 table's rounding, a little differently on each
    back end."""
    assert (got.double() - want.double()).norm() <= 1e-6 * want.double().norm() + 1e-12


def _assert_decodes_equal(got, want):
    (values, stats), (values_r, stats_r) = got, want
    _assert_close_normwise(values, values_r)
    assert torch.equal(values != 0, values_r != 0)
    assert stats.as_dict() == stats_r.as_dict()
    if stats_r.raw_positions is not None:
        assert torch.equal(stats.raw_positions, stats_r.raw_positions)


@pytest.mark.parametrize("numel, bits, load", spread(SIZES, [1, 4], [0.5, 0.75]))
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
    want, stats_r = decode(table, index, layout, 1)
    assert dict(zip(STAT_FIELDS, stats.tolist())) == stats_r.as_dict()
    # norm-wise, as _assert_decodes_equal: a value peeled from another pure cell than the
    # reference's carries that cell's float32 rounding (element-wise it can differ by ~30 ulps)
    _assert_close_normwise(out, want)
    assert torch.equal(out != 0, want != 0)
    if stats_r.unpeeled == 0:
        _assert_close_normwise(out, values)


def _stopping_sets(numel: int = 300, load: float = 1.0, tries: int = 200, unsolved: bool = True):
    """A fresh random chunk on an overloaded small sketch whose decode leaves stopping sets, some solved
    exactly, and (``unsolved``) some not (about one draw in seven at the defaults, ~60 positions stuck):
    ``(layout, values, table, index)``."""
    layout = SketchLayout(numel, 4.0, lane=1)
    for _ in range(tries):
        values = _sparse(numel, load, layout)
        table, index = encode(values, layout), build_index(values, 1)
        _, stats = decode(table, index, layout, 1)
        if stats.solved and (stats.unpeeled or not unsolved):
            return layout, values, table, index
    pytest.fail(f"no stopping set that is partly solvable in {tries} draws")


def _assert_close_to_cpu(got, want):
    """Within float32 rounding of the chunk (solved positions: amplified by their small system's conditioning)."""
    scale = want.double().abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= 1e-5 * scale, (got - want).abs().max()
    assert torch.equal(got != 0, want != 0)


@pytest.mark.parametrize("fallback", ["estimate", pytest.param("raw", marks=pytest.mark.slow)])
def test_device_decode_solves_stopping_sets_like_the_cpu(fallback):
    """The device decode solves stopping sets exactly, as the CPU back ends do: the same statistics
    (``solved`` included) and values within float32 rounding, for the full and the sync-free decode.
    (Without the device solve these inputs decoded up to ~1 off: the estimate of positions the solve recovers.)"""
    layout, values, table, index = _stopping_sets()
    want, stats_r = decode(table, index, layout, 1, fallback)
    cpu_backends = [("numba", dispatch.decode(table, index, layout, 1, fallback, backend="numba"))] if \
        dispatch._cpu.supports(table) else []
    got, stats = dispatch.decode(table, index, layout, 1, fallback, **TRITON)
    fast, fast_stats = dispatch.decode_async(table, index, layout, 1, fallback, **TRITON)
    assert stats.as_dict() == stats_r.as_dict() and stats.solved > 0
    assert dict(zip(STAT_FIELDS, fast_stats.tolist())) == stats_r.as_dict()
    assert torch.equal(fast, got)  # one decode, two ways of reading its statistics
    for name, (other, other_stats) in [("reference", (want, stats_r)), *cpu_backends]:
        assert other_stats.as_dict() == stats.as_dict(), name
        _assert_close_to_cpu(got, other)
    if fallback == "raw":
        assert torch.equal(stats.raw_positions, stats_r.raw_positions)
    determined = (want != 0) & (values != 0)  # peeled or solved (the rest is estimated or 0)
    if fallback == "raw":
        exact = torch.ones_like(determined)
        exact[stats_r.raw_positions] = False
        torch.testing.assert_close(got[exact], values[exact], rtol=1e-5, atol=1e-5 * values.abs().max().item())
    assert int(determined.sum()) > 0


@pytest.mark.slow  # 8 s under the interpreter; gpu-check runs it on the device
def test_device_decode_is_the_same_bits_at_any_tile_and_launch_size():
    """The tile of a column's rounds and the setup programs' size change the order the device works in,
    never the bits: tiles of 16 and 32 carry the rounds over many tiles (dozens of pending positions in the
    one column), with stopping sets solved, and parity to the reference."""
    layout, values, table, index = _stopping_sets()
    t = layout.tables(table.device)
    args = (table, index, t.rows, t.signs, t.lane_xor, layout.numel, layout.lane_bits, 1, 0)
    from tagc.kernels.peel import launch_peel

    base = launch_peel(*args)
    assert int(((index_to_mask(index, layout.numel, 1)).sum())) > 3 * 16 * layout.lanes  # many tiles per column
    for tile, setup in ((16, 1), (32, 4), (16, 1024)):
        other = launch_peel(*args, tile=tile, setup_blocks=setup)
        for a, b in zip(base, other):
            assert torch.equal(a, b), (tile, setup)
    want, stats_r = decode(table, index, layout, 1)
    assert dict(zip(PEEL_STATS, base[2][0].tolist()))["solved"] == stats_r.solved
    _assert_close_to_cpu(base[0], want)


@pytest.mark.parametrize("fallback", [pytest.param("estimate", marks=pytest.mark.slow), "raw"])
def test_device_decode_reads_the_host_once(fallback):
    """Strict-sync counting (``tagc.hooks.core.strict``): one host read per full decode (its statistics), with
    stopping sets solved and a fallback; none for the sync-free decode."""
    from tagc.hooks.core.strict import count_host_reads

    layout, _, table, index = _stopping_sets()
    with count_host_reads() as reads:
        dispatch.decode(table, index, layout, 1, fallback, **TRITON)
    assert reads.count == 1, dict(reads.sites)
    with count_host_reads() as reads:
        dispatch.decode_async(table, index, layout, 1, fallback, **TRITON)
    assert reads.count == 0, dict(reads.sites)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, on the NaN table
def test_device_decode_raises_what_the_reference_raises():
    layout = _layout(1000)
    values = _sparse(1000, 0.5, layout)
    table, index = encode(values, layout), build_index(values, 1)
    for bad in (float("nan"), float("inf")):
        poisoned = table.clone()
        poisoned[3] = bad
        with pytest.raises(ValueError, match="NaN" if bad != bad else "Inf"):
            dispatch.decode(poisoned, index, layout, 1, **TRITON)
    unmapped = table == 0  # at half a value per cell, about a tenth of the cells; none would leave nothing to test
    assert unmapped.any(), "no table cell is free of support positions: the stray values below would land nowhere"
    stray = table.clone()
    stray[unmapped] = 1.0
    from tagc.sketch.codec import InconsistentSketchError

    with pytest.raises(InconsistentSketchError):
        dispatch.decode(stray, index, layout, 1, **TRITON)


# ---------------------------------------------------------------- round trip over ranks


_DEFAULT_ROUND_TRIPS = {(torch.float32, 1, 2), (torch.bfloat16, 4, 4)}
"""The round trips the default suite runs on the CPU; ``-m slow`` and ``gpu-check`` on a device run all eight."""
_ROUND_TRIPS = [
    pytest.param(dtype, bits, ranks, marks=() if (dtype, bits, ranks) in _DEFAULT_ROUND_TRIPS else pytest.mark.slow,
                 id=f"{str(dtype).removeprefix('torch.')}-{bits}-{ranks}")
    for dtype in (torch.float32, torch.bfloat16) for bits in (1, 4) for ranks in (2, 4)
]


@pytest.mark.parametrize("dtype, bits, ranks", _ROUND_TRIPS)
def test_round_trip_over_ranks(ranks, bits, dtype):
    """compress on every rank -> sum tables, merge indexes -> decode: exact wherever peeling
    settles (up to the float32 table's rounding carried along the peeling chain), the same as
    the reference everywhere.

    At plan density about 1 chunk in 700 of this size keeps a small stopping set (a property
    of the code, not of a back end: the reference leaves the same positions), so the test
    decodes with ``fallback="raw"`` and checks every position outside ``raw_positions`` exactly.
    """
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
        values, stats = dispatch.decode(table[chunk], index, layout, bits, "raw", **TRITON)
        _assert_decodes_equal((values, stats), decode(table[chunk], index, layout, bits, "raw"))
        assert stats.support == int((kept[chunk] != 0).sum()) and stats.peeled + stats.unpeeled == stats.support, stats
        settled = torch.ones(numel, dtype=torch.bool, device=DEVICE)
        if stats.raw_positions is not None:
            settled[stats.raw_positions] = False
        assert int((~settled).sum()) == stats.unpeeled
        # Each peel subtracts values recovered in earlier rounds, so the float32 table's rounding
        # (eps of its largest cell) adds up along the chain: the bound allows two such units per round.
        chain_rounding = 2 * max(stats.rounds, 1) * torch.finfo(torch.float32).eps * table[chunk].abs().max().item()
        torch.testing.assert_close(values.double()[settled], kept[chunk][settled], rtol=0, atol=chain_rounding)


# ---------------------------------------------------------------- coded positions (tagc.sketch.positions)


def _assert_coded_like_reference(mask: torch.Tensor, cap: int, low: int) -> None:
    """Every coded-positions entry point on the Triton path gives the reference's bytes / positions."""
    rows, numel = mask.shape
    index = torch.stack([pack_mask(row, 1) for row in mask])
    if numel % 8:
        index[:, -1] |= (0xFF << (numel % 8)) & 0xFF  # padding bits past numel: not positions
    code = coded.code_index(index, numel, cap, low)
    got = dispatch.code_index(index, numel, cap, low, **TRITON)
    assert got.dtype == torch.uint8 and got.shape == (rows, coded.coded_row_bytes(numel, cap, low))
    assert torch.equal(got, code), "code_index differs from the reference"
    positions, count = coded.positions_from_mask(mask, cap)
    assert torch.equal(dispatch.encode_positions(positions, count, numel, cap, low, **TRITON), code), (
        "encode_positions differs"
    )
    decoded, decoded_count = dispatch.decode_positions(code, numel, cap, low, **TRITON)
    want, want_count = coded.decode_positions(code, numel, cap, low)
    assert torch.equal(decoded, want) and torch.equal(decoded_count, want_count), "decode_positions differs"
    union = dispatch.union_index(code, numel, cap, low, **TRITON)
    assert torch.equal(union, coded.union_index(code, numel, cap, low)), "union_index differs"
    assert torch.equal(index_to_mask(union, numel, 1), coded.mask_from_positions(want, numel).any(dim=0))


def _adversarial_mask(rows: int, numel: int, density: float) -> torch.Tensor:
    """Random rows, then: an empty row, a full first block, a dense (bitmap) block, one entry per block,
    the last position."""
    mask = torch.rand(rows, numel, device=DEVICE) < density
    if rows > 1:
        mask[1] = False
    if rows > 2:
        mask[2, : coded.CODE_BLOCK] = True
        mask[2, coded.CODE_BLOCK: 2 * coded.CODE_BLOCK: 3] = True
    if rows > 3:
        mask[3] = False
        mask[3, :: coded.CODE_BLOCK] = True
        mask[3, -1] = True
    return mask


@pytest.mark.parametrize("rows, numel", spread([1, 2, 3, 4], [1, 4096, 4096 * 2 + 13]))
def test_coded_positions_match_reference(rows, numel):
    """Bit parity on fresh random rows plus adversarial ones, at a random low-part width, with room
    for every entry and with a capacity that truncates the fuller rows (their first cap are coded)."""
    density = float(torch.rand(()).item()) * 0.2
    mask = _adversarial_mask(rows, numel, density)
    low = int(torch.randint(0, coded.MAX_LOW_BITS + 1, ()))
    full = int(mask.sum(1).max())
    for cap in {full, full // 3}:
        _assert_coded_like_reference(mask, cap, low)


@pytest.mark.parametrize("low", [0, 4, 12])
def test_coded_positions_every_block_kind(low):
    """Blocks of every kind in one row: empty, sparse Elias-Fano, exactly at the switch, bitmap, full,
    a partial last."""
    block = coded.CODE_BLOCK
    numel = 6 * block + 1000
    mask = torch.zeros(2, numel, dtype=torch.bool, device=DEVICE)
    switch = (block - (block >> low)) // (low + 1)  # the most entries Elias-Fano still takes (ties go to it)
    mask[0, block: 2 * block: 61] = True
    mask[0, 2 * block: 2 * block + switch] = True
    mask[0, 3 * block: 3 * block + switch + 1] = True
    mask[0, 4 * block: 5 * block] = True
    mask[0, 6 * block:] = True
    mask[1, torch.randperm(numel, device=DEVICE)[: numel // 20]] = True
    _assert_coded_like_reference(mask, int(mask.sum(1).max()), low)
    assert int(coded.bitmap_blocks(dispatch.code_index(torch.stack([pack_mask(r, 1) for r in mask]), numel,
                                                       int(mask.sum(1).max()), low, **TRITON), numel, low)) >= 2


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_coded_union_over_ranks_at_plan_capacity(ranks):
    """The engine's use: each rank codes its thresholded support within capacity(), the owner unions them."""
    numel, density = 3 * coded.CODE_BLOCK + 77, 0.0356
    cap, low = capacity(numel, density), coded.low_bits(density)
    mask = torch.rand(ranks, numel, device=DEVICE) < density * 0.9
    index = torch.stack([pack_mask(r, 1) for r in mask])
    code = dispatch.code_index(index, numel, cap, low, **TRITON)
    assert torch.equal(code, coded.code_index(index, numel, cap, low))
    union = dispatch.union_index(code, numel, cap, low, **TRITON)
    first = coded.mask_from_positions(coded.positions_from_mask(mask, cap)[0], numel)  # rows past cap: their first cap
    assert torch.equal(union, pack_mask(first.any(dim=0), 1))


@pytest.mark.slow
@pytest.mark.parametrize("numel, density", [(70_001, 0.001), (70_001, 0.0356), (70_001, 0.3), (3 * 65_536, 0.0356)])
def test_coded_positions_match_reference_large(numel, density):
    mask = _adversarial_mask(4, numel, density)
    full = int(mask.sum(1).max())
    for low in sorted({0, coded.low_bits(density), 12}):
        for cap in (full, full // 2):
            _assert_coded_like_reference(mask, cap, low)


def test_coded_positions_settings_are_checked():
    with pytest.raises(ValueError, match="bytes"):
        dispatch.union_index(torch.zeros(1, 3, dtype=torch.uint8, device=DEVICE), 10_000, 100, 4, **TRITON)
    with pytest.raises(ValueError, match="uint8"):
        dispatch.code_index(torch.zeros(1, 3, dtype=torch.uint8, device=DEVICE), 10_000, 100, 4, **TRITON)
    with pytest.raises(ValueError, match="low"):
        dispatch.code_index(torch.zeros(1, 1250, dtype=torch.uint8, device=DEVICE), 10_000, 100, 13, **TRITON)


# ---------------------------------------------------------------- topk's kept list (tagc.sketch.kept_list)


def _list_both(grad, residual, density, cap, tau=None):
    res_k, res_r = residual.clone(), residual.clone()
    got = dispatch.list_kept_(grad, res_k, density, cap, tau=tau, **TRITON)
    want = kept_list.list_kept_(grad, res_r, density, cap, tau=tau)
    for name, a, b in zip(("counts", "offsets", "values", "residual"), (*got, res_k), (*want, res_r)):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (
            f"{name} differ from the reference"
        )
    return got


@pytest.mark.parametrize("numel, dtypes, integer",
                         spread([5, 4096 + 13, 65_536 + 1000], ["fp32", "bf16"], [True, False]))
def test_list_kept_matches_reference(numel, dtypes, integer):
    """Counts, offsets, values and residual bit for bit; integer inputs tie massively at the threshold;
    the capacity is the plan's and a third of it (kept entries past it stay in the residual: overflow)."""
    grad_dtype = res_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtypes]
    rows, density = (3 if numel < 65_536 else 1), 0.06
    if integer:
        grad = torch.randint(-3, 4, (rows, numel), device=DEVICE).to(grad_dtype)
        residual = torch.randint(-1, 2, (rows, numel), device=DEVICE).to(res_dtype)
    else:
        grad = torch.randn(rows, numel, device=DEVICE).to(grad_dtype)
        residual = (torch.randn(rows, numel, device=DEVICE) * 0.5).to(res_dtype)
    cap = capacity(numel, density)
    _list_both(grad, residual, density, cap)
    counts, _, _ = _list_both(grad, residual, density, cap // 3)
    assert int(counts[:, -1].sum()) > 0  # the small capacity overflowed


def test_list_kept_explicit_tau_mixed_dtypes_and_nonfinite():
    grad = torch.randn(2, 3000, device=DEVICE).to(torch.bfloat16)
    residual = torch.randn(2, 3000, device=DEVICE)
    _list_both(grad, residual, 0.1, 400, tau=torch.tensor([0.5, 2.0], device=DEVICE, dtype=torch.float64))
    _list_both(grad, residual, 0.1, 400, tau=torch.tensor(1.0, device=DEVICE))  # one threshold for every row
    _list_both(grad, residual, 1.0, 3000)  # density 1: every non-zero entry
    grad[1, 7] = float("inf")  # a non-finite part: lists nothing, values NaN, residual untouched
    counts, offsets, values = _list_both(grad, residual, 0.1, 400)
    assert not counts.any() and not offsets.view(torch.int16).any() and values.isnan().all()  # CUDA: no uint16 any()


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("numel", [1000, 2 * 65_536 + 77])
def test_sum_lists_matches_reference(ranks, numel):
    """Bit for bit, rows added in rank order: shared positions get values whose float32 sum depends on order."""
    density = 0.05
    grad = torch.randn(ranks, numel, device=DEVICE)
    grad[:, :64] = (
        torch.tensor([1e8, 1.0, -1e8, 3.0], device=DEVICE)[torch.arange(ranks, device=DEVICE) % 4, None] * 1e3
    )
    cap = capacity(numel, density)
    counts, offsets, values = kept_list.list_kept_(grad, torch.zeros_like(grad), density, cap)
    got = dispatch.sum_lists(counts, offsets, values, numel, **TRITON)
    assert got.dtype == torch.float32 and got.shape == (numel,)
    assert torch.equal(got, kept_list.sum_lists(counts, offsets, values, numel))
    empty = torch.zeros_like(counts)  # nothing listed: zeros
    assert not dispatch.sum_lists(empty, offsets, values, numel, **TRITON).any()


# ---------------------------------------------------------------- the lean wire end to end


def _codec_exchange(name: str, options: dict, grads: list[torch.Tensor], backend: str, monkeypatch):
    """Every rank's codec encodes its rows, every owner decodes what it receives (no process group):
    ``(wires per rank, outputs per owner, residuals per rank)``."""
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import make_codec
    from tagc.hooks.core.stats import ExchangeStats

    monkeypatch.setenv("TAGC_BACKEND", backend)
    world, numel = grads[0].shape
    codecs = [make_codec(name, TAGCConfig(), options=options) for _ in range(world)]
    wires = [codec.encode(grad.clone(), "part", None) for codec, grad in zip(codecs, grads)]
    outputs = []
    for owner in range(world):
        received = [torch.stack([wire[i][owner] for wire in wires]) for i in range(len(wires[0]))]
        outputs.append(codecs[owner].decode(received, numel, "part", None, ExchangeStats()))
    return wires, outputs, [codec.residuals["part"] for codec in codecs]


@pytest.mark.parametrize("name", ["tagc", "topk"])
def test_lean_wire_codecs_on_the_triton_path(name, monkeypatch):
    """The engine's per-step calls with ``positions="coded"``: every wire tensor is byte-identical to
    the reference back end's (ranks on different back ends interoperate). ``topk`` decodes to the same
    sums bit for bit; ``tagc`` decodes the coded union exactly as its bitmap wire (the same bits)."""
    world, numel = 2, 5000
    grads = [torch.randn(world, numel, device=DEVICE) for _ in range(world)]
    lean = {"positions": "coded", "value_dtype": torch.bfloat16}
    wires, outputs, residuals = _codec_exchange(name, lean, grads, "triton", monkeypatch)
    wires_r, outputs_r, residuals_r = _codec_exchange(name, lean, grads, "torch", monkeypatch)
    for wire, wire_r in zip(wires, wires_r):
        for a, b in zip(wire, wire_r):
            assert a.dtype == b.dtype and torch.equal(a, b), "wire differs from the reference back end's"
    assert all(torch.equal(a, b) for a, b in zip(residuals, residuals_r))
    if name == "topk":
        assert all(torch.equal(a, b) for a, b in zip(outputs, outputs_r))
    else:  # the coded union decodes exactly as the bitmap wire (the same bits: the device decode is deterministic)
        # Against the reference: the same support; values differ at the bfloat16 cells' rounding, as the Numba
        # back end's do (a position owning two pure cells may read either, and the cells disagree by it).
        _, outputs_b, _ = _codec_exchange(name, {"value_dtype": torch.bfloat16}, grads, "triton", monkeypatch)
        for a, b, r in zip(outputs, outputs_b, outputs_r):
            assert torch.equal(a, b) and torch.equal(a != 0, r != 0)


# ---------------------------------------------------------------- torch.library registration


def test_ops_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    layout = _layout(1000)
    t = layout.tables("cpu")
    inverse = ops.sketch_inverse(layout, torch.device("cpu"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        grad, residual = torch.empty(2, 1000), torch.empty(2, 1000)
        assert ops.row_thresholds(residual, grad, 0.1).shape == (2,)
        index, table, held = ops.compress_(
            grad,
            residual,
            torch.empty(2),
            t.rows,
            t.signs,
            t.lane_xor,
            layout.lane_bits,
            layout.table_numel,
            4,
            100,
            110,
            *inverse,
        )
        assert index.shape == (2, 500) and index.dtype == torch.uint8 and table.shape == (2, layout.table_numel)
        assert held.shape == (2,) and held.dtype == torch.int64
        out, state, stats, rest = ops.peel(table[0], index[0], t.rows, t.signs, t.lane_xor, 1000, layout.lane_bits, 4,
                                           0)
        assert out.shape == (1, 1000) and state.dtype == torch.int8 and stats.shape == (1, len(PEEL_STATS))  # a row
        out, _, stats, rest = ops.peel(table, index, t.rows, t.signs, t.lane_xor, 1000, layout.lane_bits, 4, 0)
        assert out.shape == (2, 1000) and stats.shape == (2, len(PEEL_STATS)) and rest.shape == (2, 256)  # per part
        assert rest.dtype == torch.int64


def test_ops_under_torch_compile():
    layout = _layout(1000)
    t = layout.tables(DEVICE)
    inverse = ops.sketch_inverse(layout, torch.device(DEVICE))

    def step(grad, residual):
        tau = torch.ops.tagc.row_thresholds(residual, grad, 0.05)
        return torch.ops.tagc.compress(
            grad,
            residual,
            tau,
            t.rows,
            t.signs,
            t.lane_xor,
            layout.lane_bits,
            layout.table_numel,
            1,
            keep_limit(1000, 0.05),
            capacity(1000, 0.05),
            *inverse,
        )

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    grad = torch.randn(2, 1000, device=DEVICE)
    residual = torch.randn(2, 1000, device=DEVICE)
    (index_r, table_r, held_r), res_ref = _cpu_reference(grad, residual, 0.05, layout, 1, return_held=True)
    index, table, held = compiled(grad, residual)
    assert torch.equal(index, index_r) and torch.equal(residual, res_ref) and torch.equal(held, held_r)
    assert torch.equal(table, table_r)


def test_positions_and_list_ops_fake_and_under_torch_compile():
    """The coded-positions and kept-list ops: fake shapes for tracing, and a compiled graph giving the
    reference's bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    numel, cap, low = 9000, 500, 4
    with FakeTensorMode(allow_non_fake_inputs=True):
        index = torch.empty(2, 1125, dtype=torch.uint8)
        code = torch.ops.tagc.code_index(index, numel, cap, low)
        assert code.shape == (2, coded.coded_row_bytes(numel, cap, low)) and code.dtype == torch.uint8
        assert (
            torch.ops.tagc.encode_positions(
                torch.empty(2, cap, dtype=torch.int64), torch.empty(2, dtype=torch.int64), numel, cap, low
            ).shape
            == code.shape
        )
        positions, count = torch.ops.tagc.decode_positions(code, numel, cap, low)
        assert positions.shape == (2, cap) and count.shape == (2,) and positions.dtype == torch.int64
        assert torch.ops.tagc.union_index(code, numel, cap, low).shape == (1125,)
        counts, offsets, values = torch.ops.tagc.list_kept(
            torch.empty(2, numel), torch.empty(2, numel), torch.empty(2), cap, 400
        )
        assert counts.shape == (2, 2) and offsets.dtype == torch.uint16 and values.shape == (2, cap)
        assert torch.ops.tagc.sum_lists(counts, offsets, values, numel).shape == (numel,)

    def step(index, grad, residual):
        code = torch.ops.tagc.code_index(index, numel, cap, low)
        union = torch.ops.tagc.union_index(code, numel, cap, low)
        lists = ops.list_kept_triton(grad, residual, 0.05, cap)
        return code, union, lists, torch.ops.tagc.sum_lists(*lists, numel)

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    mask = torch.rand(2, numel, device=DEVICE) < 0.04
    index = torch.stack([pack_mask(r, 1) for r in mask])
    grad, residual = torch.randn(2, numel, device=DEVICE), torch.randn(2, numel, device=DEVICE)
    res_ref = residual.clone()
    code, union, lists, summed = compiled(index, grad, residual)
    want = kept_list.list_kept_(grad, res_ref, 0.05, cap)
    assert torch.equal(code, coded.code_index(index, numel, cap, low))
    assert torch.equal(union, coded.union_index(code, numel, cap, low))
    assert all(torch.equal(a, b) for a, b in zip(lists, want)) and torch.equal(residual, res_ref)
    assert torch.equal(summed, kept_list.sum_lists(*want, numel))


# ---------------------------------------------------------------- GPU code generation

_BUILD_KERNELS = textwrap.dedent(
    r"""
    import os, re, sys
    os.environ["TRITON_INTERPRET"] = "0"
    import triton
    from triton.backends.compiler import GPUTarget
    from tagc.kernels import compress, kept_list, peel, positions, radix_select

    MODE = sys.argv[1]  # "plain": every kernel as launched; "ones": every integer argument 1; "atomics": float atomics
    float_atomics = []

    def build(fn, sig, consts):
        variants = [(sig, consts)]
        if MODE == "ones":  # compiled Triton turns an integer argument equal to 1 into a constexpr
            ones = {name: 1 for name, kind in sig.items() if kind in ("i32", "i64")}
            variants = [({k: v for k, v in sig.items() if k not in ones}, {**consts, **ones})]
        for sig, consts in variants:
            full = {**sig, **{k: "constexpr" for k in consts}}
            kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=full, constexprs=consts),
                                    target=GPUTarget("cuda", 90, 32))
            if re.search(r"atomic_rmw\s+fadd", kernel.asm["ttir"]):
                float_atomics.append(fn.__name__)

    def sketch_and_decode():
        for grad in ("*fp32", "*bf16"):
            for bits in (1, 4):
                build(
                    compress._count_kernel,
                    dict(grad_ptr=grad, res_ptr="*fp32", tau_ptr="*fp32", counts_ptr="*i32", numel="i32"),
                    dict(BITS=bits, BLOCK=1024),
                )
                build(
                    compress._compress_kernel,
                    dict(
                        grad_ptr=grad,
                        res_ptr="*fp32",
                        tau_ptr="*fp32",
                        index_ptr="*u8",
                        sent_ptr="*fp32",
                        above_before_ptr="*i32",
                        ties_before_ptr="*i32",
                        room_ptr="*i32",
                        cap="i32",
                        numel="i32",
                        nbytes="i32",
                    ),
                    dict(BITS=bits, BLOCK=1024),
                )
        for lane_bits, rows in ((10, 2), (0, 2048)):
            build(
                compress._table_kernel,
                dict(
                    sent_ptr="*fp32",
                    table_ptr="*fp32",
                    by_row_ptr="*i64",
                    row_start_ptr="*i64",
                    signs_ptr="*fp32",
                    xor_ptr="*i64",
                    numel="i32",
                    table_numel="i32",
                    table_rows="i32",
                ),
                dict(LANE_BITS=lane_bits, ROWS=rows),
            )
        for bits, lane_bits, bb in ((1, 10, 4), (4, 0, 4096)):
            build(
                peel._setup_kernel,
                dict(
                    index_ptr="*u8",
                    state_ptr="*i8",
                    counts_ptr="*i32",
                    per_column_ptr="*i32",
                    rows_ptr="*i64",
                    xor_ptr="*i64",
                    numel="i32",
                    blocks="i32",
                    index_bytes="i32",
                    table_numel="i32",
                ),
                dict(LANE_BITS=lane_bits, BITS=bits, BB=bb),
            )
            build(
                peel._list_kernel,
                dict(state_ptr="*i8", first_ptr="*i32", list_ptr="*i32", xor_ptr="*i64", numel="i32", blocks="i32"),
                dict(LANE_BITS=lane_bits, BB=bb),
            )
        build(
            peel._check_kernel,
            dict(work_ptr="*fp64", counts_ptr="*i32", stats_ptr="*i64", table_numel="i32"),
            dict(INCONSISTENT=7, STATS=10, BLOCK=1024),
        )
        for fallback, lane_bits in ((0, 10), (1, 0), (2, 4)):
            build(
                peel._peel_kernel,
                dict(
                    work_ptr="*fp64",
                    counts_ptr="*i32",
                    owner_ptr="*i32",
                    out_ptr="*fp32",
                    state_ptr="*i8",
                    stats_ptr="*i64",
                    list_ptr="*i32",
                    support_ptr="*i32",
                    stuck_ptr="*i64",
                    rows_ptr="*i64",
                    signs_ptr="*fp32",
                    xor_ptr="*i64",
                    blocks="i32",
                    numel="i32",
                    table_numel="i32",
                ),
                dict(LANE_BITS=lane_bits, TILE=1024, FALLBACK=fallback, STUCK_CAP=256, STATS=10),
            )
            build(
                peel._solve_kernel,
                dict(
                    work_ptr="*fp64",
                    stuck_ptr="*i64",
                    system_ptr="*fp64",
                    rhs_ptr="*fp64",
                    out_ptr="*fp32",
                    state_ptr="*i8",
                    stats_ptr="*i64",
                    rest_ptr="*i64",
                    rows_ptr="*i64",
                    signs_ptr="*fp32",
                    xor_ptr="*i64",
                    numel="i32",
                    table_numel="i32",
                ),
                dict(LANE_BITS=lane_bits, M=256, ROWS=16, FALLBACK=fallback, TOL=3e-9, STATS=10),
            )

    def the_others():
        for grad in ("*fp32", "*bf16"):
            for p in (0, 1):
                build(
                    radix_select._radix_hist_kernel,
                    dict(
                        res_ptr="*fp32",
                        grad_ptr=grad,
                        hist_ptr="*i32",
                        prefix_ptr="*i32",
                        numel="i32",
                        size="i32",
                        stride="i32",
                    ),
                    dict(HAS_GRAD=True, SAMPLED=p == 1, PASS=p, BLOCK=1024),
                )
        build(
            positions._count_kernel,
            dict(index_ptr="*u8", counts_ptr="*i32", numel="i32", stride="i32", blocks="i32"),
            {},
        )
        for low, union in ((0, False), (4, True)):  # both sides of the LOW > 0 branch, both outputs
            build(
                positions._code_bitmap_kernel,
                dict(
                    index_ptr="*u8",
                    m_ptr="*i64",
                    start_ptr="*i64",
                    body_ptr="*i32",
                    numel="i32",
                    stride="i32",
                    blocks="i32",
                    body_words="i32",
                ),
                dict(LOW=low, B_BITS=12),
            )
            build(
                positions._decode_kernel,
                dict(
                    code_ptr="*u8",
                    m_ptr="*i64",
                    first_ptr="*i64",
                    start_ptr="*i64",
                    out_ptr="*i32" if union else "*i64",
                    numel="i32",
                    cap="i32",
                    blocks="i32",
                    row_bytes="i32",
                    parts="i32",
                    out_words="i32",
                ),
                dict(LOW=low, B_BITS=12, UNION=union),
            )
        build(
            positions._code_list_kernel,
            dict(
                pos_ptr="*i64",
                m_ptr="*i64",
                first_ptr="*i64",
                start_ptr="*i64",
                body_ptr="*i32",
                cap="i32",
                blocks="i32",
                body_words="i32",
            ),
            dict(LOW=4, B_BITS=12, TILE=1024),
        )
        build(
            kept_list._list_count_kernel,
            dict(grad_ptr="*fp32", res_ptr="*fp32", tau_ptr="*fp32", counts_ptr="*i32", numel="i32"),
            dict(BLOCK=1024),
        )
        build(
            kept_list._list_write_kernel,
            dict(
                grad_ptr="*bf16",
                res_ptr="*bf16",
                tau_ptr="*fp32",
                ties_before_ptr="*i64",
                room_ptr="*i64",
                kept_before_ptr="*i64",
                ok_ptr="*i32",
                offsets_ptr="*u16",
                values_ptr="*fp32",
                numel="i32",
                cap="i32",
            ),
            dict(BLOCK=1024, POSITION_BLOCK=65536),
        )
        build(
            kept_list._sum_lists_kernel,
            dict(
                counts_ptr="*i32",
                offsets_ptr="*u16",
                values_ptr="*fp32",
                first_ptr="*i64",
                out_ptr="*fp32",
                numel="i32",
                cap="i32",
            ),
            dict(TILE=1024, POSITION_BLOCK=65536),
        )


    sketch_and_decode()
    if MODE != "atomics":
        the_others()
    print("FLOAT ATOMICS:", ",".join(sorted(set(float_atomics))) or "none")
    print("OK")
    """
)


def _build_for_sm90(mode: str) -> str:
    """Compile the kernels to cubins for sm_90 in a subprocess (no GPU needed); its output."""
    if "nvidia" not in __import__("triton.backends", fromlist=["backends"]).backends:
        pytest.skip("triton has no CUDA back end here")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run([sys.executable, "-c", _BUILD_KERNELS, mode], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
    return result.stdout


def test_kernels_compile_for_sm90():
    """Without a GPU, still compile every kernel to a cubin for sm_90 (catches GPU-only errors)."""
    _build_for_sm90("plain")


@pytest.mark.slow  # about 11 s: a second full build; the default suite keeps the plain one
def test_kernels_compile_for_sm90_with_integer_arguments_equal_to_one():
    """Compiled Triton specialises an integer argument equal to 1 into a constexpr (the interpreter never
    does): ``blocks.to(...)`` on one fails to compile. Every kernel, every integer argument 1."""
    _build_for_sm90("ones")


def test_sketch_and_decode_kernels_have_no_float_atomics():
    """Float atomics sum in the order the hardware applies them, which changes from run to run: the
    compress, peel and solve kernels hold none, so tables and decoded values are the same bits on every
    run (HSDP replicas decode identically whatever ``torch.use_deterministic_algorithms`` says)."""
    assert "FLOAT ATOMICS: none" in _build_for_sm90("atomics")
