"""Batches of parts (issue 61): a plan's parts of one codec and one size go through one codec call and one
all-to-all per wire tensor, and give bit for bit what the per-part path gives
(:attr:`tagc.hooks.core.plan.BucketPlan.batches`; ``plan.BATCHING = False`` forces one part per call).

On 2 and 3 gloo ranks, several steps of one bucket: two ratio groups (``select`` returns a ratio for one
parameter) cut into parts of sizes ``q`` and ``q + 1``, a plain bias and padding; a NaN in one part on one rank,
an all-zero parameter, integer (tied) gradients. Eager and traced exchanges, four wires (the paper's, a bf16
residual with 4-bit indexes, the default's EF21 with coded positions and float16 cells, classic feedback with
coded positions): every output, residual, ``H`` and statistic equal with and without batching. A checkpoint
written mid-training resumes the identical next step, its keys and shapes those of the per-part path.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.hooks import Segment
from tagc.hooks.core import plan as planning
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE

SEGMENTS = (Segment("emb.weight", 0, 2401), Segment("mlp.weight", 2401, 3000), Segment("mlp.bias", 5401, 50),
            Segment("head.weight", 5451, 1999))
CHUNK = 7500  # 50 columns of padding
MIN_PART = 500  # emb: 600, 600, 601, 600; mlp + head: 9 parts of 555 and 556
WIRES = {
    "paper": dict(ratio=10, **PAPER_WIRE),
    "bf16-4bit": dict(ratio=10, **PAPER_WIRE, residual_dtype=torch.bfloat16, index_bits=4),
    "default": dict(),
    "coded": dict(ratio=8, plain="fp32", feedback="classic", positions="coded", value_dtype="float16"),
}
TIMES = ("compress_s", "exposed_s", "wire_s", "decode_s")


def select(name: str, module=None) -> bool | float:
    """emb at ratio 4, the other weights at the config's, the bias plain."""
    return 4.0 if name.startswith("emb.") else not name.endswith(".bias")


def make_hook(wire: str):
    return tagc.hook(**WIRES[wire], select=select, min_part=MIN_PART, min_compress_numel=1, dense_steps=0)


def gradient(rank: int, world: int, step: int) -> torch.Tensor:
    """This rank's rows ``[N, CHUNK]`` at ``step``: random; step 1 a NaN and an Inf in two parts on rank 1; step 2
    mlp.weight zero on every rank; step 3 integers (ties at every threshold)."""
    grad = torch.randn(world, CHUNK, generator=torch.Generator().manual_seed(97 * step + rank))
    if step == 1 and rank == 1:  # in a 600-column emb part and a 555/556-column mlp part (batched with others)
        grad[0, 700] = float("nan")
        grad[1, 3000] = float("inf")
    if step == 2:
        grad[:, 2401:5401] = 0
    if step == 3:
        grad = grad.mul(2).round()
    return grad


def exchange(hook, batching: bool, traced: bool, grad: torch.Tensor) -> torch.Tensor:
    planning.BATCHING = batching  # read when a plan first makes its batches
    try:
        if traced:
            wire = hook.encode_bucket(grad.reshape(-1).clone(), None, SEGMENTS)
            received = torch.empty_like(wire)
            dist.all_to_all_single(received, wire)
            out = hook.decode_bucket(received, None, SEGMENTS, CHUNK, torch.float32)
        else:
            out = torch.empty(CHUNK)
            hook.reduce_scatter(out, grad.reshape(-1).clone(), None, dist.ReduceOp.AVG, SEGMENTS)
        hook.end_step()
        return out
    finally:
        planning.BATCHING = True


def snapshot(hook) -> dict:
    """The step's statistics (no times) and a copy of the codec state."""
    stats = {k: v for k, v in hook.stats()["last_step"].items() if k not in TIMES}
    return {"stats": stats, "state": {k: v.clone() for k, v in hook.state_dict().items()
                                      if isinstance(v, torch.Tensor)}}


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # NaN payloads compared too


