"""Parameter grids for the tests: every value in the default suite, every combination under ``-m slow``."""

from __future__ import annotations

import itertools
from typing import Sequence

import pytest

_PARAM = type(pytest.param(None))


def spread(*axes: Sequence) -> list:
    """The product of ``axes`` as ``pytest.param``s. The default suite runs the diagonal (case ``i`` takes value
    ``i`` of each axis, the shorter axes wrapping round), so each value of each axis runs in at least one case;
    the other combinations are marked ``slow``. A value may be a one-value ``pytest.param``: its marks carry over."""
    width = max(len(axis) for axis in axes)
    diagonal = {tuple(i % len(axis) for axis in axes) for i in range(width)}
    cases = []
    for picks in itertools.product(*(range(len(axis)) for axis in axes)):
        values, marks = [], [] if picks in diagonal else [pytest.mark.slow]
        for axis, i in zip(axes, picks):
            value = axis[i]
            if isinstance(value, _PARAM):
                values.extend(value.values)
                marks.extend(value.marks)
            else:
                values.append(value)
        cases.append(pytest.param(*values, marks=marks))
    return cases
