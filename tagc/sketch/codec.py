"""Count-sketch encode and peeling decode (docs/design.md §3.5-3.8), plain PyTorch.

``encode`` is linear, so the sum over ranks of their tables is the table of the summed
gradient. ``decode`` recovers the summed chunk from that table and the union support:
peeling first (vectorised rounds, each settling every position that owns a cell no other
position touches), then an exact linear solve of the small stopping sets peeling leaves,
then the fallback policy for whatever is still undetermined. ``decode_parts`` decodes several
parts of one layout at once, each exactly as ``decode`` does alone.

The precision contract (exact support, values within float32 rounding of the magnitudes
summed into their cells, float32/bf16/fp16 input only, index/table consistency): docs/design.md §5.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from tagc.config import FALLBACKS
from tagc.sketch.index import check_index, index_nbytes, parts_positions
from tagc.sketch.layout import SketchLayout
from tagc.sketch.sparsify import check_finite, check_sketch_dtype

EXACT_SOLVE_LIMIT = 256
"""Stopping sets with more positions than this are left to the fallback (a dense solve of
that size is slower than re-sending them; above the peeling threshold they are huge)."""


FLOAT32_UNIT_ROUNDOFF = 2.0**-24
"""``u`` of the precision contract (docs/design.md §5)."""

_COUNT_SHIFT = 40
_ONE_COUNT = 1 << _COUNT_SHIFT  # position ids stay below 2**40


@dataclasses.dataclass
class DecodeStats:
    """What one decode did. Also readable as a mapping (``stats["peeled"]``).

    Attributes:
        support: non-zero positions in the union index.
        peeled: positions recovered exactly (by peeling or by the exact solve).
        solved: of those, how many the exact linear solve recovered.
        unpeeled: positions not recovered exactly (``support - peeled``).
        estimated: unpeeled positions given the median-of-three estimate.
        raw: unpeeled positions left for an uncompressed re-send (``raw_positions``).
        rounds: peeling rounds run.
    """

    support: int = 0
    peeled: int = 0
    solved: int = 0
    unpeeled: int = 0
    estimated: int = 0
    raw: int = 0
    rounds: int = 0
    raw_positions: Optional[torch.Tensor] = None

    def __getitem__(self, key: str):
        return getattr(self, key)

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "raw_positions"}


DECODE_STATS = tuple(DecodeStats().as_dict())
"""The decode statistics in :class:`DecodeStats` field order: the columns of :func:`decode_parts`'s statistics."""
_FIELD = {name: i for i, name in enumerate(DECODE_STATS)}


class InconsistentSketchError(RuntimeError):
    """The summed table and the union index do not describe one set of values (see :func:`decode`)."""


def check_consistent(inconsistent: int, layout: SketchLayout) -> None:
    """Raise :class:`InconsistentSketchError` if ``inconsistent`` cells no support position
    maps to are non-zero (the consistency check of :func:`decode`)."""
    if inconsistent:
        raise InconsistentSketchError(
            f"TAGC decode: the sketch table and the union index disagree: {inconsistent} of {layout.table_numel} "
            f"table cells of {layout} hold values although no indexed position maps to them (an index left out "
            "of the merge, or tables and indexes of different chunks, layouts or seeds); the decoded values "
            "would be wrong"
        )


def _check_values(values: torch.Tensor, layout: SketchLayout) -> torch.Tensor:
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise ValueError(f"values must be a floating-point tensor, got {getattr(values, 'dtype', type(values))}")
    check_sketch_dtype(values, "values to encode")
    if values.numel() != layout.numel:
        raise ValueError(f"values have {values.numel()} elements but the layout is for {layout.numel}")
    return values.reshape(-1)


