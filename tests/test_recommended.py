"""What ``tagc.hook()`` fills in for the settings a caller leaves out (:data:`tagc.hooks.core.settings.RECOMMENDED`):
codecs ``tagc``'s and ``topk``'s recommended settings, every argument given overriding only its part, the other
codecs' neutral defaults; and the compare, whose paper methods still run the TAGC paper's codec and whose ``topk``
method is still the paper-style list."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tagc
from tagc.config import TAGCConfig
from tagc.hooks.codecs.registry import resolve_options
from tagc.hooks.core.settings import NEUTRAL, RECOMMENDED, HookSettings
from tests.paper_wire import PAPER_RATIO, PAPER_STYLE_TOPK, PAPER_WIRE

TAGC_RECOMMENDED = {"ratio": 4.5, "plain": "int4", "feedback": "ef21", "feedback_decay": 0.9, "positions": "coded",
                    "value_dtype": "float16"}
"""Codec tagc's recommended setting as documented (``RECOMMENDED``'s docstring, docs/quality-diagnosis.md)."""

TOPK_RECOMMENDED = {**TAGC_RECOMMENDED, "ratio": 1.2, "value_dtype": "float8"}
"""Codec topk's: the compare's ``topk-f8`` (docs/quality-diagnosis.md, tenth screen)."""

PAPER_TOPK = {"ratio": PAPER_RATIO, **PAPER_STYLE_TOPK}
"""topk with the neutral settings and its own option defaults: ``tagc.hook(codec="topk")`` before the recommendation,
and the compare's ``topk`` method."""

PAPER = {"ratio": PAPER_RATIO, "plain": "fp32", "feedback": "classic", "feedback_decay": 1.0, "positions": "bitmap",
         "value_dtype": "float32"}
"""The TAGC paper's codec: ``tagc.hook()`` before the recommended setting."""


def _resolved(settings: HookSettings) -> dict:
    """The six settings the recommendation covers, as a hook resolved them (the codec options flattened in)."""
    return {"ratio": settings.config.ratio, "plain": settings.plain, "feedback": settings.feedback,
            "feedback_decay": settings.feedback_decay, **settings.codec_options}


def test_recommended_holds_the_documented_setting_and_neutral_the_old_defaults():
    assert RECOMMENDED == {"tagc": TAGC_RECOMMENDED, "topk": TOPK_RECOMMENDED}
    assert NEUTRAL == {"plain": "fp32", "feedback": "classic", "feedback_decay": 1.0}
    fields = {field.name: field.default for field in dataclasses.fields(HookSettings) if field.name in NEUTRAL}
    assert fields == NEUTRAL  # HookSettings' own field defaults stay the neutral ones


def test_tagc_hook_with_no_arguments_is_codec_tagcs_recommended_setting():
    hook = tagc.hook()
    assert _resolved(hook.settings) == TAGC_RECOMMENDED
    assert hook.dense_steps == 10 and hook.codec.name == "tagc"
    assert type(hook.codec).__name__ == "EF21Codec" and hook.codec.decay == 0.9  # EF21 wraps the codec
    assert hook.codec.inner.positions == "coded" and hook.codec.inner.value_dtype == torch.float16
    assert hook.plain.name == "int4" and hook.settings.config.ratio == 4.5
    # nothing else moved: the same settings as the neutral ones with the recommended six set
    assert hook.settings == HookSettings(
        config=TAGCConfig(ratio=4.5), plain="int4", feedback="ef21", feedback_decay=0.9,
        codec_options={"positions": "coded", "value_dtype": "float16"})
    assert tagc.hook(codec="tagc").settings == hook.settings


