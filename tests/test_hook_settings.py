"""The hook's pieces on their own: one validated settings object, the exchange state, and a pending
bucket that works on what it is given (no distributed group: single-process checks)."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.hooks.core.eager import PendingBucket
from tagc.hooks.core.engine import TAGCHook
from tagc.hooks.core.exchange import PartCoder
from tagc.hooks.core.hierarchy import Topology
from tagc.hooks.core.plan import Planner
from tagc.hooks.core.segment import Segment
from tagc.hooks.core.settings import HookSettings
from tagc.hooks.core.state import ExchangeState, UnitTiming
from tagc.hooks.core.stats import ExchangeStats
from tests.paper_wire import paper


def test_piece_bytes_and_side_stream_reach_the_hook_from_tagc_hook():
    hook = tagc.hook(piece_bytes=1 << 12, side_stream=False)
    assert hook.settings.piece_bytes == 1 << 12 and hook.agreed_settings()["piece_bytes"] == 1 << 12
    assert hook.settings.side_stream is False and tagc.hook().settings.side_stream is True
    with pytest.raises(ValueError, match="side_stream must be True or False, got 'no'"):
        tagc.hook(side_stream="no")


def test_settings_split_the_arguments_into_config_fields_and_codec_options():
    settings = HookSettings.from_arguments(ratio=5, codec="tagc", seed=3, min_compress_numel=7, positions="offsets",
                                           min_part=1 << 10)
    assert settings.config == tagc.TAGCConfig(ratio=5.0, seed=3, min_compress_numel=7)
    assert dict(settings.codec_options) == {"positions": "offsets", "value_dtype": "float16"}  # tagc's recommended
    settings = HookSettings.from_arguments(ratio=5, codec="topk", sparsity=0.5, min_compress_numel=7,
                                           positions="offsets", min_part=1 << 10)
    assert settings.config == tagc.TAGCConfig(ratio=5.0, sparsity=0.5, min_compress_numel=7)
    assert dict(settings.codec_options) == {"positions": "offsets", "value_dtype": "float8"}  # topk's recommended
    assert settings.min_part == 1 << 10 and settings.codec == "topk"
    with pytest.raises(ValueError, match=r"codec 'topk' takes options \('positions', 'value_dtype'\); got 'block'"):
        HookSettings.from_arguments(codec="topk", block=3)
    with pytest.raises(ValueError, match=r"seed applies only to codecs \('tagc',\), not to codec 'topk' .*it takes "
                                         r"ratio, sparsity\)"):
        HookSettings.from_arguments(codec="topk", seed=3)  # the list hashes nothing: a seed would be ignored


@pytest.mark.parametrize("name, value, allowed", [
    ("plain", "fp16", "('fp32', 'bf16', 'fp8', 'int4')"),
    ("nonfinite", "ignore", "('propagate', 'raise')"),
    ("residual_dtype", torch.float16, "torch.float32 or torch.bfloat16"),
    ("hierarchy", "tree", "auto"),
])
def test_a_bad_setting_is_refused_with_the_allowed_values(name, value, allowed):
    with pytest.raises(ValueError) as raised:
        HookSettings(**{name: value})
    assert allowed in str(raised.value) and str(value) in str(raised.value)


def test_settings_are_frozen_and_a_run_time_one_is_validated_again():
    hook = tagc.hook(min_part=1 << 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        hook.settings.min_part = 5
    with pytest.raises(AttributeError, match="min_part is fixed when the hook is built"):
        hook.update(min_part=5)
    with pytest.raises(ValueError, match="piece_bytes must be None"):
        hook.update(piece_bytes=0)
    assert hook.settings.piece_bytes is None  # the refused value left the settings as they were
    hook.update(piece_bytes=4096)
    assert hook.agreed_settings()["piece_bytes"] == 4096 and hook.settings.min_part == 1 << 10
    with pytest.raises(AttributeError, match=r"hook.update\(piece_bytes=...\)"):
        hook.piece_bytes = 1  # a setting is not an attribute of the hook: an error, not a silent no-op


def test_the_reported_settings_are_truthful_after_every_setter():
    """What the hook reports, and the ranks compare, is what it runs: after update, set_feedback_decay and
    follow_lr alike."""
    hook = tagc.hook()
    assert (hook.agreed_settings()["feedback_decay"], hook.agreed_settings()["follow_lr"]) == (0.9, None)
    hook.update(piece_bytes=1 << 14, side_stream=False)
    assert hook.agreed_settings()["piece_bytes"] == hook.settings.piece_bytes == 1 << 14
    hook.set_feedback_decay(0.97)
    assert hook.agreed_settings()["feedback_decay"] == hook.settings.feedback_decay == hook.codec.decay == 0.97
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    hook.follow_lr(optimizer)
    assert hook.agreed_settings()["follow_lr"] == "from the optimizer"
    hook.follow_lr(optimizer, peak_lr=0.2)
    assert hook.agreed_settings()["follow_lr"] == 0.2
    hook.follow_lr(None)
    assert hook.agreed_settings()["follow_lr"] is None


def test_a_hook_from_settings_is_the_hook_from_arguments():
    """``HookSettings.from_arguments`` is ``tagc.hook``'s resolution: the same hook, the settings left out filled from
    codec tagc's recommended ones (EF21 fading by 0.9, float16 cells here). ``TAGCHook(TAGCConfig(...), **kw)`` and
    ``HookSettings(...)`` fill nothing: their defaults stay the neutral ones (classic feedback, float32 cells, fp32
    plain columns, ratio 10), the TAGC paper's codec."""
    given = dict(ratio=4, codec="tagc", select="all", plain="bf16", dense_steps=2, positions="coded")
    from_settings = TAGCHook(HookSettings.from_arguments(**given))
    assert from_settings.agreed_settings() == tagc.hook(**given).agreed_settings()
    filled = from_settings.agreed_settings()
    assert (filled["feedback"], filled["feedback_decay"], dict(filled["codec_options"])) == (
        "ef21", 0.9, {"positions": "coded", "value_dtype": "float16"})
    old_style = TAGCHook(tagc.TAGCConfig(ratio=4.0), select="all", plain="bf16", dense_steps=2,
                         codec_options={"positions": "coded"})
    assert old_style.agreed_settings() == TAGCHook(HookSettings.from_arguments(
        **given, feedback="classic", value_dtype="float32")).agreed_settings()  # neutral: nothing filled
    assert old_style.agreed_settings() != from_settings.agreed_settings()
    recommended_old_style = TAGCHook(tagc.TAGCConfig(ratio=4.0), select="all", plain="bf16", dense_steps=2,
                                     codec_options={"positions": "coded", "value_dtype": "float16"},
                                     feedback="ef21", feedback_decay=0.9)
    assert recommended_old_style.agreed_settings() == from_settings.agreed_settings()
    assert HookSettings() == HookSettings.from_arguments(**paper())  # the field defaults: the paper's codec
    with pytest.raises(TypeError, match="settings are given once"):
        TAGCHook(HookSettings(), min_part=3)


