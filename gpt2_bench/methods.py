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
  keep the cells' mixed magnitudes; bf16 cost it +0.95 points of val loss at 300 steps; topk: bf16,
  its rounding fed back), and the uncompressed columns in bf16 (``plain``);
  both at :data:`LEAN_RATIO`, the sweep's pick;
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
"""The lean methods' ratio: the fewest bytes that kept val loss within 1% of fsdp's in the
300-step quality sweep (small preset, 2 ranks, lr 2e-3, 10 dense steps; val loss vs fsdp's 6.8951):

==========================  ========================  ========================
setting                     tagc-lean (MB/step)       topk-lean (MB/step)
==========================  ========================  ========================
ratio 5                     +0.17% (8.95)             +0.37% (5.58)
ratio 7                     +0.63% (7.22)             +0.85% (4.81)
ratio 10                    +1.18% (5.90)             +1.28% (4.21)
ratio 10, 40-step ramp      +1.28% (5.90)             +1.04% (4.21)
ratio 10, embedding at 4    +1.13% (9.12)             +1.15% (5.65)
ratio 16                    +1.26% (4.74)             +1.69% (3.68)
==========================  ========================  ========================

Neither DGC's density ramp (``--ramp-steps``) nor a denser tied embedding / LM head
(``--embedding-ratio``) beats a lower ratio for everything: at about 9 MB per step, ratio 5
ends +0.17% and ratio 10 with the embedding at 4 +1.13%. A 30-step warm-up gained nothing
over 10 steps at ratio 7 (+0.64% against +0.63%). Noise is about +-0.8 points.

These are 300-step figures. Over 2,000 steps (the same settings, fsdp's val loss 6.1346) TAGC
on the default wire ends +1.91% at ratio 10, +2.57% at ratio 7 and +1.10% at ratio 4, and
``powersgd-lean`` +1.25%; ``powersgd`` ends +0.97% and ``int4`` +0.81% (README, "Which ratio
keeps plain's loss").

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
