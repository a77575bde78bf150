"""FSDP1 + TAGC on 2 gloo ranks: same gradients as FSDP1's reduce-scatter when lossless."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

import tagc
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE

pytestmark = pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too


def train_fsdp1(rank, world, use_tagc, unit_ratio=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 16))
    model[0] = FSDP(model[0], device_id=torch.device("cpu"))
    model = FSDP(model, device_id=torch.device("cpu"))
    if use_tagc:
        from tagc.hooks.core.selection import ratio_for

        select = (
            "all" if unit_ratio is None else ratio_for("", unit_ratio, "all")
        )  # built here: a closure does not pickle
        hook = tagc.hook(dense_steps=0, ratio=10, sparsity=0.0, select=select, min_compress_numel=1024,
                         **PAPER_WIRE)
        tagc.register_comm_hook(model, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(100 + rank)
    for _ in range(3):
        model(torch.randint(0, 4096, (16,))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model):
        result = {name: p.detach().clone() for name, p in model.named_parameters()}
    if use_tagc:
        result["stats"] = hook.stats()
    return result


def test_fsdp1_tagc_matches_default():
    plain = run_ranks(train_fsdp1, 2, False)
    compressed = run_ranks(train_fsdp1, 2, True)
    for rank in range(2):
        stats = compressed[rank].pop("stats")
        assert stats["total"]["compressed_buckets"] == 3 and stats["total"]["unpeeled"] == 0
        for name, value in plain[rank].items():
            torch.testing.assert_close(compressed[rank][name], value, rtol=1e-6, atol=1e-6, msg=name)


def hybrid(rank, world):
    model = FSDP(nn.Linear(8, 8), device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.NO_SHARD)
    with pytest.raises(ValueError, match="FULL_SHARD"):
        tagc.register_comm_hook(model, tagc.hook(dense_steps=0))
    return True


def test_fsdp1_unsupported_strategy_is_a_clear_error():
    assert all(run_ranks(hybrid, 2))


def decided_segments(rank, world, c_fc_ratio=None):
    """Each FSDP1 unit's segment decision on GPT tiny: non-attention linears, or with the MLPs'
    first linear at ``c_fc_ratio``."""
    from gpt2_bench.model import GPT, GPTConfig
    from gpt2_bench.sharding import fsdp1_wrap_policy
    from tagc.hooks.core.selection import ratio_for

    model = GPT(GPTConfig.preset("tiny"))
    model = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=fsdp1_wrap_policy(model))
    select = "non_attention_linear" if c_fc_ratio is None else ratio_for(r"mlp\.c_fc\.", c_fc_ratio)
    tagc.register_comm_hook(model, tagc.hook(dense_steps=0, select=select))
    decided = {}
    for unit in FSDP.fsdp_modules(model):
        (segment,) = unit._comm_hook_state.segments(1000)
        decided[segment.name] = segment.selected
    return decided


def test_fsdp1_units_are_selected_by_their_full_names():
    decided = run_ranks(decided_segments, 2)[0]
    assert decided["transformer.h.0.attn.c_attn.weight+transformer.h.0.attn.c_attn.bias"] is False
    assert decided["transformer.h.1.mlp.c_fc.weight+transformer.h.1.mlp.c_fc.bias"] is True
    assert decided["transformer.h.0.attn.c_proj.weight+transformer.h.0.attn.c_proj.bias"] is True
    assert (
        decided[
            "transformer.h.0.ln_1.weight+transformer.h.0.ln_1.bias+transformer.h.0.ln_2.weight+transformer.h.0.ln_2.bias"
        ]
        is False
    )
    root = next(name for name in decided if name.startswith("transformer.wte.weight"))
    assert decided[root] is True  # the (tied) embedding dominates the root unit


def test_fsdp1_a_unit_takes_the_smallest_ratio_its_parameters_ask_for():
    from tagc.hooks.adapters.fsdp1 import unit_selection

    assert unit_selection([True, True], [90, 10], 10.0) is True
    assert unit_selection([True, False], [90, 10], 10.0) is False  # 90% selected: below the unit's bar
    assert unit_selection([4.0, True], [96, 4], 10.0) == 4.0  # a bias rides along with its weight
    assert unit_selection([4.0, 16.0], [50, 50], 10.0) == 4.0
    assert unit_selection([16.0, True], [50, 50], 10.0) == 10.0  # True is the hook's ratio
    assert unit_selection([16.0, False], [99, 1], 10.0) == 16.0
    assert unit_selection([], [], 10.0) is False
    assert unit_selection(["dense", True], [50, 50], 10.0) == "dense"  # passed on for the hook to name


def test_fsdp1_units_carry_the_ratio_their_policy_gives():
    decided = run_ranks(decided_segments, 2, 4)[0]
    assert decided["transformer.h.1.mlp.c_fc.weight+transformer.h.1.mlp.c_fc.bias"] == 4.0
    assert decided["transformer.h.1.mlp.c_proj.weight+transformer.h.1.mlp.c_proj.bias"] is True
    assert decided["transformer.h.0.attn.c_attn.weight+transformer.h.0.attn.c_attn.bias"] is False


@pytest.mark.slow  # the default suite keeps FSDP1's exact match with its default reduce-scatter
def test_fsdp1_a_unit_ratio_changes_the_wire_not_the_sum():
    plain = run_ranks(train_fsdp1, 2, False)
    at_10 = run_ranks(train_fsdp1, 2, True)
    at_4 = run_ranks(train_fsdp1, 2, True, 4)
    bytes_at = {name: run[0].pop("stats")["total"]["wire_bytes"] for name, run in (("10", at_10), ("4", at_4))}
    assert bytes_at["4"] > 2 * bytes_at["10"]  # ratio 4 keeps 2.5x as many sketch cells
    for rank in range(2):
        at_4[rank].pop("stats", None)
        for name, value in plain[rank].items():
            torch.testing.assert_close(at_4[rank][name], value, rtol=1e-6, atol=1e-6, msg=name)
