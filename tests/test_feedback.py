"""EF21 error feedback (``tagc.hook(feedback="ef21")``, :mod:`tagc.hooks.codecs.feedback`) on 2 gloo ranks.

The bookkeeping is checked against what each rank actually sent, read back from its wire by a fresh codec
(independent of the wrapper's state): every rank's shift ``h_i`` (``-residual``) is the sum of what it sent,
and every owner's output ``H`` is the sum over ranks of the ``h_i`` of its columns.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tagc
from gpt2_bench.config import TrainConfig, build_parser, config_from_args
from tagc.config import TAGCConfig
from tagc.hooks import Segment
from tagc.hooks.codecs.registry import make_codec
from tagc.hooks.core.checkpoint import check_feedback
from tagc.hooks.core.stats import ExchangeStats
from tests.distributed import run_ranks
from tests.paper_wire import paper, paper_train_config

CHUNK = 8192
RATIOS = {"topk": 4.0, "tagc": 4.0}


def _hook(codec: str, feedback: str = "ef21", **settings) -> tagc.hooks.TAGCHook:
    """The codec under ``feedback``; ``tagc`` on the paper's wire (bitmaps, float32 cells, fp32 plain columns, no
    fading unless asked), which :func:`_sent` reads back."""
    ratio = {"ratio": RATIOS[codec]} if codec in RATIOS and "ratio" not in settings else {}
    return tagc.hook(**paper(codec=codec, select="all", dense_steps=0, min_compress_numel=1, feedback=feedback,
                             **ratio, **settings))


def _step(hook, grad: torch.Tensor, segments) -> torch.Tensor:
    """One step on one bucket, reduced with SUM (the output is the codec's sum, unscaled)."""
    out = torch.empty(grad.shape[1])
    hook.reduce_scatter(out, grad.reshape(-1).clone(), None, dist.ReduceOp.SUM, segments)
    hook.end_step()
    return out


def _recording(hook) -> list:
    """Record every wire the wrapped codec's inner codec encodes (this rank's rows for every owner; one part per
    bucket here, so one part per call)."""
    inner, wires = hook.codec.inner, []
    encode = inner.encode_batch

    def recorded(grad, keys, group):
        out = encode(grad, keys, group)
        wires.append(tuple(w.clone() for w in out))
        return out

    inner.encode_batch = recorded
    return wires


def _sent(codec_name: str, wires, numel: int) -> torch.Tensor:
    """What this rank sent to each owner, ``[N, numel]``: each row of its wire decoded alone by a fresh codec."""
    fresh = make_codec(codec_name, TAGCConfig(ratio=RATIOS.get(codec_name, 10.0)))
    return torch.stack([fresh.decode([w[j : j + 1] for w in wires], numel, "fresh", None, ExchangeStats())
                        for j in range(wires[0].shape[0])])


def _grad(rank: int, step: int, world: int, numel: int = CHUNK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(world, numel, generator=generator)


# ---------------------------------------------------------------------------------------------- bookkeeping


def _bookkeeping(rank, world, codec, steps, decay=1.0, schedule=None):
    """``schedule``: a decay per step, set through ``hook.set_feedback_decay`` before each step."""
    hook = _hook(codec, feedback_decay=decay)
    segments = [Segment("w", 0, CHUNK)]
    wires = _recording(hook)
    outs, grads, shifts = [], [], []
    for step in range(steps):
        if schedule is not None:
            hook.set_feedback_decay(schedule[step])
        grad = _grad(rank, step, world)
        outs.append(_step(hook, grad, segments))
        grads.append(grad)
        (residual,) = hook.codec.residuals.values()
        shifts.append(-residual.clone())
    sent = [_sent(codec, w, CHUNK) for w in wires]
    return outs, grads, shifts, sent


@pytest.mark.parametrize("codec, decay", [("topk", 1.0), ("tagc", 1.0), ("sign", 1.0),
                                          # the decay schedule's test below checks all this does
                                          pytest.param("tagc", 0.8, marks=pytest.mark.slow),
                                          pytest.param("sign", 0.8, marks=pytest.mark.slow)])
def test_each_shift_is_what_its_rank_sent_and_each_owner_returns_their_sum(codec, decay):
    """With ``feedback_decay``, every shift and sum fades by ``decay`` before each step's change is added."""
    steps = 6
    ranks = run_ranks(_bookkeeping, 2, codec, steps, decay)
    for rank, (_, grads, shifts, sent) in enumerate(ranks):
        total = torch.zeros_like(sent[0])
        for step in range(steps):
            total = total * decay + sent[step]
            # h_i is the (faded) sum of what rank i sent (to every owner), up to float32 rounding of (g - h) - g
            assert torch.allclose(shifts[step], total, rtol=1e-5, atol=1e-5), (codec, rank, step)
            # what was sent is the codec's compression of g - h: where the shift moved, it is now g
            moved = sent[step] != 0
            if codec in ("topk", "tagc"):
                assert 0 < moved.float().mean() < 0.5  # sparse changes
                assert torch.allclose(shifts[step][moved], grads[step][moved], rtol=1e-5, atol=1e-5)
    for owner, (outs, *_rest) in enumerate(ranks):
        expected = torch.zeros(CHUNK)
        for step in range(steps):
            decoded = sum(r[3][step][owner] for r in ranks)  # this step's decoded sum: what every rank sent the owner
            expected = expected * decay + decoded
            if step == 0:
                assert torch.allclose(outs[0], decoded, rtol=1e-6, atol=1e-6)  # from h = 0: H is the decoded sum
            assert torch.allclose(outs[step], expected, rtol=1e-5, atol=1e-5), (codec, owner, step)
            # H is the sum over ranks of their shifts, on the owner's columns
            assert torch.allclose(outs[step], sum(r[2][step][owner] for r in ranks), rtol=1e-5, atol=1e-5)


def test_a_decay_set_each_step_fades_the_shifts_and_the_owners_sums_alike():
    """``hook.set_feedback_decay`` between steps (e.g. following the learning rate): each step's shifts and sums
    fade by that step's value, on every rank and owner alike."""
    schedule = [0.8, 0.9, 0.97, 1.0, 0.85, 0.99]
    ranks = run_ranks(_bookkeeping, 2, "tagc", len(schedule), 0.9, schedule)
    for rank, (_, _, shifts, sent) in enumerate(ranks):
        total = torch.zeros_like(sent[0])
        for step, decay in enumerate(schedule):
            total = total * decay + sent[step]
            assert torch.allclose(shifts[step], total, rtol=1e-5, atol=1e-5), (rank, step)
    for owner, (outs, *_rest) in enumerate(ranks):
        expected = torch.zeros(CHUNK)
        for step, decay in enumerate(schedule):
            expected = expected * decay + sum(r[3][step][owner] for r in ranks)
            assert torch.allclose(outs[step], expected, rtol=1e-5, atol=1e-5), (owner, step)
            assert torch.allclose(outs[step], sum(r[2][step][owner] for r in ranks), rtol=1e-5, atol=1e-5)


def test_set_feedback_decay_reaches_every_ratio_and_is_validated():
    hook = tagc.hook(feedback_decay=0.9)
    copy = hook.codec.at_ratio(7.0)  # the density ramp's and per-parameter ratios' copies
    assert copy is not hook.codec and copy.decay == 0.9
    hook.set_feedback_decay(0.97)
    assert (hook.codec.decay, copy.decay) == (0.97, 0.97)
    assert hook.agreed_settings()["feedback_decay"] == 0.97  # what the ranks compare is what runs
    for bad in (0.0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="feedback_decay must be a number in"):
            hook.set_feedback_decay(bad)
    assert hook.codec.decay == 0.97
    with pytest.raises(ValueError, match="feedback='ef21'"):
        tagc.hook(codec="topk", feedback="classic").set_feedback_decay(0.9)
    with pytest.raises(ValueError, match="feedback='ef21'"):
        tagc.hook(codec="sign").set_feedback_decay(0.9)


PEAK_LR = 2e-3
SCHEDULE = [0.5, 1.0, 0.6, 0.2, 0.05, 0.0]  # of the peak rate: a warm-up, then a decay to 0


def _following(rank, world, follow):
    """Six steps under a scheduler, the fading from ``hook.follow_lr`` or set by hand from the same rate."""
    hook = _hook("tagc", feedback_decay=0.9)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=PEAK_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: SCHEDULE[min(step, len(SCHEDULE) - 1)])
    if follow:
        hook.follow_lr(opt)
    outs, decays = [], []
    for step in range(len(SCHEDULE)):
        if not follow:
            hook.set_feedback_decay(1 - 0.1 * opt.param_groups[0]["lr"] / PEAK_LR)
        outs.append(_step(hook, _grad(rank, step, world), [Segment("w", 0, CHUNK)]))
        decays.append(hook.codec.decay)
        opt.step()
        scheduler.step()
    return outs, decays


def _following_and_by_hand(rank, world):
    return _following(rank, world, True), _following(rank, world, False)


def test_a_fading_that_follows_the_optimizers_rate_is_the_one_set_by_hand():
    """``hook.follow_lr(optimizer)``: each step's fading is ``1 - (1 - 0.9) * lr / initial_lr``, read when the step's
    exchange starts (after the scheduler's step), and the exchange is the one ``set_feedback_decay`` gives by hand."""
    for (outs, decays), (outs_by_hand, decays_by_hand) in run_ranks(_following_and_by_hand, 2):
        assert decays == pytest.approx([1 - 0.1 * f for f in SCHEDULE]) and decays == decays_by_hand
        assert all(torch.equal(a, b) for a, b in zip(outs, outs_by_hand))


def _ddp_following(rank, world):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 48)), bucket_cap_mb=0.03)
    state = tagc.ddp_hook(model, codec="tagc", select="all", dense_steps=0, min_compress_numel=1)
    model.register_comm_hook(*state)
    opt = torch.optim.SGD(model.parameters(), lr=PEAK_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: SCHEDULE[min(step, len(SCHEDULE) - 1)])
    state[0].follow_lr(opt)
    decays = []
    for _ in SCHEDULE:
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(torch.randn(16, 64)), torch.randn(16, 48)).backward()
        decays.append(state[0].hook.codec.decay)
        opt.step()
        scheduler.step()
        state[0].end_step()
    return decays