@pytest.mark.parametrize("given, changed", [
    ({"ratio": 10}, {"ratio": 10.0}),
    ({"plain": "fp32"}, {"plain": "fp32"}),
    ({"plain": "bf16"}, {"plain": "bf16"}),
    ({"feedback": "classic"}, {"feedback": "classic", "feedback_decay": 1.0}),  # no fading without EF21
    ({"feedback": "ef21"}, {}),  # EF21 named: still tagc's fading
    ({"feedback_decay": 0.5}, {"feedback_decay": 0.5}),
    ({"feedback": "ef21", "feedback_decay": 1.0}, {"feedback_decay": 1.0}),  # EF21 as published
    ({"positions": "bitmap"}, {"positions": "bitmap"}),  # the cells stay float16
    ({"value_dtype": "float32"}, {"value_dtype": "float32"}),  # the positions stay coded
    ({"value_dtype": torch.bfloat16}, {"value_dtype": torch.bfloat16}),  # kept as given
    ({"ratio": 10, "positions": "bitmap", "value_dtype": "float32"},
     {"ratio": 10.0, "positions": "bitmap", "value_dtype": "float32"}),
    (PAPER_WIRE, {name: PAPER[name] for name in PAPER_WIRE}),
    ({"ratio": PAPER_RATIO, **PAPER_WIRE}, PAPER),
], ids=["ratio", "plain-fp32", "plain-bf16", "classic", "ef21", "decay", "ef21-published", "bitmap", "cells-fp32",
        "cells-bf16", "ratio-bitmap-fp32", "paper-wire", "paper"])
def test_each_argument_given_overrides_only_its_part(given, changed):
    assert _resolved(tagc.hook(**given).settings) == {**TAGC_RECOMMENDED, **changed}


def test_the_papers_codec_is_the_neutral_settings():
    """``tagc.hook(ratio=10, **PAPER_WIRE)`` is ``HookSettings()`` field for field: the codec tagc.hook() was."""
    assert tagc.hook(ratio=PAPER_RATIO, **PAPER_WIRE).settings == HookSettings()
    assert _resolved(HookSettings()) == PAPER


def test_topk_hook_with_no_arguments_is_topk_f8():
    hook = tagc.hook(codec="topk")
    assert _resolved(hook.settings) == TOPK_RECOMMENDED
    assert hook.dense_steps == 10 and hook.codec.name == "topk"
    assert type(hook.codec).__name__ == "EF21Codec" and hook.codec.decay == 0.9
    assert hook.codec.inner.positions == "coded" and hook.codec.inner.value_dtype == torch.float8_e4m3fn
    assert hook.plain.name == "int4" and hook.settings.config.ratio == 1.2


@pytest.mark.parametrize("given, changed", [
    ({"ratio": 10}, {"ratio": 10.0}),
    ({"feedback": "classic"}, {"feedback": "classic", "feedback_decay": 1.0}),
    ({"feedback": "ef21"}, {}),  # EF21 named: still topk's fading
    ({"value_dtype": "float32"}, {"value_dtype": "float32"}),
    ({"ratio": 10, "plain": "fp32", "feedback": "classic", "positions": "offsets", "value_dtype": "float32"},
     PAPER_TOPK),
], ids=["ratio", "classic", "ef21", "values-fp32", "paper-style"])
def test_each_argument_given_to_topk_overrides_only_its_part(given, changed):
    assert _resolved(tagc.hook(codec="topk", **given).settings) == {**TOPK_RECOMMENDED, **changed}


@pytest.mark.parametrize("codec", ["int4", "powersgd", "sign", "bf16", "plain"])
def test_other_codecs_keep_the_neutral_defaults_and_no_tagc_options(codec):
    settings = tagc.hook(codec=codec).settings
    assert (settings.plain, settings.feedback, settings.feedback_decay) == ("fp32", "classic", 1.0)
    assert settings.config.ratio == TAGCConfig().ratio == 10.0  # the config's default
    assert dict(settings.codec_options) == resolve_options(codec, {})  # the codec's own option defaults only
    assert "coded" not in settings.codec_options.values() and "float16" not in settings.codec_options.values()
    assert settings == HookSettings(codec=codec)  # nothing filled in


