"""Fallbacks in tagc.hooks that give the user something other than what was asked for warn, once each."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import tagc
from tagc.hooks import Segment
from tagc.kernels import fallbacks
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(fallbacks, "_warned", set())  # once per process: each test starts from none


def test_powersgd_warns_once_when_a_selected_matrix_has_no_shape():
    hook = tagc.hook(codec="powersgd", dense_steps=0, select="all")
    shapeless = [Segment("unit.weight", 0, 4096)]  # e.g. an FSDP1 unit of several parameters
    with pytest.warns(RuntimeWarning, match="powersgd sends the selected 'unit.weight' uncompressed"):
        hook.codec.prepare("a#4096/part0", shapeless, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hook.codec.prepare("b#4096/part0", shapeless, 2)  # once
        fallbacks._warned.clear()
        hook.codec.prepare("c#4096/part0", [Segment("bias", 0, 64, shape=(128,))], 2)  # a bias is no matrix: by design


def test_hsdp_pieces_warn_when_the_shard_does_not_match_its_parameters():
    from tagc.hooks.adapters.replicas import Pieces as _Pieces

    segments = (Segment("w", 0, 96), Segment("b", 96, 32))
    with pytest.warns(RuntimeWarning, match="exchanged as one segment '<shard>'"):
        pieces = _Pieces.build(segments, 100, 2, torch.device("cpu"))
    assert [s.name for s in pieces.segments] == ["<shard>"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [s.name for s in _Pieces.build(segments, 128, 2, torch.device("cpu")).segments] == ["w", "b"]


def fsdp1_partly_selected_unit(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), device_id=torch.device("cpu"))  # one unit
    hook = tagc.hook(dense_steps=0, min_compress_numel=1024, select=lambda name, module: name.startswith("0."),
                     **PAPER_WIRE)  # plain: fp32, so that a unit gone plain counts as no compressed bucket
    tagc.register_comm_hook(model, hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
            hook.end_step()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return messages, hook.stats()["total"]["compressed_buckets"]


def test_fsdp1_unit_that_select_picks_in_part_goes_plain_with_one_warning():
    for messages, compressed in run_ranks(fsdp1_partly_selected_unit, 2):
        assert compressed == 0
        assert len(messages) == 1 and "goes plain although select picks 50% of its elements" in messages[0], messages