def test_ddps_hook_state_follows_the_rate_too():
    """``tagc.ddp_hook``'s state forwards ``follow_lr``: the fading each DDP step exchanged with follows the rate
    (from DDP's second iteration: its first reduces DDP's own first buckets, uncompressed, and reads no fading)."""
    for decays in run_ranks(_ddp_following, 2):
        assert decays[1:] == pytest.approx([1 - 0.1 * f for f in SCHEDULE[1:]])


def test_follow_lr_takes_the_largest_rate_as_the_peak_without_a_scheduler_and_is_validated():
    hook = tagc.hook()
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1e-3)
    hook.follow_lr(opt)
    source = hook._lr_source
    assert source.decay() == pytest.approx(0.9)
    opt.param_groups[0]["lr"] = 2.5e-4
    assert source.decay() == pytest.approx(0.975)  # a quarter of the largest rate read: a quarter of the fading
    hook.follow_lr(opt, peak_lr=5e-4)
    assert hook._lr_source.decay() == pytest.approx(0.95)
    opt.param_groups[0]["lr"] = 1e-3  # above the peak given: the hook's own fading, no lower
    assert hook._lr_source.decay() == pytest.approx(0.9)
    hook.follow_lr(None)
    assert hook._lr_source is None
    with pytest.raises(ValueError, match="feedback='ef21'"):
        tagc.hook(codec="topk", feedback="classic").follow_lr(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hook.follow_lr(opt.param_groups)
    for bad in (0, -1e-3, float("inf"), True, "1e-3"):
        with pytest.raises(ValueError, match="peak_lr must be a positive number"):
            hook.follow_lr(opt, peak_lr=bad)
    opt.param_groups[0]["lr"] = torch.tensor(1e-3)
    with pytest.raises(ValueError, match="set_feedback_decay"):
        hook.follow_lr(opt)  # a rate in a tensor: refused when asked, not in the backward


# ---------------------------------------------------------------------------------------------- a constant gradient


def _constant(rank, world, codec, steps):
    grad = _grad(rank, 0, world)
    outs = []
    for feedback in ("ef21", "classic"):
        hook = _hook(codec, feedback, ratio=2.0)
        for _ in range(steps):
            out = _step(hook, grad, [Segment("w", 0, CHUNK)])
        outs.append(out)
    return outs, grad


@pytest.mark.parametrize("codec", ["topk", "tagc"])
def test_a_constant_gradient_is_delivered_whole_every_step(codec):
    """Density ~19% (ratio 2 on 2 ranks): after ~1/density steps every element's shift holds its gradient, so EF21
    hands the optimizer the exact, dense sum every step; classic error feedback still hands it sparse bursts."""
    steps = 15
    ranks = run_ranks(_constant, 2, codec, steps)
    for owner, ((ef21, classic), _) in enumerate(ranks):
        exact = sum(grad[owner] for _, grad in ranks)
        assert (ef21 != 0).all()
        assert torch.allclose(ef21, exact, rtol=1e-5, atol=1e-5)
        assert (classic != 0).float().mean() < 0.5  # classic: this step's bursts only


def _raw(rank, world):
    hook = tagc.hook(**paper(codec="tagc", ratio=10, sparsity=0.0, fallback="raw", select="all", dense_steps=0,
                             min_compress_numel=1, feedback="ef21"))  # everything kept: far more than sketch recovers
    everyone = []
    outs = []
    for step in range(3):
        grad = _grad(rank, step, world)
        outs.append(_step(hook, grad, [Segment("w", 0, CHUNK)]))
        gathered = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(gathered, grad)
        everyone.append(sum(g[rank] for g in gathered))
    return outs, everyone, hook.stats()["total"]


def test_tagc_raw_fallback_resends_what_was_sent():
    """Every element sent every step: h_i = g_i, so H is this step's exact sum; the values decode cannot recover
    are re-sent from what the rank kept (g + r) less what it kept back, both taken with the same g."""
    for outs, exact, total in run_ranks(_raw, 2):
        assert total["raw"] > 0
        for out, want in zip(outs, exact):
            assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- powersgd (4 rounds)

ROWS, COLS, RANK = 64, 48, 2
SHARD = ROWS * COLS // 2  # per rank, 2 ranks
BIAS = 64  # per rank: a shapeless parameter powersgd sends plain


def _powersgd(rank, world, steps, constant, decay=1.0):
    hook = _hook("powersgd", rank=RANK, feedback_decay=decay)
    segments = [Segment("w", 0, SHARD, shape=(ROWS, COLS)), Segment("b", SHARD, BIAS, shape=(2 * BIAS,))]
    outs, grads, shifts = [], [], []
    for step in range(steps):
        grad = _grad(rank, 0 if constant else step, world, SHARD + BIAS)
        outs.append(_step(hook, grad, segments))
        grads.append(grad)
        (residual,) = hook.codec.residuals.values()
        shifts.append(-residual.clone())
    return outs, grads, shifts


def _matrix(grad: torch.Tensor) -> torch.Tensor:
    return grad[:, :SHARD].reshape(-1).view(ROWS, COLS)


@pytest.mark.parametrize("decay", [pytest.param(1.0, marks=pytest.mark.slow), 0.8])  # 0.8 checks all 1.0 does
def test_powersgd_shifts_move_by_the_rank_r_approximation_and_owners_return_their_sum(decay):
    steps = 5
    ranks = run_ranks(_powersgd, 2, steps, False, decay)
    previous = torch.zeros(ROWS, COLS)
    for step in range(steps):
        total = sum(r[2][step] for r in ranks)  # sum of the ranks' shifts, the whole matrix
        change = total - decay * previous  # feedback_decay: the shifts faded before this step's change
        singular = torch.linalg.svdvals(change.double())
        assert singular[RANK] <= 1e-5 * singular[0]  # what the owners received this step: a rank-r matrix
        assert singular[RANK - 1] > 1e-3 * singular[0]
        previous = total
        for owner, (outs, _, _) in enumerate(ranks):
            assert torch.allclose(outs[step][:SHARD], total.reshape(-1)[owner * SHARD : (owner + 1) * SHARD],
                                  rtol=1e-5, atol=1e-5), (owner, step)
            # the bias rides plain: this step's exact sum, not accumulated
            plain = sum(r[1][step][owner, SHARD:] for r in ranks)
            assert torch.allclose(outs[step][SHARD:], plain, rtol=1e-6, atol=1e-6)


def test_powersgd_converges_to_a_constant_gradient():
    ranks = run_ranks(_powersgd, 2, 40, True)
    exact = sum(_matrix(r[1][0]) for r in ranks).reshape(-1)
    for owner, (outs, _, _) in enumerate(ranks):
        want = exact[owner * SHARD : (owner + 1) * SHARD]
        first, last = outs[0][:SHARD], outs[-1][:SHARD]
        assert (last - want).norm() < 1e-3 * want.norm() < (first - want).norm()


# ---------------------------------------------------------------------------------------------- NaN/Inf


def _nonfinite(rank, world, codec):
    hook = _hook(codec)
    segments = [Segment("w", 0, CHUNK)]
    wires = _recording(hook)
    outs, shifts = [], []
    for step in range(4):
        grad = _grad(rank, step, world)
        if step == 2 and rank == 1:
            grad[0, 5] = float("nan")
        outs.append(_step(hook, grad, segments))
        (residual,) = hook.codec.residuals.values()
        shifts.append(-residual.clone())
    sent = [_sent(codec, w, CHUNK) for w in wires]
    return outs, shifts, sent, hook.stats()["total"]["nonfinite_parts"]


@pytest.mark.parametrize("codec", ["topk", "tagc"])
def test_a_nonfinite_gradient_leaves_its_shift_and_the_owners_sums_consistent(codec):
    ranks = run_ranks(_nonfinite, 2, codec)
    (outs0, shifts0, sent0, count0), (outs1, shifts1, sent1, count1) = ranks
    assert count0 == count1 == 1
    assert torch.equal(shifts1[2], shifts1[1])  # the NaN rank's shift stays as it was, bit for bit
    assert not torch.equal(shifts0[2], shifts0[1])  # the other rank sent (its change reaches H, below)
    for owner, (outs, *_) in enumerate(ranks):
        assert torch.isnan(outs[2]).all()  # the policy: the owner's whole part is NaN
        for step in (1, 3):
            assert torch.isfinite(outs[step]).all()
            assert torch.allclose(outs[step], shifts0[step][owner] + shifts1[step][owner], rtol=1e-5, atol=1e-5)
        # after the NaN step H went on from the finite rank's change alone
        assert torch.allclose(outs[3], outs[1] + sent0[2][owner] + sent0[3][owner] + sent1[3][owner],
                              rtol=1e-5, atol=1e-5)


def _nonfinite_powersgd(rank, world):
    hook = _hook("powersgd", rank=RANK)
    segments = [Segment("w", 0, SHARD, shape=(ROWS, COLS)), Segment("b", SHARD, BIAS, shape=(2 * BIAS,))]
    outs, shifts = [], []
    for step in range(4):
        grad = _grad(rank, step, world, SHARD + BIAS)
        if step == 2 and rank == 1:
            grad[0, 5] = float("inf")
        outs.append(_step(hook, grad, segments))
        (residual,) = hook.codec.residuals.values()
        shifts.append(-residual.clone())
    return outs, shifts, hook.stats()["total"]["nonfinite_parts"]


def test_powersgd_a_nonfinite_gradient_leaves_every_shift_and_sum_as_it_was():
    """powersgd keeps every rank's residual of a matrix whose summed Q is not finite: so do the shifts, and H."""
    ranks = run_ranks(_nonfinite_powersgd, 2)
    for owner, (outs, shifts, count) in enumerate(ranks):
        assert count >= 1
        assert torch.equal(shifts[2], shifts[1])  # every rank's, the finite one's too
        assert not torch.isfinite(outs[2][:SHARD]).all()  # the matrix reaches its owners as classic sends it
        assert torch.isfinite(outs[2][SHARD:]).all()  # the plain bias is its own sum
        total = sum(r[1][3] for r in ranks).reshape(-1)[owner * SHARD : (owner + 1) * SHARD]
        assert torch.isfinite(outs[3]).all()
        assert torch.allclose(outs[3][:SHARD], total, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- checkpoints


def _resume(rank, world, codec):
    segments = [Segment("w", 0, CHUNK)] if codec != "powersgd" else [Segment("w", 0, SHARD, shape=(ROWS, COLS))]
    numel = segments[0].numel
    options = {"rank": RANK} if codec == "powersgd" else {}
    first = _hook(codec, **options)
    for step in range(3):
        _step(first, _grad(rank, step, world, numel), segments)
    saved = {key: value.clone() if isinstance(value, torch.Tensor) else value
             for key, value in first.state_dict().items()}
    assert any("#ef21_sum" in key for key in saved)
    going_on = [_step(first, _grad(rank, step, world, numel), segments) for step in (3, 4)]
    second = _hook(codec, **options)
    second.load_state_dict(saved)
    resumed = [_step(second, _grad(rank, step, world, numel), segments) for step in (3, 4)]
    errors = []
    hook = _hook(codec, "classic", **options)
    try:
        check_feedback(saved, hook.codec)  # what the hook's load_state_dict checks first
        hook.load_state_dict(saved)
    except ValueError as error:
        errors.append(str(error))
    classic = _hook(codec, "classic", **options)
    _step(classic, _grad(rank, 0, world, numel), segments)
    try:
        _hook(codec, **options).load_state_dict(classic.state_dict())
    except ValueError as error:
        errors.append(str(error))
    return going_on, resumed, errors


@pytest.mark.parametrize("codec", ["tagc", "powersgd"])
def test_a_checkpoint_resumes_bit_identically_and_a_mismatched_one_is_an_error(codec):
    for going_on, resumed, errors in run_ranks(_resume, 2, codec):
        assert all(torch.equal(a, b) for a, b in zip(going_on, resumed))
        assert len(errors) == 2
        assert "feedback='ef21'" in errors[0]  # an EF21 checkpoint into a classic hook
        assert "feedback='classic'" in errors[1]  # a classic checkpoint into an EF21 hook


# ---------------------------------------------------------------------------------------------- DDP


def _ddp_constant(rank, world, feedback):
    torch.manual_seed(0)
    reference = DDP(nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 48)), bucket_cap_mb=0.03)
    torch.manual_seed(0)
    hooked = DDP(nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 48)), bucket_cap_mb=0.03)
    state = tagc.ddp_hook(hooked, codec="topk", ratio=2, select="all", dense_steps=0, min_compress_numel=1,
                          feedback=feedback)
    hooked.register_comm_hook(*state)
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 48, generator=generator)

    def grads(model):
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        return [p.grad.clone() for p in model.parameters()]

    for _ in range(15):  # the same batch: a constant gradient
        got = grads(hooked)
    forms = {form for form, _ in state[0].forms().values()}
    return got, grads(reference), forms


