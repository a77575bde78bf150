"""The one line on models nobody here wrote: HuggingFace ``transformers``' GPT-2 and Llama (built from
tiny configs, no download) and a nanoGPT-shaped GPT, under FSDP2 (``fully_shard``) and SimpleFSDP,
on 2 gloo ranks.

* ``codec="plain"`` (the fair baseline) gives losses, gradients and weights bit-identical to native
  FSDP2's own reduce-scatter, and so does ``select="none"``.
* TAGC compresses what it should (the MLP linears, the attention output projection, the embedding
  and the LM head, whatever class implements them), every block's wire is below plain's, and the
  planned bytes of :func:`tagc.hooks.adapters.describe.describe_plan` are what ``hook.stats()`` reports.
* A few steps train: finite losses, peeling recovers every element, and elements were sent.
* HF GPT-2's wire per step is our own GPT's (``gpt2_bench.model``) of the same shapes.

The configs are sized so that every block's selected columns reach the default ``min_compress_numel``
(65,536 per rank) with the one line: ``n_embd=128`` (a GPT-2 block selects 147,456 elements, 73,728
per rank) and a 1,024-token vocabulary (the tied embedding, 65,536 per rank).
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tagc
from tagc.hooks.adapters.describe import describe_plan, warn_if_weak_selection
from tagc.hooks.core.segment import Segment
from tests.distributed import run_ranks
from tests.paper_wire import PAPER_WIRE

pytestmark = pytest.mark.torch_range  # CI runs it on the oldest and the newest supported torch too

WORLD = 2
VOCAB = 1024
EMBD = 128
LAYERS = 2
HEADS = 2
SEQ = 32
PER_RANK = 2
STEPS = 3
ONE_LINE = dict(ratio=10, index_bits=1)
"""``tagc.hook(ratio=10, index_bits=1)``; the tests add ``dense_steps=0`` so that every step is compressed
(the default dense warm-up sends the first 10 steps plain). The rest is ``tagc.hook()``'s recommended setting: the
columns not selected go in ``int4`` (:data:`tagc.hooks.core.settings.RECOMMENDED`)."""


def _transformers():
    return pytest.importorskip("transformers", reason="HF models need transformers (pip install '.[test]')")


# ----------------------------------------------------------------------------- the models


def hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=EMBD, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=EMBD, intermediate_size=344, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: a weight and an optional bias."""

    def __init__(self, n: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = NanoLayerNorm(EMBD)
        self.attn = NanoAttention()
        self.ln_2 = NanoLayerNorm(EMBD)
        self.mlp = NanoMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """karpathy/nanoGPT's ``GPT`` in its module names: ``transformer.wte/wpe/h[i]/ln_f`` and an LM head
    tied to ``wte`` (so the tied weight is named ``transformer.wte.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, EMBD), wpe=nn.Embedding(SEQ, EMBD),
                                              h=nn.ModuleList([NanoBlock() for _ in range(LAYERS)]),
                                              ln_f=NanoLayerNorm(EMBD)))
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, labels: torch.Tensor):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.reshape(-1))


def nanogpt() -> nn.Module:
    torch.manual_seed(0)
    return NanoGPT()


def our_gpt() -> nn.Module:
    """``gpt2_bench.model.GPT`` in HF GPT-2's shapes: biases everywhere and the LM head tied to ``wte``
    as in GPT-2 (HF's ``Conv1D`` stores the block weights transposed, ``[in, out]``: with these even
    sizes dim-0 sharding pads neither, so every segment has the same length)."""
    from gpt2_bench.model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=LAYERS, n_head=HEADS, n_embd=EMBD, vocab_size=VOCAB, block_size=SEQ, bias=True,
                         tie_weights=True))


MODELS = {"hf-gpt2": hf_gpt2, "hf-llama": hf_llama, "nanogpt": nanogpt, "ours": our_gpt}


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _loss(name: str, model: nn.Module, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if name.startswith("hf-"):
        return model(input_ids=idx, labels=labels).loss
    if name == "ours":
        return model(idx, labels)[1]
    return model(idx, labels)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=gen)
    return idx, torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=gen)


# ----------------------------------------------------------------------------- one rank's run


def _train(name: str, wrapper: str, hook_kwargs, keep_tensors: bool) -> dict:
    """:data:`STEPS` SGD steps of model ``name`` wrapped by ``wrapper`` (``"fsdp2"``, ``"simple"``), with
    the one line when ``hook_kwargs`` is not ``None`` (else native FSDP2); ``keep_tensors``: return the
    last step's local gradients and the final local weights too."""
    from fsdp_integration import simple_fsdp

    model = MODELS[name]()
    if wrapper == "fsdp2":
        mesh = init_device_mesh("cpu", (WORLD,))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrapper == "fsdp1":  # a unit per block, the root for the rest
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        policy = ModuleWrapPolicy({type(_blocks(model)[0])})
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"), auto_wrap_policy=policy,
                                         use_orig_params=True)
    else:
        model = simple_fsdp(model)
    hook = None
    out: dict = {"losses": [], "steps": [], "names": [n for n, _ in model.named_parameters()]}
    if hook_kwargs is not None:
        hook = tagc.hook(**hook_kwargs)
        tagc.register_comm_hook(model, hook)
        out["plan"] = describe_plan(hook, model)  # before the first step: FSDP2 has not named its parameters yet
        out["table"] = hook.describe(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = torch.distributed.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            idx, labels = _batch(step, rank)
            loss = _loss(name, model, idx, labels)
            loss.backward()
            if keep_tensors and step == STEPS - 1:
                out["grads"] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.detach().clone())
            if hook is not None:
                hook.end_step()
                out["steps"].append(hook.stats())
    out["warnings"] = [str(w.message) for w in caught if str(w.message).startswith("TAGC compresses")]
    if keep_tensors:
        out["params"] = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    if hook is not None:
        out["plan_after"] = describe_plan(hook, model)
    return out