def encode_positions(
    positions: torch.Tensor, values: torch.Tensor, layout: SketchLayout, table: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Add ``values`` (float32, bfloat16 or float16) at chunk ``positions`` into a (new or given) float32 table."""
    check_sketch_dtype(values, "values to encode")
    if table is None:
        table = torch.zeros(layout.table_numel, dtype=torch.float32, device=values.device)
    cells, signs = layout.cells(positions)
    table.scatter_add_(0, cells.reshape(-1), (signs * values.float()[:, None]).reshape(-1))
    return table


def encode(values: torch.Tensor, layout: SketchLayout) -> torch.Tensor:
    """The count sketch (float32, ``[layout.table_numel]``) of a chunk.

    Only non-zeros are added. Linear: ``encode(a) + encode(b) == encode(a + b)`` up to
    float rounding. ``values`` are float32, bfloat16 or float16 (converted exactly);
    raises ``ValueError`` on float64 (cast it), NaN/Inf or a size that does not match.
    """
    flat = _check_values(values, layout)
    check_finite(flat, "values to encode")
    positions = flat.nonzero().squeeze(1)
    return encode_positions(positions, flat.index_select(0, positions), layout)


def _thrice(x: torch.Tensor) -> torch.Tensor:
    """``[a, a, a, b, b, b, ...]``: one entry per cell of each position."""
    return x[:, None].expand(-1, 3).reshape(-1)


def _peel(work: torch.Tensor, cells: torch.Tensor,
          signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Peel in rounds; ``work`` (float64 table) is left holding what was not peeled.

    Cell-centric, like an invertible Bloom lookup table: every cell keeps how many unsettled
    positions touch it and the sum of their ids, so a cell with count 1 names its position
    directly. A round settles the positions of all such cells; the first round finds them by
    scanning the table, later ones among the cells the previous round touched, so the work is
    proportional to the positions settled, never to the ones still stuck.
    Within a round each position reads a cell only it touches, so settling all at once gives
    the values settling them one by one would. Several parts' tables side by side (their cells
    offset by their places in ``work``) share nothing, so they peel together exactly as alone,
    each in the rounds it would take alone.

    Returns the values of all positions, the round each was settled in (0: not settled), and the
    tally (per cell: unsettled positions ``<< 40``; 0 where no position maps, for the consistency check).
    """
    k = cells.shape[0]
    device = work.device
    flat = cells.reshape(-1)
    # count << 40 | sum of ids, in one int64 per cell: one scatter maintains both
    tally = torch.zeros(work.numel(), dtype=torch.int64, device=device)
    tally.scatter_add_(0, flat, _thrice(torch.arange(k, device=device) + _ONE_COUNT))
    unused = tally == 0
    values = torch.zeros(k, dtype=torch.float64, device=device)
    settled = torch.zeros(k, dtype=torch.int64, device=device)
    rounds = 0
    pure = ((tally >> _COUNT_SHIFT) == 1).nonzero().squeeze(1)
    while pure.numel():
        rounds += 1
        owners = tally.index_select(0, pure) & (_ONE_COUNT - 1)
        settle, which = torch.unique(owners, return_inverse=True)  # a position may own several pure cells
        pure_cell = torch.empty_like(settle).scatter_(0, which, pure)
        settle_cells, settle_signs = cells.index_select(0, settle), signs.index_select(0, settle)
        sign = (settle_signs * (settle_cells == pure_cell[:, None])).sum(dim=1)  # rows are distinct: one match
        value = sign * work.index_select(0, pure_cell)
        values.index_put_((settle,), value)
        settled.index_fill_(0, settle, rounds)
        touched = settle_cells.reshape(-1)
        work.scatter_add_(0, touched, (-settle_signs * value[:, None]).reshape(-1))
        tally.scatter_add_(0, touched, _thrice(-(settle + _ONE_COUNT)))
        # only cells touched this round can have become pure (duplicates resolve via unique)
        pure = touched[(tally.index_select(0, touched) >> _COUNT_SHIFT) == 1]
    return values, settled, unused


def _solve_stopping_sets(
    work: torch.Tensor, cells: torch.Tensor, signs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve the linear system of the positions peeling left, exactly where it determines them.

    Returns their values (min-norm least squares) and a mask of the uniquely determined ones:
    unknown ``i`` is determined iff the system's null space is zero in coordinate ``i``.
    """
    m = cells.shape[0]
    used, row = torch.unique(cells.reshape(-1), return_inverse=True)
    system = torch.zeros(used.numel(), m, dtype=torch.float64, device=work.device)
    column = torch.arange(m, device=work.device).repeat_interleave(3)
    system.index_put_((row, column), signs.reshape(-1).double(), accumulate=True)
    u, s, vh = torch.linalg.svd(system, full_matrices=True)
    rank = int((s > 1e-9 * s.max()).sum())
    x = vh[:rank].T @ ((u[:, :rank].T @ work[used]) / s[:rank])
    null = vh[rank:]
    determined = null.abs().amax(dim=0) < 1e-9 if null.numel() else torch.ones(m, dtype=torch.bool, device=work.device)
    return x, determined


class UnrecoveredError(RuntimeError):
    """Decode left positions it could not recover, and ``fallback="error"`` asked to raise."""


def unrecovered_error(unrecovered: int, support: int, layout: SketchLayout) -> UnrecoveredError:
    """The error ``fallback="error"`` raises when ``unrecovered`` of ``support`` positions are left (every back end)."""
    return UnrecoveredError(
        f"TAGC decode could not recover {unrecovered} of {support} positions of {layout} "
        f"(load {support / (layout.rows * layout.lanes):.3f} non-zeros per row; peeling needs < 0.81): "
        "lower the density (sparsity='auto'), raise the table size (smaller ratio), or use fallback='estimate'/'raw'"
    )


def finish_decode(
    work: torch.Tensor, stuck: torch.Tensor, layout: SketchLayout, stats: torch.Tensor, fallback: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every back end does after peeling: solve the stopping sets exactly, then apply the
    fallback to what is still undetermined. ``work`` is the parts' tables side by side (float64
    ``[P * T]``) with the peeled positions taken out, ``stuck`` the positions peeling left (part
    ``p``'s position ``i`` as ``p * numel + i``, in increasing order); fills the int64 ``stats``
    (``[P, len(DECODE_STATS)]``: all but ``support`` and ``rounds``) and returns the positions and values
    (float64) to write, and the positions left unrecovered (``raw_positions``, in increasing order).

    The solve runs part by part, on the parts that have stopping sets small enough
    (:data:`EXACT_SOLVE_LIMIT` positions), each exactly as alone; everything else is done for all parts at once.
    """
    if not stuck.numel():  # every position peeled (a shape: no host read)
        stats[:, _FIELD["peeled"]] = stats[:, _FIELD["support"]]
        return stuck, torch.zeros(0, dtype=torch.float64, device=work.device), stuck
    numel = layout.numel
    part = torch.div(stuck, numel, rounding_mode="floor")
    cells, signs = layout.cells(stuck - part * numel)
    cells += (part * layout.table_numel)[:, None]
    parts = stats.shape[0]
    written: list[tuple[torch.Tensor, torch.Tensor]] = []
    stuck_per_part = torch.bincount(part, minlength=parts)
    solvable = ((stuck_per_part > 0) & (stuck_per_part <= EXACT_SOLVE_LIMIT)).nonzero().squeeze(1).tolist()
    if solvable:
        ends = stuck_per_part.cumsum(0).tolist()
        left = torch.ones(stuck.numel(), dtype=torch.bool, device=work.device)
        for p in solvable:  # the parts with stopping sets to solve (the data decides how many)
            at = slice(ends[p] - int(stuck_per_part[p]), ends[p])
            solution, determined = _solve_stopping_sets(work, cells[at], signs[at])
            solved = solution[determined]
            taken = (-signs[at][determined] * solved[:, None]).reshape(-1)
            work.index_add_(0, cells[at][determined].reshape(-1), taken)
            written.append((stuck[at][determined], solved))
            left[at] = ~determined
        stats[:, _FIELD["solved"]] = torch.bincount(part[~left], minlength=parts)
        stuck, cells, signs, part = stuck[left], cells[left], signs[left], part[left]
    unpeeled = torch.bincount(part, minlength=parts)
    stats[:, _FIELD["peeled"]] = stats[:, _FIELD["support"]] - unpeeled
    stats[:, _FIELD["unpeeled"]] = unpeeled
    if stuck.numel():
        if fallback == "error":
            first = int(part[0])
            raise unrecovered_error(int(unpeeled[first]), int(stats[first, _FIELD["support"]]), layout)
        if fallback == "estimate":
            written.append((stuck, (signs.double() * work[cells]).median(dim=1).values))
            stats[:, _FIELD["estimated"]] = unpeeled
        else:
            written.append((stuck, torch.zeros(stuck.numel(), dtype=torch.float64, device=work.device)))
            stats[:, _FIELD["raw"]] = unpeeled
    if not written:
        return stuck, torch.zeros(0, dtype=torch.float64, device=work.device), stuck
    return torch.cat([p for p, _ in written]), torch.cat([v for _, v in written]), stuck


def as_decode_stats(packed: torch.Tensor, rest: torch.Tensor) -> DecodeStats:
    """One part's packed statistics (:data:`DECODE_STATS` order) as :class:`DecodeStats`, with ``raw_positions``
    (``rest``) when positions were left for a re-send."""
    stats = DecodeStats(**dict(zip(DECODE_STATS, packed.tolist())))
    if stats.raw:
        stats.raw_positions = rest
    return stats


def parts_of(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int,
             fallback: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The argument checks every decode back end makes (clear ``ValueError`` on a mismatch); the tables and
    indexes as rows ``[P, T]`` and ``[P, I]``. One part: an index ``[I]`` and a table of ``T`` elements; ``P``
    parts: indexes ``[P, I]`` and tables of ``P * T`` elements."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    if not isinstance(index, torch.Tensor) or index.dim() != 2:
        check_index(index, layout.numel, bits)
    else:
        check_index(index[0] if len(index) else index.new_empty(index_nbytes(layout.numel, bits)), layout.numel, bits)
    parts = 1 if index.dim() == 1 else index.shape[0]
    if not isinstance(table, torch.Tensor) or table.numel() != parts * layout.table_numel:
        raise ValueError(f"table must have {layout.table_numel} elements for {layout}"
                         + (f" per part ({parts} parts)" if index.dim() == 2 else "")
                         + f", got {getattr(table, 'shape', type(table))}")
    return table.reshape(parts, layout.table_numel), index.reshape(parts, -1)


def decode_parts(
    tables: torch.Tensor, indexes: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode` of ``P`` parts of one layout at once (tables ``[P, T]``, indexes ``[P, I]``, or one part's
    ``[T]`` and ``[I]``): every part's values and statistics exactly as :func:`decode` of it alone gives them.

    The parts' tables lie side by side in one table (part ``p``'s cells offset by ``p * T``): peeling
    settles every part's pure cells in each round, and the exact solve takes the parts that have stopping sets,
    each alone. Returns ``(values float32 [P, numel], stats int64 [P, len(DECODE_STATS)], rest)``, ``rest`` the
    positions left unrecovered (part ``p``'s position ``i`` as ``p * numel + i``, in increasing order). Raises
    what :func:`decode` raises, for any part.
    """
    tables, indexes = parts_of(tables, indexes, layout, bits, fallback)
    check_finite(tables, "sketch table")
    parts, numel = tables.shape[0], layout.numel
    positions, part = parts_positions(indexes, numel, bits)
    cells, signs = layout.cells(positions)
    cells += (part * layout.table_numel)[:, None]
    positions += part * numel
    work = tables.reshape(-1).to(torch.float64, copy=True)
    values, settled, unused = _peel(work, cells, signs)
    check_consistent(int((unused & (work != 0)).sum()), layout)
    stats = torch.zeros(parts, len(DECODE_STATS), dtype=torch.int64, device=tables.device)
    stats[:, _FIELD["support"]] = torch.bincount(part, minlength=parts)
    stats[:, _FIELD["rounds"]].scatter_reduce_(0, part, settled, "amax")
    out = torch.zeros(parts * numel, dtype=torch.float32, device=tables.device)
    out.index_copy_(0, positions, values.float())
    rest_positions, rest_values, rest = finish_decode(work, positions[settled == 0], layout, stats, fallback)
    out.index_copy_(0, rest_positions, rest_values.float())
    return out.view(parts, numel), stats, rest


PartsDecoder = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # a back end's decode_parts


def decode_async(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate",
                 *, parts: PartsDecoder = decode_parts) -> tuple[torch.Tensor, torch.Tensor]:
    """``parts`` (:func:`decode_parts`) with the statistics as an int64 tensor (:data:`DECODE_STATS` order): one
    part's ``(values [numel], stats [F])`` from ``[T]`` and ``[I]``, ``P`` parts' ``[P, numel]`` and ``[P, F]``
    from ``[P, T]`` and ``[P, I]``."""
    values, stats, _ = parts(table, index, layout, bits, fallback)
    return (values, stats) if index.dim() == 2 else (values[0], stats[0])


def decode(table: torch.Tensor, index: torch.Tensor, layout: SketchLayout, bits: int, fallback: str = "estimate", *,
           parts: PartsDecoder = decode_parts) -> tuple[torch.Tensor, DecodeStats]:
    """Recover a chunk (float32, ``[layout.numel]``) from its summed table and union index (peeling by
    ``parts``, a back end's :func:`decode_parts`).

    Args:
        table: the (summed) count sketch, ``[layout.table_numel]`` (float32 as :func:`encode` and :func:`compress_`
            make it; any float dtype is read exactly). index: the (merged) union index of ``bits`` bits per element.
        fallback: for positions neither peeling nor the exact solve recovers (docs/design.md §3.8): ``"estimate"``,
            ``"raw"`` (0, listed in ``stats.raw_positions`` for a re-send) or ``"error"`` (``RuntimeError``).

    Raises:
        ValueError: sizes or arguments that do not match, NaN/Inf in the table.
        InconsistentSketchError: table and index disagree (docs/design.md §5, item 4).

    **Precision contract** (every back end; in full: docs/design.md §5): the support is exact (every position
    outside the union index decodes to exactly 0); every value peeling settles is within float32 rounding of the
    magnitudes that share its cells, solved ones within that amplified by their small system's conditioning,
    estimated ones unbounded; a cell no indexed position maps to must be exactly 0, or
    :class:`InconsistentSketchError` is raised (never on a legitimate table), a check
    :func:`tagc.kernels.decode_async` skips, as it skips the NaN check.
    """
    values, packed, rest = parts(table, index.reshape(-1), layout, bits, fallback)
    return values[0], as_decode_stats(packed[0], rest)