def parity(rank: int, world: int, wire: str, backend: str) -> list:
    os.environ["TAGC_BACKEND"] = backend
    hooks = {(batching, traced): make_hook(wire) for batching in (True, False) for traced in (False, True)}
    mismatches = []
    for step in range(4):
        grad = gradient(rank, world, step)
        outs = {how: exchange(hook, how[0], how[1], grad) for how, hook in hooks.items()}
        seen = {how: snapshot(hook) for how, hook in hooks.items()}
        for traced in (False, True):
            batched, alone = (True, traced), (False, traced)
            if not torch.equal(bits(outs[batched]), bits(outs[alone])):
                mismatches.append((step, traced, "output"))
            if seen[batched]["stats"] != seen[alone]["stats"]:
                mismatches.append((step, traced, "stats", seen[batched]["stats"], seen[alone]["stats"]))
            a, b = seen[batched]["state"], seen[alone]["state"]
            if a.keys() != b.keys() or any(not torch.equal(bits(a[k].float()), bits(b[k].float())) for k in a):
                mismatches.append((step, traced, "state"))
        if not torch.equal(bits(outs[(True, False)]), bits(outs[(True, True)])):
            mismatches.append((step, "eager vs traced"))
    plan = hooks[(True, False)].plan(SEGMENTS, CHUNK, world)
    shape = [(len(b.parts), b.parts[0].numel) for b in plan.batches]
    nonfinite = hooks[(True, False)].stats()["total"]["nonfinite_parts"]
    return mismatches, shape, nonfinite


@pytest.mark.parametrize("world, wire, backend", [(2, wire, "auto") for wire in WIRES] + [
    (2, "coded", "torch"), (3, "paper", "torch"), pytest.param(3, "default", "auto", marks=pytest.mark.slow)])
def test_batched_parts_give_the_per_part_results_bit_for_bit(world, wire, backend):
    """``auto``: the CPU kernels (numba) where they import; ``torch``: the reference."""
    for mismatches, shape, nonfinite in run_ranks(parity, world, wire, backend):
        assert mismatches == []
        # the plain columns, then ratio 10's 555s and 556s, then ratio 4's 600s and 601
        assert sorted(shape) == sorted([(1, 100), (5, 555), (4, 556), (3, 600), (1, 601)]), shape
        assert nonfinite >= 1  # the NaN step counted


def resumed(rank: int, world: int, wire: str) -> tuple:
    first = make_hook(wire)
    for step in range(2):
        exchange(first, True, False, gradient(rank, world, step + 2))  # a zero part, then ties
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    per_part = make_hook(wire)
    exchange(per_part, False, False, gradient(rank, world, 2))
    shapes = {k: v.shape for k, v in first.state_dict().items() if isinstance(v, torch.Tensor)}
    shapes_alone = {k: v.shape for k, v in per_part.state_dict().items() if isinstance(v, torch.Tensor)}
    grad = gradient(rank, world, 5)
    expected = exchange(first, True, False, grad)
    outs = []
    for batching in (True, False):
        hook = make_hook(wire)
        hook.load_state_dict(state)
        outs.append(torch.equal(bits(exchange(hook, batching, False, grad)), bits(expected))
                    and all(torch.equal(a, b) for a, b in zip(hook.state_dict().values(), first.state_dict().values())
                            if isinstance(a, torch.Tensor)))
        if batching:  # the loaded residuals were stacked once: a batch's members share one tensor
            plan = hook.plan(SEGMENTS, CHUNK, world)
            residuals = hook.codec.residuals
            shared = [len({residuals[p.key].untyped_storage().data_ptr() for p in b.parts}) == 1
                      for b in plan.batches if len(b.parts) > 1]
            outs.append(len(shared) == 3 and all(shared))  # 555s, 556s and 600s (601 is alone)
    return outs, shapes == shapes_alone


@pytest.mark.parametrize("wire", ["paper", "default"])
def test_a_checkpoint_mid_training_resumes_the_identical_step(wire):
    for outs, same_shapes in run_ranks(resumed, 2, wire):
        assert outs == [True, True, True] and same_shapes


def test_a_plan_batches_by_codec_and_size():
    hook = make_hook("paper")
    plan = hook.plan(SEGMENTS, CHUNK, 2)
    assert [p.key for b in plan.batches for p in b.parts] != [p.key for p in plan.parts]  # grouped
    assert sorted(p.key for b in plan.batches for p in b.parts) == sorted(p.key for p in plan.parts)
    assert len(plan.batches) == 5  # <= 2 per ratio group, and the plain part
    for b in plan.batches:
        assert len({(id(p.codec), p.numel) for p in b.parts}) == 1 and b.numel == sum(p.numel for p in b.parts)
        columns = torch.arange(CHUNK)[b.columns]
        assert torch.equal(columns, torch.cat([torch.arange(CHUNK)[p.columns] for p in b.parts]))
        assert [w.row_bytes for w in b.wire(2, torch.float32)] == [
            len(b.parts) * w.row_bytes for w in b.codec.wire(b.parts[0].numel, 2, torch.float32)]


