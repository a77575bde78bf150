"""HSDP in SimpleFSDP on 4 gloo ranks as 2 hosts x 2 ranks (a ``(replicate, shard)`` mesh): the plain
reduction against a single-process reference, TAGC's plain codec bit for bit against it, eager and
compiled, TAGC and int4 against the exact average within their bounds, the compiled exchange against
the eager one, and bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import tagc
from tests.distributed import run_ranks

WORLD, PER_HOST = 4, 2
HOSTS = WORLD // PER_HOST


class _Blocks(nn.Module):
    """Small, quick to compile; SimpleFSDP cuts it in units (each block, then the root). The output layer's
    7 rows do not divide the shard group: padded shards."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(24, width)
        self.h = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.out = nn.Linear(width, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.h:
            x = torch.relu(block(x))
        return self.out(x)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("replicate", "shard"))


def _inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 24, generator=torch.Generator().manual_seed(10 * step + rank))


def _hsdp(hook_options=None, compiled=None, **wrapper):
    from fsdp_integration import CompileSettings, compile_model, simple_fsdp

    model = simple_fsdp(_Blocks(), mesh=_mesh(), **wrapper)
    hook = None
    if hook_options is not None:
        hook = tagc.hook(**{"dense_steps": 0, **hook_options})
        tagc.register_comm_hook(model, hook)
    if compiled == "aot_eager":
        return model, compile_model(model, CompileSettings(backend="aot_eager")), hook
    if compiled is not None:  # a recording backend (tests.test_simple_fsdp._recording_backend)
        return model, torch.compile(model, backend=compiled, fullgraph=True), hook
    return model, model, hook


