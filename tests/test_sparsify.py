import math
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tagc.sketch
from tagc.sketch import sparsify as sparsify_module
from tagc.sketch import split_kept, threshold


@given(
    numel=st.integers(1, 5000), density=st.floats(0.0, 1.0), scale=st.floats(1e-6, 1e3), seed=st.integers(0, 2**31 - 1)
)
@settings(max_examples=60, deadline=None)
def test_kept_plus_residual_is_exactly_the_input(numel, density, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * scale
    kept, residual = split_kept(x, density)
    assert torch.equal(kept + residual, x)
    assert not ((kept != 0) & (residual != 0)).any()
    if (kept != 0).any() and (residual != 0).any():
        assert kept.abs()[kept != 0].min() >= residual.abs().max()


@pytest.mark.parametrize("numel", [65536, 300_007, 4 << 20])
@pytest.mark.parametrize("density", [0.01, 0.04, 0.2])
@pytest.mark.parametrize("dist", ["normal", "lognormal", "heavy_columns"])
def test_kept_fraction_within_ten_percent(numel, density, dist):
    x = torch.randn(numel)
    if dist == "lognormal":
        x = torch.randn(numel).exp() * torch.randn(numel).sign()
    elif dist == "heavy_columns":  # a weight gradient whose 7th column dominates
        x = torch.randn(numel)
        x[7::768] *= 50
    kept, _ = split_kept(x, density)
    fraction = (kept != 0).float().mean().item()
    assert abs(fraction - density) <= 0.1 * density, fraction


@pytest.mark.parametrize("numel", [1, 2, 6, 117_177, 294_912, 768 * 3072 // 2, 65_537])
def test_the_sample_holds_distinct_positions(numel):
    """The stride is coprime with the row: a stride sharing a factor with it cycles through a
    fraction of the positions (117,177 shares 139 with 0.618 * 117,177 rounded up to odd)."""
    stride = sparsify_module.sample_stride(numel)
    assert math.gcd(stride, numel) == 1
    positions = sparsify_module.sample_positions(numel, numel, torch.device("cpu"))
    assert torch.equal(positions.sort().values, torch.arange(numel))


@pytest.mark.parametrize("numel", [117_177, 294_912])
def test_kept_fraction_on_gradients_periodic_in_a_factor_of_the_row(numel):
    """Every third (or 139th) entry large: a sample confined to one residue class would see
    only large entries (294,912 = 768 x 384 once sampled positions 0 mod 3 only)."""
    density = 0.05
    for period in (3, 139):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(period))
        x[::period] *= 50
        kept, _ = split_kept(x, density)
        fraction = (kept != 0).float().mean().item()
        assert abs(fraction - density) <= 0.1 * density, (period, fraction)


def test_bf16_and_shapes_are_kept():
    x = torch.randn(64, 1000, dtype=torch.bfloat16)
    kept, residual = split_kept(x, 0.1)
    assert kept.dtype == torch.bfloat16 and kept.shape == x.shape
    assert torch.equal(kept + residual, x)


def test_threshold_stays_a_tensor():
    tau = threshold(torch.randn(100_000), 0.05)
    assert isinstance(tau, torch.Tensor) and tau.dim() == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_a_clear_error(bad):
    x = torch.randn(1000)
    x[17] = bad
    with pytest.raises(ValueError, match="NaN|Inf"):
        split_kept(x, 0.1)


def test_bad_density():
    with pytest.raises(ValueError, match="density"):
        split_kept(torch.randn(10), 1.5)


def test_tagc_sketch_sparsify_is_the_module():
    """``from tagc.sketch import sparsify`` and ``import tagc.sketch.sparsify`` give the module (no
    function shadows it); the split is :func:`split_kept`."""
    import tagc.sketch.sparsify as imported

    assert isinstance(sparsify_module, types.ModuleType) and sparsify_module is imported is tagc.sketch.sparsify
    assert "split_kept" in tagc.sketch.__all__ and "sparsify" not in tagc.sketch.__all__
