"""FSDP1 + TAGC on 2 gloo ranks: same gradients as FSDP1's reduce-scatter when lossless."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy

import tagc
from tests.distributed import run_ranks


def train_fsdp1(rank, world, use_tagc):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(4096, 64), nn.Linear(64, 16))
    model[0] = FSDP(model[0], device_id=torch.device("cpu"))
    model = FSDP(model, device_id=torch.device("cpu"))
    if use_tagc:
        hook = tagc.hook(dense_steps=0, ratio=10, sparsity=0.0, select="all", min_compress_numel=1024)
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


def unit_selection(rank, world):
    from gpt2_bench.model import GPT, GPTConfig
    from gpt2_bench.sharding import fsdp1_wrap_policy

    model = GPT(GPTConfig.preset("tiny"))
    model = FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=fsdp1_wrap_policy(model))
    tagc.register_comm_hook(model, tagc.hook(dense_steps=0, select="non_attention_linear"))
    decided = {}
    for unit in FSDP.fsdp_modules(model):
        (segment,) = unit._comm_hook_state.segments(1000)
        decided[segment.name] = segment.selected
    return decided


def test_fsdp1_units_are_selected_by_their_full_names():
    decided = run_ranks(unit_selection, 2)[0]
    assert decided["transformer.h.0.attn.c_attn.weight+transformer.h.0.attn.c_attn.bias"] is False
    assert decided["transformer.h.1.mlp.c_fc.weight+transformer.h.1.mlp.c_fc.bias"] is True
    assert decided["transformer.h.0.attn.c_proj.weight+transformer.h.0.attn.c_proj.bias"] is True
    assert decided["transformer.h.0.ln_1.weight+transformer.h.0.ln_1.bias+transformer.h.0.ln_2.weight+transformer.h.0.ln_2.bias"] is False
    root = next(name for name in decided if name.startswith("transformer.wte.weight"))
    assert decided[root] is True  # the (tied) embedding dominates the root unit
