"""What the codec registry (:mod:`tagc.hooks.codecs.registry`) holds for one codec: :class:`CodecSpec`.

It lives apart from the registry so that a codec's own module can define its spec beside the
codec class (``SPEC = CodecSpec(...)``) and the registry can import that module to register it,
with no import cycle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.codec import Codec


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """One codec: how to build it, the options it takes (name -> default), what it is."""

    name: str
    """What ``tagc.hook(codec=...)`` calls it."""
    build: Callable[[TAGCConfig, torch.dtype, dict], Codec]
    """``build(config, residual_dtype, options)``: the codec, ``options`` already checked against
    :attr:`options` and completed with its defaults."""
    options: Mapping[str, Any]
    """The codec's own options and their defaults (``tagc.hook(codec=name, **options)``)."""
    config_fields: tuple[str, ...]
    """The :class:`TAGCConfig` fields (``ratio``, ``index_bits``, ``sparsity``, ...) that apply; ``tagc.hook``
    refuses the others for this codec (``min_compress_numel``, how columns are planned, applies to every codec)."""
    summary: str
    """One line: what the codec sends."""
