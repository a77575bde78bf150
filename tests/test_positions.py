"""Coded positions (tagc.sketch.positions): exact round trips, fixed sizes, and bit parity of the CPU kernels."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tagc.kernels import dispatch
from tagc.kernels.cpu import numba_available
from tagc.sketch import positions as ref
from tagc.sketch.index import index_to_mask, pack_mask
from tagc.sketch.kept_list import capacity

BACKENDS = ["torch"] + (["numba"] if numba_available() else [])


def _mask(rows: int, numel: int, density: float, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(rows, numel, generator=gen) < density


def _round_trip(mask: torch.Tensor, cap: int, low: int, backend: str) -> torch.Tensor:
    rows, numel = mask.shape
    positions, count = ref.positions_from_mask(mask, cap)
    code = dispatch.encode_positions(positions, count, numel, cap, low, backend=backend)
    assert code.shape == (rows, ref.coded_row_bytes(numel, cap, low))  # fixed by the settings alone
    decoded, decoded_count = dispatch.decode_positions(code, numel, cap, low, backend=backend)
    assert torch.equal(decoded_count, count)
    assert torch.equal(decoded, torch.where(torch.arange(cap) < count[:, None], positions, numel))
    return code


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("density", [0.0, 0.001, 0.0356, 0.1, 0.3, 0.7, 1.0])
@pytest.mark.parametrize("numel", [1, 4095, 4096, 4097, 70_001])
def test_round_trip_is_exact_at_every_density(backend, density, numel):
    gen = torch.Generator().manual_seed(numel + int(density * 1000))
    mask = _mask(3, numel, density, gen)
    mask[1] = False  # an empty row
    mask[2, : min(numel, 5000)] = True  # a full (bitmap) block
    cap = numel
    low = ref.low_bits(max(density, 1e-3))
    _round_trip(mask, cap, low, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cap_bounds_the_code_wherever_the_entries_fall(backend):
    """cap entries fit in coded_row_bytes whether spread evenly, packed in one block or spread one per block."""
    numel, density = 65_536 * 2, 0.0356
    cap, low = capacity(numel, density), ref.low_bits(density)
    even = torch.zeros(1, numel, dtype=torch.bool)
    even[0, torch.linspace(0, numel - 1, cap).long()] = True
    packed = torch.zeros(1, numel, dtype=torch.bool)
    packed[0, :cap] = True
    one_per_block = torch.zeros(1, numel, dtype=torch.bool)
    one_per_block[0, :: ref.CODE_BLOCK] = True
    for mask in (even, packed, one_per_block):
        _round_trip(mask, cap, low, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitmap_fallback_is_counted(backend):
    numel, low = 3 * ref.CODE_BLOCK, ref.low_bits(0.03)
    mask = torch.zeros(2, numel, dtype=torch.bool)
    mask[0, : ref.CODE_BLOCK // 2] = True  # dense: m (l + 1) + B / 2**l > B
    mask[1, ref.CODE_BLOCK:: 97] = True  # sparse
    code = _round_trip(mask, numel, low, backend)
    assert int(ref.bitmap_blocks(code, numel, low)) == 1


@pytest.mark.parametrize("density", [0.01, 0.0356, 0.1])
def test_cost_is_near_the_entropy(density):
    numel = 1 << 20
    gen = torch.Generator().manual_seed(5)
    mask = _mask(1, numel, density, gen)
    low = ref.low_bits(density)
    positions, count = ref.positions_from_mask(mask, numel)
    code = ref.encode_positions(positions, count, numel, numel, low)
    used_bits = 16 * ref.code_blocks(numel) + int(ref.block_sizes(ref._header(code, numel), low)[0].sum())
    entropy = -(density * math.log2(density) + (1 - density) * math.log2(1 - density))
    assert used_bits / numel <= 1.2 * entropy + 0.02, (used_bits / numel, entropy)
    assert density * (low + 1) + 2.0 ** -low <= 1.2 * entropy + 0.01


@settings(max_examples=40, deadline=None)
@given(numel=st.integers(1, 20_000), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1),
       rows=st.integers(1, 4), low=st.integers(0, 12))
def test_numba_matches_the_reference_bit_for_bit(numel, density, seed, rows, low):
    if not numba_available():
        pytest.skip("numba not installed")
    gen = torch.Generator().manual_seed(seed)
    mask = _mask(rows, numel, density, gen)
    cap = int(mask.sum(1).max()) + int(torch.randint(0, 5, (), generator=gen))
    cap = min(cap, numel)
    positions, count = ref.positions_from_mask(mask, cap)
    code = ref.encode_positions(positions, count, numel, cap, low)
    assert torch.equal(dispatch.encode_positions(positions, count, numel, cap, low, backend="numba"), code)
    index = torch.stack([pack_mask(row, 1) for row in mask])
    assert torch.equal(dispatch.code_index(index, numel, cap, low, backend="numba"), code)
    assert torch.equal(ref.code_index(index, numel, cap, low), code)
    for backend in ("torch", "numba"):
        decoded, decoded_count = dispatch.decode_positions(code, numel, cap, low, backend=backend)
        assert torch.equal(decoded_count, count)
        union = dispatch.union_index(code, numel, cap, low, backend=backend)
        assert torch.equal(index_to_mask(union, numel, 1), mask.any(dim=0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_code_index_codes_the_first_cap_of_a_fuller_row(backend):
    """A row with more than cap set bits codes its first cap (the reference's rule), on every back end;
    padding bits past numel in the last byte are not positions."""
    numel, low = 3 * ref.CODE_BLOCK + 5, 4
    mask = torch.rand(3, numel, generator=torch.Generator().manual_seed(3)) < 0.1
    cap = int(mask.sum(1).min()) // 2
    index = torch.stack([pack_mask(row, 1) for row in mask])
    index[:, -1] |= 0xE0  # bits 5..7 of the last byte: past numel
    want = ref.code_index(index, numel, cap, low)
    assert torch.equal(dispatch.code_index(index, numel, cap, low, backend=backend), want)
    positions, count = dispatch.decode_positions(want, numel, cap, low, backend=backend)
    assert torch.equal(count, torch.full((3,), cap)) and torch.equal(positions, ref.positions_from_mask(mask, cap)[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3, 4, 8, 16])
def test_union_over_ranks_is_the_or_of_their_supports(backend, world):
    numel, density = 50_000, 0.0356
    gen = torch.Generator().manual_seed(world)
    masks = _mask(world, numel, density, gen)
    cap, low = int(masks.sum(1).max()), ref.low_bits(density)  # random masks are not thresholded: no capacity() bound
    index = torch.stack([pack_mask(row, 1) for row in masks])
    code = dispatch.code_index(index, numel, cap, low, backend=backend)
    union = dispatch.union_index(code, numel, cap, low, backend=backend)
    assert torch.equal(union, pack_mask(masks.any(dim=0), 1))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="density"):
        ref.low_bits(0.0)
    with pytest.raises(ValueError, match="bytes"):
        ref.decode_positions(torch.zeros(1, 3, dtype=torch.uint8), 10_000, 100, 4)
    with pytest.raises(ValueError, match="uint8"):
        ref.decode_positions(torch.zeros(1, 3), 10_000, 100, 4)
