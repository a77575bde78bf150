"""Host work per bucket against the number of compressed parts (issue 61; ``python -m tagc.bench launches``).

On 2 gloo ranks and the torch reference back end (fast; no kernels, so no launches), one bucket of
``tagc.hook()``'s wire is exchanged at 1, 8 and 64 compressed parts, twice each with fresh hooks: the aten
ops of a steady step are counted (:class:`tagc.bench.launches.HostWork`), positive and the same both times.
The target of issue 61, a host cost per bucket that does not grow with its parts: the engine encodes a
batch of parts in one codec call and sends it in one all-to-all per wire tensor.
"""

import pytest

from tagc.bench.launches import row_cells

PARTS = (1, 8, 64)
PART_NUMEL = 1024
"""Small parts: the counts do not depend on the size (up to the torch reference's peeling rounds), the time does."""


def _counts(rank, world):
    import os

    os.environ["TAGC_BACKEND"] = "torch"
    from tagc.bench.launches import rank_counts

    return rank_counts(rank, world, ["default"], list(PARTS), PART_NUMEL, warm=1, repeats=2)


@pytest.fixture(scope="module")
def counted():
    from tests.distributed import run_ranks

    results = run_ranks(_counts, 2)
    rows = results[0]  # rank 0's: 1 part twice, then 8 parts twice, then 64
    assert [(row["backend"], row["parts"]) for row in rows] == [("torch", n) for n in PARTS for _ in range(2)]
    return {parts: [row_cells(row) for row in rows if row["parts"] == parts] for parts in PARTS}


def test_host_work_is_counted_and_deterministic(counted):
    for parts, (first, second) in counted.items():
        assert first["encode ops"] > 0 and first["decode ops"] > 0 and first["other ops"] > 0, (parts, first)
        assert first["launches"] == 0, (parts, first)  # the torch reference launches no kernel
        assert first == second, (parts, first, second)


def test_host_work_per_bucket_does_not_grow_with_its_parts(counted):
    """Encode and transport only: the torch reference's decode runs one pass per peeling round, which follows the
    data, so its count differs between buckets whatever the batching (the kernels' decode is compared on a GPU)."""
    fixed = ("encode ops", "other ops")
    for parts in PARTS[1:]:
        assert [counted[parts][0][k] for k in fixed] == [counted[1][0][k] for k in fixed], (counted[1][0],
                                                                                            counted[parts][0])
