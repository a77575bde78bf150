"""A parameter's place in a bucket: what every adapter hands the exchange engine and its codecs."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Segment:
    """One parameter's padded shard inside every rank's chunk."""

    name: str
    start: int
    numel: int
    module: Optional[nn.Module] = dataclasses.field(default=None, compare=False, hash=False)
    selected: Optional[Union[bool, float]] = None
    """Whether to compress it (or its compression ratio), when the adapter decided already;
    ``None`` asks the hook's policy."""
    shape: Optional[tuple[int, ...]] = None
    """The unsharded parameter's shape, where the concatenation over ranks of this segment starts
    with the parameter flattened (dim-0 sharding); ``None`` where unknown. Codecs that work on
    whole matrices (``powersgd``) need it and send the segment plain without it."""
