import pytest
import torch.nn as nn

from tagc.hooks.selection import non_attention_linear, resolve_policy, select_all, select_none

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


def test_policies_by_name():
    assert resolve_policy("all") is select_all and resolve_policy("none") is select_none
    assert resolve_policy("non-attn") is non_attention_linear
    custom = lambda fqn, module: fqn.endswith("c_fc.weight")  # noqa: E731
    assert resolve_policy(custom) is custom
    with pytest.raises(ValueError, match="select must be"):
        resolve_policy("attention-only")
