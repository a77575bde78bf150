import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tagc.sketch import build_index, index_nbytes, index_to_mask, merge_index, unpack_counts


@given(numel=st.integers(1, 300), ranks=st.integers(1, 6), density=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=60, deadline=None)
def test_one_bit_merge_is_exact_or(numel, ranks, density, seed):
    gen = torch.Generator().manual_seed(seed)
    masks = [torch.rand(numel, generator=gen) < density for _ in range(ranks)]
    merged = build_index(masks[0].float(), 1)
    for m in masks[1:]:
        merged = merge_index(merged, build_index(m.float(), 1), 1)
    assert merged.numel() == index_nbytes(numel, 1)
    expected = torch.stack(masks).any(0)
    assert torch.equal(index_to_mask(merged, numel, 1), expected)


@given(numel=st.integers(1, 300), ranks=st.integers(1, 15), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_four_bit_merge_counts_ranks(numel, ranks, seed):
    gen = torch.Generator().manual_seed(seed)
    masks = [torch.rand(numel, generator=gen) < 0.5 for _ in range(ranks)]
    merged = build_index(masks[0].float(), 4)
    for m in masks[1:]:
        merged = merge_index(merged, build_index(m.float(), 4), 4)
    assert torch.equal(unpack_counts(merged, numel, 4).long(), torch.stack(masks).long().sum(0))


def test_four_bit_overflow_raises():
    ones = build_index(torch.ones(9), 4)
    merged = ones
    for _ in range(14):
        merged = merge_index(merged, ones, 4)
    assert unpack_counts(merged, 9, 4).tolist() == [15] * 9
    with pytest.raises(OverflowError, match="15 ranks"):
        merge_index(merged, ones, 4)


def test_summing_packed_bits_would_corrupt_but_or_does_not():
    a = build_index(torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]), 1)
    assert torch.equal(merge_index(a, a, 1), a)
    assert not torch.equal(a + a, a)  # the original TAGC's sum carries into bit 1


def test_bit_order_is_little_endian_within_a_byte():
    index = build_index(torch.tensor([0.0, 2.0, 0, 0, 0, 0, 0, 0, -1.0]), 1)
    assert index.tolist() == [0b10, 0b1]
    assert build_index(torch.tensor([3.0, 0, 0]), 4).tolist() == [0x01, 0x00]


def test_index_shape_is_checked():
    with pytest.raises(ValueError, match="bytes"):
        index_to_mask(torch.zeros(3, dtype=torch.uint8), 100, 1)
    with pytest.raises(ValueError, match="uint8"):
        index_to_mask(torch.zeros(13, dtype=torch.int32), 100, 1)
    with pytest.raises(ValueError, match="bits"):
        build_index(torch.ones(4), 2)


@given(
    numel=st.integers(1, 500), density=st.floats(0.0, 1.0), bits=st.sampled_from([1, 4]), seed=st.integers(0, 2**31 - 1)
)
@settings(max_examples=60, deadline=None)
def test_index_positions_are_the_support(numel, density, bits, seed):
    from tagc.sketch import index_positions

    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen) * (torch.rand(numel, generator=gen) < density)
    expected = (values != 0).nonzero().squeeze(1)
    assert torch.equal(index_positions(build_index(values, bits), numel, bits), expected)