def test_the_exchange_state_places_each_step_in_the_schedule():
    state = ExchangeState(dense_steps=2)
    schedule = []
    for step in range(4):
        state.step_count = step
        schedule.append(state.dense)
    assert schedule == [True, True, False, False]
    state.record(ExchangeStats(buckets=1, wire_bytes=10), UnitTiming("u"))
    state.seen_this_step.add("b")
    assert state.repeats("b") and not state.repeats("c")
    state.close_step()
    assert state.last_step.wire_bytes == 10 and state.current.wire_bytes == 0 and state.total.wire_bytes == 10
    assert [u.unit for u in state.last_units] == ["u"] and not state.seen_this_step


def test_a_pending_bucket_works_on_what_it_is_given_not_on_the_hook():
    """``hook`` is only the owner its strict-sync counting looks up: a bare object with no methods will do."""
    assert not dist.is_initialized()
    settings = HookSettings(select="all", dense_steps=0, min_part=64)
    codec, plain = settings.make_codecs()
    plan = Planner(settings, codec, plain).plain_plan("b#96", 96)
    state = ExchangeState(0)
    rows = torch.randn(1, 96, generator=torch.Generator().manual_seed(0))
    output = torch.empty(96)
    pending = PendingBucket(object(), plan, output, 0.5, None, ExchangeStats(buckets=1), UnitTiming("b"),
                            coder=PartCoder(plain), state=state, nonfinite="raise")
    state.in_flight.append(pending)
    pending.send(rows, Topology(1))
    assert pending.wait() is output
    torch.testing.assert_close(output, rows[0] * 0.5, rtol=0, atol=0)
    assert state.in_flight == [] and state.current.buckets == 1 and state.units[0].unit == "b"


def test_a_checkpoint_holding_no_state_for_a_compressed_part_is_refused_at_its_encode():
    settings = HookSettings(select="all", dense_steps=0, min_part=64, config=tagc.TAGCConfig(min_compress_numel=1))
    codec, plain = settings.make_codecs()
    plan = Planner(settings, codec, plain).plan((Segment("w", 0, 64),), 96, 2)  # columns 64.. are padding: plain
    from tagc.hooks.core.checkpoint import Restored

    coder = PartCoder(plain, restored=Restored({"other#96/part0"}, "all"), select_fingerprint=lambda: "mine")
    assert [part.codec is plain for part in plan.parts] == [True, False]
    coder.check(plan.parts[0])  # the plain columns hold no state: nothing to find
    compressed = plan.parts[1]
    assert compressed.key == "w#96/part0"
    with pytest.raises(ValueError, match=r"holds none \(checkpoint select='all', the hook has select='mine'\)"):
        coder.check(compressed)
    PartCoder(plain, restored=Restored({compressed.key}, "all")).check(compressed)
