"""SimpleFSDP (``fsdp_integration``) on 2 gloo ranks with a small GPT-2: gradients against a
single-process reference and against FSDP2 + TAGC, eager and compiled (fullgraph), the
collectives in the compiled graphs, resharding, mixed precision, DCP and bad input."""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.distributed as dist

import tagc
from fsdp_integration import MixedPrecisionPolicy, simple_fsdp, units
from fsdp_integration.bucket import Bucket, bucket_layout
from gpt2_bench.model import GPT, GPTConfig
from tests.distributed import run_ranks
from tests.paper_wire import paper

pytestmark = pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too

VOCAB = 101  # dim 0 of the embedding does not divide the world size: padded shards
CONFIG = dict(vocab_size=VOCAB, n_embd=64)
PER_RANK = 2


def _batch(seed: int, world: int):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (PER_RANK * world, 16), generator=gen)
    return idx, torch.randint(0, VOCAB, (PER_RANK * world, 16), generator=gen)


def _mine(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    return tensor[PER_RANK * rank : PER_RANK * (rank + 1)]


def _models(seed: int):
    torch.manual_seed(seed)
    reference = GPT(GPTConfig.preset("tiny", **CONFIG))
    copy = GPT(GPTConfig.preset("tiny", **CONFIG))
    copy.load_state_dict(reference.state_dict())
    return reference, copy


def _recording_backend(graphs: dict):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from fsdp_integration.compile import with_resharding

    def name(node) -> str:  # an op that mutates (tagc's ops: their state token) is wrapped: the op's name
        return str(node.args[0]) if str(node.target).startswith("auto_functionalized") else str(node.target)

    def record(kind):
        def compiler(gm, example_inputs):
            graphs.setdefault(kind, []).append([name(n) for n in gm.graph.nodes if n.op == "call_function"])
            return make_boxed_func(gm.forward)

        return compiler

    return with_resharding(aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward")))


# ----------------------------------------------------------------------------- layout (no ranks)


def test_bucket_layout_pads_rows_like_torch_chunk():
    entries, chunk = bucket_layout(
        ["a", "b", "c"], [torch.Size([5, 3]), torch.Size([4]), torch.Size([1, 2])], world=4, rank=2
    )
    assert [e.rows for e in entries] == [2, 1, 1]
    assert [e.local_rows for e in entries] == [1, 1, 0]  # torch.chunk: 2, 2, 1, 0 rows of a
    assert [e.start for e in entries] == [0, 6, 7] and chunk == 9
    with pytest.raises(ValueError, match="0-dimensional"):
        bucket_layout(["s"], [torch.Size([])], world=2, rank=0)


# ----------------------------------------------------------------------------- against the reference


def _plain_matches_reference(rank, world, compiled, reshard):
    reference, model = _models(0)
    model = simple_fsdp(model, reshard_after_forward=reshard)
    graphs: dict = {}
    forward = torch.compile(model, backend=_recording_backend(graphs), fullgraph=True) if compiled else model
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_sgd = torch.optim.SGD(reference.parameters(), lr=0.5)
    errors = []
    for step in range(2):
        idx, tgt = _batch(step, world)
        forward(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        reference(idx, tgt)[1].backward()
        errors.append(max((p.grad.full_tensor() - q.grad).abs().max().item()
                          for p, q in zip(model.parameters(), reference.parameters())))
        sgd.step(), ref_sgd.step(), sgd.zero_grad(), ref_sgd.zero_grad()
    weights = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    return {"errors": errors, "weights": weights, "graphs": graphs, "keys": sorted(model.state_dict()),
            "ref_keys": sorted(reference.state_dict()), "placements": {str(p.placements) for p in model.parameters()}}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_plain_gradients_equal_a_single_process_reference(compiled):
    for result in run_ranks(_plain_matches_reference, 2, compiled, True, timeout_s=300):
        assert max(result["errors"]) < 1e-6 and result["weights"] < 1e-6
        assert result["keys"] == result["ref_keys"]  # clean state_dict keys, tied weight under both names
        assert result["placements"] == {"(Shard(dim=0),)"}
        if compiled:
            assert len(result["graphs"]["forward"]) == 1  # fullgraph: one graph, no breaks, no recompiles


def _inductor_matches_reference(rank, world):
    from fsdp_integration import CompileSettings, compile_model

    reference, model = _models(0)
    model = simple_fsdp(model)
    compiled = compile_model(model, CompileSettings())  # Inductor, its bucketing and reordering passes on
    idx, tgt = _batch(0, world)
    loss = compiled(_mine(idx, rank), _mine(tgt, rank))[1]
    loss.backward()
    reference(idx, tgt)[1].backward()
    return max(
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    )


@pytest.mark.slow
def test_inductor_compiled_gradients_equal_the_reference():
    for error in run_ranks(_inductor_matches_reference, 2, timeout_s=600):
        assert error < 1e-5  # Inductor may fuse and reorder float arithmetic


def _collectives(rank, world, reshard, hooked, hook_options=None):
    _, model = _models(0)
    model = simple_fsdp(model, reshard_after_forward=reshard)
    if hooked:
        tagc.register_comm_hook(model, tagc.hook(min_compress_numel=1024, **{"dense_steps": 0, **(hook_options or {})}))
    graphs: dict = {}
    forward = torch.compile(model, backend=_recording_backend(graphs), fullgraph=True)
    idx, tgt = _batch(0, world)
    forward(_mine(idx, rank), _mine(tgt, rank))[1].backward()
    count = lambda kind, op: sum(n == op for n in graphs[kind][0])  # noqa: E731
    return {
        "forward_all_gathers": count("forward", "_c10d_functional.all_gather_into_tensor.default"),
        "backward_all_gathers": count("backward", "_c10d_functional.all_gather_into_tensor.default"),
        "backward_reduce_scatters": count("backward", "_c10d_functional.reduce_scatter_tensor.default"),
        "opaque": count("backward", "tagc.reduce_scatter.default"),
        "encodes": count("backward", "tagc.encode.default"),
        "decodes": count("backward", "tagc.decode.default"),
        "all_to_alls": count("backward", "_c10d_functional.all_to_all_single.default"),
        "all_reduces": count("backward", "_c10d_functional.all_reduce.default"),
        "units": len(units(model)),
    }


@pytest.mark.parametrize("hooked, reshard", [
    pytest.param(True, True, id="tagc-reshard"), pytest.param(False, False, id="plain-keep", marks=pytest.mark.slow),
    pytest.param(True, False, id="tagc-keep", marks=pytest.mark.slow),
    pytest.param(False, True, id="plain-reshard", marks=pytest.mark.slow)])
def test_compiled_graph_has_one_gather_and_one_reduce_scatter_per_block(reshard, hooked):
    result = run_ranks(_collectives, 2, reshard, hooked, timeout_s=300)[0]
    blocks = GPTConfig.preset("tiny").n_layer
    assert result["units"] == blocks + 1  # the blocks and the root (embeddings, final norm, tied head)
    assert result["forward_all_gathers"] == blocks + 1
    assert result["backward_all_gathers"] == (blocks if reshard else 0)  # the root keeps its parameters
    hooked_units = blocks + 1 if hooked else 0
    # TAGC: per unit encode, one fixed-shape all-to-all of bytes (plain columns, index, sketch), decode;
    # no flag all-reduce (the NaN/Inf policy needs none)
    assert result["encodes"] == result["decodes"] == hooked_units and result["all_reduces"] == 0
    assert result["all_to_alls"] == hooked_units and result["opaque"] == 0
    assert result["backward_reduce_scatters"] == (0 if hooked else blocks + 1)


@pytest.mark.slow  # ~6 s: the compiled traces; the eager exchange of these settings is checked in the default suite
def test_data_dependent_settings_compile_to_one_opaque_exchange_per_block():
    result = run_ranks(_collectives, 2, True, True, {"fallback": "raw"}, timeout_s=300)[0]
    assert result["opaque"] == GPTConfig.preset("tiny").n_layer + 1
    assert result["encodes"] == result["all_to_alls"] == 0


def _across_the_warmup(rank, world):
    """A model compiled during a 1-step warm-up, trained 2 steps: the graph of each step."""
    _, model = _models(0)
    model = simple_fsdp(model)
    hook = tagc.hook(min_compress_numel=1024, dense_steps=1)
    tagc.register_comm_hook(model, hook)
    graphs: dict = {}
    forward = torch.compile(model, backend=_recording_backend(graphs), fullgraph=True)
    idx, tgt = _batch(0, world)
    for _ in range(2):
        forward(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        hook.end_step()
    count = lambda graph, op: sum(n == op for n in graph)  # noqa: E731
    return [(count(g, "tagc.reduce_scatter.default"), count(g, "tagc.encode.default")) for g in graphs["backward"]]


@pytest.mark.slow  # ~10 s: two compiled graphs (the warm-up's and the traced one)
def test_a_model_compiled_during_the_warmup_traces_the_exchange_after_it():
    units = GPTConfig.preset("tiny").n_layer + 1
    # the warm-up's graph: one opaque exchange per unit; then one recompile, with the traced halves
    assert run_ranks(_across_the_warmup, 2, timeout_s=300)[0] == [(units, 0), (0, units)]


def _traced_halves(rank, world, poison):
    """The traced exchange (custom ops + functional collectives, run eagerly) against the engine's."""
    from tagc.hooks.adapters.simple import _registry, _traced, reduce_scatter

    results = []
    for path in ("engine", "traced"):
        _, model = _models(0)
        model = simple_fsdp(model)
        hook = tagc.hook(**paper(dense_steps=0, min_compress_numel=1024))  # plain columns: fp32, the exact mean
        tagc.register_comm_hook(model, hook)
        bucket = units(model)[0].bucket
        handle = bucket.reduce_scatter.handle
        plan = hook.plan(_registry[handle].segments, bucket.chunk, world)
        first_compressed = int(torch.arange(bucket.chunk)[plan.compressed_parts[0].columns][0])
        (plain_columns,) = [part.columns for part in plan.parts if not part.codec.compresses]
        torch.manual_seed(100 + rank)
        outs = []
        for step in range(2):
            packed = torch.randn(world * bucket.chunk)
            if poison and step == 1 and rank == 1:
                packed[first_compressed] = float("nan")  # bound for rank 0: every rank must still agree
            before = {k: [p.clone() for p in v] for k, v in hook.residuals.items()}
            if path == "traced":
                outs.append(_traced(packed, handle, _registry[handle].state, bucket.group, world))
            else:
                outs.append(reduce_scatter(packed, _registry[handle].state, handle))
        after_equal = all(torch.equal(a, b) for k, v in before.items() for a, b in zip(v, hook.residuals[k]))
        results.append((outs, after_equal, plain_columns, hook.stats()["total"]))
    return results


def test_traced_exchange_equals_the_engine_and_agrees_on_nonfinite():
    for (engine, _, _, engine_stats), (traced, _, _, traced_stats) in run_ranks(
        _traced_halves, 2, False, timeout_s=120
    ):
        assert all(torch.equal(a, b) for a, b in zip(engine, traced))  # one path: bit for bit
        assert engine_stats["wire_bytes"] == traced_stats["wire_bytes"] and traced_stats["peel_success"] == 1.0
    for rank_results in run_ranks(_traced_halves, 2, True, timeout_s=120):
        (engine, _, _, engine_stats), _ = rank_results
        for outs, _, plain_cols, stats in rank_results:  # the engine and the traced halves alike
            poisoned = outs[1]
            torch.testing.assert_close(poisoned, engine[1], rtol=0, atol=0, equal_nan=True)
            compressed = torch.ones_like(poisoned, dtype=torch.bool)
            compressed[plain_cols] = False
            assert poisoned[compressed].isnan().all()  # every rank: the compressed columns say NaN
            assert poisoned[~compressed].isfinite().all()  # the plain ones are the exact mean as usual
            assert stats["nonfinite_parts"] == 1 and stats["wire_bytes"] == engine_stats["wire_bytes"]


# ----------------------------------------------------------------------------- with the TAGC hook


def _hooked_matches_fsdp2(rank, world, compiled):
    from torch.distributed.fsdp import fully_shard

    _, simple = _models(0)
    _, fsdp2 = _models(0)
    simple = simple_fsdp(simple)
    simple_hook = tagc.hook(dense_steps=0, ratio=10, index_bits=1, min_compress_numel=1024)
    tagc.register_comm_hook(simple, simple_hook)
    for block in fsdp2.transformer.h:
        fully_shard(block)
    fully_shard(fsdp2)
    fsdp2_hook = tagc.hook(dense_steps=0, ratio=10, index_bits=1, min_compress_numel=1024)
    tagc.register_comm_hook(fsdp2, fsdp2_hook)
    forward = torch.compile(simple, backend="aot_eager", fullgraph=True) if compiled else simple
    errors = []
    for step in range(3):  # residuals carry over: later steps check error feedback too
        idx, tgt = _batch(10 + step, world)
        forward(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        fsdp2(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        errors.append(max((p.grad.full_tensor() - q.grad.full_tensor()).abs().max().item()
                          for p, q in zip(simple.parameters(), fsdp2.parameters())))
        for model in (simple, fsdp2):
            model.zero_grad()
    return errors, simple_hook.stats()["total"], fsdp2_hook.stats()["total"]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_tagc_gradients_equal_fsdp2_with_the_same_hook(compiled):
    errors, simple_stats, fsdp2_stats = run_ranks(_hooked_matches_fsdp2, 2, compiled, timeout_s=300)[0]
    assert max(errors) < 1e-6
    assert simple_stats["compressed_buckets"] == fsdp2_stats["compressed_buckets"] == 9  # 3 units x 3 steps
    assert simple_stats["wire_bytes"] == fsdp2_stats["wire_bytes"] < simple_stats["plain_equivalent_bytes"]


# ----------------------------------------------------------------------------- resharding in eager mode


def _eager_resharding(rank, world, reshard):
    _, model = _models(0)
    model = simple_fsdp(model, reshard_after_forward=reshard)
    gathered, regathers = [], []
    original_gather, original_detached = Bucket.gather, Bucket.gather_detached

    def spy_gather(self, shards):
        out = original_gather(self, shards)
        gathered.extend((self.name, weakref.ref(t)) for t in out)
        return out

    def spy_detached(self, shards):
        regathers.append(self.name)
        return original_detached(self, shards)

    Bucket.gather, Bucket.gather_detached = spy_gather, spy_detached
    idx, tgt = _batch(0, world)
    loss = model(_mine(idx, rank), _mine(tgt, rank))[1]
    alive_after_forward = sorted({name for name, ref in gathered if ref() is not None})
    loss.backward()
    return alive_after_forward, regathers, all(p.grad is not None for p in model.parameters())


def test_eager_reshard_frees_block_parameters_and_regathers_once_per_block():
    alive, regathers, grads = run_ranks(_eager_resharding, 2, True, timeout_s=120)[0]
    assert alive == ["<root>"]  # blocks' gathered parameters are gone after forward
    assert regathers == ["transformer.h.1", "transformer.h.0"]  # backward order, once each
    assert grads
    alive, regathers, grads = run_ranks(_eager_resharding, 2, False, timeout_s=120)[0]
    assert alive == ["<root>", "transformer.h.0", "transformer.h.1"] and regathers == [] and grads


# ----------------------------------------------------------------------------- prefetching


def _prefetching(rank, world):
    served = {"prefetched": 0, "stale": 0, "gathered": 0}
    original = Bucket._all_gather

    def spy(self, shards):
        pending = self._prefetched
        if pending is None:
            served["gathered"] += 1
        else:
            served["prefetched" if pending[0] == tuple(s._version for s in shards) else "stale"] += 1
        return original(self, shards)

    Bucket._all_gather = spy
    results = {}
    for prefetch in (True, False):
        _, model = _models(0)
        model = simple_fsdp(model, prefetch=prefetch)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            idx, tgt = _batch(step, world)
            loss = model(_mine(idx, rank), _mine(tgt, rank))[1]
            loss.backward()
            opt.step(), opt.zero_grad()
            losses.append(loss.item())
        results[prefetch] = (losses, [p.full_tensor() for p in model.parameters()], dict(served))
        served.update(prefetched=0, stale=0, gathered=0)

    # a prefetch of shards changed in place since is dropped, not used
    block = units(model)[0]
    block.bucket.prefetch(block.local_shards())
    with torch.no_grad():
        block.params[0].to_local().add_(1.0)
    regathered = block.bucket.gather_detached(block.local_shards())[0]
    fresh = torch.equal(regathered, block.params[0].full_tensor())
    return results, fresh


def test_prefetching_overlaps_gathers_and_changes_nothing():
    """Eager prefetch serves every block gather after the first forward (2 blocks: backward
    only in step 1, forward and backward after) and gives bit-identical training."""
    for results, fresh in run_ranks(_prefetching, 2, timeout_s=180):
        (losses, params, served), (plain_losses, plain_params, plain_served) = results[True], results[False]
        assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(params, plain_params))
        assert served == {"prefetched": 2 + 4 + 4, "stale": 0, "gathered": 3 + 2} and plain_served["prefetched"] == 0
        assert fresh


# ----------------------------------------------------------------------------- the hook point


def _generic_hook_point(rank, world):
    """Any ``unit -> (reduce_scatter, start)`` goes in through ``model.register_comm_hook``, a TAGC
    hook too (the one line); TAGC's registry entries go with the reduce-scatter that holds them
    (a hook over it, or the model)."""
    import gc

    from tagc.hooks.adapters.simple import _registry

    _, model = _models(0)
    model = simple_fsdp(model)
    seen = []

    def counting(unit):
        plain = unit.bucket.plain_reduce_scatter
        return (lambda packed: (seen.append(unit.name), plain(packed))[1]), None

    model.register_comm_hook(counting)
    idx, tgt = _batch(0, world)
    model(_mine(idx, rank), _mine(tgt, rank))[1].backward()
    names = sorted(unit.name for unit in units(model))
    gc.collect()
    before = len(_registry)
    tagc.register_comm_hook(model, tagc.hook(dense_steps=0, min_compress_numel=1024))
    installed = len(_registry) - before
    model.register_comm_hook(
        tagc.hook(dense_steps=0, min_compress_numel=1024)
    )  # the one line; over the first: its entries go
    gc.collect()
    replaced = len(_registry) - before
    del model
    gc.collect()
    return sorted(seen) == names, installed, replaced, len(_registry) - before


def test_generic_hook_point_and_registry_release():
    for every_unit, installed, replaced, dropped in run_ranks(_generic_hook_point, 2, timeout_s=120):
        assert every_unit and installed == GPTConfig.preset("tiny").n_layer + 1
        assert replaced == installed and dropped == 0


# ----------------------------------------------------------------------------- the custom ops' state


def test_the_custom_ops_declare_the_state_they_change():
    """Each op that changes a hook's residuals or statistics declares its unit's state token mutated."""
    import tagc.hooks.adapters.simple  # noqa: F401 - registers the ops

    for op in (torch.ops.tagc.encode.default, torch.ops.tagc.decode.default, torch.ops.tagc.reduce_scatter.default):
        mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert mutated == ["state"], (op, mutated)


def _unused_results_compiled(rank, world):
    """A compiled function that calls tagc::encode / tagc::reduce_scatter and drops their results."""
    from tagc.hooks.adapters.simple import _registry, encode, reduce_scatter

    _, model = _models(0)
    model = simple_fsdp(model)
    hook = tagc.hook(dense_steps=0, min_compress_numel=1024)
    tagc.register_comm_hook(model, hook)
    bucket = units(model)[0].bucket
    handle = bucket.reduce_scatter.handle
    state = _registry[handle].state

    def encode_unused(packed):
        encode(packed, state, handle)
        return packed * 2

    def exchange_unused(packed):
        reduce_scatter(packed, state, handle)
        return packed * 2

    packed = torch.randn(world * bucket.chunk, generator=torch.Generator().manual_seed(rank))
    torch.compile(encode_unused, backend="aot_eager", fullgraph=True)(packed)
    residuals = {k: [r.clone() for r in parts] for k, parts in hook.residuals.items()}
    hook.end_step()
    torch.compile(exchange_unused, backend="aot_eager", fullgraph=True)(packed)
    hook.end_step()
    return residuals, hook.stats()["total"]["buckets"], int(state)


def test_a_compiled_graph_keeps_the_ops_whose_results_go_unused():
    for residuals, buckets, bumps in run_ranks(_unused_results_compiled, 2, timeout_s=180):
        assert residuals and all(r.abs().sum() > 0 for parts in residuals.values() for r in parts)  # encode ran
        assert buckets == 1 and bumps == 2  # and so did the whole exchange


# ----------------------------------------------------------------------------- mixed precision


def _bf16_compute_fp32_reduce(rank, world):
    reference, model = _models(0)
    model = simple_fsdp(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    reduced = []
    for unit in units(model):  # overlapped (eager default): the exchange is launched by reduce_scatter_start
        start = unit.bucket.reduce_scatter_start
        unit.bucket.reduce_scatter_start = lambda packed, start=start: (reduced.append(packed.dtype), start(packed))[1]
    idx, tgt = _batch(0, world)
    loss = model(_mine(idx, rank), _mine(tgt, rank))[1]
    loss.backward()
    reference(idx, tgt)[1].backward()
    rel = max(((p.grad.full_tensor() - q.grad).norm() / q.grad.norm()).item()
              for p, q in zip(model.parameters(), reference.parameters()))
    return (
        {str(p.dtype) for p in model.parameters()},
        {str(p.grad.dtype) for p in model.parameters()},
        set(map(str, reduced)),
        rel,
    )


def test_bf16_parameters_reduce_in_fp32():
    params, grads, reduced, rel = run_ranks(_bf16_compute_fp32_reduce, 2, timeout_s=120)[0]
    assert params == grads == reduced == {"torch.float32"}
    assert rel < 0.05  # bf16 compute, against the fp32 reference


# ----------------------------------------------------------------------------- checkpoints


def _dcp_round_trip(rank, world, path):
    import torch.distributed.checkpoint as dcp

    _, model = _models(0)
    model = simple_fsdp(model)
    hook = tagc.hook(dense_steps=0, min_compress_numel=1024)
    tagc.register_comm_hook(model, hook)
    idx, tgt = _batch(0, world)
    model(_mine(idx, rank), _mine(tgt, rank))[1].backward()
    dcp.save({"model": model.state_dict(), "tagc": hook.state_dict()}, checkpoint_id=path)

    _, fresh = _models(1)  # different weights
    fresh = simple_fsdp(fresh)
    fresh_hook = tagc.hook(dense_steps=0, min_compress_numel=1024)
    tagc.register_comm_hook(fresh, fresh_hook)
    state = {"model": fresh.state_dict(), "tagc": {**hook.state_dict()}}
    state["tagc"] = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state["tagc"].items()}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    fresh_hook.load_state_dict(state["tagc"])
    weights = max(
        (p.full_tensor() - q.full_tensor()).abs().max().item() for p, q in zip(model.parameters(), fresh.parameters())
    )
    residuals = [
        (k, torch.equal(v, fresh_hook.residuals[k][i]))
        for k, parts in hook.residuals.items()
        for i, v in enumerate(parts)
    ]
    return weights, residuals, sum(v.abs().sum().item() for parts in hook.residuals.values() for v in parts)


def test_dcp_round_trips_parameters_and_residuals(tmp_path):
    for weights, residuals, mass in run_ranks(_dcp_round_trip, 2, str(tmp_path / "ckpt"), timeout_s=120):
        assert weights == 0.0
        assert len(residuals) == 3 and all(equal for _, equal in residuals)
        assert mass > 0  # the residuals were not trivially zero


# ----------------------------------------------------------------------------- bad input


def _bad_input(rank, world):
    errors = []
    _, model = _models(0)
    wrapped = simple_fsdp(model)
    torch.manual_seed(rank)  # a different model on each rank
    differs = torch.nn.Linear(2, 2)
    torch.manual_seed(0)
    for action in (lambda: simple_fsdp(wrapped), lambda: wrapped.register_comm_hook(object()),
                   lambda: simple_fsdp(torch.nn.Linear(2, 2), units=["nope"]), lambda: simple_fsdp(differs)):
        try:
            action()
            errors.append(None)
        except (ValueError, TypeError, KeyError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    return errors


def test_bad_input_is_a_clear_error():
    already, not_a_hook, unknown_unit, different = run_ranks(_bad_input, 2, timeout_s=120)[0]
    assert "already wrapped" in already
    assert "tagc.hook" in not_a_hook
    assert "nope" in unknown_unit
    assert "differ across ranks" in different


def test_needs_an_initialised_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        simple_fsdp(torch.nn.Linear(2, 2))


def _bf16_gather_matches_rounded_reference(rank, world):
    from fsdp_integration import MixedPrecisionPolicy

    reference, model = _models(0)
    with torch.no_grad():
        for p in reference.parameters():  # what a bf16 all-gather delivers, computed in float32
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, compute_dtype=torch.float32)
    model = simple_fsdp(model, mp_policy=policy)
    idx, tgt = _batch(0, world)
    loss = model(_mine(idx, rank), _mine(tgt, rank))[1]
    loss.backward()
    reference(idx, tgt)[1].backward()
    errors = [
        (p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    ]
    dtypes = {p.grad.dtype for p in model.parameters()} | {p.dtype for p in model.parameters()}
    return {"errors": errors, "dtypes": dtypes, "gathered": model.transformer.h[0].attn.c_attn.weight.dtype}


def test_bf16_parameter_gathers_compute_in_float32_with_the_rounded_weights():
    for result in run_ranks(_bf16_gather_matches_rounded_reference, 2, timeout_s=120):
        assert max(result["errors"]) < 1e-6  # the gradient of the bf16-rounded weights, reduced in float32
        assert result["dtypes"] == {torch.float32} and result["gathered"] == torch.float32
