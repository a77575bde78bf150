import math

import pytest
import torch

from tagc.sketch import SketchLayout, choose_lane
from tagc.sketch.hashing import hash32, permute
from tagc.sketch.layout import TARGET_ROWS_PER_LANE


def test_hash_golden_values():
    """The hash is part of the wire format: these bits must never change."""
    assert hash32(torch.arange(4), 0, 0).tolist() == [4103141277, 1091838452, 2210009421, 2000917787]
    assert hash32(torch.tensor([123456789]), 7, 3).tolist() == [951563862]
    layout = SketchLayout(1 << 20, 10, seed=42)
    assert layout.block_rows[[0, 1, 1000]].tolist() == [[2040, 4122, 4648], [46, 3441, 6533], [418, 2939, 4992]]
    assert layout.block_lane_xor[[0, 1, 1000]].tolist() == [14, 0, 5]


@pytest.mark.parametrize("numel", [1, 2, 5, 20, 31, 100, 4097, 65536, 1_000_003, 1 << 22])
@pytest.mark.parametrize("ratio", [2, 10, 32])
def test_geometry(numel, ratio):
    layout = SketchLayout(numel, ratio)
    assert layout.blocks == math.ceil(numel / layout.lanes)
    assert layout.rows == max(3, math.ceil(layout.blocks / ratio))
    assert layout.table_numel == layout.rows * layout.lanes
    rows = layout.block_rows
    assert rows.shape == (layout.blocks, 3)
    assert (rows[:, 0] != rows[:, 1]).all() and (rows[:, 1] != rows[:, 2]).all() and (rows[:, 0] != rows[:, 2]).all()
    assert rows.min() >= 0 and rows.max() < layout.rows
    assert set(layout.block_signs.unique().tolist()) <= {-1.0, 1.0}
    assert (layout.block_lane_xor < layout.lanes).all()


def test_lane_choice_keeps_thousands_of_rows_or_at_most_three_blocks():
    for numel in [10, 1000, 50_000, 1 << 20, 16 << 20, 64 << 20]:
        layout = SketchLayout(numel, 10)
        if math.ceil(numel / 10) <= 3:
            assert layout.blocks <= 3
        elif layout.lanes > 1:
            assert layout.rows >= TARGET_ROWS_PER_LANE
        assert layout.lanes == choose_lane(numel, 10)
    assert SketchLayout(16 << 20, 10).lanes == 256  # 6554 rows per lane, not 1638 at 1024


def test_first_two_rows_are_injective_when_possible():
    layout = SketchLayout(1_000_003, 10, seed=5)
    assert layout.injective
    rows = layout.block_rows
    pair = rows[:, 0] * layout.rows + rows[:, 1]
    assert pair.unique().numel() == layout.blocks


def test_permute_is_a_bijection():
    for domain in [1, 7, 1000, 4097]:
        out = permute(torch.arange(domain), domain, seed=3, stream=1)
        assert sorted(out.tolist()) == list(range(domain))


def test_cells_are_within_one_column():
    layout = SketchLayout(100_000, 10, seed=1)
    positions = torch.randint(0, layout.numel, (1000,))
    cells, signs = layout.cells(positions)
    assert (cells % layout.lanes == cells[:, :1] % layout.lanes).all()
    assert cells.max() < layout.table_numel


def test_seed_changes_layout_and_same_seed_repeats():
    a, b, c = SketchLayout(1 << 16, 10, seed=1), SketchLayout(1 << 16, 10, seed=1), SketchLayout(1 << 16, 10, seed=2)
    assert torch.equal(a.block_rows, b.block_rows) and torch.equal(a.block_signs, b.block_signs)
    assert not torch.equal(a.block_rows, c.block_rows)


@pytest.mark.parametrize(
    "kwargs", [{"numel": 0, "ratio": 10}, {"numel": 10, "ratio": 1}, {"numel": 10, "ratio": 10, "lane": 6}]
)
def test_bad_layout_arguments(kwargs):
    with pytest.raises(ValueError):
        SketchLayout(**kwargs)
