"""tagc.hooks.callback_stream: the DDP hook's future callbacks on one stream of its own (CUDA), unchanged elsewhere."""

import pytest
import torch

from tagc.hooks import callback_stream
from tagc.hooks.callback_stream import on_own_stream


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
