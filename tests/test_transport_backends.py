"""The transport by backend: pieces on gloo, whole collectives and NCCL's own reduce-scatter on NCCL.

NCCL itself is not here: its decisions are taken on gloo ranks whose ``dist.get_backend`` answers
``"nccl"`` (gloo runs the same collectives), and the results must not change."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tagc
from tagc.config import TAGCConfig
from tagc.hooks import Segment, TAGCHook
from tagc.hooks.core import transport
from tests.distributed import run_ranks

CHUNK = 300_000  # a plain fp32 row of 1.2 MB: two pieces of PIECE_BYTES on gloo


def test_backend_of_reads_a_mixed_backend_per_device(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert transport.backend_of(None, torch.device("cpu")) == "gloo"
    assert transport.backend_of(None, torch.device("cuda", 0)) == "nccl"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert transport.backend_of(None, torch.device("cpu")) == "nccl"


@pytest.mark.parametrize("backend, piece_bytes, expected", [("gloo", None, transport.PIECE_BYTES // 4),
                                                              ("nccl", None, CHUNK), ("nccl", 4096, 1024),
                                                              ("gloo", 4096, 1024)])
def test_pieces_on_gloo_whole_elsewhere_unless_piece_bytes_is_given(monkeypatch, backend, piece_bytes, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert transport.piece_columns(torch.empty(2, CHUNK), None, piece_bytes) == expected


def exchanges_by_backend(rank, world, backend, settings, piece_bytes):
    """Two steps of one bucket; the collectives the transport called, and the outputs."""
    if backend is not None:
        dist.get_backend = lambda group=None: backend  # this rank's process only
    calls = []
    for name in ("all_to_all_single", "reduce_scatter_single"):
        original = getattr(dist, name)
        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    options = dict(settings)
    codec, select = options.pop("codec", "tagc"), options.pop("select", "non_attention_linear")
    hook = TAGCHook(TAGCConfig(**options), codec=codec, select=select, dense_steps=0, piece_bytes=piece_bytes)
    segments = [Segment("mlp.c_fc.weight", 0, CHUNK - 150_000), Segment("mlp.c_fc.bias", CHUNK - 150_000, 150_000)]
    outs = []
    for step in range(2):
        grad = torch.randn(world * CHUNK, generator=torch.Generator().manual_seed(10 * step + rank))
        out = torch.empty(CHUNK)
        hook.start(out, grad, None, dist.ReduceOp.AVG, segments).wait()
        hook.end_step()
        outs.append(out)
    return calls, outs, hook.stats()["total"]["wire_bytes"]


@pytest.mark.parametrize("settings", [dict(codec="plain", select="all"), dict(ratio=10, min_compress_numel=1024)],
                         ids=["plain", "tagc"])
def test_nccl_sends_whole_collectives_and_reduce_scatters_plain_columns(settings):
    gloo = run_ranks(exchanges_by_backend, 2, None, settings, None)
    nccl = run_ranks(exchanges_by_backend, 2, "nccl", settings, None)
    for (gloo_calls, gloo_outs, gloo_bytes), (nccl_calls, nccl_outs, nccl_bytes) in zip(gloo, nccl):
        assert all(torch.equal(a, b) for a, b in zip(gloo_outs, nccl_outs))  # two ranks: a + b, in any order, the same
        assert gloo_bytes == nccl_bytes  # a ring reduce-scatter's volume either way
        # plain columns (the bias: 600 KB per rank row; with codec plain everything: 1.2 MB, two gloo pieces)
        assert "reduce_scatter_single" not in gloo_calls and nccl_calls.count("reduce_scatter_single") == 2
        pieces_per_step = 2 if settings.get("codec") == "plain" else 1 + 2  # tagc: its index and its sketch, whole
        assert gloo_calls.count("all_to_all_single") == 2 * pieces_per_step
        assert nccl_calls.count("all_to_all_single") == (0 if settings.get("codec") == "plain" else 2 * 2)


def test_a_piece_size_given_cuts_on_nccl_too():
    settings = dict(codec="plain", select="all")
    for calls, _, _ in run_ranks(exchanges_by_backend, 2, "nccl", settings, 1 << 18):
        assert "reduce_scatter_single" not in calls
        assert calls.count("all_to_all_single") == 2 * 5  # 1.2 MB in pieces of 256 KB, two steps


def test_piece_bytes_is_a_setting_the_ranks_agree_on():
    assert TAGCHook(TAGCConfig()).settings.piece_bytes is None and tagc.hook().agreed_settings()["piece_bytes"] is None
    assert TAGCHook(TAGCConfig(), piece_bytes=1 << 16).agreed_settings()["piece_bytes"] == 1 << 16
    with pytest.raises(ValueError, match="piece_bytes"):
        TAGCHook(TAGCConfig(), piece_bytes=0)
    assert tagc.hook(piece_bytes=1 << 16).agreed_settings()["piece_bytes"] == 1 << 16  # reachable from the one line
    with pytest.raises(ValueError, match="piece_bytes"):
        tagc.hook(piece_bytes=-1)
