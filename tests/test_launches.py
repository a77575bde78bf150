"""Host work per bucket against the number of compressed parts (issue 61; ``python -m tagc.bench launches``).

On 2 gloo ranks and the CPU back ends (the torch reference, and Numba where it imports: fast; no kernels, so no
launches), one bucket of ``tagc.hook()``'s wire is exchanged at 1, 8 and 64 compressed parts, twice each with
fresh hooks: the aten ops of a steady step are counted (:class:`tagc.bench.launches.HostWork`), positive and the
same both times. The target of issue 61, a host cost per bucket that does not grow with its parts: the engine
encodes a batch of parts in one codec call, sends it in one all-to-all per wire tensor and decodes it in one
call (the Triton back end's launches: ``tests/test_batched_decode.py``).
"""

import pytest

from tagc.bench.launches import row_cells

PARTS = (1, 8, 64)
PART_NUMEL = 1024
"""Small parts: the counts do not depend on the size (up to the torch reference's peeling rounds), the time does."""


def _backends() -> list[str]:
    from tagc.kernels.cpu import numba_available

    return ["torch", "numba"] if numba_available() else ["torch"]


def _counts(rank, world):
    import os

    from tagc.bench.launches import rank_counts

    rows = []
    for backend in _backends():
        os.environ["TAGC_BACKEND"] = backend  # read at every dispatch
        rows += rank_counts(rank, world, ["default"], list(PARTS), PART_NUMEL, warm=1, repeats=2)
    return rows


@pytest.fixture(scope="module")
def counted():
    from tests.distributed import run_ranks

    results = run_ranks(_counts, 2)
    rows = results[0]  # rank 0's, per back end: 1 part twice, then 8 parts twice, then 64
    assert [(row["backend"], row["parts"]) for row in rows] == [(b, n) for b in _backends() for n in PARTS
                                                                for _ in range(2)]
    return {(backend, parts): [row_cells(row) for row in rows if (row["backend"], row["parts"]) == (backend, parts)]
            for backend in _backends() for parts in PARTS}


def test_host_work_is_counted_and_deterministic(counted):
    for key, (first, second) in counted.items():
        assert first["encode ops"] > 0 and first["decode ops"] > 0 and first["other ops"] > 0, (key, first)
        assert first["launches"] == 0, (key, first)  # the CPU back ends launch no kernel
        assert first == second, (key, first, second)


def test_host_work_per_bucket_does_not_grow_with_its_parts(counted):
    """Encode, decode and transport. The torch reference's decode runs one pass of ops per peeling round, and a
    batch peels in as many rounds as its slowest part, so its count follows the data: bounded, not equal; the
    Numba back end's is equal (these parts all peel: a part with stopping sets adds its exact solve)."""
    for backend in _backends():
        fixed = ("encode ops", "other ops") if backend == "torch" else ("encode ops", "decode ops", "other ops")
        one = counted[(backend, 1)][0]
        for parts in PARTS[1:]:
            many = counted[(backend, parts)][0]
            assert [many[k] for k in fixed] == [one[k] for k in fixed], (backend, one, many)
            assert many["decode ops"] < 2 * one["decode ops"], (backend, one, many)
