"""The methods the compare puts side by side: what a user would pick instead of TAGC.

Each method is a :class:`~gpt2_bench.config.TrainConfig` change on the same model, tokens, seed,
integration and fair overlapped transport, so only the gradient codec differs:

* ``fsdp`` - plain fp32 reduce-scatter (the fair all-to-all transport);
* ``fsdp-bf16`` - FSDP's own ``reduce_dtype=torch.bfloat16``: the gradient is cast to bf16 before
  the reduce-scatter and the reduced shard stays bf16 (the reference for our ``bf16``);
* ``bf16``, ``fp8``, ``int4`` - low-precision transports on every layer, summed in fp32 at
  the owner (``int4``: ZeRO++ qgZ-style blockwise);
* ``sign`` - 1 bit per element and a scale per block, error feedback (1-bit Adam's compressor);
* ``powersgd`` - rank-r PowerSGD with error feedback on every matrix;
* ``topk`` - TAGC's own selection and error feedback on the non-attention layers, the kept
  values sent as a list instead of a sketch (TAGC without its sketch);
* ``tagc-all``, ``tagc-non-attn`` - TAGC on every layer / on the non-attention linears;
* ``tagc-lean``, ``topk-lean`` - the lean wire on both sparse codecs alike: coded positions
  (Elias-Fano), 16-bit sketch cells / values (TAGC: scaled float16, whose 11 significant bits
  keep the cells' mixed magnitudes, which bf16's 8 round away; topk: bf16, its rounding fed
  back), and the uncompressed columns in bf16 (``plain``); both at :data:`LEAN_RATIO`;
  ``powersgd-lean`` - the same bf16 trick where it applies to PowerSGD (P, Q and the
  shape-less columns in bf16, as DDP's ``bf16_compress_wrapper``).

Fairness: the dense warm-up (``dense_steps``) goes to every codec with error feedback, since
it serves all of them alike; the others have nothing to warm up.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from gpt2_bench.config import TrainConfig

LEAN_RATIO = 7.0
"""The lean methods' ratio: the fewest bytes per step that kept their val loss within 1% of fsdp's
in the lean-wire quality sweep over ratios, a density ramp and a denser embedding (the sweep and
its caveats: ``docs/results.md``, "Defaults and how they were chosen"). One ratio for both sparse
codecs, so ``tagc-lean`` and ``topk-lean`` differ only in how the kept entries travel.

``--ratio`` sets the other TAGC and top-k methods' ratio (the paper's 10 by default)."""

METHODS: dict[str, dict] = {
    "fsdp": dict(compression="none"),
    "fsdp-bf16": dict(compression="none", reduce_dtype="bf16"),
    "bf16": dict(compression="all", codec="bf16"),
    "fp8": dict(compression="all", codec="fp8"),
    "int4": dict(compression="all", codec="int4"),
    "topk": dict(compression="non-attn", codec="topk"),
    "sign": dict(compression="all", codec="sign"),
    "powersgd": dict(compression="all", codec="powersgd"),
    "tagc-all": dict(compression="all", codec="tagc"),
    "tagc-non-attn": dict(compression="non-attn", codec="tagc"),
    "tagc-lean": dict(compression="non-attn", codec="tagc", plain="bf16", ratio=LEAN_RATIO,
                      codec_options={"positions": "coded", "value_dtype": "float16"}),
    "topk-lean": dict(compression="non-attn", codec="topk", plain="bf16", ratio=LEAN_RATIO,
                      codec_options={"positions": "coded", "value_dtype": "bfloat16"}),
    "powersgd-lean": dict(compression="all", codec="powersgd", plain="bf16", codec_options={"value_dtype": "bfloat16"}),
}
"""Method name -> the :class:`TrainConfig` fields it sets."""

PLAIN_METHOD = "fsdp"
"""The method every other is measured against."""

PAPER_METHODS = ("fsdp", "tagc-all", "tagc-non-attn")
"""The TAGC paper's three runs: the compare's default."""

ERROR_FEEDBACK = ("topk", "sign", "powersgd", "tagc")
"""Codecs with error-feedback state: the ones a dense warm-up serves."""


def parse_methods(text: str) -> tuple[str, ...]:
    """``"fsdp,int4"`` -> ``("fsdp", "int4")``; ``"peers"`` means every method, ``"paper"`` the paper's three."""
    names: list[str] = []
    for name in (part.strip() for part in text.split(",")):
        expanded = tuple(METHODS) if name == "peers" else PAPER_METHODS if name == "paper" else (name,)
        for method in expanded:
            if method not in METHODS:
                raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}, or 'peers' (all), 'paper'")
            if method not in names:
                names.append(method)
    if not names:
        raise ValueError("--methods is empty")
    return tuple(names)


def method_config(base: TrainConfig, method: str) -> TrainConfig:
    """``base`` with ``method``'s codec settings (and its own run name)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    fields = {"codec": "tagc", "reduce_dtype": None, "codec_options": {}, "plain": "fp32", **METHODS[method]}
    if fields.get("codec") not in ERROR_FEEDBACK or fields["compression"] == "none":
        fields["dense_steps"] = 0
    if fields.get("codec") not in ("tagc", "topk") or fields["compression"] == "none":  # the ratio's own settings
        fields.update(ramp_steps=0, embedding_ratio=None)
    return dataclasses.replace(base, name=method, **fields)


def round_order(methods: Sequence[str], round_index: int) -> list[str]:
    """The methods in round ``round_index``'s order: every other round reversed, so that a drift over
    the session (machine load, thermals) lands on every method alike."""
    return list(methods) if round_index % 2 == 0 else list(reversed(methods))
