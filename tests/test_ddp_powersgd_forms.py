"""PowerSGD's all-reduce form under DDP with 16-bit values and plain columns (``powersgd-lean``), on 2 gloo ranks:
the form is taken, every tensor is summed in its own dtype, the bytes counted are the bytes the all-reduces carry,
a gradient of rank ``r`` comes back within bf16 rounding, and error feedback loses nothing."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import tagc
from tests.distributed import run_ranks
from tests.test_ddp_hook import _batch, _ddp, _model, _residual_per_parameter

RANK = 2
LEAN = {"codec": "powersgd", "rank": RANK, "plain": "bf16", "value_dtype": "bfloat16"}
"""``powersgd-lean`` (gpt2_bench.methods) at rank 2."""

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _weights(name: str, module: nn.Module | None) -> bool:
    """A ``select`` policy leaving the biases to the plain codec."""
    return name.endswith("weight")


FORMS = {  # label -> (settings, the dtype of P and Q, of a bias)
    "lean": (LEAN, BF16, BF16),  # biases selected: the codec's shape-less columns, in its value dtype
    "lean-plain-parts": ({**LEAN, "select": _weights}, BF16, BF16),  # biases: the plain codec's (bf16) parts
    "bf16-values-fp32-plain": ({"codec": "powersgd", "rank": RANK, "value_dtype": "bfloat16", "select": _weights},
                               BF16, F32),
    "fp32-values-bf16-plain": ({"codec": "powersgd", "rank": RANK, "plain": "bf16", "select": _weights}, F32, BF16),
    "fp16-values-bf16-plain": ({"codec": "powersgd", "rank": RANK, "plain": "bf16", "value_dtype": "float16",
                                "select": _weights}, F16, BF16),
    "fp8-plain": ({"codec": "powersgd", "rank": RANK, "plain": "fp8", "select": _weights}, None, None),
}
"""``fp8-plain``: its blockwise scales do not add up in an all-reduce, so the bucket goes ``rs+ag``."""


def _ring(nbytes: int, world: int) -> int:
    return 2 * (world - 1) * nbytes // world


class _Recorded:
    """Every ``dist.all_reduce`` call's tensor (dtype, elements), and every hook call's parameter shapes, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._original = dist.all_reduce

    def __enter__(self) -> _Recorded:
        def recorded(tensor, *args, **kwargs):
            self.events.append(("all_reduce", tensor.dtype, tensor.numel()))
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = recorded
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._original

    def hook(self, hook_fn):
        def called(state, bucket):
            self.events.append(("call", tuple(tuple(p.shape) for p in bucket.parameters())))
            return hook_fn(state, bucket)

        return called


def _forms(rank: int, world: int) -> dict:
    out = {}
    for label, (settings, _, _) in FORMS.items():
        settings = {"select": "all", "dense_steps": 0, "min_compress_numel": 1, **settings}
        ddp = _ddp(_model())
        state, hook_fn = tagc.ddp_hook(ddp, overlap=False, **settings)  # the blocking order: bucket after bucket
        steps = []
        with _Recorded() as recorded:
            ddp.register_comm_hook(state, recorded.hook(hook_fn))
            for step in range(3):  # DDP's first buckets, then two compressed steps
                recorded.events.clear()
                ddp.zero_grad(set_to_none=True)
                x, y = _batch(rank, step)
                nn.functional.mse_loss(ddp(x), y).backward()
                state.end_step()
                steps.append({"events": list(recorded.events), "wire_bytes": state.stats()["last_step"]["wire_bytes"]})
        out[label] = {"steps": steps, "forms": state.forms()}
    return out


def _expected_all_reduces(shapes: tuple, values: torch.dtype, bias: torch.dtype) -> list[tuple]:
    """The all-reduces of one bucket of one weight and one bias: ``P`` (rows x rank) with the bias when they share a
    dtype, else the bias in a second all-reduce, then ``Q`` (cols x rank)."""
    (weight,) = [s for s in shapes if len(s) == 2]
    (bias_numel,) = [s[0] for s in shapes if len(s) == 1]
    rows, cols = weight
    first = [("all_reduce", values, rows * RANK + bias_numel)] if bias == values else [
        ("all_reduce", values, rows * RANK), ("all_reduce", bias, bias_numel)]
    return [*first, ("all_reduce", values, cols * RANK)]