TAGC = {**ONE_LINE, "dense_steps": 0}
PLAIN = (("native", None), ("plain", {"codec": "plain"}),
         ("none", {**ONE_LINE, **PAPER_WIRE, "select": "none"}))  # nothing selected, the rest fp32 as it is
PLAIN_JOBS = {f"{name}/{kind}": (name, "fsdp2", kwargs, True)
              for name in ("hf-gpt2", "hf-llama") for kind, kwargs in PLAIN}
TAGC_JOBS = {f"{name}/{wrapper}": (name, wrapper, TAGC, False) for name in ("hf-gpt2", "hf-llama", "nanogpt", "ours")
             for wrapper in ("fsdp2", "simple")}


FSDP1_JOB = {"nanogpt/fsdp1": ("nanogpt", "fsdp1", TAGC, False)}
OTHER_CODECS = {  # describe's bytes are every codec's wire shapes, the plain columns' codec's too
    "nanogpt/fsdp2-bf16-plain": ("nanogpt", "fsdp2", {**TAGC, "plain": "bf16"}, False),
    "nanogpt/simple-topk": ("nanogpt", "simple", {"codec": "topk", "ratio": 10, "dense_steps": 0}, False),
    "nanogpt/fsdp2-int4": ("nanogpt", "fsdp2", {"codec": "int4"}, False),
}


def _runs(rank, world, jobs):
    return {key: _train(*job) for key, job in jobs.items()}


@pytest.fixture(scope="module")
def runs() -> dict:
    """Every run of this module's distributed tests, in one pair of ranks (the ranks import
    ``transformers`` once): rank 0's results by ``"model/variant"``."""
    jobs = {**PLAIN_JOBS, **TAGC_JOBS, **FSDP1_JOB, **OTHER_CODECS, **OLD_SELECTION}
    if importlib.util.find_spec("transformers") is None:
        jobs = {key: job for key, job in jobs.items() if not job[0].startswith("hf-")}
    return run_ranks(_runs, WORLD, jobs, timeout_s=300)[0]


def _assert_identical(a: dict, b: dict, what: str) -> None:
    assert len(a["losses"]) == len(b["losses"])
    for step, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True)):
        assert torch.equal(x, y), f"{what}: loss of step {step} {x.item()!r} != {y.item()!r}"
    for kind in ("grads", "params"):
        assert a[kind].keys() == b[kind].keys()
        for n in a[kind]:
            assert torch.equal(a[kind][n], b[kind][n]), f"{what}: {kind} of {n} differ"


