"""The end-of-backward drain (:class:`backward_drain.BackwardDrain`) that SimpleFSDP's overlapped
reduce-scatters and TAGC's FSDP2 adapter share: what it completes, when, in which order, and what
happens after an error. One process, no collectives: the work items record what they were asked."""

from __future__ import annotations

import pytest
import torch

from backward_drain import BackwardDrain, in_backward_pass

pytestmark = pytest.mark.torch_range  # the autograd engine's internals: on the oldest and the newest torch too


class _Launch(torch.autograd.Function):
    """Identity whose backward adds a work item ``(name, log)`` to ``drain`` (or raises, for ``name == "fail"``)."""

    @staticmethod
    def forward(ctx, x, drain, name, log):
        ctx.drain, ctx.name, ctx.log = drain, name, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.name == "fail":
            raise RuntimeError("this backward pass fails")
        name, log = ctx.name, ctx.log
        assert in_backward_pass()
        ctx.drain.add(lambda deliver: log.append((name, deliver)))
        log.append((name, "launched"))
        return grad, None, None, None


def _chain(x, drain, log, names):
    for name in names:
        x = _Launch.apply(x, drain, name, log)
    return x.sum()


def test_work_completes_at_the_end_of_its_backward_pass_oldest_first():
    drain, log = BackwardDrain(), []
    x = torch.ones(3, requires_grad=True)
    _chain(x, drain, log, ["a", "b", "c"]).backward()
    # backward runs c, b, a: each is launched during the pass and completed, delivered, after all were launched
    assert log == [("c", "launched"), ("b", "launched"), ("a", "launched"), ("c", True), ("b", True), ("a", True)]
    log.clear()
    _chain(x, drain, log, ["d"]).backward()  # the next pass queues its own callback: nothing is held over
    assert log == [("d", "launched"), ("d", True)]


def test_every_item_completes_after_an_error_and_the_first_error_is_raised():
    drain, done = BackwardDrain(), []

    def item(name, error=None):
        def complete(deliver):
            done.append((name, deliver))
            if error is not None:
                raise error
        return complete

    class _Add(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            drain.add(item("first", ValueError("first")))
            drain.add(item("second", KeyError("second")))
            drain.add(item("third"))
            return grad

    with pytest.raises(ValueError, match="first"):
        _Add.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert done == [("first", True), ("second", True), ("third", True)]  # none left unfinished


def test_work_of_a_failed_pass_completes_without_delivering_at_the_next_pass():
    drain, log = BackwardDrain(), []
    x = torch.ones(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="fails"):
        _chain(x, drain, log, ["fail", "left"]).backward()  # "left" launches, then "fail" raises: no callback
    assert log == [("left", "launched")]
    _chain(x, drain, log, ["next"]).backward()
    assert log == [("left", "launched"), ("left", False), ("next", "launched"), ("next", True)]


def test_add_outside_a_backward_pass_is_a_clear_error_and_holds_nothing():
    drain, log = BackwardDrain(), []
    assert not in_backward_pass()
    for _ in range(2):  # the second time too: a refused add leaves no state behind
        with pytest.raises(RuntimeError, match="inside a backward pass"):
            drain.add(lambda deliver: log.append(deliver))
    x = torch.ones(3, requires_grad=True)
    _chain(x, drain, log, ["a"]).backward()
    assert log == [("a", "launched"), ("a", True)]  # nothing refused was held and run