def test_16_bit_powersgd_takes_the_all_reduce_form_and_counts_the_bytes_its_all_reduces_carry():
    """Per bucket ``P`` (with the bias in its dtype, or beside it in a second all-reduce), then ``Q``, each in the
    dtype the settings give (worked out here from the shapes), and nothing else; the hook's own byte count equals
    those all-reduces' ring volumes, and is each bucket's planned bytes; ``plain="fp8"`` goes ``rs+ag``."""
    result = run_ranks(_forms, 2, timeout_s=240.0)[0]
    for label, (_, values, bias) in FORMS.items():
        forms = result[label]["forms"]
        if values is None:
            assert {form for form, _ in forms.values()} == {"rs+ag"}, label
            continue
        assert {form for form, _ in forms.values()} == {"sketch"}, (label, forms)
        for step in result[label]["steps"][1:]:  # the compressed steps
            events = step["events"]
            calls = [i for i, event in enumerate(events) if event[0] == "call"]
            assert len(calls) == len(forms) >= 2, label  # several buckets
            expected = []
            for at in calls:
                expected += [events[at], *_expected_all_reduces(events[at][1], values, bias)]
            assert events == expected, label
            counted = sum(_ring(e[2] * e[1].itemsize, 2) for e in events if e[0] == "all_reduce")
            assert counted == sum(planned["sketch"] for _, planned in forms.values()), label
        # the last step's statistics are its own (the first compressed one's also hold DDP's first iteration, whose
        # step is not counted)
        assert result[label]["steps"][-1]["wire_bytes"] == counted, label


# ---------------------------------------------------------------------------------------------- exactness


def _rank_r(rank: int, world: int) -> dict:
    out = {}
    for label, settings in {"lean": LEAN, "fp32": {"codec": "powersgd", "rank": RANK}}.items():
        model = _model()
        ddp = _ddp(copy.deepcopy(model))
        ddp.register_comm_hook(*tagc.ddp_hook(ddp, select="all", dense_steps=0, min_compress_numel=1, **settings))
        steps = []
        for step in range(2):  # DDP's first buckets, then the first compressed step (no residual yet)
            generator = torch.Generator().manual_seed(100 * rank + step)
            x, y = torch.randn(1, 64, generator=generator), torch.randn(1, 48, generator=generator)
            # one sample per rank: every weight gradient has rank 1 on a rank, rank <= 2 summed
            local = copy.deepcopy(model)
            nn.functional.mse_loss(local(x), y).backward()
            ddp.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            steps.append({"avg": [p.grad.clone() for p in ddp.parameters()],
                          "local": [p.grad.clone() for p in local.parameters()]})
        out[label] = steps
    return out


def test_lean_powersgd_recovers_a_rank_r_gradient_within_bf16_rounding():
    """One sample per rank: each weight's summed gradient has rank <= 2, which rank-2 PowerSGD recovers (the first
    compressed step: no residual yet, so what is compressed is exactly of rank 2; later steps add each rank's
    residual, whose own rounding on the 16-bit wire is relative to that rank's ``M``, not to the sum). In bf16
    (``P``, ``Q`` and the biases summed in bf16, unit roundoff 2^-8) the average is within a few roundings of the
    exact one: each bias within 2^-7 of its ranks' mean magnitude (each value and their sum rounded), each weight
    within 2^-5 of its largest entry (P rounded, which moves its span, then Q rounded and summed); the fp32 form
    within 1e-5, so the bf16 error is the wire's, and it is there (the form did not send fp32)."""
    results = run_ranks(_rank_r, 2, timeout_s=180.0)
    for label, bound in (("lean", None), ("fp32", 1e-5)):
        rounded = False
        for step in range(1, 2):
            avgs = [r[label][step]["avg"] for r in results]
            assert all(torch.equal(a, b) for a, b in zip(*avgs)), (label, step)  # both ranks: the same bits
            for i, got in enumerate(avgs[0]):
                grads = torch.stack([r[label][step]["local"][i] for r in results]).double()
                exact = grads.mean(0)
                error = (got.double() - exact).abs()
                if bound is not None:
                    limit = bound * exact.abs().max()
                elif got.dim() == 1:
                    limit = 2.0**-7 * grads.abs().mean(0) + 1e-30
                else:
                    limit = 2.0**-5 * exact.abs().max()
                assert (error <= limit).all(), (label, step, i, float((error - limit).max()))
                rounded |= bool((error > 1e-5 * exact.abs().max()).any())
        assert rounded == (label == "lean"), label


