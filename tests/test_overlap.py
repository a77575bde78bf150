"""The overlapped exchange: the same gradients as the blocking one, bit for bit, in every
integration (with gradient accumulation too), and a real overlap with the backward pass."""

from __future__ import annotations

import time

import pytest
import torch

import tagc
from fsdp_integration import simple_fsdp, units
from tests.distributed import run_ranks
from tests.paper_wire import paper
from tests.test_simple_fsdp import _batch, _mine, _models


def _train(model, rank, world, micro_batches, forward=None, hook=None):
    """Two optimizer-free steps of ``micro_batches`` backward passes each; every step's local gradients."""
    forward = model if forward is None else forward
    steps = []
    for step in range(2):
        for micro in range(micro_batches):
            idx, tgt = _batch(10 + 2 * step + micro, world)
            forward(_mine(idx, rank), _mine(tgt, rank))[1].backward()
        steps.append([p.grad.to_local().clone() for p in model.parameters()])
        model.zero_grad()
        if hook is not None:
            hook.end_step()
    return steps


def _simple(rank, world, overlap, codec, micro_batches):
    _, model = _models(0)
    model = simple_fsdp(model, overlap=overlap)
    hook = None
    if codec is not None:
        hook = tagc.hook(dense_steps=0, min_compress_numel=1024, codec=codec, overlap=overlap)
        tagc.register_comm_hook(model, hook)
    return _train(model, rank, world, micro_batches, hook=hook)


# one of the six in the default suite (the other five: -m slow)
@pytest.mark.parametrize("codec, micro_batches", [
    pytest.param("tagc", 2, id="tagc-accumulate"),
    pytest.param(None, 1, id="funcol-one-backward", marks=pytest.mark.slow),
    pytest.param("tagc", 1, id="tagc-one-backward", marks=pytest.mark.slow),
    pytest.param("plain", 1, id="plain-one-backward", marks=pytest.mark.slow),
    pytest.param("plain", 2, id="plain-accumulate", marks=pytest.mark.slow),
    pytest.param(None, 2, id="funcol-accumulate", marks=pytest.mark.slow)])
def test_simple_fsdp_overlapped_gradients_equal_blocking_ones_bit_for_bit(codec, micro_batches):
    overlapped = run_ranks(_simple, 2, True, codec, micro_batches, timeout_s=120)
    blocking = run_ranks(_simple, 2, False, codec, micro_batches, timeout_s=120)
    for a_rank, b_rank in zip(overlapped, blocking):
        for a_step, b_step in zip(a_rank, b_rank):
            assert all(torch.equal(a, b) for a, b in zip(a_step, b_step))
            assert any(a.abs().sum() > 0 for a in a_step)


def _fsdp2(rank, world, overlap, micro_batches):
    from torch.distributed.fsdp import fully_shard

    _, model = _models(0)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    hook = tagc.hook(dense_steps=0, min_compress_numel=1024, overlap=overlap)
    tagc.register_comm_hook(model, hook)
    deferred = []
    original = hook.start
    hook.start = lambda *args, **kw: (deferred.append(torch._C._current_graph_task_id() != -1), original(*args, **kw))[
        1
    ]
    return _train(model, rank, world, micro_batches, hook=hook), sum(deferred)


@pytest.mark.parametrize("micro_batches", [pytest.param(1, id="one-backward", marks=pytest.mark.slow),
                                           pytest.param(2, id="accumulate")])
def test_fsdp2_overlapped_gradients_equal_blocking_ones_bit_for_bit(micro_batches):
    overlapped = run_ranks(_fsdp2, 2, True, micro_batches, timeout_s=120)
    blocking = run_ranks(_fsdp2, 2, False, micro_batches, timeout_s=120)
    for (a_rank, launched_in_backward), (b_rank, _) in zip(overlapped, blocking):
        assert launched_in_backward >= 2  # the blocks' exchanges were launched inside backward (and deferred)
        for a_step, b_step in zip(a_rank, b_rank):
            assert all(torch.equal(a, b) for a, b in zip(a_step, b_step))


