"""tagc.hooks.core.callback_stream: the DDP hook's future callbacks on one stream of its own (CUDA), unchanged
elsewhere."""

import pytest
import torch

from tagc.hooks.core import callback_stream
from tagc.hooks.core.callback_stream import on_own_stream


def _no_streams(*args, **kwargs):
    raise AssertionError("a CUDA stream was asked for off CUDA")


def test_cpu_callback_runs_where_called_and_returns_its_value(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Stream", _no_streams)
    monkeypatch.setattr(callback_stream, "callback_stream", _no_streams)
    future = torch.futures.Future()
    chained = future.then(on_own_stream(lambda done: done.wait() * 2 + 1, torch.device("cpu")))
    future.set_result(torch.arange(4.0))
    assert torch.equal(chained.wait(), torch.tensor([1.0, 3.0, 5.0, 7.0]))


def test_callback_error_reaches_the_waiter():
    def decode(done: torch.futures.Future) -> torch.Tensor:
        raise FloatingPointError("the summed table is not finite")

    future = torch.futures.Future()
    chained = future.then(on_own_stream(decode, torch.device("cpu")))
    future.set_result(torch.zeros(1))
    with pytest.raises(Exception, match="the summed table is not finite"):
        chained.wait()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_callbacks_reuse_one_cache():
    from tagc.bench.gpu_check import callback_memory

    device = torch.device("cuda", torch.cuda.current_device())
    result = callback_memory(device, calls=16, numel=1 << 22)
    assert result["ok"], result
    assert callback_stream.callback_stream(device) is callback_stream.callback_stream(device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_counters_summed_on_another_stream_stay_exact():
    from tagc.bench.gpu_check import counters_across_streams

    result = counters_across_streams(torch.device("cuda", torch.cuda.current_device()), rounds=32)
    assert result["ok"], result


def test_exchange_stats_count_and_add_sum_ints_and_device_counters():
    """``count`` and ``add`` (which tell the allocator which stream reads a CUDA counter) sum Python ints and 0-d
    tensors alike; off CUDA the stream bookkeeping is a no-op and the arithmetic is all there is."""
    from tagc.hooks.core.stats import ExchangeStats

    part = ExchangeStats(buckets=1)
    part.count("overflow", 3)
    part.count("overflow", torch.tensor(4))
    part.count_nonfinite(torch.tensor(False))
    part.count_nonfinite(torch.tensor(True))
    assert isinstance(part.overflow, torch.Tensor) and int(part.overflow) == 7 and int(part.nonfinite_parts) == 1
    total = ExchangeStats(overflow=torch.tensor(10))
    total.add(part)
    total.add(part)
    numbers = total.as_dict()
    assert (numbers["buckets"], numbers["overflow"], numbers["nonfinite_parts"]) == (2, 24, 2)
    with pytest.raises(AttributeError):
        part.count("no_such_counter", 1)
