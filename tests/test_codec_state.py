"""The state the error-feedback codecs share one implementation of (:class:`tagc.hooks.codecs.codec.ResidualCodec`)
and the one NaN/Inf counter (:meth:`tagc.hooks.core.stats.ExchangeStats.count_nonfinite`).

* **Residual set-up.** A part's residual is created at zero, of the part's shape and the codec's
  ``residual_dtype``, the first time the part is encoded, and is the same tensor afterwards.
* **Residual load.** ``load_state_dict`` updates the codec's one residual dict in place (``tagc``,
  ``topk`` and ``sign`` alike): whatever holds it, a copy at another ratio included, sees the loaded
  residuals, which are copies of the checkpoint's; and a codec loaded from another's state encodes
  the next step exactly as that codec does. PowerSGD's per-matrix state loads the same way.
* **NaN/Inf count.** ``count_nonfinite`` adds one per non-finite part on the device, and every codec's
  decode counts through it (a poisoned part counts 1 at every owner, a clean one 0), TAGC's host-read
  decodes (``fallback="raw"`` and ``"error"``, two gloo ranks) included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tagc.config import TAGCConfig
from tagc.hooks.codecs.codec import ResidualCodec
from tagc.hooks.codecs.registry import make_codec
from tagc.hooks.core.stats import ExchangeStats
from tests.distributed import run_ranks

KEY = "w#1/part0"
RESIDUAL_CODECS = ("tagc", "topk", "sign")
CONFIG = TAGCConfig(sparsity=0.9)


def _grads(step: int, world: int = 2, numel: int = 3000) -> torch.Tensor:
    return torch.randn(world, numel, generator=torch.Generator().manual_seed(100 + step))


@pytest.mark.parametrize("name", RESIDUAL_CODECS)
def test_residual_is_created_at_zero_once_in_the_residual_dtype(name):
    codec = make_codec(name, CONFIG, torch.bfloat16)
    assert isinstance(codec, ResidualCodec)
    grad = _grads(0)
    first = codec.residual(KEY, grad)
    assert first.dtype == torch.bfloat16 and first.shape == grad.shape and not first.any()
    assert codec.residual(KEY, _grads(1)) is first  # later calls: the same tensor, never a fresh zero
    codec.encode(grad, KEY, None)
    assert codec.residuals[KEY] is first and first.any()  # encode kept what it did not send in that tensor


@pytest.mark.parametrize("name", RESIDUAL_CODECS)
def test_load_state_dict_updates_the_one_residual_dict(name):
    codec = make_codec(name, CONFIG)
    codec.encode(_grads(0), KEY, None)
    held = codec.residuals  # what a copy at another ratio, or any other holder, keeps
    at_other_ratio = codec.at_ratio(20.0)
    state = {KEY: torch.full((2, 3000), 0.5), "w#2/part0": torch.arange(6.0).view(2, 3)}
    codec.load_state_dict(state)
    assert codec.residuals is held, "load_state_dict replaced the residual dict instead of updating it"
    assert at_other_ratio.residuals is held
    assert sorted(held) == sorted(state)  # the stale part's residual is gone, the new one is there
    for key, value in state.items():
        assert torch.equal(held[key], value) and held[key] is not value  # copies of the checkpoint's
    state[KEY].fill_(9.0)
    assert torch.equal(held[KEY], torch.full((2, 3000), 0.5))  # the checkpoint's tensors stay the checkpoint's


@pytest.mark.parametrize("name", RESIDUAL_CODECS)
def test_a_codec_loaded_from_anothers_state_encodes_the_next_step_identically(name):
    trained, resumed = make_codec(name, CONFIG), make_codec(name, CONFIG)
    trained.encode(_grads(0), KEY, None)
    resumed.load_state_dict(trained.state_dict())
    want, got = trained.encode(_grads(1), KEY, None), resumed.encode(_grads(1), KEY, None)
    assert len(want) == len(got) and all(torch.equal(w, g) for w, g in zip(want, got))
    assert torch.equal(trained.residuals[KEY], resumed.residuals[KEY])
    assert trained.residuals[KEY].any()  # a state that was there to carry over


def test_powersgd_load_state_dict_updates_its_dicts_and_refuses_unknown_entries():
    codec = make_codec("powersgd", CONFIG)
    held = (codec.residuals, codec.qs, codec.draws)
    codec.residuals["b/part0/old"] = torch.ones(2, 2)
    residual, q = torch.randn(4, 3), torch.randn(3, 2)
    codec.load_state_dict({"b/part0/w/residual": residual, "b/part0/w/q": q, "b/part0/w/draws": torch.tensor(3)})
    loaded = (codec.residuals, codec.qs, codec.draws)
    assert all(a is b for a, b in zip(loaded, held)), "load_state_dict replaced a dict instead of updating it"
    assert list(codec.residuals) == ["b/part0/w"] and torch.equal(codec.residuals["b/part0/w"], residual)
    assert codec.residuals["b/part0/w"] is not residual and torch.equal(codec.qs["b/part0/w"], q)
    assert codec.draws == {"b/part0/w": 3}
    with pytest.raises(ValueError, match="unknown powersgd state entry"):
        codec.load_state_dict({"b/part0/v/residual": torch.zeros(1), "b/part0/v/momentum": torch.zeros(1)})
    assert list(codec.residuals) == ["b/part0/w"] and codec.draws == {"b/part0/w": 3}  # as it was


def test_int4_load_state_dict_updates_its_step_counters():
    codec = make_codec("int4", CONFIG, options={"stochastic": True})
    held = codec.steps
    codec.encode(_grads(0), "b/part1", None)
    codec.load_state_dict({f"{KEY}#steps": torch.tensor(5)})
    assert codec.steps is held and held == {KEY: 5}


def test_count_nonfinite_adds_one_per_nonfinite_part_on_the_device():
    stats = ExchangeStats()
    for ok in (True, False, True, False, False):
        stats.count_nonfinite(torch.tensor(ok))
    assert isinstance(stats.nonfinite_parts, torch.Tensor) and stats.nonfinite_parts.dtype == torch.int64
    assert stats.as_dict()["nonfinite_parts"] == 3
    total = ExchangeStats(nonfinite_parts=2)
    total.add(stats)
    assert total.as_dict()["nonfinite_parts"] == 5  # a device count adds to a host one


@pytest.mark.parametrize("name", ["tagc", "topk", "sign", "bf16", "fp8", "int4"])
@pytest.mark.parametrize("poisoned", [False, True])
def test_every_codec_counts_a_nonfinite_part_once_at_every_owner(name, poisoned):
    world, numel = 3, 3000
    codecs = [make_codec(name, CONFIG) for _ in range(world)]
    grads = [_grads(rank, world, numel) for rank in range(world)]
    if poisoned:
        grads[1][0, 5] = float("nan")  # rank 1's row for owner 0: every owner of the part learns of it
    sent = [codec.encode(grad, KEY, None) for codec, grad in zip(codecs, grads)]
    for owner in range(world):
        received = [torch.stack([wires[i][owner] for wires in sent]) for i in range(len(sent[0]))]
        stats = ExchangeStats()
        codecs[owner].decode(received, numel, KEY, None, stats)
        assert stats.as_dict()["nonfinite_parts"] == int(poisoned), (name, owner)


def _tagc_exchange_with_a_nan(rank: int, world: int, fallback: str) -> tuple[int, bool]:
    """Two ranks, TAGC at ``fallback``; rank 1's gradient holds a NaN. Every wire reaches every rank
    (all-gathered), each owner decodes its row: ``(nonfinite_parts, whether its part came out all NaN)``."""
    codec = make_codec("tagc", TAGCConfig(sparsity=0.9, fallback=fallback))
    grad = _grads(rank, world)
    if rank == 1:
        grad[0, 5] = float("nan")
    received = []
    for wire in codec.encode(grad, KEY, None):
        gathered = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(gathered, wire.contiguous())
        received.append(torch.stack([g[rank] for g in gathered]))
    stats = ExchangeStats()
    values = codec.decode(received, grad.shape[1], KEY, None, stats)  # both owners take the host-read path
    return stats.as_dict()["nonfinite_parts"], bool(values.isnan().all())


@pytest.mark.slow  # 2-rank runs of the raw/error decode paths (~6 s); device-counted codecs stay in the default suite
@pytest.mark.parametrize("fallback", ["raw", "error"])
def test_tagc_host_read_decodes_count_a_nonfinite_part_once_at_every_owner(fallback):
    assert run_ranks(_tagc_exchange_with_a_nan, 2, fallback) == [(1, True), (1, True)]
