"""The methods the compare puts side by side (:data:`METHODS`): what a user would pick instead of TAGC, each a
:class:`~gpt2_bench.config.TrainConfig` change on the same model, tokens, seed and transport, so only the gradient codec
differs; :data:`LAYOUT_METHODS` adds the DDP and HSDP layouts'. The dense warm-up goes to every codec with error
feedback; no method sets ``param_dtype``, so the compare's ``--param-dtype`` reaches every method that gathers
parameters alike. The list and what each is: docs/results.md, "Who wins at which share"."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpt2_bench.config import TrainConfig, library_dense_steps

LEAN_RATIO = 7.0
"""The lean methods' ratio, one for both sparse codecs (docs/results.md, "LEAN_RATIO")."""
PAPER_RATIO = 10.0
"""The TAGC paper's ratio: the compare's ``--ratio`` default, for the paper's methods and ``topk``."""
INT4_RATIO = 4.5
"""``tagc-int4``'s ratio: the densest TAGC whose step sends no more than ``int4`` (docs/results.md, "RECOMMENDED")."""
F8_TOPK_RATIO = 1.2
"""``topk-f8``'s ratio: the densest list whose step sends no more than ``tagc-int4`` (docs/results.md,
"F8_TOPK_RATIO")."""
FADE = 0.9
"""``tagc-int4``'s ``feedback_decay`` (docs/quality-diagnosis.md, "Sixth screen")."""

PAPER_WIRE = {"plain": "fp32", "feedback": "classic",
              "codec_options": {"positions": "bitmap", "value_dtype": "float32"}}
"""The TAGC paper's wire, which ``tagc.hook()`` no longer defaults to: the other columns in fp32, the codec's own
error feedback, full support bitmaps and float32 cells. The paper's methods and the older TAGC ones set it."""

def on_the_papers_wire(base: TrainConfig) -> dict:
    """The fields that put ``base``'s TAGC on the paper's wire (:data:`PAPER_WIRE`) wherever the library filled a
    setting in; a setting the caller gave (a flag) stays as given."""
    given = {**{name: getattr(base, name) for name in PAPER_WIRE}, **base.as_given()}
    fields = {name: value for name, value in PAPER_WIRE.items() if name != "codec_options" and given[name] is None}
    fields["codec_options"] = {**PAPER_WIRE["codec_options"], **(given["codec_options"] or {})}
    return fields


METHODS: dict[str, dict] = {
    "fsdp": {"compression": "none"},
    "fsdp-bf16": {"compression": "none", "reduce_dtype": "bf16"},
    "bf16": {"compression": "all", "codec": "bf16"},
    "fp8": {"compression": "all", "codec": "fp8"},
    "int4": {"compression": "all", "codec": "int4"},
    "topk": {"compression": "non-attn", "codec": "topk", "plain": "fp32", "feedback": "classic",
             "codec_options": {"positions": "offsets", "value_dtype": "float32"}},
    "sign": {"compression": "all", "codec": "sign"},
    "powersgd": {"compression": "all", "codec": "powersgd"},
    "tagc-all": {"compression": "all", "codec": "tagc", **PAPER_WIRE},
    "tagc-non-attn": {"compression": "non-attn", "codec": "tagc", **PAPER_WIRE},
    "tagc-ef21": {"compression": "non-attn", "codec": "tagc", **PAPER_WIRE, "feedback": "ef21", "feedback_decay": 1.0},
    "tagc-int4": {"compression": "non-attn", "codec": "tagc", "plain": "int4", "ratio": INT4_RATIO,
                  "codec_options": {"positions": "coded", "value_dtype": "float16"}, "feedback": "ef21",
                  "feedback_decay": FADE},
    "topk-int4": {"compression": "non-attn", "codec": "topk", "plain": "int4", "ratio": INT4_RATIO,
                  "codec_options": {"positions": "coded", "value_dtype": "bfloat16"}, "feedback": "ef21",
                  "feedback_decay": FADE},
    "topk-f8": {"compression": "non-attn", "codec": "topk", "plain": "int4", "ratio": F8_TOPK_RATIO,
                "codec_options": {"positions": "coded", "value_dtype": "float8"}, "feedback": "ef21",
                "feedback_decay": FADE},
    "tagc-lean": {"compression": "non-attn", "codec": "tagc", "plain": "bf16", "ratio": LEAN_RATIO,
                  "codec_options": {"positions": "coded", "value_dtype": "float16"}, "feedback": "classic"},
    "topk-lean": {"compression": "non-attn", "codec": "topk", "plain": "bf16", "ratio": LEAN_RATIO,
                  "codec_options": {"positions": "coded", "value_dtype": "bfloat16"}, "feedback": "classic"},
    "powersgd-lean": {"compression": "all", "codec": "powersgd", "plain": "bf16",
                      "codec_options": {"value_dtype": "bfloat16"}},
}
"""Method name -> the :class:`TrainConfig` fields it sets."""