def _compiled(rank, world, micro_batches):
    from fsdp_integration import CompileSettings, compile_model

    results = []
    for compiled in (False, True):
        _, model = _models(0)
        model = simple_fsdp(model)
        hook = tagc.hook(dense_steps=0, min_compress_numel=1024)
        tagc.register_comm_hook(model, hook)
        forward = compile_model(model, CompileSettings(backend="aot_eager")) if compiled else None
        results.append(_train(model, rank, world, micro_batches, forward=forward, hook=hook))
    return results


@pytest.mark.parametrize("micro_batches", [pytest.param(1, id="one-backward", marks=pytest.mark.slow),
                                           pytest.param(2, id="accumulate", marks=pytest.mark.slow)])
def test_compiled_exchange_equals_the_overlapped_eager_one(micro_batches):
    for eager, compiled in run_ranks(_compiled, 2, micro_batches, timeout_s=300):
        for a_step, b_step in zip(eager, compiled):
            for a, b in zip(a_step, b_step):  # the traced graph runs the model's own ops in its own order
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the overlap is real

DELAY_S = 0.4
COMPUTE_S = 0.3
"""Each block's backward is made this long (a sleep when its output's gradient arrives), so there is
compute to hide behind."""


class _SlowLink:
    """Every all-to-all completes (for ``is_completed`` and ``wait``) only ``DELAY_S`` after launch."""

    def __init__(self, exchange) -> None:
        self.exchange = exchange

    def __getattr__(self, name):
        return getattr(self.exchange, name)

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.exchange.launched + DELAY_S and self.exchange.is_completed()

    def wait(self):
        time.sleep(max(0.0, self.exchange.launched + DELAY_S - time.perf_counter()))
        received = self.exchange.wait()
        self.exchange.arrived = max(self.exchange.arrived or 0.0, self.exchange.launched + DELAY_S)
        return received


def _slow_link(rank, world, overlap):
    import tagc.hooks.core.eager as eager  # where the engine launches its all-to-alls

    real = eager.all_to_all_rows
    eager.all_to_all_rows = lambda *args, **kw: _SlowLink(real(*args, **kw))
    _, model = _models(0)
    def slow_backward(module, args, out) -> None:
        out.register_hook(lambda grad: time.sleep(COMPUTE_S))

    for block in model.transformer.h:
        block.register_forward_hook(slow_backward)
    model = simple_fsdp(model, overlap=overlap)
    hook = tagc.hook(dense_steps=0, min_compress_numel=1024, overlap=overlap)
    tagc.register_comm_hook(model, hook)
    idx, tgt = _batch(0, world)
    for _ in range(2):  # the second step is timed
        loss = model(_mine(idx, rank), _mine(tgt, rank))[1]
        start = time.perf_counter()
        loss.backward()
        backward_s = time.perf_counter() - start
        hook.end_step()
    return backward_s, hook.stats()["units"], len(units(model))


@pytest.mark.slow  # ~8 s; the compiled exchange against the overlapped eager one stays in the default suite
def test_backward_computes_while_the_exchange_is_in_flight():
    (overlapped, units_on, n_units), _ = run_ranks(_slow_link, 2, True, timeout_s=120)
    (blocking, units_off, _), _ = run_ranks(_slow_link, 2, False, timeout_s=120)
    assert n_units == 3 and len(units_on) == len(units_off) == 3
    # blocking: each unit waits out its own delay; overlapped: the blocks' delays run under later compute
    assert blocking >= n_units * DELAY_S + COMPUTE_S
    assert overlapped < blocking - DELAY_S
    first, second = units_on[0], units_on[1]  # backward order: the last block first
    launch = lambda unit: min(ev[1] for ev in unit["events"] if ev[0] == "wire")  # noqa: E731
    assert launch(second) < launch(first) + DELAY_S  # the next block's backward ran while the first exchange flew
    assert first["exposed_s"] < 0.5 * first["wire_s"]  # and most of the first exchange was hidden
    assert all(unit["exposed_s"] >= 0.9 * DELAY_S for unit in units_off)  # blocking: all of it exposed