@pytest.mark.slow  # DDP on 2 gloo ranks: ~7 s
def test_ddp_delivers_the_exact_average_of_a_constant_gradient():
    """DDP's ``gather`` form decodes every replica's piece on every rank: EF21 keeps one sum per piece."""
    for got, want, forms in run_ranks(_ddp_constant, 2, "ef21"):
        assert "gather" in forms
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            assert (a != 0).float().mean() > 0.99


# ---------------------------------------------------------------------------------------------- settings


def test_settings_are_validated_with_clear_errors():
    hook = tagc.hook(feedback="ef21", feedback_decay=0.95)
    assert hook.codec.name == "tagc" and hook.dense_steps == 10
    assert hook.agreed_settings()["feedback"] == "ef21" and "feedback_momentum" not in hook.agreed_settings()
    assert hook.codec.decay == 0.95 and hook.agreed_settings()["feedback_decay"] == 0.95
    default = tagc.hook()  # codec tagc: EF21 fading by 0.9 (tagc.hooks.core.settings.RECOMMENDED)
    assert (default.agreed_settings()["feedback"], default.agreed_settings()["feedback_decay"]) == ("ef21", 0.9)
    assert type(default.codec).__name__ == "EF21Codec" and default.codec.decay == 0.9
    assert type(default.codec.inner).__name__ == "TAGCCodec"
    assert type(tagc.hook(feedback="classic").codec).__name__ == "TAGCCodec"  # classic: the codec itself
    assert type(tagc.hook(codec="topk").codec).__name__ == "EF21Codec"  # topk: EF21 fading by 0.9 too
    assert type(tagc.hook(codec="topk", feedback="classic").codec).__name__ == "TopKCodec"
    assert type(tagc.hook(codec="sign").codec).__name__ == "SignCodec"  # other codecs: classic by default
    for bad, message in [
        (dict(feedback="ef22"), "feedback must be one of ('classic', 'ef21')"),
        (dict(feedback="classic", feedback_decay=0.9), "feedback_decay applies only with feedback='ef21'"),
        (dict(codec="topk", feedback="classic", feedback_decay=0.9),
         "feedback_decay applies only with feedback='ef21'"),
        (dict(codec="sign", feedback_decay=0.9), "feedback_decay applies only with feedback='ef21'"),
        (dict(feedback="ef21", feedback_decay=0.0), "(0, 1]"),
        (dict(feedback="ef21", feedback_decay=1.5), "(0, 1]"),
        (dict(feedback="ef21", feedback_decay=True), "(0, 1]"),
        (dict(feedback="ef21", codec="int4"), "'tagc', 'powersgd', 'sign', 'topk'"),
        (dict(feedback="ef21", residual_dtype=torch.bfloat16), "residual_dtype=torch.float32"),
        (dict(residual_dtype=torch.bfloat16), "feedback='classic'"),  # tagc's default EF21 says how to keep bf16
    ]:
        with pytest.raises(ValueError) as error:
            tagc.hook(**bad)
        assert message in str(error.value), (bad, str(error.value))


