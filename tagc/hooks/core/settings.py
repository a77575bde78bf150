"""Every setting of a TAGC hook in one validated, frozen object: :class:`HookSettings`.

:func:`tagc.hook` takes its arguments here (:meth:`HookSettings.from_arguments`), so a bad value
fails once, at construction, with a message that lists what is allowed. The codec's own settings
stay nested: the TAGC selection settings in :class:`~tagc.config.TAGCConfig` (``config``), a codec's
options (``codec_options``, checked against :data:`tagc.hooks.codecs.registry.SPECS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tagc.config import SELECTION_FIELDS, TAGCConfig, is_int
from tagc.hooks.codecs.codec import Codec
from tagc.hooks.codecs.feedback import check_feedback, with_feedback
from tagc.hooks.codecs.registry import codec_names, error_feedback_codecs, make_codec, resolve_options, spec
from tagc.hooks.core.hierarchy import check_hierarchy, resolve_ranks_per_host
from tagc.hooks.core.selection import SelectPolicy, resolve_policy

MIN_PART = 1 << 20
"""Compressed columns are split into pipeline parts of at least this many elements. Each part
samples its own threshold (:func:`tagc.sketch.sparsify.row_thresholds`, ~4096/density entries
per row), so parts much smaller than that sample pay a full selection each (how it was chosen:
``docs/results.md``)."""

DENSE_STEPS = 10
"""The dense warm-up of an error-feedback codec when ``dense_steps`` is not given: early gradients
carry large, dense moves that error feedback under Adam would spread over many steps (how 10 was
chosen: ``docs/results.md``)."""

NONFINITE = ("propagate", "raise")
PLAIN_CODECS = {"fp32": "plain", "bf16": "bf16", "fp8": "fp8", "int4": "int4"}
"""``plain=`` -> the codec of the columns the ``select`` policy leaves alone (and of a dense
warm-up): ``"fp32"`` sends them as they are (the reduce dtype); the others are the stateless
low-precision peers of :mod:`tagc.hooks.codecs.quantized`, summed in float32 at the owner."""

RECOMMENDED: dict[str, dict[str, Any]] = {
    "tagc": {"ratio": 4.5, "plain": "int4", "feedback": "ef21", "feedback_decay": 0.9,
             "positions": "coded", "value_dtype": "float16"},
    "topk": {"ratio": 1.2, "plain": "int4", "feedback": "ef21", "feedback_decay": 0.9,
             "positions": "coded", "value_dtype": "float8"},
}
"""What :func:`tagc.hook` fills in, per codec, for each of these settings the caller leaves out: for ``tagc``, the
screens' pick for plain training's loss while sending no more than ``int4`` does (ratio 4.5, the other columns in
``int4``, EF21 whose shifts fade by 0.9 a step, coded positions and float16 cells); for ``topk``, the list at the same
bytes (ratio 1.2, float8 values, whose rounding the list's error feedback keeps and a sketch's cannot, the rest as
for ``tagc``). How they were chosen: ``docs/quality-diagnosis.md``; their loss against plain: ``docs/evidence.md``.
A codec not listed, and a setting not listed, keeps :data:`NEUTRAL`'s value or the codec's own default."""

NEUTRAL: dict[str, Any] = {"plain": "fp32", "feedback": "classic", "feedback_decay": 1.0}
"""The defaults of the codecs :data:`RECOMMENDED` does not list (and :class:`HookSettings`' own field defaults):
the other columns as they are, the codec's own error feedback, no fading."""


def recommended_settings(codec: str, ratio: float | None = None, plain: str | None = None,
                         feedback: str | None = None, feedback_decay: float | None = None,
                         options: Mapping[str, Any] | None = None, index_bits: int | None = None) -> dict[str, Any]:
    """``ratio``, ``plain``, ``feedback``, ``feedback_decay`` and ``options`` (the codec's own) with every one left
    out (``None``, or an option not named) filled in as :func:`tagc.hook` does for ``codec``
    (:data:`RECOMMENDED`, else :data:`NEUTRAL`; ``ratio`` stays ``None`` for a codec with no entry, which
    leaves it to :class:`~tagc.config.TAGCConfig`). A fading factor is filled in only for EF21: the codec's
    recommended one when its recommended feedback is EF21, else 1 (EF21 as published). With ``index_bits=4``
    codec ``tagc``'s positions default to the bitmap: coded positions code a set, which 4-bit rank counts are not
    (``topk``'s positions list each rank's own entries, which the index width does not change)."""
    recommended = RECOMMENDED.get(codec, {})
    plain = plain if plain is not None else recommended.get("plain", NEUTRAL["plain"])
    feedback = feedback if feedback is not None else recommended.get("feedback", NEUTRAL["feedback"])
    if feedback_decay is None:
        fading = feedback == "ef21" and recommended.get("feedback") == "ef21"
        feedback_decay = recommended["feedback_decay"] if fading else NEUTRAL["feedback_decay"]
    own = spec(codec).options if codec in codec_names() else {}
    filled = {name: value for name, value in recommended.items() if name in own}
    if index_bits == 4 and "positions" in filled and codec == "tagc":  # topk's positions list each rank's own entries
        filled["positions"] = "bitmap"
    options = {**filled, **(options or {})}
    return {"ratio": ratio if ratio is not None else recommended.get("ratio"), "plain": plain, "feedback": feedback,
            "feedback_decay": feedback_decay, "options": options}


_CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(TAGCConfig))


