"""The default ``select`` on HuggingFace ``transformers`` decoder families, built from their configs (no download).

Every attention input projection (separate ``q/k/v``, fused ``c_attn``/``qkv_proj``/``query_key_value``/``Wqkv``,
DeepSeek's latent ``q_a/q_b/kv_a/kv_b`` projections) stays plain; every MLP linear and the attention output
projection are compressed, as are the token embedding and an untied LM head (the policy's documented rule);
position embeddings, norms and biases stay plain. The expectations come from an explicit table per family (the
owner module's path, by its last components), never from the library's own code, and every parameter of a
model must be in the table exactly once. The rule must hold whatever the case or spelling of the module names.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable

import pytest
import torch.nn as nn

import tagc
from tagc.hooks.core.selection import resolve_policy

transformers = pytest.importorskip("transformers", reason="needs transformers (the [test] extra)")

DEFAULT_SELECT = resolve_policy(inspect.signature(tagc.hook).parameters["select"].default)

COMPRESSED_ROLES = ("attn_out", "mlp", "embed", "head")
PLAIN_ROLES = ("attn_in", "positional", "norm")

SMALL = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, intermediate_size=128,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GQA = dict(num_key_value_heads=2)

QKV = ("q_proj", "k_proj", "v_proj")
GATED_MLP = ("gate_proj", "up_proj", "down_proj")
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm", "model.norm")


def llama_like(*extra_norms: str, head: tuple[str, ...] = ("lm_head",)) -> dict[str, tuple[str, ...]]:
    """The roles of a Llama-shaped decoder: separate q/k/v, o_proj, a gated MLP, ``embed_tokens``."""
    return dict(attn_in=QKV, attn_out=("o_proj",), mlp=GATED_MLP, embed=("embed_tokens",), head=head,
                norm=LLAMA_NORMS + extra_norms)


# family -> (config class, config overrides, role -> owner-module path suffixes)
FAMILIES: dict[str, tuple[str, dict, dict[str, tuple[str, ...]]]] = {
    "gpt2": ("GPT2Config", {}, dict(
        attn_in=("attn.c_attn",), attn_out=("attn.c_proj",), mlp=("mlp.c_fc", "mlp.c_proj"), embed=("wte",),
        positional=("wpe",), norm=("ln_1", "ln_2", "ln_f"))),
    "llama": ("LlamaConfig", GQA, llama_like()),
    "mistral": ("MistralConfig", GQA, llama_like()),
    "qwen2": ("Qwen2Config", GQA, llama_like()),
    "qwen3": ("Qwen3Config", dict(GQA, head_dim=16), llama_like("q_norm", "k_norm")),
    "gemma": ("GemmaConfig", dict(GQA, head_dim=16), llama_like(head=())),
    "gemma2": ("Gemma2Config", dict(GQA, head_dim=16),
               llama_like("pre_feedforward_layernorm", "post_feedforward_layernorm", head=())),
    "phi": ("PhiConfig", {}, dict(
        attn_in=QKV, attn_out=("self_attn.dense",), mlp=("fc1", "fc2"), embed=("embed_tokens",), head=("lm_head",),
        norm=("input_layernorm", "final_layernorm"))),
    "phi3": ("Phi3Config", GQA, dict(
        attn_in=("qkv_proj",), attn_out=("o_proj",), mlp=("gate_up_proj", "down_proj"), embed=("embed_tokens",),
        head=("lm_head",), norm=LLAMA_NORMS)),
    "gpt_neox": ("GPTNeoXConfig", {}, dict(
        attn_in=("attention.query_key_value",), attn_out=("attention.dense",),
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), embed=("embed_in",), head=("lm_head",),
        norm=("input_layernorm", "post_attention_layernorm", "final_layer_norm"))),
    "falcon": ("FalconConfig", {}, dict(
        attn_in=("self_attention.query_key_value",), attn_out=("self_attention.dense",),
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), embed=("word_embeddings",), norm=("input_layernorm", "ln_f"))),
    "bloom": ("BloomConfig", {}, dict(
        attn_in=("self_attention.query_key_value",), attn_out=("self_attention.dense",),
        mlp=("mlp.dense_h_to_4h", "mlp.dense_4h_to_h"), embed=("word_embeddings",),
        norm=("word_embeddings_layernorm", "input_layernorm", "post_attention_layernorm", "ln_f"))),
    "opt": ("OPTConfig", dict(ffn_dim=128), dict(
        attn_in=QKV, attn_out=("self_attn.out_proj",), mlp=("fc1", "fc2"), embed=("embed_tokens",),
        positional=("embed_positions",), norm=("self_attn_layer_norm", "final_layer_norm"))),
    "gptj": ("GPTJConfig", {}, dict(
        attn_in=QKV, attn_out=("attn.out_proj",), mlp=("mlp.fc_in", "mlp.fc_out"), embed=("wte",), head=("lm_head",),
        norm=("ln_1", "ln_f"))),
    "stablelm": ("StableLmConfig", GQA, llama_like()),
    "starcoder2": ("Starcoder2Config", GQA, dict(
        attn_in=QKV, attn_out=("o_proj",), mlp=("mlp.c_fc", "mlp.c_proj"), embed=("embed_tokens",),
        norm=LLAMA_NORMS)),
    "cohere": ("CohereConfig", GQA, dict(llama_like(head=()), norm=("input_layernorm", "model.norm"))),
    "olmo": ("OlmoConfig", GQA, dict(llama_like(), norm=())),
    "olmo2": ("Olmo2Config", GQA, dict(llama_like(), norm=(
        "q_norm", "k_norm", "post_attention_layernorm", "post_feedforward_layernorm", "model.norm"))),
    "mpt": ("MptConfig", {}, dict(
        attn_in=("attn.Wqkv",), attn_out=("attn.out_proj",), mlp=("ffn.up_proj", "ffn.down_proj"), embed=("wte",),
        norm=("norm_1", "norm_2", "norm_f"))),
    "codegen": ("CodeGenConfig", {}, dict(
        attn_in=("attn.qkv_proj",), attn_out=("attn.out_proj",), mlp=("mlp.fc_in", "mlp.fc_out"), embed=("wte",),
        head=("lm_head",), norm=("ln_1", "ln_f"))),
    "gpt_bigcode": ("GPTBigCodeConfig", {}, dict(
        attn_in=("attn.c_attn",), attn_out=("attn.c_proj",), mlp=("mlp.c_fc", "mlp.c_proj"), embed=("wte",),
        positional=("wpe",), norm=("ln_1", "ln_2", "ln_f"))),
    "deepseek_v3": ("DeepseekV3Config", dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16), dict(
        llama_like("q_a_layernorm", "kv_a_layernorm"),
        attn_in=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"))),
}
FUSED_ATTENTION_INPUT = ("gpt2", "phi3", "gpt_neox", "falcon", "bloom", "mpt", "codegen", "gpt_bigcode", "deepseek_v3")


def fresh(family: str) -> nn.Module:
    """A tiny untrained model of ``family`` from its config class; skips where this transformers lacks the class."""
    config_class, overrides, _ = FAMILIES[family]
    config = getattr(transformers, config_class, None)
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    return transformers.AutoModelForCausalLM.from_config(config(**{**SMALL, **overrides}))


build = functools.cache(fresh)


def role_of(owner: str, roles: dict[str, tuple[str, ...]]) -> str:
    """The one role whose path suffixes match module path ``owner`` at a component boundary."""
    found = [role for role, suffixes in roles.items()
             for suffix in suffixes if owner == suffix or owner.endswith("." + suffix)]
    assert len(found) == 1, f"{owner!r} has roles {found} in the family's table: exactly one expected"
    return found[0]


def expected_compressed(name: str, roles: dict[str, tuple[str, ...]]) -> bool:
    """What the documented rule says of parameter ``name``: the weight of a compressed role, nothing else."""
    owner, _, leaf = name.rpartition(".")
    return role_of(owner, roles) in COMPRESSED_ROLES and leaf == "weight"


def picked_and_plain(family: str, select: Callable = DEFAULT_SELECT) -> tuple[list[str], list[str]]:
    """The parameter names of ``family``'s tiny model that ``select`` compresses, and those it leaves plain."""
    model = build(family)
    modules = dict(model.named_modules())
    names = [name for name, _ in model.named_parameters()]
    picked = [name for name in names if select(name, modules[name.rpartition(".")[0]])]
    return picked, [name for name in names if name not in picked]


