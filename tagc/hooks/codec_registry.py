"""Every codec ``tagc.hook(codec=...)`` accepts, with its options: one table that the API, the
engine and the benchmarks read, so a name or an option is validated in one place.

A codec module (e.g. :mod:`tagc.hooks.codecs`) defines the :class:`~tagc.hooks.codecs.Codec`;
this module only names it, lists its options (with defaults) and says whether the TAGC
selection settings (``ratio``, ``index_bits``, ``sparsity`` and the other
:class:`~tagc.config.TAGCConfig` fields) apply to it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch

from tagc.config import TAGCConfig
from tagc.hooks.codecs import Codec, PlainCodec, TAGCCodec


@dataclasses.dataclass(frozen=True)
class CodecSpec:
    """One codec: how to build it, the options it takes (name -> default), what it is."""

    name: str
    build: Callable[[TAGCConfig, torch.dtype, dict], Codec]
    options: Mapping[str, Any]
    uses_config: bool
    """Whether the :class:`TAGCConfig` fields (``ratio``, ``index_bits``, ``sparsity``, ...) apply."""
    summary: str


SPECS: dict[str, CodecSpec] = {}


def register(spec: CodecSpec) -> CodecSpec:
    if spec.name in SPECS:
        raise ValueError(f"codec {spec.name!r} is registered twice")
    SPECS[spec.name] = spec
    return spec


register(CodecSpec("tagc", lambda config, residual_dtype, options: TAGCCodec(config, residual_dtype), {}, True,
                   "error feedback, threshold, exact index and count sketch (the paper's method)"))
register(CodecSpec("plain", lambda config, residual_dtype, options: PlainCodec(), {}, False,
                   "the columns as they are, summed in float32 at the owner (a fair reduce-scatter)"))


def codec_names() -> tuple[str, ...]:
    """The names ``tagc.hook(codec=...)`` accepts."""
    return tuple(SPECS)


def spec(name: str) -> CodecSpec:
    if name not in SPECS:
        raise ValueError(f"codec must be one of {codec_names()}, got {name!r}")
    return SPECS[name]


def resolve_options(name: str, options: Optional[Mapping[str, Any]] = None) -> dict:
    """``options`` checked against codec ``name``'s, with its defaults filled in."""
    codec = spec(name)
    options = dict(options or {})
    unknown = sorted(set(options) - set(codec.options))
    if unknown:
        takes = f"options {tuple(codec.options)}" if codec.options else "no options"
        raise ValueError(f"codec {name!r} takes {takes}; got {', '.join(map(repr, unknown))}")
    return {**codec.options, **options}


def make_codec(name: str, config: TAGCConfig, residual_dtype: torch.dtype = torch.float32,
               options: Optional[Mapping[str, Any]] = None) -> Codec:
    """The codec called ``name`` (one of :func:`codec_names`), built with its resolved options."""
    return spec(name).build(config, residual_dtype, resolve_options(name, options))
