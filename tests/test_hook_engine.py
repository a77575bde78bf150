"""The TAGC exchange itself on 2-4 gloo ranks, without FSDP around it."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import tagc
from tagc.hooks import Segment
from tagc.sketch.sparsify import capacity, keep_limit
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_RATIO, PAPER_WIRE, paper

CHUNK = 300_000


def segments(chunk=CHUNK):
    """Two compressible 'weights' and a small plain 'bias' in every chunk."""
    return [
        Segment("mlp.c_fc.weight", 0, chunk - 1000 - 150_000),
        Segment("mlp.c_fc.bias", chunk - 1000 - 150_000, 1000),
        Segment("mlp.c_proj.weight", chunk - 150_000, 150_000),
    ]


def exchange(rank, world, hook, grad, op=dist.ReduceOp.AVG, segs=None):
    out = torch.empty(grad.numel() // world)
    hook.reduce_scatter(
        out, grad.reshape(-1).clone(), None, op, segs if segs is not None else segments(grad.numel() // world)
    )
    return out


def lossless_transport(rank, world, bits):
    hook = tagc.hook(dense_steps=0, ratio=10, index_bits=bits, min_part=1 << 17, **PAPER_WIRE)
    torch.manual_seed(rank)
    grad = torch.randn(world, CHUNK)
    out = exchange(rank, world, hook, grad)
    residual = {k: [r.clone() for r in v] for k, v in hook.residuals.items()}
    (key, parts), = residual.items()
    plan = hook.plan(tuple(segments()), CHUNK, world)
    density = hook.settings.config.density(world)
    kept = grad.clone()
    rows = []  # per part and owner row: (kept count, planned count, capacity, smallest kept |a|, largest held-back |a|)
    for part, res in zip(plan.compressed_parts, parts):
        kept[:, part.columns] -= res  # residual + kept == gradient
        assert ((kept[:, part.columns] == 0) | (res == 0)).all()
        for row, held in zip(kept[:, part.columns], res):
            size = row.numel()
            sent = row[row != 0].abs()
            rows.append((sent.numel(), keep_limit(size, density), capacity(size, density),
                         sent.min().item() if sent.numel() else float("inf"), held.abs().max().item()))
    everyone = [torch.empty_like(kept) for _ in range(world)]
    dist.all_gather(everyone, kept)
    # the expected shard: the plain bias is the exact mean of the gradients; the compressed columns the mean
    # of what each rank kept, which `rows` pins down independently: each rank's largest magnitudes, as many
    # as the plan asks for
    expected = sum(k[rank] for k in everyone) / world
    union = sum((k[rank] != 0).int() for k in everyone) > 0
    compressed_union = int(union[: CHUNK - 1000 - 150_000].sum() + union[-150_000:].sum())  # the bias is plain
    return out, expected, hook.stats(), density, rows, compressed_union


@pytest.mark.parametrize("world, bits", [(2, 1), (3, 4), pytest.param(4, 1, marks=pytest.mark.slow)])
def test_decoded_shard_is_the_exact_sum_of_what_ranks_kept(world, bits):
    for out, expected, stats, density, rows, union in run_ranks(lossless_transport, world, bits):
        # what each rank sent is its largest magnitudes (none held back is larger), about as many as planned:
        # a codec that sent nothing, or everything, or the wrong entries fails here
        for count, planned, cap, smallest_sent, largest_held in rows:
            assert 0.95 * planned <= count <= cap, (count, planned, cap)
            assert smallest_sent >= largest_held, (smallest_sent, largest_held)
        # lossless up to float32 rounding of the summed sketch cells
        assert ((out - expected).norm() / expected.norm()) <= 1e-6
        assert (out - expected).abs().max() <= 1e-5 * expected.abs().max()
        assert torch.equal(out != 0, expected != 0)
        total = stats["total"]
        assert total["unpeeled"] == 0 and total["support"] == union  # the decoded support is the union of what was sent
        compressed = CHUNK - 1000
        assert 1 - (1 - 0.95 * density) ** world <= union / compressed <= 1 - (1 - 1.1 * density) ** world  # as planned


def wire_bytes(rank, world, bits, ratio):
    hook = tagc.hook(dense_steps=0, ratio=ratio, index_bits=bits, select="all", **PAPER_WIRE)
    grad = torch.randn(world, 1 << 20)
    exchange(rank, world, hook, grad, segs=[Segment("w", 0, 1 << 20)])
    return hook.stats()["total"]


@pytest.mark.parametrize("world, bits, ratio", [(2, 1, 10), pytest.param(4, 1, 5, marks=pytest.mark.slow), (3, 4, 10)])
def test_wire_bytes_match_the_design_formula(world, bits, ratio):
    n = world * (1 << 20)
    formula = (world - 1) / world * n * (bits + 32 / ratio) / 8
    plain = (world - 1) / world * n * 4
    for total in run_ranks(wire_bytes, world, bits, ratio):
        assert abs(total["wire_bytes"] - formula) <= 0.02 * formula
        assert total["plain_equivalent_bytes"] == plain


def error_feedback_training(rank, world, use_tagc):
    torch.manual_seed(0)
    w_true = torch.randn(64, 512)
    model = torch.nn.Linear(512, 64, bias=False)
    hook = tagc.hook(dense_steps=0, ratio=10, select="all", min_compress_numel=1024, min_part=1 << 14, **PAPER_WIRE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses = []
    for _ in range(300):
        x = torch.randn(32, 512, generator=gen)
        loss = (model(x) - x @ w_true.T).square().mean()
        loss.backward()
        grad = model.weight.grad.reshape(-1)
        if use_tagc:
            shard = exchange(rank, world, hook, grad.view(world, -1), segs=[Segment("w", 0, grad.numel() // world)])
        else:
            shard = torch.empty(grad.numel() // world)
            dist.reduce_scatter_tensor(shard, grad.clone(), op=dist.ReduceOp.SUM)
            shard /= world
        full = [torch.empty_like(shard) for _ in range(world)]
        dist.all_gather(full, shard)
        model.weight.grad = torch.cat(full).view_as(model.weight)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return sum(losses[-20:]) / 20


@pytest.mark.slow  # 7 s of training; error feedback's mass is conserved exactly in the default suite
def test_error_feedback_reaches_the_uncompressed_loss():
    plain = run_ranks(error_feedback_training, 2, False)[0]
    compressed = run_ranks(error_feedback_training, 2, True)[0]
    assert compressed <= plain * 1.05 + 1e-3, (compressed, plain)


def checkpoint_roundtrip(rank, world, path):
    grads = [torch.randn(world, CHUNK, generator=torch.Generator().manual_seed(10 * s + rank)) for s in range(3)]
    first = tagc.hook(dense_steps=0, ratio=10)
    for g in grads[:2]:
        exchange(rank, world, first, g)
    dcp.save(first.state_dict(), checkpoint_id=path)
    expected = exchange(rank, world, first, grads[2])
    resumed = tagc.hook(dense_steps=0, ratio=10)
    state = resumed.state_dict()
    for key, value in first.state_dict().items():  # DCP loads in place into matching entries
        state[key] = torch.zeros_like(value) if isinstance(value, torch.Tensor) else value
    dcp.load(state, checkpoint_id=path)
    resumed.load_state_dict(state)
    return torch.equal(exchange(rank, world, resumed, grads[2]), expected), resumed.step_count


def test_checkpoint_restart_gives_the_identical_next_step():
    with tempfile.TemporaryDirectory() as path:
        for identical, step in run_ranks(checkpoint_roundtrip, 2, path):
            assert identical and step >= 1


# every setting that changes what crosses the wire, or when: (name in the error, rank 0's and rank 1's hook arguments)
MISMATCHES = [
    ("ratio", dict(ratio=10.0), dict(ratio=5.0)),
    ("index_bits", dict(index_bits=1), dict(index_bits=4)),
    ("sparsity", dict(sparsity="auto"), dict(sparsity=0.9)),
    ("lane", dict(lane=None), dict(lane=256)),
    ("seed", dict(seed=0), dict(seed=1)),
    ("fallback", dict(fallback="estimate"), dict(fallback="raw")),
    ("min_compress_numel", dict(min_compress_numel=65536), dict(min_compress_numel=1024)),
    ("codec", dict(codec="tagc"), dict(codec="plain")),
    ("select", dict(select="all"), dict(select="non_attention_linear")),
    ("min_part", dict(min_part=1 << 17), dict(min_part=1 << 18)),
    ("dense_steps", dict(dense_steps=0), dict(dense_steps=2)),
    ("nonfinite", dict(nonfinite="propagate"), dict(nonfinite="raise")),
    ("plain", dict(plain="fp32"), dict(plain="bf16")),
    ("codec_options", dict(positions="bitmap"), dict(positions="coded")),
    ("codec_options", dict(codec="topk", value_dtype="float32"), dict(codec="topk", value_dtype="float16")),
]


def mismatched(rank, world):
    """Every mismatch, one after another in the same group: each a ValueError on both ranks naming
    the setting and both values, and the group still usable after it (no hang, no abort)."""
    messages = []
    for _, mine, theirs in MISMATCHES:
        hook = tagc.hook(**paper(**{"dense_steps": 0, **(mine if rank == 0 else theirs)}))
        with pytest.raises(ValueError, match="settings differ") as error:
            exchange(rank, world, hook, torch.randn(world, CHUNK))
        messages.append(str(error.value))
    piece = tagc.hook(dense_steps=0, ratio=PAPER_RATIO, **PAPER_WIRE)
    piece.update(piece_bytes=1 << 20 if rank == 0 else 1 << 19)
    with pytest.raises(ValueError, match="piece_bytes"):
        exchange(rank, world, piece, torch.randn(world, CHUNK))
    agreed = exchange(rank, world, tagc.hook(dense_steps=0, ratio=PAPER_RATIO, **PAPER_WIRE),
                      torch.randn(world, CHUNK))  # the group still works
    return messages, bool(torch.isfinite(agreed).all())


def test_every_mismatched_setting_is_a_clear_error_on_every_rank():
    results = run_ranks(mismatched, 2)
    assert all(still_works and len(messages) == len(MISMATCHES) for messages, still_works in results)
    rank0_messages = results[0][0]
    for (name, mine, theirs), message in zip(MISMATCHES, rank0_messages):
        if name == "select":  # compared by what it selects: the policy's name, then what it compressed
            assert "select (this rank 'select_all: 3 of 3 parameters compressed, digest " in message, message
            assert "rank 1 'non_attention_linear: 2 of 3 parameters compressed, digest " in message, message
            assert "pick different parameters or ratios" in message
            continue
        if name == "codec_options":  # every option of the codec, as (name, value) pairs
            ((option, value),) = mine.items() - {("codec", "topk")}
            ((_, other),) = theirs.items() - {("codec", "topk")}
            assert "codec_options (this rank [" in message and f"({option!r}, {value!r})" in message, message
            assert "rank 1 [" in message and f"({option!r}, {other!r})" in message, message
            continue
        assert f"{name} (this rank {mine[name]!r}, rank 1 {theirs[name]!r})" in message, message


def dying_rank(rank, world):
    hook = tagc.hook(dense_steps=0, ratio=10)
    hook.verify(None)
    if rank == 1:
        os._exit(0)  # dies before the exchange
    with pytest.raises(RuntimeError, match="peer rank"):
        exchange(rank, world, hook, torch.randn(world, CHUNK))
    return True


def test_a_dead_rank_is_a_clear_error_not_a_hang():
    results = run_ranks_allow_missing(dying_rank, 2)
    assert results[0] is True


def run_ranks_allow_missing(fn, world):
    import torch.multiprocessing as mp

    from tests.distributed import _entry

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, out, fn, (), 20.0, False), nprocs=world, join=True)
        return [
            torch.load(os.path.join(out, f"rank{r}.pt")) if os.path.exists(os.path.join(out, f"rank{r}.pt")) else None
            for r in range(world)
        ]


def nonfinite(rank, world, policy):
    hook = tagc.hook(dense_steps=0, ratio=10, nonfinite=policy, **PAPER_WIRE)
    grad = torch.randn(world, CHUNK)
    exchange(rank, world, hook, grad)  # a normal step leaves a residual
    (before,) = [[p.clone() for p in parts] for parts in hook.residuals.values()]
    grad = torch.randn(world, CHUNK)
    if rank == 1:
        grad[0, 5] = float("nan")
    if policy == "raise":
        with pytest.raises(FloatingPointError, match="NaN"):
            exchange(rank, world, hook, grad)
        return None
    out = exchange(rank, world, hook, grad)
    (parts,) = hook.residuals.values()
    return (
        out,
        hook.stats()["total"]["nonfinite_parts"],
        all(bool(torch.isfinite(p).all()) for p in parts),
        before,
        parts,
    )


def test_nonfinite_gradient_reaches_every_owner_or_raises():
    results = run_ranks(nonfinite, 2, "propagate")
    assert torch.isnan(results[0][0][5])  # the NaN reaches its owner, as plain FSDP would
    for (
        out,
        count,
        finite_residuals,
        _,
        _,
    ) in results:  # the compressed part is NaN on every owner; the plain bias is not
        assert count == 1 and finite_residuals
        assert (
            torch.isnan(out[: CHUNK - 1000 - 150_000]).all()
            and torch.isfinite(out[CHUNK - 1000 - 150_000 : CHUNK - 150_000]).all()
        )
    (_, _, _, before1, after1) = results[1]
    assert all(torch.equal(a, b) for a, b in zip(before1, after1))  # the rank with the NaN keeps its residual as it was
    run_ranks(nonfinite, 2, "raise")


def world_one_and_tiny(rank, world):
    hook = tagc.hook(dense_steps=0, ratio=10, **PAPER_WIRE)
    if world == 1:
        grad = torch.randn(1, 1000)
        return torch.equal(
            exchange(rank, world, hook, grad, op=dist.ReduceOp.SUM, segs=[Segment("w", 0, 1000)]), grad[0]
        )
    tiny = torch.randn(world, 7)  # below the size floor: plain, exact
    out = exchange(rank, world, hook, tiny, op=dist.ReduceOp.SUM, segs=[Segment("mlp.c_fc.weight", 0, 5)])
    everyone = [torch.empty_like(tiny) for _ in range(world)]
    dist.all_gather(everyone, tiny)
    return torch.allclose(out, sum(t[rank] for t in everyone))


@pytest.mark.parametrize("world", [1, 3])
def test_world_size_one_and_tiny_buckets(world):
    assert all(run_ranks(world_one_and_tiny, world))


def test_bad_hook_arguments():
    with pytest.raises(ValueError, match="ratio"):
        tagc.hook(dense_steps=0, ratio=0.5)
    with pytest.raises(ValueError, match="select"):
        tagc.hook(dense_steps=0, select="attention")
    with pytest.raises(ValueError, match="nonfinite"):
        tagc.hook(dense_steps=0, nonfinite="ignore")
    with pytest.raises(ValueError, match="dense_steps"):
        tagc.hook(dense_steps=-1)
    with pytest.raises(TypeError):
        tagc.register_comm_hook(torch.nn.Linear(2, 2), object())
    with pytest.raises(ValueError, match="no FSDP module"):
        tagc.register_comm_hook(torch.nn.Linear(2, 2), tagc.hook(dense_steps=0))


def triton_backend_exchange(rank, world):
    os.environ["TAGC_BACKEND"] = "triton"
    hook = tagc.hook(dense_steps=0, ratio=4, select="all", min_compress_numel=1024, **PAPER_WIRE)
    torch.manual_seed(rank)
    grad = torch.randn(world, 6000)
    out = exchange(rank, world, hook, grad, segs=[Segment("w", 0, 6000)])
    ((part,),) = hook.residuals.values()
    kept = grad - part
    everyone = [torch.empty_like(kept) for _ in range(world)]
    dist.all_gather(everyone, kept)
    expected = sum(k[rank] for k in everyone) / world
    return ((out - expected).norm() / expected.norm()).item(), hook.stats()["total"]["unpeeled"]


@pytest.mark.triton
def test_the_hook_runs_on_the_triton_kernels(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # run alone, the ranks are spawned: the fork server's triton compiles
    for error, unpeeled in run_ranks(triton_backend_exchange, 2, timeout_s=300):
        assert error <= 1e-6 and unpeeled == 0


def raw_resend(rank, world):
    hook = tagc.hook(
        dense_steps=0, ratio=10, sparsity=0.0, select="all", fallback="raw", min_part=1 << 16
    )  # dense: far above the threshold
    torch.manual_seed(rank)
    grad = torch.randn(world, 100_000)
    out = exchange(rank, world, hook, grad, op=dist.ReduceOp.SUM, segs=[Segment("w", 0, 100_000)])
    everyone = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(everyone, grad)
    expected = sum(g[rank] for g in everyone)  # sparsity 0: everything is kept
    return ((out - expected).norm() / expected.norm()).item(), hook.stats()["total"]


def test_raw_fallback_resends_what_decode_cannot_recover():
    for error, total in run_ranks(raw_resend, 2):
        assert total["raw"] > 0 and total["unpeeled"] == total["raw"]
        assert error <= 1e-6


def dense_warmup(rank, world):
    hook = tagc.hook(ratio=10, dense_steps=2, **PAPER_WIRE)
    torch.manual_seed(rank)
    results = []
    for _ in range(3):
        grad = torch.randn(world, CHUNK)
        out = exchange(rank, world, hook, grad)
        everyone = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(everyone, grad)
        exact = sum(g[rank] for g in everyone) / world
        hook.end_step()
        last = hook.stats()["last_step"]
        results.append(
            ((out - exact).abs().max().item(), last["compressed_buckets"], last["wire_bytes"], len(hook.residuals))
        )
    return results


def test_dense_warmup_sends_the_first_steps_plain():
    for (err0, comp0, wire0, res0), (err1, comp1, wire1, res1), (err2, comp2, wire2, res2) in run_ranks(
        dense_warmup, 2
    ):
        assert err0 < 1e-6 and err1 < 1e-6  # warm-up steps: the exact mean, nothing kept back
        assert comp0 == comp1 == 0 and res0 == res1 == 0 and wire0 == wire1
        assert comp2 == 1 and res2 == 1 and wire2 < wire1 / 4 and err2 > 1e-3  # then compressed (lossy vs dense)


ENCODE_S, DECODE_S = 0.03, 0.02
"""What each compressed batch's encode and decode is made to take (a sleep) in the timing test."""


