"""Round trips of the reference codec: encode on every simulated rank, sum, decode."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tagc.sketch import (
    PEELING_THRESHOLD,
    SketchLayout,
    build_index,
    compress_,
    decode,
    encode,
    merge_index,
    plan_density,
    split_kept,
)


def simulate_ranks(layout, ranks, density, bits, dtype=torch.float32, gen=None):
    """Each rank's random sparse chunk (drawn from ``gen``, so a failure replays); returns
    (summed table, merged index, exact sum, union of the ranks' supports)."""
    table = torch.zeros(layout.table_numel)
    index = None
    exact = torch.zeros(layout.numel, dtype=torch.float64)
    union = torch.zeros(layout.numel, dtype=torch.bool)
    for _ in range(ranks):
        mask = torch.rand(layout.numel, generator=gen) < density
        values = (torch.randn(layout.numel, generator=gen) * mask).to(dtype)
        exact += values.double()
        union |= values != 0
        table += encode(values, layout)
        own = build_index(values, bits)
        index = own if index is None else merge_index(index, own, bits)
    return table, index, exact, union


def relative_error(decoded, exact):
    return ((decoded.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


LOSSLESS_SIZES = [1, 7, 20, 65_536, 200_003, 1 << 20, 1_000_003]


@pytest.mark.parametrize("numel", LOSSLESS_SIZES)
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("bits", [1, 4])
def test_lossless_at_planned_density(numel, ranks, bits):
    ratio = 10
    gen = torch.Generator().manual_seed(1000 * numel + 10 * ranks + bits)  # a failure replays
    layout = SketchLayout(numel, ratio, seed=int(torch.randint(0, 2**31, (), generator=gen)))
    table, index, exact, union = simulate_ranks(layout, ranks, plan_density(ratio, ranks), bits, gen=gen)
    decoded, stats = decode(table, index, layout, bits, fallback="error")
    assert stats.support == int(union.sum())  # the merged index is exactly the union of the ranks' supports
    assert stats.unpeeled == 0 and stats.peeled == stats.support
    assert relative_error(decoded, exact) <= 1e-6
    assert (decoded[~union] == 0).all()  # nothing off the support
    assert torch.equal(decoded != 0, exact != 0)  # continuous values: no exact cancellation in these draws


@pytest.mark.parametrize("ratio", [2, 5, 32])
def test_lossless_at_other_ratios(ratio):
    layout = SketchLayout(300_000, ratio)
    gen = torch.Generator().manual_seed(ratio)
    table, index, exact, _ = simulate_ranks(layout, 2, plan_density(ratio, 2), 1, gen=gen)
    decoded, stats = decode(table, index, layout, 1, fallback="error")
    assert stats.unpeeled == 0 and relative_error(decoded, exact) <= 1e-6


def test_tiny_chunks_decode_any_support():
    """Chunks clamped to 3 rows keep <= 3 blocks with independent signs: even a full support decodes."""
    gen = torch.Generator().manual_seed(2)
    for numel in range(1, 31):
        layout = SketchLayout(numel, 10)
        values = torch.randn(numel, generator=gen)
        decoded, stats = decode(encode(values, layout), build_index(values, 1), layout, 1, fallback="error")
        assert stats.unpeeled == 0
        assert relative_error(decoded, values.double()) <= 1e-6


def test_bf16_values_round_trip():
    layout = SketchLayout(100_000, 10)
    table, index, exact, _ = simulate_ranks(layout, 2, plan_density(10, 2), 1, dtype=torch.bfloat16,
                                            gen=torch.Generator().manual_seed(7))
    decoded, stats = decode(table, index, layout, 1)
    assert stats.unpeeled == 0 and relative_error(decoded, exact) <= 1e-6


def test_encode_is_linear():
    layout = SketchLayout(50_000, 10)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(50_000, generator=gen) * (torch.rand(50_000, generator=gen) < 0.1)
    b = torch.randn(50_000, generator=gen) * (torch.rand(50_000, generator=gen) < 0.1)
    assert torch.allclose(encode(a, layout) + encode(b, layout), encode(a + b, layout), atol=1e-5)


@pytest.mark.parametrize("fallback", ["estimate", "raw", "error"])
def test_above_threshold_degrades_as_the_policy_says(fallback):
    layout = SketchLayout(100_000, 10)
    load = 1.1 * PEELING_THRESHOLD
    density = load * layout.table_numel / layout.numel
    gen = torch.Generator().manual_seed(4)
    values = torch.randn(layout.numel, generator=gen) * (torch.rand(layout.numel, generator=gen) < density)
    table, index = encode(values, layout), build_index(values, 1)
    if fallback == "error":
        with pytest.raises(RuntimeError, match="could not recover"):
            decode(table, index, layout, 1, fallback=fallback)
        return
    decoded, stats = decode(table, index, layout, 1, fallback=fallback)
    assert stats.unpeeled > 0 and stats.peeled + stats.unpeeled == stats.support
    exact = (decoded - values).abs() <= 1e-5 * values.abs().max()
    assert int(exact[values != 0].sum()) >= stats.peeled  # every recovered position is exact
    if fallback == "estimate":
        assert stats.estimated == stats.unpeeled and stats.raw == 0
    else:
        assert stats.raw == stats.unpeeled and stats.raw_positions.numel() == stats.raw
        assert (decoded[stats.raw_positions] == 0).all()
        assert (values[stats.raw_positions] != 0).all()
        fixed = decoded.clone()
        fixed[stats.raw_positions] = values[stats.raw_positions]  # the re-send completes it
        assert relative_error(fixed, values.double()) <= 1e-6


def test_stopping_set_is_solved_exactly():
    """Two positions on the same three cells (a 2-element stopping set) with different signs."""
    layout = SketchLayout(31, 10, lane=1)  # 4 rows: many blocks share all their cells
    rows, signs = layout.block_rows, layout.block_signs
    same = [
        (i, j)
        for i in range(31)
        for j in range(i + 1, 31)
        if torch.equal(rows[i], rows[j])
        and not torch.equal(signs[i], signs[j])
        and not torch.equal(signs[i], -signs[j])
    ]
    assert same, "layout has no such pair"
    i, j = same[0]
    values = torch.zeros(31)
    values[i], values[j] = 1.5, -2.25
    decoded, stats = decode(encode(values, layout), build_index(values, 1), layout, 1, fallback="error")
    assert stats.solved == 2 and stats.unpeeled == 0
    assert torch.allclose(decoded, values, atol=1e-6)


@given(
    numel=st.integers(1, 20_000),
    ratio=st.sampled_from([2.0, 3.5, 10.0, 50.0]),
    load=st.floats(0.0, 1.5),
    seed=st.integers(0, 2**32 - 1),
    bits=st.sampled_from([1, 4]),
)
@settings(max_examples=40, deadline=None)
def test_decode_properties(numel, ratio, load, seed, bits):
    """Whatever the load: every exact position is exact, stats add up, nothing lands off-support."""
    layout = SketchLayout(numel, ratio, seed=seed)
    density = min(1.0, load * layout.table_numel / layout.numel)
    gen = torch.Generator().manual_seed(seed)  # hypothesis replays the seed, and so the values
    values = torch.randn(numel, generator=gen) * (torch.rand(numel, generator=gen) < density)
    decoded, stats = decode(encode(values, layout), build_index(values, bits), layout, bits, fallback="raw")
    support = values != 0
    assert stats.support == int(support.sum())
    assert stats.peeled + stats.unpeeled == stats.support and stats.raw == stats.unpeeled
    assert (decoded[~support] == 0).all()
    raw = torch.zeros(numel, dtype=torch.bool)
    if stats.raw_positions is not None:
        raw[stats.raw_positions] = True
    scale = values.abs().max().clamp_min(1e-30) * math.sqrt(max(1, stats.support))
    assert ((decoded - values)[support & ~raw].abs() <= 1e-5 * scale).all()


def test_compress_equals_sparsify_index_encode():
    layout = SketchLayout(100_003, 10)
    gen = torch.Generator().manual_seed(5)
    grad, residual = torch.randn(3, 100_003, generator=gen), torch.randn(3, 100_003, generator=gen) * 0.1
    accum = grad + residual
    index, table = compress_(grad, residual, 0.05, layout, 1)
    for chunk in range(3):
        kept, rest = split_kept(accum[chunk], 0.05)
        assert torch.equal(residual[chunk], rest)
        assert torch.equal(index[chunk], build_index(kept, 1))
        assert torch.allclose(table[chunk], encode(kept, layout), atol=1e-6)


def test_non_finite_and_mismatched_inputs_are_clear_errors():
    layout = SketchLayout(1000, 10)
    bad = torch.randn(1000, generator=torch.Generator().manual_seed(6))
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        encode(bad, layout)
    with pytest.raises(ValueError, match="elements"):
        encode(torch.randn(999), layout)
    table = torch.zeros(layout.table_numel)
    table[0] = float("inf")
    with pytest.raises(ValueError, match="Inf"):
        decode(table, build_index(torch.zeros(1000), 1), layout, 1)
    with pytest.raises(ValueError, match="fallback"):
        decode(torch.zeros(layout.table_numel), build_index(torch.zeros(1000), 1), layout, 1, fallback="guess")