# ----------------------------------------------------------------------------- plain is native FSDP2


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_plain_is_bit_identical_to_native_fsdp2(runs, name):
    _transformers()
    native, plain, none = (runs[f"{name}/{kind}"] for kind in ("native", "plain", "none"))
    _assert_identical(plain, native, f"{name} codec='plain' vs native FSDP2")
    _assert_identical(none, native, f"{name} select='none' vs native FSDP2")
    assert all(math.isfinite(x.item()) for x in native["losses"])
    assert all(bool(g.abs().sum() > 0) for g in native["grads"].values())  # every gradient is there to compare
    for run in (plain, none):
        last = run["steps"][-1]["last_step"]
        assert last["compressed_buckets"] == 0 and last["wire_bytes"] == last["plain_equivalent_bytes"] > 0
        assert not run["plan"].compressed and run["plan"].planned_bytes == last["wire_bytes"]


# ----------------------------------------------------------------------------- TAGC on real clients

EXPECTED = {  # the MLP linears, the attention output projection, the embedding and the LM head
    "hf-gpt2": ["transformer.wte.weight"]  # the LM head is tied to it
    + [f"transformer.h.{i}.{leaf}.weight" for i in range(LAYERS) for leaf in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")],
    "hf-llama": ["model.embed_tokens.weight", "lm_head.weight"]
    + [f"model.layers.{i}.{leaf}.weight" for i in range(LAYERS)
       for leaf in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")],
    "nanogpt": ["transformer.wte.weight"]
    + [f"transformer.h.{i}.{leaf}.weight" for i in range(LAYERS) for leaf in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")],
}
EXPECTED["ours"] = EXPECTED["nanogpt"]


@pytest.mark.parametrize("key", sorted(TAGC_JOBS))
def test_the_one_line_compresses_the_blocks_and_trains(runs, key):
    if key.startswith("hf-"):
        _transformers()
    run = runs[key]
    plan = run["plan"]
    names = [row.name for row in plan.parameters]
    assert sorted(plan.compressed) == sorted(EXPECTED[key.split("/")[0]])
    assert sorted(names) == sorted(run["names"])  # every parameter once (a tied one once)
    for row in plan.parameters:  # the columns not selected: int4, tagc.hook()'s recommended plain codec
        assert (row.codec, row.ratio) == (("tagc", 10.0) if row.compressed else ("int4", None)), row
    assert run["plan_after"] == plan  # the same plan before the first step and after (FSDP2 names its parameters late)
    assert sorted(b.bucket for b in plan.buckets) == ["<root>"] + [f"{_prefix(key)}.{i}" for i in range(LAYERS)]
    assert all(b.compressed_numel > 0 for b in plan.buckets)  # every block, and the root's embedding / head
    for stats in run["steps"]:
        last = stats["last_step"]
        assert last["wire_bytes"] == plan.planned_bytes  # the plan is what the engine sends
        assert last["plain_equivalent_bytes"] == plan.plain_bytes
        units = {u["unit"]: u["wire_bytes"] for u in stats["units"]}
        assert units == {b.bucket: b.planned_bytes for b in plan.buckets}
        for b in plan.buckets:
            assert b.planned_bytes < b.plain_bytes, b  # every unit's wire below plain's
        assert last["support"] > 0 and last["peeled"] == last["support"] and last["peel_success"] == 1.0
        assert last["unpeeled"] == 0 and last["nonfinite_parts"] == 0
    assert all(math.isfinite(x.item()) for x in run["losses"])
    for row in plan.parameters:
        assert row.name in run["table"]


def _prefix(key: str) -> str:
    return "model.layers" if key.startswith("hf-llama") else "transformer.h"


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "nanogpt", "ours"])
def test_fsdp2_and_simple_fsdp_plan_the_same_buckets_and_train_alike(runs, name):
    if name.startswith("hf-"):
        _transformers()
    fsdp2, simple = runs[f"{name}/fsdp2"], runs[f"{name}/simple"]
    # the units come in another order (FSDP2: the root first; SimpleFSDP: the blocks, then the root)
    assert {b.bucket: b for b in fsdp2["plan"].buckets} == {b.bucket: b for b in simple["plan"].buckets}
    assert {r.name: r for r in fsdp2["plan"].parameters} == {r.name: r for r in simple["plan"].parameters}
    wires = [[s["last_step"]["wire_bytes"] for s in run["steps"]] for run in (fsdp2, simple)]
    assert wires[0] == wires[1]
    # the same buckets, residuals and sketches: the same losses, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(fsdp2["losses"], simple["losses"], strict=True))


def test_describe_plans_fsdp1_units_whole(runs):
    """FSDP1 selects whole units (a block holds the attention's QKV: plain); the plan is still what the engine sends."""
    run = runs["nanogpt/fsdp1"]
    plan = run["plan"]
    assert sorted(b.bucket for b in plan.buckets) == ["<root>", "transformer.h.0", "transformer.h.1"]
    for b in plan.buckets:
        assert b.compressed_numel == (b.chunk if b.bucket == "<root>" else 0), b
    unwrapped = sorted(n.replace("_fsdp_wrapped_module.", "") for n in run["names"])
    assert sorted(row.name for row in plan.parameters) == unwrapped
    for stats in run["steps"]:
        assert stats["last_step"]["wire_bytes"] == plan.planned_bytes
        assert {u["unit"]: u["wire_bytes"] for u in stats["units"]} == {b.bucket: b.planned_bytes for b in plan.buckets}
        assert stats["last_step"]["peel_success"] == 1.0 and stats["last_step"]["support"] > 0


@pytest.mark.parametrize("key, codec, plain", [
    ("nanogpt/fsdp2-bf16-plain", "tagc", "bf16"), ("nanogpt/simple-topk", "topk", "int4"),  # topk's recommended plain
    ("nanogpt/fsdp2-int4", "int4", "plain")])
def test_describe_counts_every_codecs_wire(runs, key, codec, plain):
    run = runs[key]
    plan = run["plan"]
    assert sorted(plan.compressed) == sorted(EXPECTED["nanogpt"])
    for row in plan.parameters:
        assert row.codec == (codec if row.compressed else plain), row
        assert (row.ratio is not None) == (row.compressed and codec != "int4"), row
    for stats in run["steps"]:
        assert stats["last_step"]["wire_bytes"] == plan.planned_bytes < plan.plain_bytes
        assert {u["unit"]: u["wire_bytes"] for u in stats["units"]} == {b.bucket: b.planned_bytes for b in plan.buckets}


def test_the_engine_warns_once_when_a_hook_compresses_only_the_embedding(runs):
    _transformers()
    caught = runs["hf-gpt2/old-selection"]["warnings"]
    assert len(caught) == 1 and "only the embedding / LM head (transformer.wte.weight)" in caught[0]
    for key in TAGC_JOBS:
        assert runs[key]["warnings"] == [], key


def test_hf_gpt2_wire_matches_our_gpt_of_the_same_shapes(runs):
    _transformers()
    hf, ours = runs["hf-gpt2/fsdp2"], runs["ours/fsdp2"]
    for step in range(STEPS):
        hf_bytes, our_bytes = (run["steps"][step]["last_step"]["wire_bytes"] for run in (hf, ours))
        assert abs(hf_bytes - our_bytes) <= 0.05 * our_bytes, (step, hf_bytes, our_bytes)
        hf_units = {u["unit"]: u["wire_bytes"] for u in hf["steps"][step]["units"]}
        our_units = {u["unit"]: u["wire_bytes"] for u in ours["steps"][step]["units"]}
        assert hf_units.keys() == our_units.keys()
        for unit in hf_units:
            assert abs(hf_units[unit] - our_units[unit]) <= 0.05 * our_units[unit], (step, unit, hf_units, our_units)
    # the same shapes: the same parameters, each compressed alike, in units of the same size
    assert sorted(hf["plan"].compressed) == sorted(ours["plan"].compressed)
    assert sorted((b.bucket, b.chunk, b.compressed_numel) for b in hf["plan"].buckets) == \
        sorted((b.bucket, b.chunk, b.compressed_numel) for b in ours["plan"].buckets)


# ----------------------------------------------------------------------------- the first-step warning (no ranks)


def _segments(model: nn.Module) -> tuple[tuple[Segment, ...], int]:
    """Every parameter of ``model`` as a segment of one 2-rank bucket (dim-0 sharding, as FSDP2 packs it)."""
    modules = {name: module for name, module in model.named_modules()}
    segments, start = [], 0
    for name, p in model.named_parameters():
        numel = -(-p.shape[0] // WORLD) * math.prod(p.shape[1:])
        segments.append(Segment(name, start, numel, modules[name.rpartition(".")[0]], shape=tuple(p.shape)))
        start += numel
    return tuple(segments), start


def _warnings_after_planning(model: nn.Module, base: dict = ONE_LINE, **kwargs) -> list[str]:
    hook = tagc.hook(**{**base, **kwargs})
    segments, chunk = _segments(model)
    hook.plan(segments, chunk, WORLD)  # what the engine plans at a bucket's first exchange
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_weak_selection(hook)
    return [str(w.message) for w in caught]


def _old_selection(fqn, module):
    """``non_attention_linear`` as it was: ``nn.Linear`` and ``nn.Embedding`` only (HF GPT-2's blocks: ``Conv1D``)."""
    from tagc.hooks.core.selection import non_attention_linear

    return isinstance(module, (nn.Linear, nn.Embedding)) and non_attention_linear(fqn, module)


OLD_SELECTION = {"hf-gpt2/old-selection": ("hf-gpt2", "fsdp2", {**ONE_LINE, "dense_steps": 2, "select": _old_selection},
                                         False)}
"""The selection before HF's ``Conv1D`` counted as a linear layer: the engine warns once, at the end of the first
step after the dense warm-up (the first step whose buckets are planned compressed)."""


def test_a_hook_that_compresses_only_the_embedding_says_so():
    _transformers()
    model = hf_gpt2()
    assert _warnings_after_planning(model) == []  # the blocks' Conv1D linears are selected
    caught = _warnings_after_planning(model, select=_old_selection)
    assert len(caught) == 1 and "only the embedding / LM head (transformer.wte.weight)" in caught[0]
    assert _warnings_after_planning(model, select=lambda fqn, module: ".mlp." in fqn and fqn.endswith("weight")) == []


def test_a_hook_that_compresses_nothing_says_so():
    model = nanogpt()
    caught = _warnings_after_planning(model, min_compress_numel=10**9)  # every bucket below the size floor
    assert len(caught) == 1 and caught[0].startswith("TAGC compresses nothing")
    caught = _warnings_after_planning(model, select=lambda fqn, module: fqn.endswith(".bias"))
    assert len(caught) == 1 and caught[0].startswith("TAGC compresses nothing")
    assert _warnings_after_planning(model) == []
    assert _warnings_after_planning(model, select="none") == []  # the fair baseline asked for nothing
    assert _warnings_after_planning(model, base={}, codec="plain") == []


def _fsdp1_warnings(units: list[tuple[list[str], bool]]) -> list[str]:
    """FSDP1 hands the engine one segment per unit, ``a+b+...``, selected as a whole (``True``/``False``)."""
    hook = tagc.hook(**ONE_LINE)
    for names, selected in units:
        hook.plan((Segment("+".join(names), 0, 1 << 17, selected=selected),), 1 << 17, WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_weak_selection(hook)
    return [str(w.message) for w in caught]


def test_fsdp1_units_that_compress_only_the_embedding_say_so():
    root = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    block = [f"transformer.h.0.{leaf}" for leaf in ("ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight",
                                                     "mlp.c_fc.weight", "mlp.c_proj.weight")]
    caught = _fsdp1_warnings([(root, True), (block, False)])
    assert len(caught) == 1 and "only the embedding / LM head" in caught[0]
    assert _fsdp1_warnings([(root, True), (block, True)]) == []
    assert _fsdp1_warnings([(root + block, True)]) == []  # one unit for the whole model: the blocks too
    caught = _fsdp1_warnings([(root, False), (block, False)])
    assert len(caught) == 1 and caught[0].startswith("TAGC compresses nothing")