def _piece_bytes_between_hosts(model) -> int:
    """An independent count of what a plain replica all-reduce sends to the other host per step: for every
    unit, its chunk cut into one piece per host (each parameter's part padded to a multiple of the hosts),
    once as the reduce-scatter's row and once as the all-gather's, in float32."""
    from fsdp_integration import units

    pieces = sum(-(-entry.numel // HOSTS) for unit in units(model) for entry in unit.bucket.entries)
    return 2 * (HOSTS - 1) * pieces * 4


# ----------------------------------------------------------------------------- plain


def _plain(rank, world, compiled):
    from tests.test_simple_fsdp import _recording_backend

    reference = _Blocks()
    graphs: dict = {}
    backend = _recording_backend(graphs) if compiled else None
    runs = {"native": _hsdp(None, backend), "plain": _hsdp(dict(codec="plain", ranks_per_host=PER_HOST), backend)}
    if not compiled:
        runs["blocking"] = _hsdp(dict(codec="plain", ranks_per_host=PER_HOST, overlap=False))
        runs["native_blocking"] = _hsdp(None, overlap=False)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, (model, _, _) in runs.items()}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    grads = {name: [] for name in runs}
    reference_errors = []
    for step in range(2):
        x = _inputs(step, rank)
        everyone = torch.cat([_inputs(step, r) for r in range(world)])
        reference(everyone).square().mean().backward()
        for name, (model, forward, _) in runs.items():
            forward(x).square().mean().backward()
            grads[name].append({n: (p.grad.to_local().clone(), tuple(p.grad.placements))
                                for n, p in model.named_parameters()})
        model = runs["native"][0]
        reference_errors.append(max((p.grad.full_tensor() - q.grad).abs().max().item()
                                    for p, q in zip(model.parameters(), reference.parameters())))
        for optimizer in [ref_opt, *optimizers.values()]:
            optimizer.step()
            optimizer.zero_grad()
    ops = [op for graph in graphs.get("backward", []) for op in graph]
    hook = runs["plain"][2]
    return {"grads": grads, "reference_errors": reference_errors, "stats": hook.stats()["total"],
            "between_hosts": 2 * _piece_bytes_between_hosts(runs["plain"][0]),
            "opaque": ops.count("tagc.replica_reduce_scatter.default"),
            "all_reduces": ops.count("_c10d_functional.all_reduce.default"),
            "units": len(runs["plain"][0]._simple_fsdp_units)}


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_plain_codec_is_bit_identical_to_simple_fsdp_hsdp(compiled):
    """SimpleFSDP HSDP (reduce-scatter within the host, all-reduce across hosts) equals a single-process
    reference; TAGC's plain codec gives its gradients bit for bit (2 ranks per group: a sum of two is exact
    in any order), eager (overlapped or not) and compiled (one opaque exchange per unit), and counts
    the bytes between hosts that a plain replica all-reduce of the unit's pieces sends."""
    for result in run_ranks(_plain, WORLD, compiled, timeout_s=600):
        assert max(result["reference_errors"]) < 1e-6
        runs = [("native", "plain")] + ([] if compiled else [("native", "blocking"), ("native_blocking", "native")])
        for reference, name in runs:
            for expected, got in zip(result["grads"][reference], result["grads"][name]):
                for param, (value, placements) in expected.items():
                    assert got[param][1] == placements == (Replicate(), Shard(0)), param
                    assert torch.equal(got[param][0], value), (reference, name, param)
        assert result["stats"]["inter_host_bytes"] == result["between_hosts"] > 0  # 2 steps
        if compiled:  # the plain codec's exchange is one opaque op per unit; the native graph all-reduces per unit
            assert result["opaque"] == result["all_reduces"] == result["units"]


# ----------------------------------------------------------------------------- TAGC, eager and compiled


TAGC = dict(ratio=10, index_bits=1, select="all", min_compress_numel=1024, ranks_per_host=PER_HOST)
INT4 = dict(codec="int4", select="all", min_compress_numel=1024, ranks_per_host=PER_HOST)


def _compiled_tagc(rank, world, options):
    """Eager TAGC HSDP against the same hook compiled (the traced halves), from a 1-step dense warm-up on."""
    from tests.test_simple_fsdp import _recording_backend

    graphs: dict = {}
    eager_model, eager, eager_hook = _hsdp({**options, "dense_steps": 1})
    model, compiled, hook = _hsdp({**options, "dense_steps": 1}, _recording_backend(graphs))
    errors, stats = [], []
    for step in range(3):
        x = _inputs(step, rank)
        for forward, h in ((eager, eager_hook), (compiled, hook)):
            forward(x).square().mean().backward()
            h.end_step()
        errors.append(max((p.grad.to_local() - q.grad.to_local()).abs().max().item()
                          for p, q in zip(eager_model.parameters(), model.parameters())))
        stats.append((eager_hook.stats()["last_step"], hook.stats()["last_step"]))
        eager_model.zero_grad()
        model.zero_grad()
    ops = [[op for op in graph] for graph in graphs["backward"]]
    count = lambda graph, op: sum(o == op for o in graph)  # noqa: E731
    return {"errors": errors, "stats": stats, "units": len(model._simple_fsdp_units),
            "graphs": [{name: count(graph, f"{name}.default") for name in (
                "tagc.replica_reduce_scatter", "tagc.replica_encode", "tagc.replica_decode",
                "_c10d_functional.all_to_all_single", "_c10d_functional.all_gather_into_tensor")} for graph in ops]}


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["tagc", "int4"])
def test_compiled_tagc_equals_eager_and_counts_the_same_bytes(codec):
    """The warm-up compiles to one opaque exchange per unit; after it the graph is made again with the
    traced halves (all-to-all within the host, encode, all-gather of every replica's wire across hosts,
    decode): the gradients are the eager exchange's bit for bit, and the bytes counted are the same."""
    options = TAGC if codec == "tagc" else INT4
    for result in run_ranks(_compiled_tagc, WORLD, options, timeout_s=600):
        assert max(result["errors"]) == 0.0
        for eager, compiled in result["stats"]:
            for field in ("wire_bytes", "inter_host_bytes", "plain_equivalent_bytes", "buckets", "compressed_buckets"):
                assert eager[field] == compiled[field], field
        eager, _ = result["stats"][-1]
        assert eager["compressed_buckets"] == result["units"]
        assert 0 < eager["inter_host_bytes"] < 0.5 * eager["plain_equivalent_bytes"]
        units = result["units"]
        warmup, traced = result["graphs"]
        assert warmup["tagc.replica_reduce_scatter"] == units and warmup["tagc.replica_encode"] == 0
        gathers = traced.pop("_c10d_functional.all_gather_into_tensor")
        assert traced == {"tagc.replica_reduce_scatter": 0, "tagc.replica_encode": units, "tagc.replica_decode": units,
                          "_c10d_functional.all_to_all_single": units}
        assert gathers >= units  # every replica's wire (and any parameter re-gather)