def mismatches(model: nn.Module, expected: dict[str, bool]) -> list[str]:
    """Where the default policy, given the owner module or the name alone, disagrees with ``expected``."""
    modules = dict(model.named_modules())
    wrong = []
    for name, _ in model.named_parameters():
        got = (DEFAULT_SELECT(name, modules[name.rpartition(".")[0]]), DEFAULT_SELECT(name, None))
        if got != (expected[name], expected[name]):
            wrong.append(f"{name}: expected {expected[name]}, got {got} (with the module, by name)")
    return wrong


def test_at_least_ten_families_with_fused_attention_inputs():
    assert len(FAMILIES) >= 10 and {"gpt2", "llama"} <= set(FAMILIES)
    assert all(set(roles) <= {*COMPRESSED_ROLES, *PLAIN_ROLES} for _, _, roles in FAMILIES.values())
    assert len(FUSED_ATTENTION_INPUT) >= 4 and set(FUSED_ATTENTION_INPUT) <= set(FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_default_select_by_role(family):
    model = build(family)
    roles = FAMILIES[family][2]
    names = [name for name, _ in model.named_parameters()]
    owners = {name.rpartition(".")[0] for name in names}
    for role, suffixes in roles.items():
        for suffix in suffixes:
            assert any(o == suffix or o.endswith("." + suffix) for o in owners), f"{role} {suffix!r}: not in model"
    assert roles["attn_in"] and roles["attn_out"] and roles["mlp"]
    expected = {name: expected_compressed(name, roles) for name in names}
    assert mismatches(model, expected) == []
    picked, plain = picked_and_plain(family)
    assert picked == [name for name in names if expected[name]] and plain


def camel(name: str) -> str:
    """``name`` in camelCase: ``q_proj`` -> ``qProj``, ``dense_h_to_4h`` -> ``denseHTo4h``."""
    return re.sub(r"_([a-z0-9])", lambda match: match.group(1).upper(), name)


def renamed(family: str, spell: Callable[[str], str]) -> nn.Module:
    """``family``'s tiny model, a fresh one, with every module renamed by ``spell``."""
    model = fresh(family)
    for module in list(model.modules()):
        module._modules = {spell(key): child for key, child in module._modules.items()}
    return model


@pytest.mark.parametrize("spell", [str.upper, str.title, camel], ids=["upper", "title", "camel"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "phi3", "gpt_neox", "mpt", "opt", "codegen", "deepseek_v3"])
def test_default_select_whatever_the_case_of_module_names(family, spell):
    roles = FAMILIES[family][2]
    original = [name for name, _ in build(family).named_parameters()]
    model = renamed(family, spell)
    names = [name for name, _ in model.named_parameters()]
    assert len(names) == len(original) and names != original
    expected = {name: expected_compressed(was, roles) for name, was in zip(names, original, strict=True)}
    assert mismatches(model, expected) == []


ATTENTION_INPUT_SPELLINGS = (
    "Q_Proj", "K_PROJ", "v_Proj", "qProj", "QProj", "QKV", "qkv", "Qkv_Proj", "QKV_PROJ", "qkvProj", "Wqkv", "WQKV",
    "W_qkv", "wq", "WK", "Wv", "query_key_value", "Query_Key_Value", "QueryKeyValue", "QUERY_KEY_VALUE", "Query",
    "KEY", "value", "c_attn", "C_Attn", "cAttn", "in_proj", "W_pack", "Q_A_Proj", "KV_B_Proj", "kvAProjWithMqa", "to_q",
)
COMPRESSED_SPELLINGS = (
    "O_Proj", "OUT_PROJ", "oProj", "OutProj", "Dense", "C_Proj", "cProj", "Wo", "WO", "Up_Proj", "GATE_PROJ",
    "gateUpProj", "Down_Proj", "FC1", "Fc2", "FC_In", "fc_OUT", "Dense_H_To_4H", "DENSE_4H_TO_H", "denseHTo4h",
    "C_FC", "cFc", "W1", "w2", "W3", "Post_Proj", "to_out",
)


@pytest.mark.parametrize("owner, expected", [(name, False) for name in ATTENTION_INPUT_SPELLINGS]
                         + [(name, True) for name in COMPRESSED_SPELLINGS])
def test_default_select_whatever_the_spelling(owner, expected):
    linear = nn.Linear(8, 8)
    model = nn.ModuleDict({"Layers": nn.ModuleList([nn.ModuleDict({"Self_Attn": nn.ModuleDict({owner: linear})})])})
    name = f"Layers.0.Self_Attn.{owner}.weight"
    assert dict(model.named_parameters())[name] is linear.weight
    assert (DEFAULT_SELECT(name, linear), DEFAULT_SELECT(name, None)) == (expected, expected)