@pytest.mark.parametrize("codec", ["powersgd", "sign"])
def test_ef21_on_another_codec_is_ef21_as_published(codec):
    settings = tagc.hook(codec=codec, feedback="ef21").settings
    assert (settings.feedback, settings.feedback_decay, settings.plain) == ("ef21", 1.0, "fp32")


def test_a_bf16_residual_under_tagcs_default_feedback_says_to_use_classic():
    with pytest.raises(ValueError) as raised:
        tagc.hook(residual_dtype=torch.bfloat16)
    assert "feedback='classic'" in str(raised.value) and "residual_dtype=torch.float32" in str(raised.value)
    hook = tagc.hook(residual_dtype=torch.bfloat16, feedback="classic")  # what the message says works
    assert hook.settings.residual_dtype == torch.bfloat16 and hook.settings.feedback == "classic"
    with pytest.raises(ValueError, match="'topk' is 'ef21'"):
        tagc.hook(codec="topk", residual_dtype=torch.bfloat16)
    classic_topk = tagc.hook(codec="topk", residual_dtype=torch.bfloat16, feedback="classic")
    assert classic_topk.settings.feedback == "classic"
    assert tagc.hook(codec="sign", residual_dtype=torch.bfloat16).settings.feedback == "classic"


# ----------------------------------------------------------------------------- the compare


def _compare_base():
    from gpt2_bench.compare import build_compare_parser
    from gpt2_bench.config import config_from_args

    return config_from_args(build_compare_parser().parse_args([]))


def _method(name: str):
    from gpt2_bench.methods import METHODS, _with_method

    return _with_method(_compare_base(), name, METHODS[name])


def _trained(config) -> dict:
    """The six settings a run of ``config`` trains with, as the hook the trainer builds resolves them."""
    from gpt2_bench.sharding import make_hook

    hook = make_hook(config)
    assert hook.settings.codec_options == resolve_options(config.codec, config.codec_options)
    return _resolved(hook.settings)


@pytest.mark.parametrize("method, compression", [("tagc-all", "all"), ("tagc-non-attn", "non-attn")])
def test_the_compares_paper_methods_still_run_the_papers_codec(method, compression):
    config = _method(method)
    assert (config.codec, config.compression, config.dense_steps) == ("tagc", compression, 10)
    assert (config.ratio, config.plain, config.feedback, config.feedback_decay) == (PAPER_RATIO, "fp32", "classic", 1.0)
    assert config.codec_options == {"positions": "bitmap", "value_dtype": "float32"}
    assert _trained(config) == PAPER


def test_the_compares_other_tagc_methods_keep_their_settings():
    assert _trained(_method("tagc-ef21")) == {**PAPER, "feedback": "ef21"}  # EF21 as published, on the paper's wire
    lean = _method("tagc-lean")
    assert (lean.feedback, lean.feedback_decay, lean.plain) == ("classic", 1.0, "bf16")
    assert _trained(_method("topk")) == PAPER_TOPK  # the compare's --ratio (the paper's), the neutral rest
    assert _trained(_method("topk-lean"))["feedback"] == "classic"


def test_the_compares_tagc_int4_is_tagc_hooks_recommended_setting():
    config = _method("tagc-int4")
    hook = tagc.hook()
    assert _trained(config) == _resolved(hook.settings) == TAGC_RECOMMENDED
    assert config.dense_steps == hook.dense_steps


