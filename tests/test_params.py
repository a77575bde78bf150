import pytest

from tests.params import spread


def test_spread_runs_every_value_by_default_and_the_rest_under_slow():
    marked = pytest.param("triton", marks=pytest.mark.triton)
    cases = spread([1, 2, 3], ["a", "b"], ["torch", marked])
    assert [c.values for c in cases] == [(n, s, b) for n in (1, 2, 3) for s in "ab" for b in ("torch", "triton")]
    default = [c.values for c in cases if not any(m.name == "slow" for m in c.marks)]
    assert default == [(1, "a", "torch"), (2, "b", "triton"), (3, "a", "torch")]
    assert all(any(m.name == "triton" for m in c.marks) for c in cases if c.values[2] == "triton")
    assert sum(any(m.name == "slow" for m in c.marks) for c in cases) == len(cases) - 3
