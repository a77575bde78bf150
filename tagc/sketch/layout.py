"""Where every element of a chunk lands in the count-sketch table.

Element ``(b, t)`` of block ``b`` (``L`` lanes each) is added to cells ``(rho_j(b), t ^ x(b))`` with signs
``sigma_j(b)``, ``j < 3``, one row in each third of the table. docs/design.md §3.5 explains the geometry, why the
first two rows are injective and why tiny chunks take at most 3 blocks: each makes decoding lossless at the
planned load instead of merely likely.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch

from tagc.config import MAX_LANE, is_int, is_power_of_two
from tagc.sketch.hashing import hash32, permute

TARGET_ROWS_PER_LANE = 4096
"""``lane=None`` picks the widest lane that keeps at least this many rows per lane."""

_STREAM_ROW0, _STREAM_ROW1, _STREAM_ROW2, _STREAM_SIGN, _STREAM_XOR = range(5)

# Sign patterns for 3-row tables: any three of these four are linearly independent.
_INDEPENDENT_SIGNS = torch.tensor([[1, 1, 1], [1, 1, -1], [1, -1, 1], [-1, 1, 1]], dtype=torch.float32)


def choose_lane(numel: int, ratio: float) -> int:
    """The lane width ``lane=None`` picks for a chunk of ``numel`` elements."""
    if math.ceil(numel / ratio) <= 3:  # table clamped to 3 rows: at most 3 blocks
        return min(MAX_LANE, 1 << max(0, math.ceil(numel / 3) - 1).bit_length())
    lane = 1
    while lane * 2 <= MAX_LANE and math.ceil(math.ceil(numel / (lane * 2)) / ratio) >= TARGET_ROWS_PER_LANE:
        lane *= 2
    return lane


@dataclasses.dataclass(frozen=True)
class _Tables:
    rows: torch.Tensor  # [B, 3] int64, absolute table rows
    signs: torch.Tensor  # [B, 3] float32, +-1
    lane_xor: torch.Tensor  # [B] int64, in [0, L)


@functools.lru_cache(maxsize=256)
def _block_tables(blocks: int, rows: int, lane: int, seed: int, injective: bool) -> _Tables:
    b = torch.arange(blocks, dtype=torch.int64)
    p0 = p1 = rows // 3
    p2 = rows - p0 - p1
    if injective:
        pair = permute(b, p0 * p1, seed, _STREAM_ROW0)
        r0, r1 = pair % p0, pair // p0
    else:
        r0 = hash32(b, seed, _STREAM_ROW0) % p0
        r1 = hash32(b, seed, _STREAM_ROW1) % p1
    r2 = hash32(b, seed, _STREAM_ROW2) % p2
    table_rows = torch.stack([r0, r1 + p0, r2 + p0 + p1], dim=1)
    sign_bits = hash32(b, seed, _STREAM_SIGN)
    if rows == 3:
        flip = 1.0 - 2.0 * (sign_bits & 1).to(torch.float32)
        signs = _INDEPENDENT_SIGNS[b % 4] * flip[:, None]
    else:
        shifts = torch.arange(3, dtype=torch.int64)
        signs = 1.0 - 2.0 * ((sign_bits[:, None] >> shifts) & 1).to(torch.float32)
    lane_xor = hash32(b, seed, _STREAM_XOR) & (lane - 1)
    return _Tables(table_rows.contiguous(), signs.contiguous(), lane_xor)


class SketchLayout:
    """The count-sketch geometry of one chunk: sizes, and the rows/signs of every block.

    Args:
        numel: chunk length ``S`` (>= 1).
        ratio: elements per table cell, > 1.
        lane: lane width (power of two <= 1024) or ``None`` to choose it from the size.
        seed: hash seed, identical on every rank.

    Attributes:
        numel, ratio, lanes (``L``), blocks (``B``), rows (``R``), table_numel (``R * L``),
        injective (whether no two blocks share both of their first two rows).
    """

    def __init__(self, numel: int, ratio: float, lane: Optional[int] = None, seed: int = 0) -> None:
        if not is_int(numel) or numel < 1:
            raise ValueError(f"numel must be a positive integer, got {numel!r}")
        if not isinstance(ratio, (int, float)) or not 1.0 < float(ratio) < math.inf:
            raise ValueError(f"ratio must be a finite number > 1, got {ratio!r}")
        if lane is not None and (not isinstance(lane, int) or not is_power_of_two(lane) or lane > MAX_LANE):
            raise ValueError(f"lane must be None or a power of two <= {MAX_LANE}, got {lane!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.numel = numel
        self.ratio = float(ratio)
        self.seed = seed
        self.lanes = choose_lane(numel, self.ratio) if lane is None else lane
        self.lane_bits = self.lanes.bit_length() - 1
        self.blocks = math.ceil(numel / self.lanes)
        self.rows = max(3, math.ceil(self.blocks / self.ratio))
        self.table_numel = self.rows * self.lanes
        pairs = (self.rows // 3) ** 2
        self.injective = self.blocks <= pairs <= 2**32
        self._device_tables: dict[torch.device, _Tables] = {}

    def __repr__(self) -> str:
        return (f"SketchLayout(numel={self.numel}, ratio={self.ratio:g}, lanes={self.lanes}, blocks={self.blocks}, "
                f"rows={self.rows}, seed={self.seed})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SketchLayout) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def key(self) -> tuple:
        return (self.numel, self.ratio, self.lanes, self.seed)

    def tables(self, device: torch.device | str = "cpu") -> _Tables:
        device = torch.device(device)
        if device not in self._device_tables:
            host = _block_tables(self.blocks, self.rows, self.lanes, self.seed, self.injective)
            self._device_tables[device] = _Tables(*(t.to(device) for t in dataclasses.astuple(host)))
        return self._device_tables[device]

    @property
    def block_rows(self) -> torch.Tensor:
        """``[blocks, 3]`` int64: the three distinct table rows of every block."""
        return self.tables().rows

    @property
    def block_signs(self) -> torch.Tensor:
        """``[blocks, 3]`` float32: the sign (+1/-1) of every block in each of its rows."""
        return self.tables().signs

    @property
    def block_lane_xor(self) -> torch.Tensor:
        """``[blocks]`` int64: the column permutation (xor mask) of every block."""
        return self.tables().lane_xor

    def cells(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat table cells ``[k, 3]`` (int64) and signs ``[k, 3]`` of element ``positions``."""
        t = self.tables(positions.device)
        block = positions >> self.lane_bits
        column = (positions & (self.lanes - 1)) ^ t.lane_xor.index_select(0, block)
        return t.rows.index_select(0, block) * self.lanes + column[:, None], t.signs.index_select(0, block)
