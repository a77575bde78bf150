"""The ``powersgd`` codec on 2 gloo ranks: exact on low-rank gradients, the DDP hook's algorithm
and error feedback, state round trip, bytes, overlapped = blocking = compiled, bad input."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

import tagc
from tagc.hooks import Segment
from tagc.hooks.codecs.powersgd import PowerSGDCodec, _Matrix
from tests.distributed import run_ranks

RANK = 4
SHAPES = {"a.weight": (37, 24), "a.bias": (37,), "b.weight": (16, 50), "skip.weight": (10, 10)}
"""Two matrices (one with uneven rows over 2 ranks), a bias that rides plain inside the codec's
part, and a matrix the select policy leaves to the hook's plain part."""


def select(name, module=None) -> bool:
    return not name.startswith("skip")


def powersgd_hook(**options):
    options = {"select": select, "min_compress_numel": 1, "rank": RANK, **options}
    return tagc.hook(codec="powersgd", **{"dense_steps": 0, **options})


def layout(world: int, prefix: str = "") -> tuple[list[Segment], int]:
    """SimpleFSDP/FSDP2's packing: each parameter's rows padded to ``world * R``, R rows per rank."""
    segments, start = [], 0
    for name, shape in SHAPES.items():
        numel = -(-shape[0] // world) * math.prod(shape[1:])
        segments.append(Segment(prefix + name, start, numel, shape=shape))
        start += numel
    return segments, start


def pack(grads: dict[str, torch.Tensor], world: int) -> torch.Tensor:
    """Full per-parameter gradients -> the ``[world, S]`` reduce-scatter input."""
    rows = []
    for name, shape in SHAPES.items():
        g = grads[name].reshape(shape[0], -1)
        rows.append(F.pad(g, (0, 0, 0, -(-shape[0] // world) * world - shape[0])).reshape(world, -1))
    return torch.cat(rows, dim=1)


def unpack(rows: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    """``[world, S]`` (row ``j`` = rank ``j``'s reduced chunk) -> full parameters."""
    segments, _ = layout(world)
    return {s.name: rows[:, s.start : s.start + s.numel].reshape(-1)[: math.prod(s.shape)].view(s.shape[0], -1)
            for s in segments}


def exchange(hook, packed: torch.Tensor, world: int, prefix: str = "") -> torch.Tensor:
    segments, chunk = layout(world, prefix)
    out = torch.empty(chunk)
    hook.reduce_scatter(out, packed.reshape(-1).clone(), None, dist.ReduceOp.AVG, segments)
    return out


def gathered(out: torch.Tensor, world: int) -> dict[str, torch.Tensor]:
    everyone = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(everyone, out)
    return unpack(torch.stack(everyone), world)


def random_grads(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def matrix_residuals(hook) -> dict[str, torch.Tensor]:
    return {key.rsplit("/", 1)[1]: value for key, value in hook.codec.residuals.items()}


# ----------------------------------------------------------------------------- the algorithm


def _low_rank(rank, world):
    """Each rank's matrices lie in one shared rank-RANK span, so the sum does too."""
    packed = pack(_low_rank_grads(rank), world)
    everyone = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(everyone, packed)
    expected = sum(p[rank] for p in everyone) / world
    hook = powersgd_hook()
    out = exchange(hook, packed, world)
    residual_sum = {k: v.clone() for k, v in matrix_residuals(hook).items()}
    for value in residual_sum.values():
        dist.all_reduce(value)
    return out, expected, residual_sum


def test_a_gradient_of_rank_r_is_reproduced_to_float32_rounding():
    for out, expected, residual_sum in run_ranks(_low_rank, 2):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
        assert all(v.abs().max() < 1e-4 for v in residual_sum.values())  # nothing was missed


def _reference_and_feedback(rank, world):
    """Two steps on full-rank gradients: the DDP hook's algorithm on the summed matrices, and
    ``residual + this rank's share of the approximation == M`` on every rank."""
    hook = powersgd_hook()
    segments, chunk = layout(world)
    part_key = f"{'|'.join(s.name for s in segments if select(s.name))}#{chunk}/part0"
    results, residual = [], {name: torch.zeros(SHAPES[name]) for name in ("a.weight", "b.weight")}
    q = {name: PowerSGDCodec()._q(f"{part_key}/{name}", _Matrix(name, 0, 0, *SHAPES[name], RANK), torch.device("cpu"))
         for name in residual}
    for step in range(2):
        grads = random_grads(1000 * step + rank)
        out = gathered(exchange(hook, pack(grads, world), world), world)
        for name in residual:
            m = grads[name] + residual[name]
            summed = m.clone()
            dist.all_reduce(summed)
            q_in = q[name].clone().unsqueeze(0)
            _orthogonalize(q_in)
            p = (summed @ q_in[0]).unsqueeze(0)
            _orthogonalize(p)
            q[name] = summed.T @ p[0] / world
            approx = p[0] @ q[name].T  # the DDP hook's averaged approximation
            results.append(((out[name] - approx).abs().max() / approx.abs().max(),
                            (matrix_residuals(hook)[name] + out[name] - m).abs().max() / m.abs().max()))
            residual[name] = matrix_residuals(hook)[name].clone()
        plain = gathered(exchange(powersgd_hook(select="none"), pack(grads, world), world), world)
        results.append(
            ((out["a.bias"] - plain["a.bias"]).abs().max(), (out["skip.weight"] - plain["skip.weight"]).abs().max())
        )
    return results


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_ddp_hooks_algorithm_and_error_feedback(world):
    for results in run_ranks(_reference_and_feedback, world):
        for against_reference, feedback in results:
            assert against_reference < 1e-5 and feedback < 1e-6


# ----------------------------------------------------------------------------- state, bytes


def _roundtrip(rank, world):
    """Per ``warm_start``: the third step after a reload equals it without; the state's kinds."""
    grads = [pack(random_grads(10 * s + rank), world) for s in range(3)]
    results = []
    for warm_start in (True, False):
        first = powersgd_hook(warm_start=warm_start)
        for g in grads[:2]:
            exchange(first, g, world)
        state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in first.state_dict().items()}
        expected = exchange(first, grads[2], world)
        resumed = powersgd_hook(warm_start=warm_start)
        resumed.load_state_dict(state)
        again = exchange(resumed, grads[2], world)
        kinds = sorted({key.rsplit("/", 1)[1] for key in state if key.startswith("residual.")})
        results.append((torch.equal(again, expected), kinds, all(torch.equal(a, b) for a, b in zip(
            first.codec.state_dict().values(), resumed.codec.state_dict().values()))))
    return results


def test_q_and_residuals_survive_a_state_dict_round_trip():
    for (warm, warm_kinds, warm_state), (cold, cold_kinds, cold_state) in run_ranks(_roundtrip, 2):
        assert warm and warm_state and warm_kinds == ["draws", "q", "residual"]
        assert cold and cold_state and cold_kinds == ["draws", "residual"]  # a fresh Q per step: its draw count


def _bytes(rank, world):
    hook = powersgd_hook()
    exchange(hook, pack(random_grads(rank), world), world)
    return hook.stats()["total"]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_wire_bytes_follow_the_formula(world):
    p = sum(SHAPES[name][0] * RANK for name in ("a.weight", "b.weight"))
    q = sum(SHAPES[name][1] * RANK for name in ("a.weight", "b.weight"))
    rows = lambda name: -(-SHAPES[name][0] // world)  # noqa: E731
    plain = rows("a.bias") + rows("skip.weight") * SHAPES["skip.weight"][1]
    formula = (world - 1) * (2 * 4 * -(-p // world) + 2 * 4 * -(-q // world) + 4 * plain)
    for total in run_ranks(_bytes, world):
        assert total["wire_bytes"] == formula
        assert total["plain_equivalent_bytes"] == (world - 1) * layout(world)[1] * 4


def _bf16(rank, world):
    """The low-rank case and the bytes, with P, Q and the shape-less columns in bf16."""
    bf16 = powersgd_hook(value_dtype="bfloat16")
    packed = pack(_low_rank_grads(rank), world)
    approx = exchange(bf16, packed, world)
    return approx, exchange(powersgd_hook(), packed, world), bf16.stats()["total"]


def _low_rank_grads(rank):
    shared, mine = torch.Generator().manual_seed(0), torch.Generator().manual_seed(100 + rank)
    grads = random_grads(10 + rank)
    for name in ("a.weight", "b.weight"):
        m, n = SHAPES[name]
        u, v = torch.randn(m, RANK, generator=shared), torch.randn(n, RANK, generator=shared)
        grads[name] = u @ torch.randn(RANK, RANK, generator=mine) @ v.T
    return grads


def test_bf16_values_halve_the_wire_and_keep_the_approximation_to_bf16_rounding():
    world = 2
    p = sum(SHAPES[name][0] * RANK for name in ("a.weight", "b.weight"))
    q = sum(SHAPES[name][1] * RANK for name in ("a.weight", "b.weight"))
    rows = lambda name: -(-SHAPES[name][0] // world)  # noqa: E731
    formula = (world - 1) * (2 * 2 * -(-p // world) + 2 * 2 * -(-q // world) + 2 * rows("a.bias")
                             + 4 * rows("skip.weight") * SHAPES["skip.weight"][1])  # skip.weight: not selected, fp32
    for approx, fp32, total in run_ranks(_bf16, world):
        assert total["wire_bytes"] == formula
        scale = fp32.abs().max().item()
        assert (approx - fp32).abs().max().item() <= 2**-6 * scale and not torch.equal(approx, fp32)


def _nonfinite(rank, world):
    hook = powersgd_hook()
    exchange(hook, pack(random_grads(rank), world), world)
    before = {k: v.clone() for k, v in hook.codec.state_dict().items()}
    grads = random_grads(10 + rank)
    if rank == 1:
        grads["a.weight"][3, 5] = float("nan")
    out = gathered(exchange(hook, pack(grads, world), world), world)
    after = hook.codec.state_dict()
    kept = all(torch.equal(after[k], v) for k, v in before.items() if "/a.weight/" in k)  # residual, Q, draws
    finite_state = all(bool(torch.isfinite(v).all()) for v in after.values())
    return (
        bool(out["a.weight"].isnan().all()),
        bool(torch.isfinite(out["b.weight"]).all() and torch.isfinite(out["a.bias"]).all()),
        kept,
        finite_state,
    )


def test_a_nonfinite_matrix_reaches_every_owner_and_poisons_no_state():
    for matrix_nan, others_finite, kept, finite_state in run_ranks(_nonfinite, 2):
        assert matrix_nan and others_finite and kept and finite_state


def _nonfinite_raises(rank, world):
    hook = powersgd_hook(nonfinite="raise")
    exchange(hook, pack(random_grads(rank), world), world)  # a finite step passes
    grads = random_grads(10 + rank)
    if rank == 0:
        grads["b.weight"][0, 1] = float("inf")
    try:
        exchange(hook, pack(grads, world), world)
    except FloatingPointError as error:
        raised = "NaN/Inf" in str(error)
    else:
        raised = False
    out = exchange(hook, pack(random_grads(20 + rank), world), world)  # the group is still in step
    return raised, bool(torch.isfinite(out).all())


def test_nonfinite_raise_raises_on_every_rank_and_the_next_step_runs():
    assert run_ranks(_nonfinite_raises, 2) == [(True, True), (True, True)]


# ----------------------------------------------------------------------------- overlapped = blocking


def _overlapped(rank, world):
    """Three buckets in flight at once (polled between launches) against one at a time."""
    prefixes = ("l0.", "l1.", "l2.")
    blocking, overlapped = powersgd_hook(), powersgd_hook()
    results = []
    for step in range(2):
        grads = {prefix: pack(random_grads(100 * step + 10 * rank + i), world) for i, prefix in enumerate(prefixes)}
        expected = [exchange(blocking, grads[prefix], world, prefix) for prefix in prefixes]
        pending = []
        for prefix in prefixes:
            segments, chunk = layout(world, prefix)
            pending.append(overlapped.start(torch.empty(chunk), grads[prefix].reshape(-1).clone(), None,
                                            dist.ReduceOp.AVG, segments))
            time.sleep(0.01 * (rank + 1))  # ranks poll at different moments
            overlapped.poll()
        results.append(all(torch.equal(p.wait(), e) for p, e in zip(pending, expected)))
        blocking.end_step(), overlapped.end_step()
    return results, blocking.stats()["total"]["wire_bytes"], overlapped.stats()["total"]["wire_bytes"]


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_overlapped_buckets_equal_blocking_ones_bit_for_bit(world):
    for identical, blocking_bytes, overlapped_bytes in run_ranks(_overlapped, world):
        assert all(identical) and blocking_bytes == overlapped_bytes


def _simple_fsdp(rank, world):
    """A step of SimpleFSDP GPT-2 eager overlapped, eager blocking and compiled (aot_eager)."""
    from fsdp_integration import CompileSettings, compile_model, simple_fsdp
    from tests.test_simple_fsdp import _batch, _mine, _models

    results = []
    for overlap, compiled in ((True, False), (False, False), (True, True)):
        _, model = _models(0)
        model = simple_fsdp(model, overlap=overlap)
        hook = tagc.hook(dense_steps=0, codec="powersgd", min_compress_numel=1024, overlap=overlap)
        tagc.register_comm_hook(model, hook)
        forward = compile_model(model, CompileSettings(backend="aot_eager")) if compiled else model
        idx, tgt = _batch(0, world)
        forward(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        results.append(([p.grad.to_local().clone() for p in model.parameters()], hook.stats()["total"]["wire_bytes"],
                        hook.stats()["total"]["compressed_buckets"]))
    return results


@pytest.mark.slow  # the default suite keeps FSDP2's powersgd and SimpleFSDP's compiled tagc exchange
def test_simple_fsdp_eager_overlapped_blocking_and_compiled_agree():
    for (overlapped, o_bytes, buckets), (blocking, b_bytes, _), (compiled, c_bytes, _) in run_ranks(
        _simple_fsdp, 2, timeout_s=300
    ):
        assert buckets > 0 and o_bytes == b_bytes == c_bytes
        assert all(torch.equal(a, b) for a, b in zip(overlapped, blocking))
        assert all(torch.equal(a, b) for a, b in zip(overlapped, compiled))  # the exchange is one opaque op there


def _fsdp2(rank, world):
    """FSDP2 on a batch of one per rank: every weight gradient has rank <= 2 <= RANK, so PowerSGD is exact."""
    return [_fsdp2_grads(rank, world, use_powersgd) for use_powersgd in (True, False)]


def _fsdp2_grads(rank, world, use_powersgd):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 7), torch.nn.Tanh(), torch.nn.Linear(7, 12, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    if use_powersgd:
        tagc.register_comm_hook(model, tagc.hook(dense_steps=0, codec="powersgd", select="all", min_compress_numel=1))
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(rank))
    model(x).square().sum().backward()
    return [p.grad.to_local().clone() for p in model.parameters()]


def test_fsdp2_shapes_reach_the_codec_exact_on_low_rank_gradients():
    for compressed, plain in run_ranks(_fsdp2, 2):
        for a, b in zip(compressed, plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fsdp1(rank, world):
    """FSDP1 units of one parameter each (their flat buffer starts with it), a batch of one per rank."""
    return [_fsdp1_step(rank, world, use_powersgd) for use_powersgd in (True, False)]


def _fsdp1_step(rank, world, use_powersgd):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 7, bias=False), torch.nn.Tanh(), torch.nn.Linear(7, 12, bias=False))
    model[0], model[2] = FSDP(model[0], device_id=torch.device("cpu")), FSDP(model[2], device_id=torch.device("cpu"))
    model = FSDP(model, device_id=torch.device("cpu"))
    hook = tagc.hook(dense_steps=0, codec="powersgd", select="all", min_compress_numel=1)
    if use_powersgd:
        tagc.register_comm_hook(model, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(1, 16, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    opt.step()
    with FSDP.summon_full_params(model):
        return [p.detach().clone() for p in model.parameters()], hook.stats()["total"]["compressed_buckets"]


def test_fsdp1_single_parameter_units_are_compressed_exact_on_low_rank_gradients():
    for (compressed, buckets), (plain, _) in run_ranks(_fsdp1, 2):
        assert buckets == 2
        for a, b in zip(compressed, plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("rank", [0, -1, 2.0, True, "4"])
def test_bad_rank_is_a_clear_error(rank):
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        tagc.hook(dense_steps=0, codec="powersgd", rank=rank)


def test_other_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="warm_start must be True or False"):
        tagc.hook(dense_steps=0, codec="powersgd", warm_start=1)
    with pytest.raises(ValueError, match="takes options"):
        tagc.hook(dense_steps=0, codec="powersgd", rnak=2)
    with pytest.raises(ValueError, match="ratio applies only"):
        tagc.hook(dense_steps=0, codec="powersgd", ratio=10)


def test_a_rank_above_a_matrix_side_names_the_parameter_and_its_shape():
    hook = powersgd_hook(rank=17)  # b.weight is 16 x 50; a.weight 37 x 24; skip.weight is not selected
    with pytest.raises(ValueError, match=r"rank=17 exceeds .*'b.weight' of shape \(16, 50\)"):
        exchange(hook, pack(random_grads(0), 1), 1)