# ---------------------------------------------------------------- the codec alone, on every back end

CODECS = {  # (TAGCConfig fields, residual dtype, codec options, EF21 decay or None)
    "paper": (dict(ratio=10.0), torch.float32, dict(positions="bitmap", value_dtype="float32"), None),
    "4bit-bf16": (dict(ratio=6.0, index_bits=4), torch.bfloat16, dict(positions="bitmap", value_dtype="bfloat16"),
                  None),
    "coded-ef21": (dict(ratio=4.5), torch.float32, dict(positions="coded", value_dtype="float16"), 0.9),
}


def codec_parity(rank: int, world: int, backend: str) -> list:
    """``R = 3`` emulated ranks, one codec each, batched and alone: three parts of 301 columns, three steps (a NaN
    in one part on one rank at the second), every owner decoding what every rank sent it (Triton's interpreter:
    2 ranks, 2 parts of 97, 2 steps). Returns what differs."""
    os.environ["TAGC_BACKEND"] = backend
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.feedback import with_feedback
    from tagc.hooks.codecs.registry import make_codec
    from tagc.hooks.core.stats import ExchangeStats

    ranks, parts, numel, steps = (2, 2, 97, 2) if backend == "triton" else (3, 3, 301, 3)  # the interpreter is slow
    keys = [f"w#903/part{p}" for p in range(parts)]
    differ = []
    def build(config, dtype, options, decay):
        codec = make_codec("tagc", TAGCConfig(**config), dtype, options)
        return codec if decay is None else with_feedback(codec, "ef21", decay)

    for name, settings in CODECS.items():
        batched, alone = [build(*settings) for _ in range(ranks)], [build(*settings) for _ in range(ranks)]
        for step in range(steps):
            grads = [torch.randn(ranks, parts * numel, generator=torch.Generator().manual_seed(10 * step + r))
                     for r in range(ranks)]
            if step == 1:
                grads[0][1, numel + 5] = float("nan")  # part 1, rank 0's row for owner 1
            sent = [c.encode_batch(g, keys, None) for c, g in zip(batched, grads)]
            sent_alone = [[c.encode_batch(g[:, p * numel:(p + 1) * numel], keys[p:p + 1], None) for p in range(parts)]
                          for c, g in zip(alone, grads)]
            for mine, theirs in zip(sent, sent_alone):
                if any(not torch.equal(bits(w.float()), bits(torch.cat([t[i] for t in theirs], 1).float()))
                       for i, w in enumerate(mine)):
                    differ.append((name, step, "wire"))
            for owner in range(ranks):
                stats, stats_alone = ExchangeStats(), ExchangeStats()
                received = [torch.stack([w[i][owner] for w in sent]) for i in range(len(sent[0]))]
                values = batched[owner].decode_batch(received, numel, keys, None, stats)
                alone_values = torch.cat([alone[owner].decode_batch(
                    [torch.stack([w[p][i][owner] for w in sent_alone]) for i in range(len(sent[0]))], numel,
                    keys[p:p + 1], None, stats_alone) for p in range(parts)])
                if not torch.equal(bits(values), bits(alone_values)) or stats.as_dict() != stats_alone.as_dict():
                    differ.append((name, step, "decode", owner))
            for c, c_alone in zip(batched, alone):
                state, state_alone = c.state_dict(), c_alone.state_dict()
                if state.keys() != state_alone.keys() or any(
                        not torch.equal(bits(state[k].float()), bits(state_alone[k].float())) for k in state):
                    differ.append((name, step, "state"))
    return differ


@pytest.mark.parametrize("backend", ["torch", "numba",
                                     pytest.param("triton", marks=[pytest.mark.triton, pytest.mark.slow])])
def test_a_batch_encodes_and_decodes_as_its_parts_on_every_back_end(backend, monkeypatch):
    """The Triton kernels run in their interpreter here (``TRITON_INTERPRET=1``, a few minutes: ``-m slow``), as on a
    GPU but for races."""
    pytest.importorskip({"torch": "torch", "numba": "numba", "triton": "triton"}[backend])
    if backend == "triton":  # run alone, the rank is spawned: the fork server's triton compiles
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    (differ,) = run_ranks(codec_parity, 1, backend, timeout_s=600)
    assert differ == []
