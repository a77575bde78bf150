"""Where the DDP hook's future callbacks run on CUDA: on one stream of the hook's per device (:func:`on_own_stream`),
not on the next stream of torch's pool, so that every callback's bucket-sized temporaries reuse one stream's cache
(why: docs/design.md §2, "Where DDP's callbacks run"). Off CUDA it changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_streams: dict[torch.device, torch.cuda.Stream] = {}


def callback_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the callbacks for ``device`` (a CUDA device with its index) run on, made at first use."""
    with _lock:  # callbacks run on the collectives' threads
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = torch.cuda.Stream(device=device)
        return stream


@contextlib.contextmanager
def own_stream(device: torch.device) -> Iterator[None]:
    """Make :func:`callback_stream` current for the block, after the stream the callback was called on (which
    waited for the future), and make that stream wait for the block's work, which the future's completion then
    covers: its waiters wait for the called-on stream. Nothing off CUDA."""
    if device.type != "cuda":
        yield
        return
    called_on = torch.cuda.current_stream(device)
    stream = callback_stream(device)
    stream.wait_stream(called_on)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        called_on.wait_stream(stream)


def on_own_stream(body: Callable[[torch.futures.Future], T], device: torch.device) -> Callable[
        [torch.futures.Future], T]:
    """``body``, a ``Future.then`` callback for a value on ``device``, run under :func:`own_stream`."""

    @functools.wraps(body)
    def run(future: torch.futures.Future) -> T:
        with own_stream(device):
            return body(future)

    return run
