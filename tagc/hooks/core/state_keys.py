"""How codec state entries are keyed: by the bucket part they belong to (``"<parameters>#<chunk>/part<k>"``),
some with a suffix (``/residual``, ``#steps``, ``#ef21_sum``, ...). Shared by the checkpoint module and the
codec wrappers that add entries of their own."""

from __future__ import annotations

import re

_PART_KEY = re.compile(r"^(.*?/part\d+)(?=$|[/#])")


def part_key(state_key: str) -> str:
    """The bucket part a codec state entry belongs to: codecs key their state by the part's key
    (``"<parameters>#<chunk>/part<k>"``), some with a suffix (``/residual``, ``#steps``, ...)."""
    match = _PART_KEY.match(state_key)
    return match.group(1) if match else state_key