def _mass(rank: int, world: int) -> dict:
    ddp = _ddp(_model())
    state, hook_fn = tagc.ddp_hook(ddp, select="all", dense_steps=0, min_compress_numel=1, **LEAN)
    ddp.register_comm_hook(state, hook_fn)
    names = [name for name, _ in ddp.module.named_parameters()]
    grads = {name: [] for name in names}
    avgs = {name: [] for name in names}
    model = copy.deepcopy(ddp.module)
    for step in range(5):  # DDP's first buckets (reduced as DDP does), then four compressed steps
        x, y = _batch(rank, step)  # 16 samples: full-rank gradients, much of them left in the residuals
        local = copy.deepcopy(model)
        nn.functional.mse_loss(local(x), y).backward()
        ddp.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        state.end_step()
        for name, p, q in zip(names, local.parameters(), ddp.parameters()):
            grads[name].append(p.grad.clone())
            avgs[name].append(q.grad.clone())
    residuals = _residual_per_parameter(state)
    return {"grads": grads, "avgs": avgs, "residuals": residuals, "forms": state.forms()}


def test_lean_powersgd_error_feedback_conserves_mass():
    """Over five steps, what the ranks received (N times each step's average) plus what they still hold (their
    residuals) equals every gradient they produced: the weights to float32 rounding (their residuals hold P and Q's
    bf16 rounding too), the biases, which have no residual, within 2^-7 of their magnitudes per step (each rank's
    value and the sum rounded to bf16, unit roundoff 2^-8)."""
    results = run_ranks(_mass, 2, timeout_s=180.0)
    world = len(results)
    assert {form for form, _ in results[0]["forms"].values()} == {"sketch"}
    for name in results[0]["grads"]:
        produced = sum(sum(g.double() for g in r["grads"][name]) for r in results).reshape(-1)
        received = world * sum(a.double() for a in results[0]["avgs"][name]).reshape(-1)
        held = sum(r["residuals"][name].double() for r in results)
        magnitudes = sum(sum(g.double().abs() for g in r["grads"][name]) for r in results).reshape(-1)
        if len(results[0]["grads"][name][0].shape) == 1:
            limit = 2.0**-7 * magnitudes + 1e-30
            assert not held.any(), name
        else:
            limit = 1e-5 * (magnitudes + world * sum(a.double().abs() for a in results[0]["avgs"][name]).reshape(-1)
                            + sum(r["residuals"][name].double().abs() for r in results))
            assert held.abs().sum() > 1e-3 * magnitudes.sum(), name  # error feedback holds a real share
        error = (received + held - produced).abs()
        assert (error <= limit).all(), (name, float((error - limit).max()))


# ---------------------------------------------------------------------------------------------- host bytes


def _tiny_gpt(rank: int, world: int) -> dict:
    from gpt2_bench.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", block_size=32))
    ddp = nn.parallel.DistributedDataParallel(model)
    state, hook_fn = tagc.ddp_hook(ddp, codec="powersgd", select="all", min_compress_numel=2048, dense_steps=0,
                                   plain="bf16", value_dtype="bfloat16")
    ddp.register_comm_hook(state, hook_fn)
    idx = torch.randint(0, 50304, (1, 32), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):  # DDP's first buckets, then two compressed steps: the last one's statistics are its own
        ddp.zero_grad(set_to_none=True)
        ddp(idx, idx)[1].backward()
        state.end_step()
    return {"wire_bytes": state.stats()["last_step"]["wire_bytes"], "forms": state.forms()}


