"""The TAGC paper's wire, which ``tagc.hook()`` no longer defaults to (its codec ``tagc`` fills what is left out from
:data:`tagc.hooks.core.settings.RECOMMENDED`): the tests of the classic codec's mechanics (exact sums, wire-byte
formulas,
residual conservation, bit-for-bit equalities) pass it explicitly, so that they keep testing that codec."""

from __future__ import annotations

PAPER_WIRE = {"plain": "fp32", "feedback": "classic", "feedback_decay": 1.0, "positions": "bitmap",
              "value_dtype": "float32"}
"""``tagc.hook(**PAPER_WIRE)``: the other columns as they are, the codec's own error feedback, no fading (so that a
test that also passes ``feedback="ef21"`` gets EF21 as published, as ``tagc.hook(feedback="ef21")`` was), full support
bitmaps and float32 sketch cells. ``positions`` and ``value_dtype`` are options of codec ``tagc`` (an error for a codec
without them): use it only with codec ``tagc`` (:func:`paper` checks the codec)."""

PAPER_RATIO = 10.0
"""The paper's count-sketch ratio (``tagc.hook()``'s before it took the recommended 4.5)."""


def paper_train_config() -> dict:
    """The :class:`gpt2_bench.config.TrainConfig` fields of the paper's wire and ratio for codec ``tagc`` (a fresh
    ``codec_options`` dict each call, so no test shares one)."""
    return {"ratio": PAPER_RATIO, "plain": "fp32", "feedback": "classic", "feedback_decay": 1.0,
            "codec_options": {"positions": "bitmap", "value_dtype": "float32"}}


PAPER_STYLE_TOPK = {"plain": "fp32", "feedback": "classic", "feedback_decay": 1.0, "positions": "offsets",
                    "value_dtype": "float32"}
"""``tagc.hook(codec="topk", ratio=PAPER_RATIO, **PAPER_STYLE_TOPK)``: the list as ``tagc.hook(codec="topk")`` was
before it took its recommended setting (ratio 1.2, float8 values, the rest as ``tagc``'s): the paper's selection sent
as an offset list of float32 values, the other columns as they are, classic error feedback."""


def paper(**settings) -> dict:
    """``settings`` for :func:`tagc.hook`, on the paper's ratio and wire (:data:`PAPER_WIRE`) where the codec is
    ``tagc`` (the default), or the paper-style list (:data:`PAPER_STYLE_TOPK`) where it is ``topk``, and ``settings``
    leave them out; other codecs' settings as they are (their defaults did not change)."""
    codec = settings.get("codec", "tagc")
    if codec == "topk":
        return {"ratio": PAPER_RATIO, **PAPER_STYLE_TOPK, **settings}
    if codec != "tagc":
        return settings
    return {"ratio": PAPER_RATIO, **PAPER_WIRE, **settings}
