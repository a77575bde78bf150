"""Per-parameter ratios (``select`` returning a ratio) and the dense warm-up."""

import math

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.hooks import Segment
from tagc.hooks.codecs.registry import make_codec
from tagc.hooks.core.engine import DENSE_STEPS
from tagc.hooks.core.selection import ratio_for
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE, paper

EMB, MLP = 120_000, 180_000
CHUNK = EMB + MLP + 1000
SEGMENTS = (Segment("emb.weight", 0, EMB), Segment("mlp.weight", EMB, MLP), Segment("mlp.bias", EMB + MLP, 1000))
SELECT = ratio_for(r"^emb\.", 4)  # the "embedding" at ratio 4, the MLP weight at the config's 10, the bias plain


def _owned_sum(rows: torch.Tensor, rank: int) -> torch.Tensor:
    """Every rank's ``rows[rank]`` summed (what this rank owns, over all senders)."""
    everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, rows.contiguous())
    return sum(r[rank] for r in everyone)


def ratios(rank, world, codec):
    """4 steps: 1 dense, 3 steady. Error feedback conserves the gradient: what the owners decoded plus what
    every rank holds back equals everything every rank produced."""
    hook = tagc.hook(**paper(ratio=10, codec=codec, select=SELECT, dense_steps=1,
                             min_part=1 << 16))  # tagc: classic error feedback, whose residual holds what waits
    torch.manual_seed(rank)
    decoded, produced, wire = torch.zeros(CHUNK), torch.zeros(world, CHUNK), []
    for _ in range(4):
        grad = torch.randn(world, CHUNK)
        produced += grad
        out = torch.empty(CHUNK)
        hook.reduce_scatter(out, grad.reshape(-1).clone(), None, dist.ReduceOp.SUM, SEGMENTS)
        decoded += out
        hook.end_step()
        wire.append(hook.stats()["last_step"]["wire_bytes"])
    held = torch.zeros(world, CHUNK)
    plan = hook.plan(SEGMENTS, CHUNK, world)
    (parts,) = hook.residuals.values()
    for part, residual in zip(plan.compressed_parts, parts):
        held[:, part.columns] = residual
    conserved = (decoded + _owned_sum(held, rank) - _owned_sum(produced, rank)).abs().max() / _owned_sum(
        produced, rank
    ).abs().max()
    # the steady wire: each ratio's parts at that ratio (the formula of every codec's wire, per group)
    steady = 0
    for numel, ratio in ((MLP, 10.0), (EMB, 4.0)):
        parts = max(1, numel // (1 << 16))
        bounds = [round(i * numel / parts) for i in range(parts + 1)]
        one = make_codec(codec, tagc.TAGCConfig(ratio=ratio), options=hook.settings.codec_options)
        steady += sum(w.row_bytes for a, b in zip(bounds, bounds[1:]) for w in one.wire(b - a, world, torch.float32))
    steady = (world - 1) * (steady + 1000 * 4)  # + the plain bias
    kept = [
        (held[:, s.start : s.start + s.numel] == 0).float().mean().item() for s in SEGMENTS[:2]
    ]  # sent, so nothing held
    density = hook.settings.config.density(world)
    return float(conserved), wire, steady, kept, density, tagc.TAGCConfig(ratio=4).density(world)


@pytest.mark.parametrize("codec", ["tagc", "topk"])
def test_per_parameter_ratios_conserve_the_gradient_and_send_the_planned_bytes(codec):
    for conserved, wire, steady, kept, density10, density4 in run_ranks(ratios, 2, codec):
        assert conserved < 1e-5  # nothing lost: one residual serves every ratio
        assert wire[0] == CHUNK * 4  # the warm-up: the plain exchange (one remote row of fp32)
        assert wire[1:] == [steady] * 3
        # the last step sent about each ratio's density of the embedding and of the MLP (the rest held back)
        emb_kept, mlp_kept = kept
        assert emb_kept == pytest.approx(density4, rel=0.25) and mlp_kept == pytest.approx(density10, rel=0.25)


def test_a_ratio_policy_is_checked():
    with pytest.raises(ValueError, match="ratio must be a finite number > 1"):
        ratio_for("emb", 1.0)
    hook = tagc.hook(dense_steps=0, select=lambda name, module: 0.5)
    with pytest.raises(ValueError, match=r"select returned 0.5 for 'emb.weight'.*ratio > 1"):
        hook.plan(SEGMENTS, CHUNK, 2)
    hook = tagc.hook(dense_steps=0, codec="int4", select=SELECT)
    with pytest.raises(ValueError, match="codec 'int4' has no ratio"):
        hook.plan(SEGMENTS, CHUNK, 2)
    assert "ratio_for('^emb\\\\.', 4, non_attention_linear)" == SELECT.__name__  # the settings' fingerprint


def test_loaded_residuals_reach_every_ratio_of_the_codec():
    hook = tagc.hook(dense_steps=0, ratio=10, select=SELECT, **PAPER_WIRE)  # the codec itself holds the residuals
    at4 = hook.planner.codec_at(4.0)
    assert at4 is not hook.codec and at4.config.ratio == 4.0 and at4.layout(1 << 16).ratio == 4.0
    assert hook.codec.layout(1 << 16).ratio == 10.0
    hook.load_state_dict(
        {"step": 3, "config": repr(hook.settings.config.fingerprint()), "residual.rank0.b/part0": torch.ones(2, 5)}
    )
    assert at4.residuals is hook.codec.residuals and torch.equal(at4.residuals["b/part0"], torch.ones(2, 5))
    assert math.isclose(hook.planner.codec_at(10.0).config.ratio, 10.0) and hook.planner.codec_at(10.0) is hook.codec


def test_error_feedback_codecs_warm_up_by_default_and_trace_only_after_it():
    assert tagc.hook().dense_steps == DENSE_STEPS == 10
    assert [tagc.hook(codec=c).dense_steps for c in ("topk", "sign", "powersgd")] == [DENSE_STEPS] * 3
    assert [tagc.hook(codec=c).dense_steps for c in ("plain", "bf16", "fp8", "int4")] == [0] * 4
    assert tagc.hook(dense_steps=0).dense_steps == 0 and tagc.hook(codec="int4", dense_steps=3).dense_steps == 3
    hook = tagc.hook(dense_steps=2, select="all")
    traced = []
    for _ in range(4):  # a graph made now would trace the exchange in halves only once the warm-up is over
        traced.append(hook.traceable(SEGMENTS, CHUNK, 2))
        hook.end_step()
    assert traced == [False, False, True, True]