def test_the_main_job_runs_the_papers_codec(tmp_path, monkeypatch):
    """``python -m gpt2_bench.compare`` with no mode flag (:func:`gpt2_bench.compare_paper.compare`): its plain runs
    are plain, and its TAGC runs on all and on the non-attention layers run the paper's codec, as before
    ``tagc.hook()`` took the recommended setting."""
    import gpt2_bench.launch as launch
    from gpt2_bench import compare_paper

    ran = []

    def fake_run(cfg, data_dir, link=None, attempts=1):  # the calibration's runs (launch.scaled_link) and the job's
        ran.append(cfg)
        return {"algorithm": "fsdp" if cfg.compression == "none" else cfg.codec, "compressed": cfg.compression,
                "iter_ms": 1000.0, "steady_iter_ms": [1000.0], "train_s": 10.0, "exchange_ms_per_mb": 50.0,
                "wire_bytes_per_rank": 1e6, "wire_bytes_per_step": 1e6, "val_loss": 6.0, "n_params": 10**6,
                "grad_mb": 4.0, "peel_success": None, "units": None, "curve": [],
                "integration": cfg.integration}

    monkeypatch.setattr(compare_paper, "run", fake_run)
    monkeypatch.setattr(launch, "run", fake_run)
    monkeypatch.setattr("gpt2_bench.data.prepare", lambda *a, **k: tmp_path)
    base = dataclasses.replace(_compare_base(), preset="tiny", out_dir=str(tmp_path))
    assert base.link == "scaled"
    compare_paper.compare(base)
    assert sum(cfg.compression == "none" for cfg in ran) >= 4  # two calibration runs, plain, plain without overlap
    compressed = {cfg.compression: cfg for cfg in ran if cfg.compression != "none"}
    assert sorted(compressed) == ["all", "non-attn"]
    for cfg in compressed.values():
        assert cfg.codec == "tagc" and _trained(cfg) == PAPER, cfg.compression
    assert all(cfg.feedback == "classic" and cfg.plain == "fp32" for cfg in ran if cfg.compression == "none")


def _codec_fields(cfg) -> dict:
    return {"ratio": cfg.ratio, "plain": cfg.plain, "feedback": cfg.feedback, "feedback_decay": cfg.feedback_decay,
            **cfg.codec_options}


def test_a_trainer_config_copy_leaves_what_the_library_filled_in_to_the_library_again():
    """``dataclasses.replace`` on a :class:`TrainConfig` whose codec settings the library filled in re-fills them for
    the copy's codec (a plain calibration run of a tagc config is a valid plain run; topk gets topk's defaults),
    while a setting the caller gave, or changes in the copy, stays; the bookkeeping is not part of the settings."""
    import json

    from gpt2_bench.config import TrainConfig

    tagc_cfg = TrainConfig()
    assert _codec_fields(tagc_cfg) == TAGC_RECOMMENDED
    plain_run = dataclasses.replace(tagc_cfg, compression="none")  # raised before: EF21 with compression none
    assert (plain_run.ratio, plain_run.plain, plain_run.feedback, plain_run.feedback_decay, plain_run.codec_options) \
        == (10.0, "fp32", "classic", 1.0, {})
    assert _codec_fields(dataclasses.replace(plain_run, compression="non-attn")) == TAGC_RECOMMENDED
    topk = dataclasses.replace(tagc_cfg, codec="topk")
    assert _codec_fields(topk) == TOPK_RECOMMENDED
    int4 = dataclasses.replace(tagc_cfg, codec="int4", compression="all")
    assert (int4.ratio, int4.plain, int4.feedback, int4.feedback_decay) == (10.0, "fp32", "classic", 1.0)
    assert int4.codec_options == {}
    changed = dataclasses.replace(tagc_cfg, plain="bf16")  # changed in the copy: kept, the rest still filled
    assert _codec_fields(changed) == {**TAGC_RECOMMENDED, "plain": "bf16"}
    given = TrainConfig(ratio=7.0, feedback="classic")
    copy = dataclasses.replace(given, steps=3)
    assert (copy.ratio, copy.feedback, copy.feedback_decay, copy.plain) == (7.0, "classic", 1.0, "int4")
    assert "library_filled" not in json.loads(tagc_cfg.to_json())
    assert TrainConfig(**json.loads(tagc_cfg.to_json())) == tagc_cfg  # a worker's copy runs the same settings