# ----------------------------------------------------------------------------- against the exact average


def _packed(step: int, rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s packed gradients of a unit at ``step`` (any rank can make anyone's)."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))


def _residuals(hook, binding, chunk: int) -> torch.Tensor:
    """This rank's error-feedback residuals of a unit's replica exchange, put back in chunk order."""
    plan = hook.plan(binding.pieces.segments, binding.piece, HOSTS)
    flat = torch.zeros(chunk + 1, dtype=torch.float64)
    for part in plan.parts:
        residual = getattr(part.codec, "residuals", {}).get(part.key)
        if part.codec is not hook.plain and residual is not None:
            flat.index_add_(0, binding.pieces.index[:, part.columns].reshape(-1), residual.reshape(-1).double())
    return flat[:chunk]


def _unit_exchange(rank, world, options, route="gathered"):
    """A block's exchange called with known packed gradients for 3 steps: what every step gives, the exact
    average, each host's average, and the replicas' residuals before and after (summed over replicas)."""
    from fsdp_integration import units
    from tagc.hooks.adapters import simple_hsdp

    chooses = simple_hsdp.gathers_wires
    if route == "scattered":  # the other route across replicas: a compressed reduce-scatter, then a dense all-gather
        simple_hsdp.gathers_wires = lambda *args: False
    try:
        model, _, hook = _hsdp(options)
        bucket = units(model)[0].bucket
        binding = bucket.reduce_scatter.binding
        shard, chunk = dist.get_rank(bucket.group), bucket.chunk
        steps = []
        before = torch.zeros(chunk, dtype=torch.float64)
        for step in range(3):
            everyone = torch.stack([_packed(step, r, PER_HOST * chunk) for r in range(world)]).double()
            rows = everyone.view(HOSTS, PER_HOST, PER_HOST, chunk)[:, :, shard]  # [host, rank in host, chunk]
            out = bucket.reduce_scatter(_packed(step, rank, PER_HOST * chunk))
            hook.end_step()
            after = _residuals(hook, binding, chunk)
            dist.all_reduce(after, group=bucket.replicate)  # the replicas' residuals, summed
            replicas = [torch.empty_like(out) for _ in range(HOSTS)]
            dist.all_gather(replicas, out, group=bucket.replicate)
            steps.append({"out": out, "exact": rows.mean((0, 1)), "hosts": rows.mean(1), "before": before,
                          "after": after, "replicas_agree": all(torch.equal(r, out) for r in replicas)})
            before = after
    finally:
        simple_hsdp.gathers_wires = chooses
    return {"steps": steps, "stats": hook.stats()["total"], "piece": binding.piece,
            "remote_rows": binding.replica_remote_rows}


def _both_routes(rank, world):
    return {route: _unit_exchange(rank, world, TAGC, route) for route in ("gathered", "scattered")}


@pytest.mark.slow
def test_tagc_conserves_the_exact_sum_and_both_routes_agree():
    """What the replicas sent (H times the average) plus what they kept equals their hosts' exact averages
    plus what they kept before, to float32 rounding; replicas get the same bits; the two routes across
    replicas give the same gradients, the gathered wires (chosen for TAGC on 2 hosts) with fewer bytes
    between hosts."""
    for result in run_ranks(_both_routes, WORLD, timeout_s=300):
        for route in ("gathered", "scattered"):
            for step in result[route]["steps"]:
                assert step["replicas_agree"]
                produced = HOSTS * step["exact"] + step["before"]
                accounted = HOSTS * step["out"].double() + step["after"]
                scale = step["hosts"].abs().sum(0) + step["before"].abs() + step["after"].abs()
                assert ((accounted - produced).abs() <= 1e-5 * scale + 1e-30).all(), route
                assert step["after"].abs().sum() > 0 and (step["out"] != 0).any()  # some sent, some kept
            stats = result[route]["stats"]
            assert stats["compressed_buckets"] == 3 and stats["support"] > 0
        for gathered, scattered in zip(result["gathered"]["steps"], result["scattered"]["steps"]):
            assert torch.equal(gathered["out"], scattered["out"])
        gathered, scattered = result["gathered"]["stats"], result["scattered"]["stats"]
        assert 0 < gathered["inter_host_bytes"] < scattered["inter_host_bytes"]


def test_the_reduced_pieces_are_gathered_in_bf16_only_where_no_residual_accounts_for_them():
    from tagc.hooks.adapters.replicas import replica_gather_dtype

    def dtype(dtype=torch.float32, **options):
        hook = tagc.hook(**options)
        return replica_gather_dtype(hook.settings.plain, hook.codec, dtype)

    for options in ({}, {"codec": "topk"}, {"codec": "powersgd", "rank": 4}, {"ratio": 10, "plain": "fp32"}):
        assert dtype(**options) == torch.float32, options  # error feedback: the sum stays conserved
    for options in ({"codec": "int4", "select": "all"}, {"codec": "fp8"}, {"codec": "bf16"}, {"plain": "bf16"}):
        assert dtype(**options) == torch.bfloat16, options
    assert dtype(torch.float16, codec="int4") == torch.float16  # never wider, nor another 16-bit format
    assert replica_gather_dtype("fp32", None, torch.float32) == torch.float32  # no codec: plain


def _int4_routes(rank, world):
    return {route: _unit_exchange(rank, world, INT4, route) for route in ("gathered", "scattered")}


def test_int4_reduce_scatter_route_gathers_the_reduced_pieces_in_bf16():
    """``int4`` keeps no residual, so the reduce-scatter route all-gathers its reduced pieces in bf16: the gathered
    wires' values rounded to bf16, bit for bit, every replica alike, and an all-gather of 2 bytes per element."""
    for result in run_ranks(_int4_routes, WORLD, timeout_s=300):
        gathered, scattered = result["gathered"], result["scattered"]
        for wires, reduced in zip(gathered["steps"], scattered["steps"]):
            assert reduced["replicas_agree"]
            assert torch.equal(reduced["out"], wires["out"].bfloat16().float())
            assert not torch.equal(reduced["out"], wires["out"])  # rounded, not float32
        # between hosts, per step: the gathered route sends its H wire rows to each other host; the reduce-scatter
        # route one wire row per remote replica, then the reduced piece in bf16 (2 bytes an element)
        steps, remote = len(scattered["steps"]), scattered["remote_rows"]
        row = gathered["stats"]["inter_host_bytes"] // (steps * (HOSTS - 1) * HOSTS)
        assert scattered["stats"]["inter_host_bytes"] == steps * remote * (row + 2 * scattered["piece"])


@pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too
def test_int4_is_within_its_bound_of_the_exact_average():
    """int4 quantizes each replica's piece blockwise (``|x - deq(x)| <= blockmax / 14``): the average over
    replicas is within the mean of the hosts' largest magnitudes / 14 of the exact one, and not exact."""
    for result in run_ranks(_unit_exchange, WORLD, INT4, timeout_s=300):
        for step in result["steps"]:
            assert step["replicas_agree"]
            error = (step["out"].double() - step["exact"]).abs()
            assert (error <= step["hosts"].abs().amax(1).mean() / 14 * (1 + 1e-6)).all()
            assert (error > 0).any()
        assert result["stats"]["compressed_buckets"] == 3


# ----------------------------------------------------------------------------- arguments and the trainer


def _bad_meshes_and_the_trainer(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_integration import simple_fsdp
    from gpt2_bench.config import TrainConfig
    from gpt2_bench.model import GPT, GPTConfig
    from gpt2_bench.sharding import shard

    errors = []
    for mesh in (init_device_mesh("cpu", (1, HOSTS, PER_HOST)),
                 init_device_mesh("cpu", (HOSTS, PER_HOST), mesh_dim_names=("shard", "replicate")), "cpu"):
        with pytest.raises((ValueError, TypeError)) as error:
            simple_fsdp(_Blocks(), mesh=mesh)
        errors.append((type(error.value).__name__, str(error.value)))
    # the trainer's wiring (gpt2_bench.sharding.shard) on one loopback: hosts are the mesh's rows, no namespaces
    cfg = TrainConfig(integration="simple", hsdp=True, hosts=HOSTS, world=world, preset="tiny", compression="all",
                      dense_steps=0, min_compress_numel=1024)
    torch.manual_seed(0)
    model, hook = shard(GPT(GPTConfig.preset("tiny", vocab_size=101, n_embd=64)), cfg, world)
    idx = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(idx, idx)[1].backward()
    grad = dict(model.named_parameters())["transformer.wte.weight"].grad.to_local()  # tied to the head: the root
    replicas = [torch.empty_like(grad) for _ in range(HOSTS)]
    dist.all_gather(replicas, grad, group=model._simple_fsdp_units[0].bucket.replicate)
    return {"errors": errors, "placements": {tuple(p.placements) for p in model.parameters()},
            "bindings": {type(unit.bucket.reduce_scatter.binding).__name__ for unit in model._simple_fsdp_units},
            "replicas_agree": torch.equal(replicas[0], replicas[1]), "stats": hook.stats()["total"]}


def test_bad_arguments_are_clear_errors_and_the_trainer_wires_hsdp():
    for result in run_ranks(_bad_meshes_and_the_trainer, WORLD, timeout_s=300):
        (kind3, three_d), (kind_names, swapped), (kind_type, not_a_mesh) = result["errors"]
        assert kind3 == "ValueError" and "1-D mesh (FSDP) or a 2-D (replicate, shard) mesh" in three_d
        assert kind_names == "ValueError" and "mesh_dim_names=('replicate', 'shard')" in swapped
        assert kind_type == "TypeError" and "mesh must be a DeviceMesh" in not_a_mesh
        assert result["placements"] == {(Replicate(), Shard(0))}
        assert result["bindings"] == {"ReplicaBinding"} and result["replicas_agree"]
        assert result["stats"]["compressed_buckets"] > 0 and result["stats"]["inter_host_bytes"] == 0  # no hosts known


def test_hsdp_settings_are_checked():
    from gpt2_bench.config import TrainConfig, build_parser, config_from_args

    args = build_parser().parse_args(["--integration", "simple", "--hsdp", "--hosts", "2", "--world", "4"])
    cfg = config_from_args(args)
    assert cfg.hsdp and cfg.integration == "simple" and cfg.run_name.endswith("-hsdp")
    for kwargs in (dict(integration="fsdp1", hosts=2, world=4), dict(integration="simple", hosts=1, world=4)):
        with pytest.raises(ValueError, match="hsdp applies to integration='fsdp2' or 'simple'"):
            TrainConfig(hsdp=True, **kwargs)
