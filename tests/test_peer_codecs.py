"""The peer codecs (bf16, fp8, int4, sign, topk): bounds, error feedback, wire bytes, eager = traced.

Single-process tests simulate ranks: rank ``r``'s codec encodes its ``[N, n]`` rows, owner
``j`` decodes row ``j`` of every rank's wire tensors (no process group: ``group=None``).
"""

import math

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.config import TAGCConfig
from tagc.hooks import Segment
from tagc.hooks.codecs import quantized, topk
from tagc.hooks.codecs.registry import make_codec
from tagc.hooks.core.stats import ExchangeStats
from tagc.sketch.sparsify import keep_limit, keep_mask, row_thresholds
from tests.distributed import eager_and_traced_step, run_ranks
from tests.paper_wire import paper

KEY = "w#1/part0"
QUANTIZERS = ("bf16", "fp8", "int4", "int4-stochastic")
SPARSE_CONFIG = TAGCConfig(sparsity=0.9)  # frozen: one shared default is safe


def build(name: str, config: TAGCConfig = SPARSE_CONFIG, **options):
    if name == "int4-stochastic":
        name, options = "int4", {**options, "stochastic": True}
    return make_codec(name, config, options=options)


def exchange(codecs, grads, key=KEY):
    """Every rank encodes its rows; owner ``j`` decodes row ``j`` of each rank's wire tensors."""
    world, numel = grads[0].shape
    sent = [codec.encode(grad, key, None) for codec, grad in zip(codecs, grads)]
    outs, stats = [], []
    for owner in range(world):
        received = [torch.stack([wires[i][owner] for wires in sent]) for i in range(len(sent[0]))]
        stats.append(ExchangeStats())
        outs.append(codecs[owner].decode(received, numel, key, None, stats[-1]))
    return torch.stack(outs), sent, stats


def sent_values(codec, wires, numel):
    """What one rank's wire tensors carry to each owner, decoded alone: ``[N, n]``."""
    world = wires[0].shape[0]
    rows = [[w[j : j + 1] for w in wires] for j in range(world)]
    return torch.stack([codec.decode(received, numel, KEY, None, ExchangeStats()) for received in rows])