def test_a_4_bit_index_takes_bitmap_positions_by_default():
    """Coded positions code a set, which 4-bit rank counts are not: with ``index_bits=4`` the recommended setting
    keeps the bitmap (and everything else); asking for coded positions with it is still the codec's clear error."""
    from gpt2_bench.config import TrainConfig

    settings = tagc.hook(index_bits=4).settings
    assert settings.config.index_bits == 4
    assert _resolved(settings) == {**TAGC_RECOMMENDED, "positions": "bitmap"}
    assert TrainConfig(index_bits=4).codec_options == {"positions": "bitmap", "value_dtype": "float16"}
    with pytest.raises(ValueError, match="index_bits=1"):
        tagc.hook(index_bits=4, positions="coded")
    with pytest.raises(ValueError, match=r"index_bits applies only to codecs \('tagc',\), not to codec 'topk'"):
        tagc.hook(codec="topk", index_bits=4)  # topk's list is each rank's own: no index to size
    bench_topk = TrainConfig(codec="topk", index_bits=4)  # the bench's --index-bits reaches tagc alone
    assert bench_topk.codec_options == {"positions": "coded", "value_dtype": "float8"}
    assert "index_bits" not in bench_topk.hook_arguments()


@pytest.mark.parametrize("base_fields", [{"compression": "none"}, {"codec": "int4", "compression": "all"},
                                         {"codec": "topk"}, {}])
def test_the_papers_methods_run_the_papers_wire_whatever_the_base_filled_in(base_fields):
    """A compare whose command line names another codec, or no compression, still runs its paper methods on the
    paper's wire with the library's warm-up; an explicit setting of a copy made by ``copy_with`` stays."""
    from gpt2_bench.config import TrainConfig
    from gpt2_bench.methods import layout_config, on_the_papers_wire

    base = TrainConfig(ratio=PAPER_RATIO, **base_fields)
    for method in ("tagc-non-attn", "tagc-all"):
        cfg = layout_config(base, "flat", method)
        assert _codec_fields(cfg) == PAPER and cfg.dense_steps == 10, (method, base_fields)
    assert _codec_fields(layout_config(base, "flat", "tagc-int4")) == TAGC_RECOMMENDED
    paper = base.copy_with(compression="non-attn", codec="tagc", **on_the_papers_wire(base))
    assert _codec_fields(paper) == PAPER
    explicit = base.copy_with(compression="non-attn", codec="tagc", plain="fp32", feedback="classic")
    assert (explicit.plain, explicit.feedback, explicit.feedback_decay) == ("fp32", "classic", 1.0)


def test_the_compares_topk_f8_is_the_defaults_settings_at_their_bytes_with_the_densest_float8_list():
    """``topk-f8`` trains with every setting of ``tagc.hook()``'s defaults but the codec, its ratio and float8
    values; its FSDP step sends no more than ``tagc-int4``'s, and a step of 0.05 denser would (the arithmetic of
    :mod:`gpt2_bench.host_bytes`, 2 ranks, the small preset)."""
    from gpt2_bench import host_bytes
    from gpt2_bench.methods import F8_TOPK_RATIO, METHODS

    trained = _trained(_method("topk-f8"))
    assert _method("topk-f8").codec == "topk"
    assert trained == {**TAGC_RECOMMENDED, "ratio": F8_TOPK_RATIO, "value_dtype": "float8"}
    assert trained == TOPK_RECOMMENDED == _resolved(tagc.hook(codec="topk").settings)  # topk's defaults
    parts = {compression: host_bytes.model_parts("small", compression, block_size=128)
             for compression in ("none", "non-attn", "all")}

    def fsdp_bytes(name: str, ratio: float) -> float:
        method = {**host_bytes.ARITHMETIC_METHODS[name], "ratio": ratio}
        with pytest.MonkeyPatch.context() as patch:
            patch.setitem(host_bytes.ARITHMETIC_METHODS, name, method)
            return host_bytes.per_host_bytes("flat", name, 2, parts, ranks_per_host=1, param_bytes=0)[0]

    budget = fsdp_bytes("tagc-int4", METHODS["tagc-int4"]["ratio"])
    assert fsdp_bytes("topk-f8", F8_TOPK_RATIO) <= budget < fsdp_bytes("topk-f8", F8_TOPK_RATIO - 0.05)
