import pytest
import torch
import torch.nn as nn

from tagc.hooks.core.selection import (
    is_embedding_or_head,
    is_projection,
    non_attention_block_linear,
    non_attention_linear,
    resolve_policy,
    select_all,
    select_none,
)

GPT2_NAMES = {
    "transformer.wte.weight": (nn.Embedding(10, 4), True),
    "transformer.wpe.weight": (nn.Embedding(10, 4), False),
    "transformer.h.0.ln_1.weight": (nn.LayerNorm(4), False),
    "transformer.h.0.ln_1.bias": (nn.LayerNorm(4), False),
    "transformer.h.0.attn.c_attn.weight": (nn.Linear(4, 12), False),
    "transformer.h.0.attn.c_attn.bias": (nn.Linear(4, 12), False),
    "transformer.h.0.attn.c_proj.weight": (nn.Linear(4, 4), True),
    "transformer.h.0.attn.c_proj.bias": (nn.Linear(4, 4), False),
    "transformer.h.0.mlp.c_fc.weight": (nn.Linear(4, 16), True),
    "transformer.h.0.mlp.c_proj.weight": (nn.Linear(16, 4), True),
    "transformer.ln_f.weight": (nn.LayerNorm(4), False),
    "lm_head.weight": (nn.Linear(4, 10), True),
    "model.layers.3.self_attn.q_proj.weight": (nn.Linear(4, 4), False),
    "model.layers.3.self_attn.o_proj.weight": (nn.Linear(4, 4), True),
}


@pytest.mark.parametrize("name", sorted(GPT2_NAMES))
def test_non_attention_linear_picks_the_papers_layers(name):
    module, expected = GPT2_NAMES[name]
    assert non_attention_linear(name, module) is expected
    assert non_attention_linear(name, None) is expected  # by name alone (FSDP1 units)


@pytest.mark.parametrize("name", sorted(GPT2_NAMES))
def test_block_linears_are_the_non_attention_linears_less_embedding_and_head(name):
    module, in_paper = GPT2_NAMES[name]
    expected = in_paper and name not in ("transformer.wte.weight", "lm_head.weight")
    assert non_attention_block_linear(name, module) is expected
    assert non_attention_block_linear(name, None) is expected


def test_policies_by_name():
    assert resolve_policy("all") is select_all and resolve_policy("none") is select_none
    assert resolve_policy("non-attn") is non_attention_linear
    assert resolve_policy("blocks") is non_attention_block_linear
    custom = lambda fqn, module: fqn.endswith("c_fc.weight")  # noqa: E731
    assert resolve_policy(custom) is custom
    with pytest.raises(ValueError, match="select must be"):
        resolve_policy("attention-only")


class Conv1D(nn.Module):
    """HuggingFace GPT-2's linear layer, as ``transformers.pytorch_utils.Conv1D`` builds it: weight ``[in, out]``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))


class RMSNorm(nn.Module):
    """Llama's norm (``LlamaRMSNorm``): a 1-D weight."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm (optional bias): a 1-D weight."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))