def blockmax(rows: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax (``[N, n]``)."""
    top = quantized.blocked(rows, block).abs().amax(-1, keepdim=True)
    return quantized.unblocked(top.expand(-1, -1, block), rows.shape[1])


def error_bound(name: str, rows: torch.Tensor, block: int) -> torch.Tensor:
    """The documented per-element bound of one rank's rows, float64."""
    x = rows.double().abs()
    top = blockmax(rows, block).double()
    if name == "bf16":
        return x * 2.0**-8 + 2.0**-134
    if name == "fp8":
        return top * 2.0**-4 * (1 + 2.0**-20) + 2.0**-140
    if name == "int4":
        return top / 14 * (1 + 2.0**-20)
    return top / 7 * (1 + 2.0**-20)  # int4, stochastic


def adversarial(kind: str, world: int, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "randn":
        return torch.randn(world, numel, generator=g)
    if kind == "zeros":
        return torch.zeros(world, numel)
    if kind == "ones":
        return torch.ones(world, numel)
    if kind == "plusminus":
        return torch.where(torch.arange(numel) % 2 == 0, 1.0, -1.0).expand(world, numel).clone()
    if kind == "mixed":  # 1e30 next to 1e-30 in every block
        signs = torch.where(torch.rand(world, numel, generator=g) < 0.5, -1.0, 1.0)
        return torch.where(torch.arange(numel) % 3 == 0, 1e30, 1e-30) * signs
    raise ValueError(kind)


KINDS = ("randn", "zeros", "ones", "plusminus", "mixed")
SIZES = (1, 7, 1000, 4099)


# ----------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("kind", KINDS)
def test_quantizers_sum_within_their_documented_bound(name, kind):
    world = 3
    for numel in SIZES:
        block = 128
        codecs = [build(name) for _ in range(world)]
        grads = [adversarial(kind, world, numel, seed=10 * r + numel) for r in range(world)]
        out, _, stats = exchange(codecs, grads)
        exact = sum(g.double() for g in grads)
        bound = sum(error_bound(name, g, block) for g in grads)
        slack = 2.0**-22 * sum(g.double().abs() + error_bound(name, g, block) for g in grads)  # the owner's float32 sum
        err = (out.double() - exact).abs()
        assert out.dtype == torch.float32 and out.shape == (world, numel)
        assert (err <= bound + slack).all(), (name, kind, numel, (err - bound - slack).max().item())
        assert all(s.as_dict()["nonfinite_parts"] == 0 for s in stats)
        if kind in ("zeros", "ones", "plusminus"):  # one magnitude: every code is exact (up to the scale's rounding)
            assert torch.allclose(out.double(), exact, rtol=2.0**-20, atol=0)


@pytest.mark.parametrize("name", ["fp8", "int4", "sign"])
@pytest.mark.parametrize("block", [1, 5, 300])
def test_block_option_sets_the_scale_granularity(name, block):
    world, numel = 2, 1001
    codecs = [build(name, block=block) for _ in range(world)]
    grads = [torch.randn(world, numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    _, sent, _ = exchange(codecs, grads)
    assert sent[0][1].shape == (world, math.ceil(numel / block)) and sent[0][1].dtype == torch.float32
    if name == "sign":
        return
    out, _, _ = exchange([build(name, block=block) for _ in range(world)], grads)
    bound = sum(error_bound(name, g, block) * 1.0001 for g in grads)
    assert ((out.double() - sum(g.double() for g in grads)).abs() <= bound).all()


def test_int4_stochastic_rounding_is_unbiased_and_reproducible():
    numel = 128 * 800
    row = torch.full((1, numel), 0.5)
    row[0, ::128] = 7.0  # scale 1 in every block: 0.5 is half way between codes 0 and 1
    nearest = build("int4").encode(row, KEY, None)
    stochastic = build("int4-stochastic")
    first = stochastic.encode(row, KEY, None)
    second = stochastic.encode(row, KEY, None)  # the next step: other noise
    again = build("int4-stochastic").encode(row, KEY, None)  # a fresh codec: the same first step
    values = quantized.dequantize_int4(first[0], first[1], numel, 128)
    halves = values[0, torch.arange(numel) % 128 != 0]
    assert abs(halves.mean().item() - 0.5) < 0.01 and set(halves.unique().tolist()) == {0.0, 1.0}
    assert quantized.dequantize_int4(nearest[0], nearest[1], numel, 128)[0, 1].item() in (0.0, 1.0)
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], second[0])
    assert set(stochastic.state_dict()) == {f"{KEY}#steps"} and int(stochastic.state_dict()[f"{KEY}#steps"]) == 2


def test_uniform_noise_is_uniform_and_depends_on_stream():
    u = quantized.uniform_noise((4, 50_000), stream=12345, device=torch.device("cpu"))
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    counts = torch.histc(u, bins=16, min=0, max=1)
    assert (counts - u.numel() / 16).abs().max() < 5 * math.sqrt(u.numel() / 16)
    assert not torch.equal(u, quantized.uniform_noise((4, 50_000), stream=12346, device=torch.device("cpu")))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantizers_carry_nan_inf_to_the_owner(name, value):
    world, numel, block, at = 3, 1000, 128, 300
    codecs = [build(name) for _ in range(world)]
    grads = [torch.randn(world, numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    grads[1][0, at] = value  # rank 1's row for owner 0
    out, _, stats = exchange(codecs, grads)
    bad = torch.zeros(numel, dtype=torch.bool)
    if name == "bf16":  # element by element, as plain: the same NaN or signed Inf
        bad[at] = True
        assert torch.equal(out[0, at], torch.tensor(value)) or (math.isnan(value) and out[0, at].isnan())
    else:  # the sender's whole block is NaN
        bad[at // block * block : (at // block + 1) * block] = True
        assert out[0, bad].isnan().all()
    assert out[0, ~bad].isfinite().all() and out[1:].isfinite().all()
    assert [s.as_dict()["nonfinite_parts"] for s in stats] == [1, 1, 1]  # every owner knows: raise on every rank


# ----------------------------------------------------------------------------- error feedback: sign, topk


def two_steps(name, grads_per_step, config=SPARSE_CONFIG, **options):
    """Run the steps; return the codecs, and for the last step (residuals before, out, wires, stats)."""
    world = grads_per_step[0][0].shape[0]
    codecs = [build(name, config, **options) for _ in range(world)]
    for grads in grads_per_step[:-1]:
        exchange(codecs, grads)
    before = [c.residuals[KEY].clone() for c in codecs]
    out, sent, stats = exchange(codecs, grads_per_step[-1])
    return codecs, before, out, sent, stats


def grads_for(kind, world, numel, steps=2):
    return [[adversarial(kind, world, numel, seed=100 * s + r) for r in range(world)] for s in range(steps)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", SIZES)
def test_topk_sends_what_tagc_selects_and_keeps_the_rest_exactly(kind, numel):
    world = 3
    steps = grads_for(kind, world, numel)
    codecs, before, out, sent, stats = two_steps("topk", steps)
    density = TAGCConfig(sparsity=0.9).density(world)
    expected = torch.zeros(world, numel)
    for r, codec in enumerate(codecs):
        accumulated = before[r] + steps[-1][r]
        kept = sent_values(codec, sent[r], numel)
        assert torch.equal(kept + codec.residuals[KEY], accumulated)  # nothing lost, nothing twice
        assert not ((kept != 0) & (codec.residuals[KEY] != 0)).any()
        tau = row_thresholds(accumulated, density)
        selected = keep_mask(accumulated, tau[:, None], keep_limit(numel, density))
        assert torch.equal(kept != 0, selected)  # TAGC's selection
        expected += kept  # the owner adds rank by rank, in order
    assert torch.equal(out, expected)  # exact on what was kept
    assert all(s.as_dict()["nonfinite_parts"] == 0 and s.as_dict()["overflow"] == 0 for s in stats)
    if kind == "zeros":
        assert not out.any() and not any(c.residuals[KEY].any() for c in codecs)


def test_topk_positions_decode_exactly_across_position_blocks():
    world, numel = 2, 3 * 65536 + 4123  # several 65,536-position blocks, the last one short; sampled threshold
    steps = grads_for("randn", world, numel, steps=1)
    codecs = [build("topk", TAGCConfig(sparsity=0.99)) for _ in range(world)]
    out, sent, stats = exchange(codecs, steps[0])
    kept = [steps[0][r] - codecs[r].residuals[KEY] for r in range(world)]
    assert torch.equal(out, kept[0] + kept[1])
    counts = sent[0][0][:, :-1]
    assert counts.shape == (world, 4) and (counts > 0).all()  # every block, the short last one too, lists entries
    total = (kept[0] != 0).sum(dim=1)
    assert ((total - 0.01 * numel).abs() <= 0.1 * 0.01 * numel).all()  # the sampled threshold keeps ~density
    assert all(s.as_dict()["overflow"] == 0 for s in stats)


def test_topk_overflow_keeps_the_first_entries_and_the_rest_in_the_residual(monkeypatch):
    world, numel, cap = 2, 5000, 60
    monkeypatch.setattr(topk.TopKCodec, "capacity", lambda self, numel, world: cap)  # fewer slots than kept entries
    codecs = [build("topk", TAGCConfig(sparsity=0.9)) for _ in range(world)]
    grads = grads_for("randn", world, numel, steps=1)[0]
    out, sent, stats = exchange(codecs, grads)
    density = TAGCConfig(sparsity=0.9).density(world)
    overflow = torch.zeros(world, dtype=torch.int64)  # per owner: the rows it receives
    for r, codec in enumerate(codecs):
        selected = keep_mask(grads[r], row_thresholds(grads[r], density)[:, None], keep_limit(numel, density)).clone()
        first = selected & (selected.cumsum(dim=1) <= cap)  # the first cap selected entries, in index order
        kept = sent_values(codec, sent[r], numel)
        assert torch.equal(kept != 0, first)
        assert torch.equal(kept + codec.residuals[KEY], grads[r])  # the rest stayed behind
        assert torch.equal(sent[r][0][:, -1], selected.sum(dim=1, dtype=torch.int32) - cap)
        overflow += selected.sum(dim=1) - cap
    assert [s.as_dict()["overflow"] for s in stats] == overflow.tolist()
    assert (overflow > 0).all()


def test_sign_sends_sign_times_block_mean_and_feeds_back_the_rest():
    world, numel, block = 3, 2500, 1024
    steps = grads_for("randn", world, numel, steps=3)
    codecs, before, out, sent, _ = two_steps("sign", steps)
    expected = torch.zeros(world, numel)
    for r, codec in enumerate(codecs):
        accumulated = before[r].float() + steps[-1][r]
        kept = sent_values(codec, sent[r], numel)
        assert torch.equal(codec.residuals[KEY], accumulated - kept)  # the residual is what was not sent (one rounding)
        means = quantized.blocked(accumulated, block).abs().sum(-1) / torch.tensor([1024, 1024, 452])
        magnitude = quantized.blocked(kept.abs(), block)[:, :, 0]
        assert torch.allclose(magnitude, means, rtol=1e-6)
        assert torch.equal(kept > 0, accumulated >= 0)
        expected += kept
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)
    # over the steps, what was sent plus what is left equals what came in
    total_sent = torch.zeros(world, numel)
    codecs = [build("sign") for _ in range(world)]
    for grads in steps:
        _, sent, _ = exchange(codecs, grads)
        total_sent += sent_values(codecs[0], sent[0], numel)
    assert torch.allclose(total_sent + codecs[0].residuals[KEY], sum(g[0] for g in steps), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["zeros", "ones", "mixed"])
@pytest.mark.parametrize("numel", [1, 7, 1025])
def test_sign_on_adversarial_inputs(kind, numel):
    world = 2
    steps = grads_for(kind, world, numel)
    codecs, before, out, sent, _ = two_steps("sign", steps)
    for r, codec in enumerate(codecs):
        accumulated = before[r].float() + steps[-1][r]
        kept = sent_values(codec, sent[r], numel)
        assert torch.equal(codec.residuals[KEY], accumulated - kept)
        assert kept.isfinite().all() and codec.residuals[KEY].isfinite().all()
    if kind == "ones":  # every element at the block mean: sent exactly, nothing left
        assert torch.equal(out, torch.full((world, numel), float(world)))
        assert not any(c.residuals[KEY].any() for c in codecs)
    if kind == "zeros":
        assert not out.any()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("name", ["sign", "topk"])
def test_error_feedback_codecs_turn_a_nonfinite_part_nan_and_keep_the_residual(name, value):
    world, numel = 3, 3000
    steps = grads_for("randn", world, numel)
    steps[-1][1][2, 17] = value  # rank 1, its row for owner 2
    codecs, before, out, _, stats = two_steps(name, steps)
    assert out.isnan().all()  # every owner's whole part
    assert [s.as_dict()["nonfinite_parts"] for s in stats] == [1] * world
    assert torch.equal(codecs[1].residuals[KEY], before[1])  # the poisoned rank's residual as it was
    for r in (0, 2):  # the others kept what they did not send, as in a normal step
        assert codecs[r].residuals[KEY].isfinite().all() and not torch.equal(codecs[r].residuals[KEY], before[r])


def test_encode_and_decode_never_read_tensors_on_the_host():
    """On the meta device a host read (``.item()``, ``nonzero()``, ``bool()``) raises: none happens."""
    world, numel = 2, 70_001
    for name in ("bf16", "fp8", "int4", "int4-stochastic", "sign", "topk"):
        codec = build(name)
        wires = codec.encode(torch.empty(world, numel, device="meta"), KEY, None)
        planned = codec.wire(numel, world, torch.float32)
        assert [(w.shape[1], w.dtype) for w in wires] == [(w.columns, w.dtype) for w in planned]
        stats = ExchangeStats()
        assert codec.decode(wires, numel, KEY, None, stats).shape == (numel,)


# ----------------------------------------------------------------------------- wire bytes


def hand_formula(name: str, numel: int, world: int, block: int, density: float) -> int:
    blocks = math.ceil(numel / block)
    if name == "bf16":
        return 2 * numel + 1
    if name == "fp8":
        return numel + 4 * blocks
    if name.startswith("int4"):
        return math.ceil(numel / 2) + 4 * blocks
    if name == "sign":
        return math.ceil(numel / 8) + 4 * blocks
    if numel <= 65536:  # topk, exact threshold: room for the planned count
        cap = max(1, round(density * numel))
    else:
        mean, hits = density * numel, round(density * max(65536, math.ceil(4096 / density)))
        cap = math.ceil(mean + 4 * math.sqrt(mean + mean**2 / hits)) + 8
    return 4 * (math.ceil(numel / 65536) + 1) + 6 * cap


@pytest.mark.parametrize("name", ["bf16", "fp8", "int4", "sign", "topk"])
def test_wire_row_bytes_match_the_hand_formula(name):
    config = TAGCConfig(sparsity=0.95)
    for numel, world, block in [(1, 2, 128), (7, 3, 5), (1000, 2, 128), (4099, 4, 300), (1 << 20, 8, 1024)]:
        options = {} if name in ("bf16", "topk") else {"block": block}
        codec = build(name, config, **options)
        row = sum(w.row_bytes for w in codec.wire(numel, world, torch.float32))
        assert row == hand_formula(name, numel, world, block, config.density(world)), (numel, world, block)
    if name == "topk":
        overhead = topk.capacity(1 << 20, 0.05) / (0.05 * (1 << 20)) - 1
        assert 0.05 < overhead < 0.08  # ~4 sigma of a 4096-hit sample: +6.25%


# ----------------------------------------------------------------------------- on 2 gloo ranks

CHUNK = 5000
SEGMENTS = (Segment("w", 0, CHUNK - 100), Segment("bias", CHUNK - 100, 100, selected=False))
STATEFUL = {"sign", "topk", "int4-stochastic"}
ERROR_BOUND = {"bf16": 0.005, "fp8": 0.05, "int4": 0.15, "int4-stochastic": 0.22, "sign": 1.0, "topk": 1.0}
"""Relative error of a step's mean on Gaussian gradients: catches rows reaching the wrong owner (~1.4)."""


def hook_for(name, **settings):
    if name == "int4-stochastic":
        return tagc.hook(
            codec="int4", stochastic=True, select="all", min_compress_numel=1000, **{"dense_steps": 0, **settings}
        )
    config = paper(codec="topk", sparsity=0.9) if name == "topk" else {"codec": name}  # the list's formula bytes
    return tagc.hook(select="all", min_compress_numel=1000, **config, **{"dense_steps": 0, **settings})


def eager_and_traced(rank, world, name):
    """Two steps through the engine's eager ``reduce_scatter`` and through ``encode_bucket`` +
    all-to-all + ``decode_bucket``; a third hook resumes the first from its state after step 1."""
    eager, traced, resumed = hook_for(name), hook_for(name), hook_for(name)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(world * CHUNK, generator=gen) for _ in range(2)]
    outs = {"eager": [], "traced": [], "resumed": []}
    saved = None
    for step, grad in enumerate(grads):
        out, decoded = eager_and_traced_step(eager, traced, grad, SEGMENTS, CHUNK)
        outs["eager"].append(out)
        outs["traced"].append(decoded)
        if step == 0:
            sent = grad.view(world, CHUNK)[:, : CHUNK - 100].clone()
            for residuals in eager.residuals.values():  # sign, topk: what was sent is what did not stay behind
                sent -= residuals[0]
            saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in eager.state_dict().items()}
            resumed.load_state_dict(saved)
        else:
            out = torch.empty(CHUNK)
            resumed.reduce_scatter(out, grad.clone(), None, dist.ReduceOp.AVG, SEGMENTS)
            outs["resumed"].append(out)
    everyone = [torch.empty_like(g) for g in grads for _ in range(world)]
    dist.all_gather(everyone[:world], grads[0])
    dist.all_gather(everyone[world:], grads[1])
    exact = [sum(g.view(world, CHUNK)[rank] for g in everyone[s * world : (s + 1) * world]) / world for s in range(2)]
    all_sent = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(all_sent, sent)
    sent_mean = sum(s[rank] for s in all_sent) / world
    plan = eager.plan(SEGMENTS, CHUNK, world)
    row_bytes = sum(w.row_bytes for part in plan.parts for w in part.codec.wire(part.numel, world, torch.float32))
    poisoned = grads[1].clone()
    if rank == 1:
        poisoned[7] = float("nan")  # rank 1's row for owner 0 only
    raised = False
    try:
        strict = hook_for(name, nonfinite="raise")
        strict.reduce_scatter(torch.empty(CHUNK), poisoned, None, dist.ReduceOp.AVG, SEGMENTS)
    except FloatingPointError:
        raised = True
    return outs, exact, sent_mean, eager.stats()["total"], traced.stats()["total"], row_bytes, len(saved), raised


@pytest.mark.parametrize("name", ["bf16", "fp8", "int4", "int4-stochastic", "sign", "topk"])
def test_two_ranks_eager_equals_traced_and_counts_the_formula_bytes(name):
    world = 2
    for outs, exact, sent_mean, eager_total, traced_total, row_bytes, saved, raised in run_ranks(
            eager_and_traced, world, name):
        assert raised  # a NaN bound for owner 0 raises on every rank (nonfinite="raise")
        assert all(torch.equal(a, b) for a, b in zip(outs["eager"], outs["traced"]))  # both paths, bit for bit
        codec_name = name.split("-")[0]
        density = TAGCConfig(sparsity=0.9).density(world)
        formula = hand_formula(name, CHUNK - 100, world, 1024 if codec_name == "sign" else 128, density) + 100 * 4
        assert row_bytes == formula
        assert eager_total["wire_bytes"] == traced_total["wire_bytes"] == 2 * (world - 1) * formula
        assert eager_total["nonfinite_parts"] == traced_total["nonfinite_parts"] == 0
        for out, ref in zip(outs["eager"], exact):
            assert torch.equal(out[-100:], ref[-100:])  # the unselected bias went plain
            error = ((out - ref).norm() / ref.norm()).item()
            assert error < ERROR_BOUND[name]
        if name in ("sign", "topk"):  # the first step's mean is exactly the mean of what the ranks sent
            torch.testing.assert_close(outs["eager"][0][: CHUNK - 100], sent_mean, rtol=1e-6, atol=1e-7)
        if name in STATEFUL:  # the state survives state_dict / load_state_dict: the identical next step
            assert saved > 2 and torch.equal(outs["resumed"][0], outs["eager"][1])


# ----------------------------------------------------------------------------- bad input


def test_bad_codec_options_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match=r"codec 'int4' takes options \('block', 'stochastic'\); got 'rank'"):
        tagc.hook(dense_steps=0, codec="int4", rank=2)
    with pytest.raises(ValueError, match=r"ratio applies only to codecs \('tagc', 'topk'.*not to codec 'int4'"):
        tagc.hook(dense_steps=0, ratio=10, codec="int4")
    with pytest.raises(ValueError, match="takes no options"):
        tagc.hook(dense_steps=0, codec="bf16", block=64)
    for name in ("fp8", "int4", "sign"):
        for block in (0, -1, 2.5, True, "128"):
            with pytest.raises(ValueError, match="block must be a positive integer"):
                tagc.hook(dense_steps=0, codec=name, block=block)
    with pytest.raises(ValueError, match="stochastic must be True or False"):
        tagc.hook(dense_steps=0, codec="int4", stochastic="yes")
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match=r"float8_e4m3fn.*use codec 'bf16' or 'int4'"):
        tagc.hook(dense_steps=0, codec="fp8")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_topk_sends_at_most_0_55x_tagc_bytes_at_equal_density(world):
    """The same kept values as a list (16-bit offsets, fp32 values, capacity with slack) against
    TAGC's bitmap index and fp32 sketch, on the compressed columns (ratio 10, planned density)."""
    from tagc.config import TAGCConfig
    from tagc.hooks.codecs.registry import make_codec

    numel = 1 << 22
    tagc_bytes = sum(w.row_bytes for w in make_codec("tagc", TAGCConfig()).wire(numel, world, torch.float32))
    topk_bytes = sum(w.row_bytes for w in make_codec("topk", TAGCConfig()).wire(numel, world, torch.float32))
    assert topk_bytes <= 0.55 * tagc_bytes
    assert topk_bytes >= TAGCConfig().density(world) * numel * 6  # every planned value and its offset fit