PAPER_METHODS = ("fsdp", "tagc-all", "tagc-non-attn")
"""The TAGC paper's three runs: the compare's default."""

def parse_methods(text: str) -> tuple[str, ...]:
    """``"fsdp,int4"`` -> ``("fsdp", "int4")``; ``"peers"`` means every method, ``"paper"`` the paper's three."""
    names: list[str] = []
    for name in (part.strip() for part in text.split(",")):
        expanded = tuple(METHODS) if name == "peers" else PAPER_METHODS if name == "paper" else (name,)
        for method in expanded:
            if method not in METHODS:
                raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}, "
                                 f"or 'peers' (all), 'paper'")
            if method not in names:
                names.append(method)
    if not names:
        raise ValueError("--methods is empty")
    return tuple(names)


def _with_method(base: TrainConfig, method: str, settings: dict) -> TrainConfig:
    """``base`` with a method's codec ``settings`` and its name; the dense warm-up only for error-feedback codecs."""
    reset = ("codec", "reduce_dtype", "plain", "torch_hook", "feedback", "feedback_decay", "feedback_decay_follows_lr")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in reset}  # = the library's
    fields = {"codec_options": {}, **defaults, **settings}
    if not library_dense_steps(fields["codec"], fields["compression"]):  # no error feedback: nothing to warm up
        fields["dense_steps"] = 0
    return base.copy_with(**{"name": method + param_suffix(base.param_dtype), **fields})


def param_suffix(param_dtype: str | None) -> str:
    """What a run's name gains from its parameter all-gather dtype: ``-param-bf16``; none for
    the parameters' own (fp32), so runs made before ``--param-dtype`` keep their names."""
    return f"-param-{param_dtype}" if param_dtype else ""


# ----------------------------------------------------------------------------- layouts

LAYOUTS = ("flat", "ddp", "hsdp")
"""How the model is laid out over the ranks: ``flat`` FSDP (sharded over every rank; the parameters'
all-gathers cross the slow link), ``ddp`` (replicated; only the gradient crosses, as an all-reduce),
``hsdp`` (FSDP2: sharded within a host, replicated across hosts)."""

LAYOUT_FIELDS: dict[str, dict] = {
    "flat": {},
    "ddp": {"integration": "ddp", "hosts": 2, "world": 2, "param_dtype": None},  # DDP gathers no parameters
    "hsdp": {"integration": "fsdp2", "hsdp": True, "hosts": 2, "world": 4},
}
"""The :class:`TrainConfig` fields a layout sets: the DDP layout on 2 emulated hosts x 1 rank (the
paper's 2 hosts with 1 GPU each), HSDP on 2 x 2. DDP drops the compare's ``param_dtype`` (it gathers no
parameters); HSDP keeps it (its gathers within a host are FSDP's)."""


HIGH_POWERSGD_RANK = 16
"""The higher PowerSGD rank the DDP layout adds, ours and torch's alike: rank 4 trailed plain DDP's loss in the
earlier protocol's screens (``docs/layout.md``, "Loss under DDP"); rank 16's loss is judged in ``docs/evidence.md``
(``powersgd-r16``)."""


POWERSGD_RANKS = {4: "", HIGH_POWERSGD_RANK: f"-r{HIGH_POWERSGD_RANK}"}
"""Rank 4 (Vogels et al.'s language model, our codec's default) and :data:`HIGH_POWERSGD_RANK`, each with its
name's suffix."""


OURS_ON_A_LAYOUT = {"tagc": "tagc-non-attn", **{name: name for name in (
    "tagc-ef21", "tagc-int4", "topk-int4", "topk-f8", "tagc-lean", "topk-lean", "int4", "powersgd", "powersgd-lean")}}
"""Our codecs on the DDP and HSDP layouts -> the flat method with the same settings (``tagc``: the paper's
selection, the non-attention linears, at ``--ratio``)."""