def test_host_bytes_arithmetic_for_ddp_powersgd_lean_is_the_hooks_count():
    """``gpt2_bench.host_bytes``'s DDP row for ``powersgd-lean`` at 2 hosts (the all-reduce form, bf16) is what the
    hook counts on the tiny preset with the same selection."""
    from gpt2_bench import host_bytes

    result = run_ranks(_tiny_gpt, 2, timeout_s=180.0)[0]
    assert {form for form, _ in result["forms"].values()} == {"sketch"}
    parts = {c: host_bytes.model_parts("tiny", c, 2048, block_size=32) for c in ("none", "all", "non-attn")}
    worked_out, form = host_bytes.per_host_bytes("ddp", "powersgd-lean", 2, parts, rank=4)
    assert form == "sketch" and worked_out == result["wire_bytes"]


def test_average_into_is_approximate_in_place_bit_for_bit():
    """The DDP form's in-place decode (the averaged approximation written into the bucket, the residual into ``M``'s
    memory) gives the bits of the codec's own :meth:`approximate` (``p q^T``, then ``M - p q^T / N``): the bucket's
    values, the residual and the next warm-start ``Q``, for 2 and 3 ranks, with a residual held or not, bf16 residuals
    too; and a non-finite summed ``Q`` leaves the residual and ``Q`` as they were, counted, with NaN in the bucket."""
    from tagc.hooks.codecs.powersgd import PowerSGDCodec, orthonormal
    from tagc.hooks.core.stats import ExchangeStats

    generator = torch.Generator().manual_seed(7)
    rows, cols, rank = 48, 40, 3
    for world in (2, 3):
        for residual_dtype in (F32, BF16):
            for held in (False, True):
                for finite_q in (True, False):
                    m = torch.randn(rows, cols, generator=generator)
                    p = orthonormal(torch.randn(rows, rank, generator=generator))
                    q = torch.randn(cols, rank, generator=generator) * world
                    if not finite_q:
                        q[1, 2] = float("nan")
                    q_used = torch.randn(cols, rank, generator=generator)
                    residual = torch.randn(rows, cols, generator=generator).to(residual_dtype)
                    codecs = []
                    for _ in range(2):
                        codec = PowerSGDCodec(rank=rank, residual_dtype=residual_dtype)
                        if held:
                            codec.residuals["w"] = residual.clone()
                            codec.qs["w"] = q_used.clone() * 2
                        codecs.append(codec)
                    reference_stats, stats = ExchangeStats(), ExchangeStats()
                    approx = codecs[0].approximate("w", m.clone(), p, q, q_used, world, reference_stats)
                    bucket = torch.full((rows * cols + 5,), 9.0)
                    averaged = bucket[2 : 2 + rows * cols].view(rows, cols)  # a matrix's place in a DDP bucket
                    codecs[1].average_into("w", m.clone(), p, q, q_used, world, averaged, stats)
                    label = (world, residual_dtype, held, finite_q)
                    assert torch.equal(averaged.nan_to_num(), (approx / world).nan_to_num()), label
                    assert averaged.isnan().any() == (not finite_q), label
                    assert torch.equal(bucket[:2], torch.full((2,), 9.0)), label  # nothing written outside
                    assert torch.equal(bucket[-3:], torch.full((3,), 9.0)), label
                    assert codecs[1].residuals["w"].dtype == residual_dtype, label
                    assert torch.equal(codecs[1].residuals["w"], codecs[0].residuals["w"]), label
                    assert torch.equal(codecs[1].qs["w"], codecs[0].qs["w"]), label
                    assert int(stats.nonfinite_parts) == int(reference_stats.nonfinite_parts) == (0 if finite_q else 1)
                    if not finite_q:
                        kept = residual if held else torch.zeros(rows, cols, dtype=residual_dtype)
                        assert torch.equal(codecs[1].residuals["w"], kept), label
                        assert torch.equal(codecs[1].qs["w"], q_used * 2 if held else q_used), label