def test_trainer_flags_reach_the_config_and_the_run_name():
    parse = build_parser().parse_args
    cfg = config_from_args(parse(["--codec", "topk", "--feedback", "ef21", "--feedback-decay", "1"]))
    assert cfg.feedback == "ef21" and cfg.run_name.endswith("-ef21")
    faded = config_from_args(parse(["--feedback", "ef21", "--feedback-decay", "0.9"]))
    assert faded.feedback_decay == 0.9 and "-ef21d0.9" in faded.run_name
    assert "-ef21d0.9" in TrainConfig().run_name  # codec tagc: the library's EF21, fading by 0.9
    assert "ef21" not in TrainConfig(**paper_train_config()).run_name
    assert "-ef21d0.9" in TrainConfig(codec="topk").run_name  # codec topk: the library's too
    assert "ef21" not in TrainConfig(codec="sign", compression="all").run_name
    for bad in (dict(feedback="ef21", compression="none"), dict(feedback="ef21", codec="int4"),
                dict(feedback="nope"), dict(feedback="classic", feedback_decay=0.9),
                dict(codec="topk", feedback="classic", feedback_decay=0.9),
                dict(codec="sign", compression="all", feedback_decay=0.9), dict(feedback="ef21", feedback_decay=0.0)):
        with pytest.raises(ValueError):
            TrainConfig(**bad)
    follows = config_from_args(parse(["--feedback-decay-follows-lr", "--lr", "1e-3", "--steps", "100"]))
    assert follows.feedback_decay_follows_lr and "-ef21d0.9-lr" in follows.run_name
    for bad in (dict(feedback_decay=1.0), dict(feedback="classic"), dict(codec="int4", compression="all"),
                dict(compression="none")):
        with pytest.raises(ValueError, match="feedback_decay_follows_lr"):
            TrainConfig(feedback_decay_follows_lr=True, **bad)
    from gpt2_bench.methods import layout_config  # a compare's other methods do not inherit it

    assert not layout_config(follows, "flat", "int4").feedback_decay_follows_lr
    assert not layout_config(follows, "flat", "tagc-int4").feedback_decay_follows_lr