def codec_times(rank, world):
    import time

    hook = tagc.hook(dense_steps=0, ratio=10, min_part=1 << 17)
    calls = {"encode": 0, "decode": 0}
    codec = hook.codec  # every compressed part's codec (one ratio)

    def slowed(name, method):
        def run(*args, **kwargs):
            calls[name] += 1
            time.sleep(ENCODE_S if name == "encode" else DECODE_S)
            return method(*args, **kwargs)
        return run

    codec.encode_batch, codec.decode_batch = slowed("encode", codec.encode_batch), slowed("decode", codec.decode_batch)
    start = time.perf_counter()
    exchange(rank, world, hook, torch.randn(world, CHUNK))
    hook.end_step()
    elapsed = time.perf_counter() - start
    last, (unit,) = hook.stats()["last_step"], hook.stats()["units"]
    return last["compress_s"], unit["compress_s"], last["decode_s"], calls, elapsed


def test_step_stats_carry_the_encode_and_decode_time():
    for step_compress, unit_compress, decode_s, calls, elapsed in run_ranks(codec_times, 2):
        assert calls["encode"] == calls["decode"] == 1  # two compressed parts of one size: one batch, one call
        assert step_compress == unit_compress  # the step's time is its one unit's
        assert step_compress >= calls["encode"] * ENCODE_S and decode_s >= calls["decode"] * DECODE_S
        assert step_compress + decode_s <= elapsed  # one after the other, inside the exchange