def _failed_backward(rank, world):
    """A backward pass that raises after launching exchanges: the next one is still right. Nothing of
    the failed pass may reach it but the residuals (the finite rank's compressed parts left what they
    did not send there): it gives, bit for bit, the gradients of a new model and hook loaded with
    those residuals."""
    _, model = _models(0)
    model = simple_fsdp(model)
    hook = tagc.hook(**paper(dense_steps=0, min_compress_numel=1024, nonfinite="raise"))  # classic residuals
    tagc.register_comm_hook(model, hook)
    idx, tgt = _batch(0, world)
    loss = model(_mine(idx, rank), _mine(tgt, rank))[1]
    raised = False
    try:
        (loss * (float("nan") if rank == 1 else 1.0)).backward()  # every compressed part is NaN on rank 1
    except FloatingPointError:
        raised = True
    model.zero_grad()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in hook.state_dict().items()}
    residuals = [v for k, v in state.items() if k.startswith("residual.")]
    clean = _train(model, rank, world, 1)
    _, fresh = _models(0)
    fresh = simple_fsdp(fresh)
    fresh_hook = tagc.hook(**paper(dense_steps=0, min_compress_numel=1024, nonfinite="raise"))
    tagc.register_comm_hook(fresh, fresh_hook)
    fresh_hook.load_state_dict(state)
    return raised, clean, _train(fresh, rank, world, 1), residuals


def test_a_raising_backward_leaves_nothing_in_flight():
    for rank, (raised, clean, fresh, residuals) in enumerate(run_ranks(_failed_backward, 2, timeout_s=120)):
        assert raised
        assert all(r.isfinite().all() for r in residuals)
        if rank == 1:  # the rank with the NaN kept its residuals as they were: zero
            assert all(torch.equal(r, torch.zeros_like(r)) for r in residuals)
        else:  # the finite rank held back what it did not send
            assert residuals and all(r.abs().sum() > 0 for r in residuals)
        for step, reference in zip(clean, fresh):
            assert all(torch.equal(g, r) for g, r in zip(step, reference))
            assert any(r.abs().sum() > 0 for r in reference)


def test_bad_overlap_argument():
    with pytest.raises(ValueError, match="overlap"):
        tagc.hook(dense_steps=0, overlap="yes")
    with pytest.raises(ValueError, match="codec"):
        tagc.hook(dense_steps=0, codec="zip")
    with pytest.raises(ValueError, match="nonfinite"):
        tagc.hook(dense_steps=0, nonfinite="plain")


def _inductor_order(rank, world):
    import re

    from torch._inductor.utils import run_and_get_code

    from fsdp_integration import compile_model

    _, model = _models(0)
    model = simple_fsdp(model)
    tagc.register_comm_hook(model, tagc.hook(dense_steps=0, min_compress_numel=1024))
    compiled = compile_model(model)
    idx, tgt = _batch(0, world)
    _, codes = run_and_get_code(lambda: compiled(_mine(idx, rank), _mine(tgt, rank))[1].backward())
    call = codes[-1][codes[-1].index("def call("):]
    order = []  # per all-to-all: how many compute kernels ran between its launch and its wait
    open_launches: dict[str, int] = {}
    for line in call.splitlines():
        launch = re.match(r"\s*(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single", line)
        wait = re.search(r"_c10d_functional\.wait_tensor\.default\((buf\d+)\)", line)
        if launch:
            open_launches[launch.group(1)] = 0
        elif wait and wait.group(1) in open_launches:
            order.append(open_launches.pop(wait.group(1)))
        elif re.search(r"cpp_fused|extern_kernels\.", line):
            open_launches = {name: n + 1 for name, n in open_launches.items()}
    return order


@pytest.mark.slow
def test_inductor_moves_each_blocks_wait_past_later_backward_compute():
    order = run_ranks(_inductor_order, 2, timeout_s=300)[0]
    assert len(order) == 3  # one all-to-all per unit
    assert order[0] >= 5  # the last block's exchange waits until the block before it has computed its backward