def test_the_fading_follows_the_trainers_learning_rate_from_its_peak_to_its_floor():
    """The trainer calls ``hook.follow_lr(optimizer)`` as users do: during the warm-up the rate read is the largest
    seen, so the fading is the one asked for; after the peak it holds more as the rate decays."""
    from gpt2_bench.train import learning_rate
    from tagc.hooks.codecs.feedback import LearningRateFading

    cfg = TrainConfig(feedback_decay_follows_lr=True, steps=200, lr=1e-3, min_lr=1e-4, warmup_steps=5)
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    fading = LearningRateFading(optimizer, 0.9)
    decays = []
    for step in range(cfg.steps):
        optimizer.param_groups[0]["lr"] = learning_rate(cfg, step)
        decays.append(fading.decay())
    assert decays[: cfg.warmup_steps + 1] == pytest.approx([0.9] * (cfg.warmup_steps + 1))
    assert decays[-1] == pytest.approx(1 - 0.1 * learning_rate(cfg, cfg.steps - 1) / 1e-3)
    assert decays[-1] == pytest.approx(0.99, abs=1e-4)  # the floor, a tenth of the peak: a tenth of the fading
    after_peak = decays[cfg.warmup_steps:]
    assert all(a <= b for a, b in zip(after_peak, after_peak[1:]))  # holds more and more as the rate decays