# ---------------------------------------------------------------- PREMUL_SUM: the factor stays on the device


def test_a_tensor_premul_sum_factor_is_applied_without_a_host_read():
    from tagc.hooks.core.engine import op_scale, scale_into
    from tagc.hooks.core.strict import count_host_reads

    summed = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        factor = torch.tensor(1.0 / 3.0)  # FSDP2's PREMUL_SUM factor as a tensor (on the device, on a GPU)
        expected = torch.empty(4096, dtype=dtype)
        scale_into(expected, summed, op_scale(dist._make_nccl_premul_sum(float(factor)), 2))  # the same factor, a float
        out = torch.empty(4096, dtype=dtype)
        with count_host_reads() as reads:
            scale = op_scale(dist._make_nccl_premul_sum(factor), 2)
            scale_into(out, summed, scale)
        assert reads.count == 0, reads.sites
        assert scale is factor and torch.equal(out, expected)


@pytest.mark.parametrize("wire", [PAPER_WIRE, {}], ids=["paper", "recommended"])
def test_a_steady_premul_sum_exchange_reads_nothing_on_the_host(wire):
    """One process (world 1): the exchange's own work, PREMUL_SUM with a tensor factor, strict sync mode; on the
    paper's wire and on ``tagc.hook()``'s recommended one (EF21, coded positions, int4 plain columns)."""
    hook = tagc.hook(dense_steps=0, **wire)
    hook.strict_sync = True
    op = dist._make_nccl_premul_sum(torch.tensor(0.25))
    reads, outs = [], []
    for step in range(3):
        grad = torch.full((CHUNK,), float(step + 1))
        out = torch.empty(CHUNK)
        hook.start(out, grad, None, op, segments()).wait()
        hook.end_step()
        reads.append(hook.stats()["last_step"]["host_reads"])
        outs.append(out)
    assert reads[1:] == [0, 0], dict(hook.host_read_sites)  # the first step plans the bucket (host work)
    assert all(torch.equal(out, torch.full((CHUNK,), (step + 1) * 0.25)) for step, out in enumerate(outs))


