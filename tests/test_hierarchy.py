"""The hierarchical exchange on 4 gloo ranks as 2 hosts x 2 ranks: values, error feedback, bytes,
settings, and the FSDP2 (1-D and HSDP) and SimpleFSDP (eager and compiled) adapters."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import tagc
from tagc.hooks import Segment
from tagc.sketch.sparsify import capacity, keep_limit
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE

WORLD, PER_HOST = 4, 2
HOSTS = WORLD // PER_HOST
CHUNK = 60_000


def _segments(chunk=CHUNK):
    """A compressible 'weight' and a small plain 'bias' in every chunk."""
    return [Segment("mlp.c_fc.weight", 0, chunk - 500), Segment("mlp.c_fc.bias", chunk - 500, 500)]


def _grad(step: int, rank: int, chunk=CHUNK) -> torch.Tensor:
    """Rank ``rank``'s reduce-scatter input at ``step`` (``[N, C]``): every rank can make everyone's."""
    return torch.randn(WORLD, chunk, generator=torch.Generator().manual_seed(1000 * step + rank))


def _exchange(hook, grad, segments=None):
    out = torch.empty(grad.shape[1])
    hook.reduce_scatter(out, grad.reshape(-1).clone(), None, dist.ReduceOp.AVG, segments or _segments(grad.shape[1]))
    return out


def _host_block(step: int, rank: int) -> torch.Tensor:
    """What step 1 gives rank ``(h, l)``: the chunks of ranks ``(h', l)`` summed over host ``h``'s ranks
    (``[H, C]``)."""
    host, local = divmod(rank, PER_HOST)
    summed = sum(_grad(step, host * PER_HOST + other).double() for other in range(PER_HOST))
    return summed.view(HOSTS, PER_HOST, -1)[:, local].float()


# ----------------------------------------------------------------------------- the engine


def _engine(rank, world):
    # plain codec: the exact mean
    plain = tagc.hook(dense_steps=0, codec="plain", ranks_per_host=PER_HOST)
    out = _exchange(plain, _grad(0, rank))
    exact = sum(_grad(0, r).double()[rank] for r in range(world)) / world
    plain_error = ((out.double() - exact).abs().max() / exact.abs().max()).item()

    # tagc: what the owner decodes is the exact sum of what the cross ranks kept (their residual + kept == block)
    hook = tagc.hook(
        dense_steps=0, ratio=10, index_bits=1, ranks_per_host=PER_HOST, min_part=1 << 17, min_compress_numel=1024,
        **PAPER_WIRE,
    )
    host, local = divmod(rank, PER_HOST)
    density = hook.settings.config.density(HOSTS)
    outs, checks, rows, unions = [], [], [], []
    for step in range(3):
        before = {k: [r.clone() for r in v] for k, v in hook.residuals.items()}
        outs.append(_exchange(hook, _grad(step, rank)))
        plan = hook.plan(tuple(_segments()), CHUNK, HOSTS)
        (parts,) = hook.residuals.values()
        kept = _host_block(step, rank)
        for part, residual, old in zip(plan.compressed_parts, parts, next(iter(before.values()), [None] * len(parts))):
            if old is not None:
                kept[:, part.columns] += old
            kept[:, part.columns] -= residual
            assert ((kept[:, part.columns] == 0) | (residual == 0)).all()  # a value is sent or kept back, never split
            for row, held in zip(kept[:, part.columns], residual):  # per owner host: its largest magnitudes, as planned
                sent = row[row != 0].abs()
                rows.append((sent.numel(), keep_limit(row.numel(), density), capacity(row.numel(), density),
                             sent.min().item() if sent.numel() else float("inf"), held.abs().max().item()))
        everyone = [torch.empty_like(kept) for _ in range(world)]
        dist.all_gather(everyone, kept)
        expected = sum(everyone[h * PER_HOST + local][host] for h in range(HOSTS)) / world
        sent_by = [everyone[h * PER_HOST + local][host, : CHUNK - 500] != 0 for h in range(HOSTS)]
        unions.append(int((sum(s.int() for s in sent_by) > 0).sum()))
        checks.append(((outs[-1] - expected).norm() / expected.norm()).item())
        checks.append(bool(torch.equal(outs[-1] != 0, expected != 0)))
    residuals = {k: [tuple(r.shape) for r in v] for k, v in hook.residuals.items()}
    # error feedback: what all owners received over the steps plus what all ranks still hold == what was put in
    (parts,) = hook.residuals.values()
    held = torch.zeros(HOSTS, CHUNK)
    for part, residual in zip(plan.compressed_parts, parts):
        held[:, part.columns] = residual
    received = [torch.empty(CHUNK) for _ in range(world)]
    dist.all_gather(received, sum(outs) * world)
    holds = [torch.empty_like(held) for _ in range(world)]
    dist.all_gather(holds, held)
    owed = torch.stack(
        [sum(holds[h * PER_HOST + (j % PER_HOST)][j // PER_HOST] for h in range(HOSTS)) for j in range(world)]
    )
    put_in = sum(_grad(step, r).double() for step in range(3) for r in range(world)).float()
    feedback = ((torch.stack(received) + owed - put_in).norm() / put_in.norm()).item()
    stats, state = hook.stats()["total"], hook.state_dict()
    # a checkpoint of the H-row residuals resumes exactly
    resumed = tagc.hook(
        dense_steps=0, ratio=10, index_bits=1, ranks_per_host=PER_HOST, min_part=1 << 17, min_compress_numel=1024,
        **PAPER_WIRE,
    )
    resumed.load_state_dict({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    resumes = bool(torch.equal(_exchange(resumed, _grad(9, rank)), _exchange(hook, _grad(9, rank))))
    return {"plain_error": plain_error, "checks": checks, "residuals": residuals, "feedback": feedback, "stats": stats,
            "density": density, "state": sorted(state), "resumes": resumes, "rows": rows, "unions": unions}


def test_hierarchical_reduce_scatter_is_exact_and_keeps_error_feedback():
    for result in run_ranks(_engine, WORLD):
        assert result["plain_error"] <= 1e-6
        errors, same_support = result["checks"][0::2], result["checks"][1::2]
        assert max(errors) <= 1e-6 and all(same_support)
        assert result["feedback"] <= 1e-6
        assert result["residuals"] == {f"mlp.c_fc.weight#{CHUNK}": [(HOSTS, CHUNK - 500)]}  # H rows, not N
        assert any(key.startswith("residual.rank") for key in result["state"]) and result["resumes"]
        # each cross rank sent its largest magnitudes (none held back is larger), about as many as planned for H:
        # a codec that sent nothing, or everything, or the wrong entries fails here
        for count, planned, cap, smallest_sent, largest_held in result["rows"]:
            assert 0.95 * planned <= count <= cap, (count, planned, cap)
            assert smallest_sent >= largest_held, (smallest_sent, largest_held)
        stats = result["stats"]
        assert stats["unpeeled"] == 0 and stats["compressed_buckets"] == 3
        # the support the owner decodes is the union over H ranks of what they sent, at the density planned for H
        assert stats["support"] == sum(result["unions"])
        density = result["density"]
        for union in result["unions"]:
            assert 1 - (1 - 0.95 * density) ** HOSTS <= union / (CHUNK - 500) <= 1 - (1 - 1.1 * density) ** HOSTS


def _bytes(rank, world):
    segments = [Segment("w", 0, CHUNK)]
    grad = _grad(0, rank)
    result = {}
    for name, options in {
        "flat": dict(hierarchy="flat", ranks_per_host=PER_HOST),
        "auto": dict(ranks_per_host=PER_HOST),
        "one_host": {},
        "warmup": dict(ranks_per_host=PER_HOST, dense_steps=1),
    }.items():
        hook = tagc.hook(ratio=10, select="all", **PAPER_WIRE, **{"dense_steps": 0, **options})
        out = _exchange(hook, grad, segments)
        result[name] = {"stats": hook.stats()["total"], "out": out,
                        "row_flat": hook.wire_row_bytes(segments, CHUNK, world, torch.float32),
                        "row_hosts": hook.wire_row_bytes(segments, CHUNK, HOSTS, torch.float32)}
    result["exact"] = sum(_grad(0, r)[rank] for r in range(world)) / world
    return result


def test_inter_host_bytes_follow_the_formula():
    for result in run_ranks(_bytes, WORLD):
        flat, auto, one, warmup = (result[k]["stats"] for k in ("flat", "auto", "one_host", "warmup"))
        plain_equivalent = (WORLD - 1) * CHUNK * 4  # a flat fp32 reduce-scatter, whichever way the bytes went
        assert flat["plain_equivalent_bytes"] == auto["plain_equivalent_bytes"] == plain_equivalent
        # flat: every row for a rank on the other host leaves the host
        assert flat["inter_host_bytes"] == (WORLD - PER_HOST) * result["flat"]["row_flat"]
        assert flat["wire_bytes"] == (WORLD - 1) * result["flat"]["row_flat"]
        # hierarchical: H - 1 rows of the codec planned for H ranks; the intra-host step is plain
        assert auto["inter_host_bytes"] == (HOSTS - 1) * result["auto"]["row_hosts"]
        assert auto["wire_bytes"] == (PER_HOST - 1) * HOSTS * CHUNK * 4 + auto["inter_host_bytes"]
        assert one["inter_host_bytes"] == 0 and one["wire_bytes"] == flat["wire_bytes"]  # one host: today's exchange
        # the dense warm-up goes hierarchical too: plain across hosts, the exact mean
        assert warmup["compressed_buckets"] == 0 and warmup["inter_host_bytes"] == (HOSTS - 1) * CHUNK * 4
        torch.testing.assert_close(result["warmup"]["out"], result["exact"], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- settings


def test_bad_settings_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"hierarchy must be one of \('auto', 'flat'\)"):
        tagc.hook(dense_steps=0, hierarchy="bogus")
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="ranks_per_host"):
            tagc.hook(dense_steps=0, ranks_per_host=bad)
    old = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        os.environ["LOCAL_WORLD_SIZE"] = "8"
        assert (
            tagc.hook(dense_steps=0).settings.ranks_per_host == 8
            and tagc.hook(dense_steps=0, ranks_per_host=2).settings.ranks_per_host == 2
        )
        os.environ.pop("LOCAL_WORLD_SIZE")
        assert tagc.hook(dense_steps=0).settings.ranks_per_host is None
        assert tagc.hook(dense_steps=0).agreed_settings()["hierarchy"] == "auto"
    finally:
        if old is not None:
            os.environ["LOCAL_WORLD_SIZE"] = old


def _invalid(rank, world):
    grad = _grad(0, rank)
    messages = {}
    with pytest.raises(ValueError, match="ranks_per_host=3 does not divide the world size 4") as error:
        _exchange(tagc.hook(dense_steps=0, ranks_per_host=3), grad)
    messages["divide"] = str(error.value)
    for name, mine, theirs in [("hierarchy", "auto", "flat"), ("ranks_per_host", 2, 1)]:
        with pytest.raises(ValueError, match="settings differ") as error:
            _exchange(
                tagc.hook(**{"dense_steps": 0, "ranks_per_host": PER_HOST, name: mine if rank == 0 else theirs}), grad
            )
        messages[name] = str(error.value)
    agreed = _exchange(tagc.hook(dense_steps=0, ranks_per_host=PER_HOST), grad)  # the group still works
    return messages, bool(torch.isfinite(agreed).all())


def test_invalid_and_mismatched_topology_settings_are_clear_errors_on_every_rank():
    for messages, still_works in run_ranks(_invalid, WORLD):
        assert still_works
        assert (
            "hierarchy (this rank" in messages["hierarchy"]
            and "ranks_per_host (this rank" in messages["ranks_per_host"]
        )


# ----------------------------------------------------------------------------- FSDP2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _shard(model: nn.Module, mesh, divide=None, native: bool = True) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if divide is not None:
        for module in (model, model[0], model[2]):
            module.set_gradient_divide_factor(divide)
            module.set_force_sum_reduction_for_comms(native)  # gloo has no PREMUL_SUM; TAGC takes it
    return model


def _fsdp2_runs(rank, world, mesh, variants: dict, steps: int = 2):
    """Train one model per variant (``None``: plain FSDP2) on the same batches; every step's gradients."""
    models, hooks, grads = {}, {}, {name: [] for name in variants}
    for name, (options, divide) in variants.items():
        models[name] = _shard(_mlp(), mesh, divide, native=options is None)
        if options is not None:
            hooks[name] = tagc.hook(**{"dense_steps": 0, **options})
            tagc.register_comm_hook(models[name], hooks[name])
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    losses = {name: [] for name in variants}
    for step in range(steps):
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(10 * step + rank))
        for name, model in models.items():
            loss = model(x).square().mean()
            loss.backward()
            losses[name].append(loss.item())
            grads[name].append(
                {n: (p.grad.to_local().clone(), tuple(p.grad.placements)) for n, p in model.named_parameters()}
            )
            optimizers[name].step()
            optimizers[name].zero_grad()
    params = {
        name: {n: p.to_local().detach().clone() for n, p in model.named_parameters()} for name, model in models.items()
    }
    return {
        "grads": grads,
        "losses": losses,
        "params": params,
        "stats": {n: h.stats()["total"] for n, h in hooks.items()},
        "hierarchical": {n: any(t.hierarchical for t in h.topologies.values()) for n, h in hooks.items()},
    }


