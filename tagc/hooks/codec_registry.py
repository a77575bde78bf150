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
from tagc.hooks import quantized
from tagc.hooks.codecs import Codec, PlainCodec, TAGCCodec
from tagc.hooks.powersgd import DEFAULT_RANK, PowerSGDCodec
from tagc.hooks.topk import TopKCodec


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


register(CodecSpec("tagc", lambda config, residual_dtype, options: TAGCCodec(config, residual_dtype, **options),
                   {"positions": "bitmap", "value_dtype": "float32"}, True,
                   "error feedback, threshold, exact index and count sketch (the paper's method)"))
register(CodecSpec("plain", lambda config, residual_dtype, options: PlainCodec(), {}, False,
                   "the columns as they are, summed in float32 at the owner (a fair reduce-scatter)"))
register(CodecSpec("powersgd", lambda config, residual_dtype, options: PowerSGDCodec(options["rank"], options["warm_start"], residual_dtype,
                                                                                   options["value_dtype"]),
                   {"rank": DEFAULT_RANK, "warm_start": True, "value_dtype": "float32"}, False, "rank-r PowerSGD of each weight matrix, error feedback, warm start (4 rounds)"))
register(CodecSpec("bf16", lambda config, residual_dtype, options: quantized.BF16Codec(), {}, False,
                   "values cast to bfloat16, summed in float32 at the owner"))
register(CodecSpec("fp8", lambda config, residual_dtype, options: quantized.FP8Codec(**options), {"block": 128}, False,
                   "float8 e4m3, one float32 scale (absmax / 448) per block"))
register(CodecSpec("int4", lambda config, residual_dtype, options: quantized.Int4Codec(**options),
                   {"block": 128, "stochastic": False}, False,
                   "ZeRO++ qgZ-style symmetric int4, one float32 scale per block"))
register(CodecSpec("sign", lambda config, residual_dtype, options: quantized.SignCodec(residual_dtype=residual_dtype,
                                                                                       **options),
                   {"block": 1024}, False, "1 bit per element and a mean-|a| scale per block, with error feedback"))
register(CodecSpec("topk", lambda config, residual_dtype, options: TopKCodec(config, residual_dtype, **options),
                   {"positions": "offsets", "value_dtype": "float32"}, True,
                   "TAGC's threshold and error feedback, kept values sent as a position/value list"))


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