# ---------------------------------------------------------------- select, by what it selects


def different_lambdas(rank, world, same_selection):
    if same_selection:  # two lambdas (both named <lambda>) that select the same parameters
        select = (lambda name, module: "weight" in name) if rank == 0 else (lambda fqn, _: fqn.endswith("weight"))
    else:  # two lambdas that select differently
        select = ((lambda name, module: "weight" in name) if rank == 0
                  else (lambda name, module: name.endswith("c_fc.weight")))
    hook = tagc.hook(dense_steps=0, select=select)
    assert hook.settings.select.__name__ == "<lambda>"
    try:
        exchange(rank, world, hook, torch.randn(world, CHUNK))
    except ValueError as error:
        return str(error)
    return None


def test_two_lambdas_that_select_differently_are_a_clear_error_on_every_rank():
    for message in run_ranks(different_lambdas, 2, False):
        assert message is not None and "settings differ" in message, message
        assert "select (this rank '<lambda>: " in message, message
        assert "pick different parameters or ratios" in message
    assert run_ranks(different_lambdas, 2, True) == [None, None]  # what is selected agrees: no error


# ---------------------------------------------------------------- checkpoints keyed for other buckets


def other_buckets_checkpoint(rank, world, bound):
    first = tagc.hook(dense_steps=0, ratio=10)  # non_attention_linear: the two weights
    for step in range(2):
        grad = torch.randn(world, CHUNK, generator=torch.Generator().manual_seed(10 * step + rank))
        exchange(rank, world, first, grad)
    state = first.state_dict()
    other = tagc.hook(dense_steps=0, ratio=10, select="all")  # the bias too: other bucket keys
    if bound:  # an adapter bound the hook to its parameters before the load
        other.note_parameters(segments())
    errors = []
    try:
        other.load_state_dict(state)
        exchange(rank, world, other, torch.randn(world, CHUNK))
    except ValueError as error:
        errors.append(str(error))
    same = tagc.hook(dense_steps=0, ratio=10)  # the same settings: loads, and starts from the checkpoint's residuals
    if bound:
        same.note_parameters(segments())
    same.load_state_dict(state)
    exchange(rank, world, same, torch.randn(world, CHUNK))
    return errors, sorted(other.codec.residuals), sorted(first.codec.residuals)


def both_bindings(rank, world):
    return [other_buckets_checkpoint(rank, world, bound) for bound in (False, True)]


def test_a_checkpoint_keyed_for_other_buckets_is_an_error_that_names_select():
    # raised at the first compressed part, or at the load when the hook knows its parameters (bound)
    for rank_results in run_ranks(both_bindings, 2):
        for errors, other_keys, saved_keys in rank_results:
            assert len(errors) == 1, errors
            assert "this checkpoint's residuals are keyed for" in errors[0], errors[0]
            assert "select='select_all: " in errors[0], errors[0]
            assert "non_attention_linear: " in errors[0]
            assert set(other_keys) <= set(saved_keys)  # no residual of another key started from zeros