def _fsdp2_flat_mesh(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return _fsdp2_runs(
        rank,
        world,
        mesh,
        {
            "native": (None, None),
            "plain": (dict(codec="plain", ranks_per_host=PER_HOST), None),
            "blocking": (dict(codec="plain", ranks_per_host=PER_HOST, overlap=False), None),
        },
    )


def _close(a: dict, b: dict, tol: float = 1e-6) -> None:
    for (name, (ga, pa)), (_, (gb, pb)) in zip(a.items(), b.items()):
        assert pa == pb, name
        torch.testing.assert_close(ga, gb, rtol=tol, atol=tol, msg=name)


def test_fsdp2_1d_mesh_with_the_hierarchical_hook_equals_plain_fsdp2():
    for result in run_ranks(_fsdp2_flat_mesh, WORLD):
        assert result["hierarchical"] == {"plain": True, "blocking": True}
        for name in ("plain", "blocking"):
            for native, hooked in zip(result["grads"]["native"], result["grads"][name]):
                _close(native, hooked)
            assert result["stats"][name]["inter_host_bytes"] > 0


def _fsdp2_hsdp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("replicate", "shard"))
    compared = _fsdp2_runs(rank, world, mesh, {
        "native": (None, None), "plain": (dict(codec="plain", ranks_per_host=PER_HOST), None),
        "blocking": (dict(codec="plain", overlap=False), None),
        "native_divide": (None, 3.0), "plain_divide": (dict(codec="plain"), 3.0)})
    tagc_options = dict(ratio=10, select="all", min_compress_numel=256, ranks_per_host=PER_HOST)
    trained = _fsdp2_runs(rank, world, mesh, {"tagc": (tagc_options, None)}, steps=4)
    import tagc.hooks.adapters.fsdp2 as fsdp2

    gathers = fsdp2.gathers_wires
    fsdp2.gathers_wires = lambda *args: False  # the other way across replicas: reduce-scatter, then a dense all-gather
    try:
        scattered = _fsdp2_runs(rank, world, mesh, {"tagc": (tagc_options, None)}, steps=4)
    finally:
        fsdp2.gathers_wires = gathers
    return compared, trained, scattered


@pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too
def test_fsdp2_hsdp_mesh_equals_native_hsdp_and_trains_compressed():
    """Native HSDP against the hooked plain codec; then TAGC across replicas both ways: gathering every
    replica's wire (the leaner way, chosen here) and a compressed reduce-scatter plus a dense
    all-gather give the same gradients, bit for bit, with fewer bytes between hosts for the first."""
    results = run_ranks(_fsdp2_hsdp, WORLD)
    for _, trained, scattered in results:
        for step, other in zip(trained["grads"]["tagc"], scattered["grads"]["tagc"]):
            for (name, (a, pa)), (_, (b, pb)) in zip(step.items(), other.items()):
                assert pa == pb and torch.equal(a, b), name
        assert trained["stats"]["tagc"]["inter_host_bytes"] < 0.7 * scattered["stats"]["tagc"]["inter_host_bytes"]
    for compared, trained, _ in results:
        for reference, name in [("native", "plain"), ("native", "blocking"), ("native_divide", "plain_divide")]:
            for native, hooked in zip(compared["grads"][reference], compared["grads"][name]):
                _close(native, hooked)  # placements too: (Replicate(), Shard(dim=0))
        assert {p for step in compared["grads"]["plain"] for _, p in step.values()} == {(Replicate(), Shard(0))}
        stats = trained["stats"]["tagc"]
        assert stats["compressed_buckets"] > 0 and stats["wire_bytes"] < stats["plain_equivalent_bytes"]
        assert stats["inter_host_bytes"] > 0 and all(torch.isfinite(torch.tensor(trained["losses"]["tagc"])))
    for rank in range(PER_HOST):  # replicas (same shard on both hosts) stay bit-identical
        for name, value in results[rank][1]["params"]["tagc"].items():
            assert torch.equal(value, results[rank + PER_HOST][1]["params"]["tagc"][name]), name