class MatrixNorm(nn.Module):
    """A normalisation layer with a 2-D weight: still a norm, never a projection."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, n))


class GatheringWeight(nn.Module):
    """A module whose ``weight`` attribute is a property that must not be read (SimpleFSDP's all-gathers
    the unit); the registered parameter is what selection looks at."""

    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight", nn.Parameter(torch.empty(4, 8)))
        self.guarded = True

    def __getattr__(self, name):
        if name == "weight" and self.__dict__.get("guarded"):
            raise AssertionError("selection read the weight attribute (a collective under SimpleFSDP)")
        return super().__getattr__(name)


HF_GPT2_NAMES = {  # transformers' GPT2LMHeadModel: Conv1D everywhere in the blocks, lm_head tied to wte
    "transformer.wte.weight": (nn.Embedding(10, 4), True),
    "transformer.wpe.weight": (nn.Embedding(10, 4), False),
    "transformer.h.0.ln_1.weight": (nn.LayerNorm(4), False),
    "transformer.h.0.attn.c_attn.weight": (Conv1D(12, 4), False),
    "transformer.h.0.attn.c_attn.bias": (Conv1D(12, 4), False),
    "transformer.h.0.attn.c_proj.weight": (Conv1D(4, 4), True),
    "transformer.h.0.attn.c_proj.bias": (Conv1D(4, 4), False),
    "transformer.h.0.ln_2.weight": (nn.LayerNorm(4), False),
    "transformer.h.0.mlp.c_fc.weight": (Conv1D(16, 4), True),
    "transformer.h.0.mlp.c_fc.bias": (Conv1D(16, 4), False),
    "transformer.h.0.mlp.c_proj.weight": (Conv1D(4, 16), True),
    "transformer.ln_f.weight": (nn.LayerNorm(4), False),
}

LLAMA_NAMES = {  # transformers' LlamaForCausalLM (untied head)
    "model.embed_tokens.weight": (nn.Embedding(10, 4), True),
    "model.layers.0.input_layernorm.weight": (RMSNorm(4), False),
    "model.layers.0.self_attn.q_proj.weight": (nn.Linear(4, 4, bias=False), False),
    "model.layers.0.self_attn.k_proj.weight": (nn.Linear(4, 2, bias=False), False),
    "model.layers.0.self_attn.v_proj.weight": (nn.Linear(4, 2, bias=False), False),
    "model.layers.0.self_attn.o_proj.weight": (nn.Linear(4, 4, bias=False), True),
    "model.layers.0.post_attention_layernorm.weight": (RMSNorm(4), False),
    "model.layers.0.mlp.gate_proj.weight": (nn.Linear(4, 8, bias=False), True),
    "model.layers.0.mlp.up_proj.weight": (nn.Linear(4, 8, bias=False), True),
    "model.layers.0.mlp.down_proj.weight": (nn.Linear(8, 4, bias=False), True),
    "model.norm.weight": (RMSNorm(4), False),
    "lm_head.weight": (nn.Linear(4, 10, bias=False), True),
}

NANOGPT_NAMES = {  # karpathy/nanoGPT's model.py: its own LayerNorm, lm_head tied to wte (named once, as wte)
    "transformer.wte.weight": (nn.Embedding(10, 4), True),
    "transformer.wpe.weight": (nn.Embedding(10, 4), False),
    "transformer.h.0.ln_1.weight": (LayerNorm(4), False),
    "transformer.h.0.ln_1.bias": (LayerNorm(4), False),
    "transformer.h.0.attn.c_attn.weight": (nn.Linear(4, 12), False),
    "transformer.h.0.attn.c_proj.weight": (nn.Linear(4, 4), True),
    "transformer.h.0.mlp.c_fc.weight": (nn.Linear(4, 16), True),
    "transformer.h.0.mlp.c_proj.weight": (nn.Linear(16, 4), True),
    "transformer.h.0.mlp.c_proj.bias": (nn.Linear(16, 4), False),
    "transformer.ln_f.weight": (LayerNorm(4), False),
    "lm_head.weight": (nn.Linear(4, 10, bias=False), True),
}


@pytest.mark.parametrize("table, name", [(table, name) for table in ("hf_gpt2", "llama", "nanogpt")
                                         for name in sorted({"hf_gpt2": HF_GPT2_NAMES, "llama": LLAMA_NAMES,
                                                             "nanogpt": NANOGPT_NAMES}[table])])
def test_non_attention_linear_selects_by_role_in_real_models(table, name):
    module, expected = {"hf_gpt2": HF_GPT2_NAMES, "llama": LLAMA_NAMES, "nanogpt": NANOGPT_NAMES}[table][name]
    assert non_attention_linear(name, module) is expected
    assert non_attention_linear(name, None) is expected  # by name alone (FSDP1 units)


def test_transformers_conv1d_is_a_projection():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils", reason="needs transformers (the [test] extra)")
    conv = pytorch_utils.Conv1D(16, 4)
    assert tuple(conv.weight.shape) == (4, 16)  # transposed against nn.Linear's [out, in]
    assert is_projection(conv)
    assert non_attention_linear("transformer.h.3.mlp.c_fc.weight", conv) is True
    assert non_attention_linear("transformer.h.3.attn.c_attn.weight", conv) is False


def test_is_projection_by_duck_typing():
    assert is_projection(nn.Linear(4, 4)) and is_projection(nn.Embedding(4, 4)) and is_projection(Conv1D(4, 4))
    assert not is_projection(nn.LayerNorm(4)) and not is_projection(RMSNorm(4)) and not is_projection(LayerNorm(4))
    assert not is_projection(nn.RMSNorm(4))
    assert not is_projection(MatrixNorm(4))  # a 2-D weight, but a norm by class
    assert not is_projection(nn.Conv2d(2, 2, 3))  # a 4-D weight
    assert not is_projection(nn.ReLU())  # no weight
    assert is_projection(GatheringWeight())  # read from _parameters, never through the attribute
    assert non_attention_linear("blocks.0.ff.weight", GatheringWeight()) is True


@pytest.mark.parametrize("name, module, expected", [
    ("transformer.wte.weight", nn.Embedding(4, 4), True),
    ("lm_head.weight", nn.Linear(4, 4), True),
    ("model.embed_tokens.weight", nn.Embedding(4, 4), True),
    ("output.weight", nn.Linear(4, 4), True),  # Meta's Llama names its head `output`
    ("bert.embeddings.word_embeddings.weight", None, True),
    ("transformer.h.0.mlp.c_fc.weight", Conv1D(4, 4), False),
    ("model.layers.0.self_attn.o_proj.weight", nn.Linear(4, 4), False),
    ("bert.encoder.layer.0.attention.output.dense.weight", nn.Linear(4, 4), False),
])
def test_is_embedding_or_head(name, module, expected):
    assert is_embedding_or_head(name, module) is expected
