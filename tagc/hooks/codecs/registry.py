"""Every codec ``tagc.hook(codec=...)`` accepts, with its options: one table that the API, the
engine and the benchmarks read, so a name or an option is validated in one place.

Each codec's :class:`~tagc.hooks.codecs.spec.CodecSpec` is registered with one explicit line below; nothing is
discovered by scanning. Adding a codec: ``docs/design.md``, "Adding a codec" (:mod:`tagc.hooks.codecs.sign` is the
model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tagc.config import SKETCH_FIELDS, TAGCConfig
from tagc.hooks.codecs import quantized, sign
from tagc.hooks.codecs.codec import Codec, PlainCodec, TAGCCodec
from tagc.hooks.codecs.powersgd import DEFAULT_RANK, PowerSGDCodec
from tagc.hooks.codecs.spec import CodecSpec
from tagc.hooks.codecs.topk import TopKCodec

__all__ = ["SPECS", "CodecSpec", "codec_names", "error_feedback_codecs", "make_codec", "register", "resolve_options",
           "spec"]

SPECS: dict[str, CodecSpec] = {}
"""Codec name -> its spec, in registration order."""


def register(codec_spec: CodecSpec) -> CodecSpec:
    """Add ``codec_spec`` to :data:`SPECS` under its name (a name taken already is an error)."""
    if not isinstance(codec_spec, CodecSpec):
        raise TypeError(f"register takes a tagc.hooks.codecs.spec.CodecSpec, got {type(codec_spec).__name__}")
    if codec_spec.name in SPECS:
        raise ValueError(f"codec {codec_spec.name!r} is registered twice")
    SPECS[codec_spec.name] = codec_spec
    return codec_spec


register(CodecSpec("tagc", lambda config, residual_dtype, options: TAGCCodec(config, residual_dtype, **options),
                   {"positions": "bitmap", "value_dtype": "float32"}, SKETCH_FIELDS,
                   "error feedback, threshold, exact index and count sketch (the paper's method)"))
register(CodecSpec("plain", lambda config, residual_dtype, options: PlainCodec(), {}, (),
                   "the columns as they are, summed in float32 at the owner (a fair reduce-scatter)"))
register(CodecSpec("powersgd",
                   lambda config, residual_dtype, options: PowerSGDCodec(options["rank"], options["warm_start"],
                                                                         residual_dtype, options["value_dtype"]),
                   {"rank": DEFAULT_RANK, "warm_start": True, "value_dtype": "float32"}, (),
                   "rank-r PowerSGD of each weight matrix, error feedback, warm start (4 rounds)"))
register(quantized.BF16_SPEC)
register(quantized.FP8_SPEC)
register(quantized.INT4_SPEC)
register(sign.SPEC)
register(CodecSpec("topk", lambda config, residual_dtype, options: TopKCodec(config, residual_dtype, **options),
                   {"positions": "offsets", "value_dtype": "float32"}, ("ratio", "sparsity"),
                   "TAGC's threshold and error feedback, kept values sent as a position/value list"))


def codec_names() -> tuple[str, ...]:
    """The names ``tagc.hook(codec=...)`` accepts."""
    return tuple(SPECS)


def error_feedback_codecs() -> tuple[str, ...]:
    """The registered codecs with error feedback (a residual of what they did not send), built with their default
    options: the codecs ``feedback="ef21"`` (:mod:`tagc.hooks.codecs.feedback`) and a dense warm-up serve."""
    return tuple(name for name in codec_names() if make_codec(name, TAGCConfig()).error_feedback)


def spec(name: str) -> CodecSpec:
    """Codec ``name``'s spec, or a ``ValueError`` that lists the registered names."""
    if name not in SPECS:
        raise ValueError(f"codec must be one of {codec_names()}, got {name!r}")
    return SPECS[name]


def resolve_options(name: str, options: Mapping[str, Any] | None = None) -> dict:
    """``options`` checked against codec ``name``'s, with its defaults filled in."""
    codec = spec(name)
    options = dict(options or {})
    unknown = sorted(set(options) - set(codec.options))
    if unknown:
        takes = f"options {tuple(codec.options)}" if codec.options else "no options"
        raise ValueError(f"codec {name!r} takes {takes}; got {', '.join(map(repr, unknown))}")
    return {**codec.options, **options}


def make_codec(name: str, config: TAGCConfig, residual_dtype: torch.dtype = torch.float32,
               options: Mapping[str, Any] | None = None) -> Codec:
    """The codec called ``name`` (one of :func:`codec_names`), built with its resolved options."""
    return spec(name).build(config, residual_dtype, resolve_options(name, options))