# ----------------------------------------------------------------------------- SimpleFSDP


class _Blocks(nn.Module):
    """A small model SimpleFSDP cuts in units (each block of the ``nn.ModuleList``, then the root): quick to compile."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(24, 128)
        self.h = nn.ModuleList(nn.Linear(128, 128) for _ in range(2))
        self.out = nn.Linear(128, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.h:
            x = torch.relu(block(x))
        return self.out(x)


def _simple(rank, world, compiled):
    from fsdp_integration import simple_fsdp
    from tests.test_simple_fsdp import _recording_backend

    if compiled:  # eager hierarchical TAGC against the compiled one: the traced halves, bit for bit
        options = dict(ratio=10, index_bits=1, select="all", min_compress_numel=1024, ranks_per_host=PER_HOST)
        reference, hooked = dict(options), dict(options)
    else:  # the flat plain exchange against the hierarchical plain one
        reference, hooked = dict(codec="plain"), dict(codec="plain", ranks_per_host=PER_HOST)
    models, hooks = [], []
    for options in (reference, hooked):
        model = simple_fsdp(_Blocks())
        hooks.append(tagc.hook(**{"dense_steps": 0, **options}))
        tagc.register_comm_hook(model, hooks[-1])
        models.append(model)
    graphs: dict = {}
    run = torch.compile(models[1], backend=_recording_backend(graphs), fullgraph=True) if compiled else models[1]
    errors = []
    for step in range(2):
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(10 * step + rank))
        models[0](x).square().mean().backward()
        run(x).square().mean().backward()
        errors.append(max((p.grad.to_local() - q.grad.to_local()).abs().max().item()
                          for p, q in zip(models[0].parameters(), models[1].parameters())))
        for model in models:
            model.zero_grad()
    ops = [op for graph in graphs.get("backward", []) for op in graph]
    return {
        "errors": errors,
        "stats": [h.stats()["total"] for h in hooks],
        "all_to_alls": ops.count("_c10d_functional.all_to_all_single.default"),
        "encodes": ops.count("tagc.encode.default"),
        "opaque": ops.count("tagc.reduce_scatter.default"),
    }


@pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too
@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_simple_fsdp_hierarchical_equals_the_reference(compiled):
    for result in run_ranks(_simple, WORLD, compiled, timeout_s=300):
        eager, hooked = result["stats"]
        if compiled:
            assert max(result["errors"]) == 0.0  # one arithmetic, eager or traced
            assert (
                eager["wire_bytes"] == hooked["wire_bytes"]
                and eager["inter_host_bytes"] == hooked["inter_host_bytes"] > 0
            )
            # per unit: the intra-host all-to-all, then encode -> all-to-all on the cross group -> decode
            assert result["opaque"] == 0 and result["all_to_alls"] == 2 * result["encodes"] > 0
        else:
            assert max(result["errors"]) < 1e-6
            assert (
                hooked["wire_bytes"] == eager["wire_bytes"]
                and hooked["inter_host_bytes"] > 0 == eager["inter_host_bytes"]
            )