LAYOUT_METHODS: dict[str, dict[str, dict]] = {
    "flat": {name: METHODS[name] for name in ("fsdp", "fsdp-bf16", *OURS_ON_A_LAYOUT.values())},
    "ddp": {"ddp": {"compression": "none", "transport": "gloo"},  # DDP's own fp32 all-reduce, no hook
            "ddp-bf16": {"compression": "all", "codec": "bf16", "torch_hook": True},  # torch's bf16_compress_hook
            **{f"ddp-powersgd{suffix}": {"compression": "all", "codec": "powersgd", "torch_hook": True,
                                         "codec_options": {"rank": rank}}
               for rank, suffix in POWERSGD_RANKS.items()},  # torch's powerSGD_hook
            **{name: METHODS[flat] for name, flat in OURS_ON_A_LAYOUT.items()},  # ours, through tagc.ddp_hook
            **{f"powersgd{suffix}": {**METHODS["powersgd"], "codec_options": {"rank": rank}}
               for rank, suffix in POWERSGD_RANKS.items() if suffix}},  # ours at torch's other ranks
    "hsdp": {"hsdp": METHODS["fsdp"], "hsdp-bf16": METHODS["fsdp-bf16"],
             **{name: METHODS[flat] for name, flat in OURS_ON_A_LAYOUT.items()}},
}
"""Per layout, its methods' :class:`TrainConfig` fields (the layout's own, :data:`LAYOUT_FIELDS`, come on top)."""

LAYOUT_BASELINES = {"flat": ("fsdp", "fsdp-bf16"), "ddp": ("ddp", "ddp-bf16"), "hsdp": ("hsdp", "hsdp-bf16")}
"""Per layout, ``(its plain fp32 method, its bf16 baseline)``: what its rows' speed-ups and losses are set against."""

FLAT_PEER = {"ddp": "fsdp", "ddp-bf16": "fsdp-bf16", "ddp-powersgd": "powersgd", "hsdp": "fsdp",
             "hsdp-bf16": "fsdp-bf16",
             **{name: flat for name, flat in OURS_ON_A_LAYOUT.items()}}
"""A layout's method -> the flat-FSDP method with the same codec (the report puts them side by side)."""


def layout_config(base: TrainConfig, layout: str, method: str, link: str | None = None) -> TrainConfig:
    """``base`` with ``layout``'s fields and ``method``'s codec settings (``flat``: any of :data:`METHODS`),
    on ``link`` (a rate; emulated hosts cannot take ``"scaled"``: it is resolved before). Its run is
    named ``<layout>-<method>`` (``ddp-tagc``), or the method where it names its layout (``hsdp-bf16``),
    torch's hooks ``<method>-torch`` (``ddp-powersgd-torch``, beside our ``ddp-powersgd``), each with its
    gather dtype's :func:`param_suffix` (``hsdp-tagc-param-bf16``; none under DDP)."""
    if layout not in LAYOUT_METHODS:
        raise ValueError(f"unknown layout {layout!r}: choose from {', '.join(LAYOUTS)}")
    known = METHODS if layout == "flat" else LAYOUT_METHODS[layout]  # flat: every method; beside a layout: its peers
    if method not in known:
        raise ValueError(f"unknown method {method!r} for layout {layout!r}: choose from {', '.join(known)}")
    fields = {**LAYOUT_FIELDS[layout], **({"link": link} if link is not None else {})}
    cfg = _with_method(dataclasses.replace(base, **fields) if fields else base, method, known[method])
    name = (f"{method}-torch" if cfg.torch_hook else
            method if layout == "flat" or method.startswith(layout) else f"{layout}-{method}")
    return dataclasses.replace(cfg, name=name + param_suffix(cfg.param_dtype))


def parse_layout_methods(layout: str, text: str | None) -> tuple[str, ...]:
    """``"ddp,tagc"`` -> ``("ddp", "tagc")`` for ``layout``; ``None`` or ``"all"``: every method of the layout."""
    known = LAYOUT_METHODS[layout]
    if text is None or text == "all":
        return tuple(known)
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"unknown {layout} method(s) {unknown or text!r}: choose from {', '.join(known)}, or 'all'")
    return names


def round_order(methods: Sequence[str], round_index: int) -> list[str]:
    """The methods in round ``round_index``'s order: every other round reversed, so that a drift over
    the session (machine load, thermals) lands on every method alike."""
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))