@dataclasses.dataclass(frozen=True)
class HookSettings:
    """What a hook does, validated once: the arguments of :func:`tagc.hook`, documented here (why and how each
    behaves, at length: ``docs/guide.md``, "The hook", the paragraph named in brackets below).

    ``select`` holds the resolved policy (a callable), ``codec_options`` the codec's options with
    its defaults filled in, ``ranks_per_host`` the resolved value (torchrun's ``LOCAL_WORLD_SIZE``
    when not given), ``dense_steps`` the value given (``None``: the codec's default, resolved by
    :meth:`warmup_steps`). ``ratio``, ``index_bits``, ``sparsity``, ``lane``, ``seed``, ``fallback`` and
    ``min_compress_numel`` are the fields of ``config`` (:class:`~tagc.config.TAGCConfig`).

    Arguments of :func:`tagc.hook`:
        ratio, index_bits, sparsity: :class:`~tagc.config.TAGCConfig`'s (``ratio``'s default here: 4.5 for ``tagc``,
            1.2 for ``topk``); like its other fields they apply to ``tagc`` and ``topk`` only, an error elsewhere.
        select: which parameters to compress: ``"non_attention_linear"`` (default), ``"all"``, ``"none"`` or a
            callable ``(param_fqn, module) -> bool``, which for ``tagc`` and ``topk`` may return a parameter's own
            ratio instead of ``True`` (:func:`tagc.hooks.core.selection.ratio_for`) [Models you did not write].
        codec: how the selected columns cross the wire, one of :func:`tagc.hooks.codecs.registry.codec_names`:
            ``"tagc"``, ``"plain"`` (the fair uncompressed reduce-scatter, for baselines) or a peer [Codecs].
        overlap: launch each bucket's exchange once its gradient is packed and finish them all at the end of the
            backward pass (SimpleFSDP eager, FSDP2, DDP); ``False`` blocks per bucket [Overlapped by default].
        nonfinite: ``"propagate"`` or ``"raise"`` (``FloatingPointError`` on every rank once the exchange is
            complete), the same in eager and compiled models [NaN/Inf].
        residual_dtype: error-feedback residual dtype (``torch.bfloat16`` halves its memory) [Memory].
        min_part: compressed columns are cut into pipeline parts of at least this many elements (part ``k+1``
            is compressed while part ``k`` is on the wire; a codec that batches takes parts of one size in one call).
        dense_steps: send everything uncompressed for the first this many steps, counted by
            :meth:`TAGCHook.end_step` (or a bucket seen twice). ``None`` (default): :data:`DENSE_STEPS` (10) for the
            error-feedback codecs (``tagc``, ``topk``, ``sign``, ``powersgd``), 0 for the others. A compiled model
            recompiles once after it (its graph guards on :attr:`TAGCHook.warmed_up`) [Warm-up, per-parameter ratios].
        plain: the codec of the columns not sparsified (those ``select`` leaves alone, and everything during
            ``dense_steps``): ``"fp32"`` (as they are), ``"bf16"``, ``"fp8"`` or ``"int4"``
            (:mod:`tagc.hooks.codecs.quantized`). ``None`` (default): ``"int4"`` for ``tagc`` and ``topk``,
            ``"fp32"`` for the others [The lean wire].
        hierarchy: ``"auto"`` (default): on several hosts, reduce plainly inside each host and compress only
            across hosts (:mod:`tagc.hooks.core.hierarchy`); ``"flat"``: one compressed exchange over the whole
            group [Several hosts].
        ranks_per_host: ranks per host, numbered host-major as torchrun does; must divide the world size.
            ``None`` (default): torchrun's ``LOCAL_WORLD_SIZE`` when set, else one host.
        piece_bytes: bytes per peer of each all-to-all piece. ``None`` (default): pieces of
            :data:`~tagc.hooks.core.transport.PIECE_BYTES` on gloo, whole collectives on NCCL; a number cuts
            pieces on every backend.
        side_stream: on CUDA, run the codec work on a side stream of the hook's (:mod:`tagc.hooks.core.eager`);
            ``False``: on the caller's stream. No effect on the CPU.
        feedback: ``"classic"`` (the codec's own error feedback) or ``"ef21"`` (:mod:`tagc.hooks.codecs.feedback`).
            Error-feedback codecs only, with ``residual_dtype=torch.float32``. ``None`` (default): ``"ef21"`` for
            ``tagc`` and ``topk``, ``"classic"`` for the others [Error feedback of another kind (TAGC's default)].
        feedback_decay: with ``"ef21"``, the factor ``gamma`` every rank's shift fades by each step:
            ``h = gamma h + C(g - gamma h)``; 1: EF21 as published. ``None`` (default): 0.9 when ``tagc`` or
            ``topk`` runs EF21, else 1 [Error feedback of another kind (TAGC's default)].
        **options: the other :class:`~tagc.config.TAGCConfig` fields (``lane``, ``seed``, ``fallback``,
            ``min_compress_numel``), or the codec's own options (:data:`tagc.hooks.codecs.registry.SPECS`, e.g.
            ``block`` for ``int4``). The wire of ``tagc`` and ``topk``: ``positions`` (default ``"coded"``, each
            rank's support Elias-Fano coded, :mod:`tagc.sketch.positions`; else ``"bitmap"`` for ``tagc``, its
            default with ``index_bits=4``, ``"offsets"`` for ``topk``) and ``value_dtype`` (default ``"float16"``
            for ``tagc``, ``"float8"`` for ``topk``, which alone it suits); ``positions="bitmap"``,
            ``value_dtype="float32"`` are the paper's wire [The lean wire].
    """

    config: TAGCConfig = dataclasses.field(default_factory=TAGCConfig)
    select: str | SelectPolicy = "non_attention_linear"
    nonfinite: str = "propagate"
    residual_dtype: torch.dtype = torch.float32
    min_part: int = MIN_PART
    piece_bytes: int | None = None
    dense_steps: int | None = None
    codec: str = "tagc"
    overlap: bool = True
    codec_options: Mapping[str, Any] | None = None
    plain: str = "fp32"
    hierarchy: str = "auto"
    ranks_per_host: int | None = None
    side_stream: bool = True
    feedback: str = "classic"
    feedback_decay: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.config, TAGCConfig):
            raise TypeError(f"config must be a tagc.config.TAGCConfig, got {type(self.config).__name__}")
        object.__setattr__(self, "hierarchy", check_hierarchy(self.hierarchy))
        object.__setattr__(self, "ranks_per_host", resolve_ranks_per_host(self.ranks_per_host))
        if self.plain not in PLAIN_CODECS:
            raise ValueError(f"plain must be one of {tuple(PLAIN_CODECS)} (the codec of the columns not sparsified), "
                             f"got {self.plain!r}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"nonfinite must be one of {NONFINITE} (see tagc.hooks.codecs.codec), got {self.nonfinite!r}")  # noqa: E501
        if self.residual_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"residual_dtype must be torch.float32 or torch.bfloat16, got {self.residual_dtype}")
        if not is_int(self.min_part) or self.min_part < 1:
            raise ValueError(f"min_part must be a positive integer, got {self.min_part!r}")
        if self.piece_bytes is not None and (not is_int(self.piece_bytes) or self.piece_bytes < 1):
            raise ValueError("piece_bytes must be None (pieces on gloo, whole collectives on NCCL) or a positive "
                             f"integer, got {self.piece_bytes!r}")
        if self.dense_steps is not None and (not is_int(self.dense_steps) or self.dense_steps < 0):
            raise ValueError(f"dense_steps must be a non-negative integer or None (the codec's default), "
                             f"got {self.dense_steps!r}")
        # a wrong type is a ValueError like every other bad setting (callers and tests catch one kind)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")  # noqa: TRY004
        if not isinstance(self.side_stream, bool):
            raise ValueError(f"side_stream must be True or False, got {self.side_stream!r}")  # noqa: TRY004
        object.__setattr__(self, "select", resolve_policy(self.select))
        object.__setattr__(self, "codec_options", resolve_options(self.codec, self.codec_options))
        check_feedback(self.feedback, self.feedback_decay)
        if self.feedback != "classic":
            if self.codec not in error_feedback_codecs():
                raise ValueError(f"feedback={self.feedback!r} changes a codec's error feedback; codec {self.codec!r} "
                                 f"has none: use one of {error_feedback_codecs()}, or feedback='classic'")
            if self.residual_dtype != torch.float32:
                raise ValueError(f"feedback={self.feedback!r} keeps each rank's shift in the residual, which a "
                                 f"{self.residual_dtype} residual would round at every step: use "
                                 "residual_dtype=torch.float32, or feedback='classic' (tagc.hook's default "
                                 "for codecs 'tagc' and 'topk' is 'ef21')")

    @classmethod
    def from_arguments(cls, ratio: float | None = None, index_bits: int | None = None,
                       sparsity: float | str | None = None, codec: str = "tagc", **settings) -> HookSettings:
        """:func:`tagc.hook`'s arguments, with the settings left out (``None``) filled in by
        :func:`recommended_settings`: the :class:`TAGCConfig` fields (``ratio``, ``index_bits``,
        ``sparsity`` and, among ``settings``, ``lane``, ``seed``, ``fallback``, ``min_compress_numel``)
        go to ``config``, the other names of this class to their fields, and what is left to
        ``codec_options``. A config field a codec does not use (not in its ``config_fields``) is an error that names
        what it takes."""
        codec_spec = spec(codec)
        own_options = {name: settings.pop(name) for name in list(settings) if name in codec_spec.options}
        filled = recommended_settings(codec, ratio, settings.pop("plain", None), settings.pop("feedback", None),
                                      settings.pop("feedback_decay", None), own_options, index_bits)
        ratio = filled["ratio"]
        settings.update(plain=filled["plain"], feedback=filled["feedback"],
                        feedback_decay=filled["feedback_decay"], **filled["options"])
        given = {"ratio": ratio, "index_bits": index_bits, "sparsity": sparsity}
        config_args = {name: value for name, value in given.items() if value is not None}
        config_args.update({name: settings.pop(name) for name in list(settings) if name in _CONFIG_FIELDS})
        misplaced = sorted(set(config_args) - set(SELECTION_FIELDS) - set(codec_spec.config_fields))
        if misplaced:
            takes = [name for name in codec_names() if set(misplaced) <= set(spec(name).config_fields)]
            own = f"its options are {tuple(codec_spec.options)}" if codec_spec.options else "it takes no options"
            if codec_spec.config_fields:
                own += f"; of the sketch's settings it takes {', '.join(codec_spec.config_fields)}"
            verb = "applies" if len(misplaced) == 1 else "apply"
            raise ValueError(f"{', '.join(misplaced)} {verb} only to codecs {tuple(takes)}, not to codec {codec!r} "
                             f"({own})")
        fields = {field.name for field in dataclasses.fields(cls)} - {"config", "codec_options"}
        options = {name: settings.pop(name) for name in list(settings) if name not in fields}
        return cls(config=TAGCConfig(**config_args), codec=codec, codec_options=options, **settings)

    def replace(self, **changes) -> HookSettings:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def make_codecs(self) -> tuple[Codec, Codec]:
        """``(codec, plain)``: the codec of the selected columns, and the one of the columns left plain (and of a
        dense warm-up)."""
        codec = make_codec(self.codec, self.config, self.residual_dtype, self.codec_options)
        codec = with_feedback(codec, self.feedback, self.feedback_decay)
        plain = make_codec(PLAIN_CODECS[self.plain], self.config)
        return codec, plain

    def warmup_steps(self, codec: Codec) -> int:
        """Steps sent plain first: ``dense_steps``, or when it is ``None`` :data:`DENSE_STEPS` for an
        error-feedback codec and 0 for the others."""
        if self.dense_steps is not None:
            return self.dense_steps
        return DENSE_STEPS if codec.error_feedback else 0

    def agreed(self, codec: Codec, select_fingerprint: str) -> dict:
        """Every setting that changes what crosses the wire, or when: must agree across ranks
        (:mod:`tagc.hooks.core.verify`). ``select`` is compared by what it selects (its fingerprint)."""
        return {**dataclasses.asdict(self.config), "codec": codec.name,
                "codec_options": sorted(self.codec_options.items()), "select": select_fingerprint,
                "min_part": self.min_part, "piece_bytes": self.piece_bytes, "dense_steps": self.warmup_steps(codec),
                "nonfinite": self.nonfinite, "plain": self.plain,
                "hierarchy": self.hierarchy, "ranks_per_host": self.ranks_per_host, "feedback": self.feedback,
                "feedback_decay": self.feedback_decay}