def _ddp_sketch(rank, world, nan_step, decay):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 192), nn.ReLU(), nn.Linear(192, 48)), bucket_cap_mb=0.03)
    state = tagc.ddp_hook(model, **paper(codec="tagc", ratio=4, select="all", dense_steps=0, min_compress_numel=1,
                                         feedback="ef21", feedback_decay=decay))
    model.register_comm_hook(*state)
    codec = state[0].hook.codec
    generator = torch.Generator().manual_seed(rank)
    steps = []
    for step in range(6):
        x, y = torch.randn(16, 64, generator=generator), torch.randn(16, 48, generator=generator)
        if step == nan_step and rank == 1:
            x[0, 0] = float("nan")
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        state[0].end_step()
        steps.append({"grads": [p.grad.clone() for p in model.parameters()],
                      "shifts": {key: -r.clone().reshape(-1) for key, r in codec.residuals.items()},
                      "sums": {key: h.clone() for key, h in codec.sums.items()}})
    forms = {form for form, _ in state[0].forms().values()}
    return steps, forms, state[0].stats()["total"]["nonfinite_parts"]


@pytest.mark.slow  # DDP on 2 gloo ranks: ~6 s
@pytest.mark.parametrize("nan_step, decay", [(None, 1.0), (3, 1.0), (3, 0.8)])
def test_ddp_sketch_form_keeps_every_rank_sum_the_sum_of_the_shifts(nan_step, decay):
    """TAGC's all-reduce form under EF21: every rank's ``H`` (replicated) is the sum over ranks of their shifts ``h_i``
    at every step; a non-finite gradient on one rank leaves every shift and ``H`` as they were (that step NaN)."""
    (steps0, forms0, nonfinite0), (steps1, forms1, _) = run_ranks(_ddp_sketch, 2, nan_step, decay)
    assert forms0 == forms1 == {"sketch"}
    assert sum(bool(s["shifts"]) for s in steps0) >= 5
    assert nonfinite0 == (0 if nan_step is None else len(steps0[-1]["sums"]))  # every part of the NaN step
    for step, (mine, theirs) in enumerate(zip(steps0, steps1)):
        assert mine["sums"].keys() == {key + "#ef21_sum" for key in mine["shifts"]}
        for key, shift in mine["shifts"].items():
            total = mine["sums"][key + "#ef21_sum"]
            assert torch.equal(total, theirs["sums"][key + "#ef21_sum"])  # replicated, bit for bit
            assert torch.allclose(total, shift + theirs["shifts"][key], rtol=1e-5, atol=1e-6), (step, key)
            previous = steps0[step - 1]["shifts"].get(key) if step else None  # DDP's first iteration is its own
            if previous is not None:
                moved = (shift != decay * previous).float().mean()  # feedback_decay fades every shift first
                assert (moved == 0) if step == nan_step else (0 < moved < 0.6)  # sparse changes, none when NaN
        for index, (a, b) in enumerate(zip(mine["grads"], theirs["grads"])):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
            assert a.isnan().all() == (step == nan_step)
            earlier = [s["grads"][index] for s in steps0[1:step] if not s["grads"][index].isnan().any()]
            if earlier:  # H fills in: an element once sent keeps its value (classic error feedback's would be 0)
                assert (a != 0).float().mean() >= (earlier[-1] != 0).float().mean()
    assert min((g != 0).float().mean() for g in steps0[-1]["grads"]) > 0.35
