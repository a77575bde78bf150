"""Which parameters TAGC compresses: a policy over parameter names and module roles.

Selection is by module role, never by parameter counts, and never by the class that implements
a role: a linear map is a linear map whether it is an ``nn.Linear``, HuggingFace's ``Conv1D``
(GPT-2's, its weight stored transposed as ``[in, out]``) or any other module whose ``weight`` is a
2-D matrix (:func:`is_projection`). A policy is any callable
``(param_fqn, module) -> bool``; the shipped ones are also reachable by name. A policy may
also return a number, the compression ratio of that parameter (``tagc`` and ``topk``), e.g.
a denser embedding and LM head: :func:`ratio_for`.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Union

import torch.nn as nn

SelectPolicy = Callable[[str, Optional[nn.Module]], Union[bool, float]]

_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")
_QKV = frozenset({"q", "k", "v", "qk", "kv", "qkv", "query", "key", "value"})
_FUSED_QKV = frozenset({"cattn", "inproj", "wpack"})  # GPT-2's c_attn, MultiheadAttention's in_proj, Baichuan's W_pack
_POSITIONAL = frozenset({"wpe", "pos", "position", "positions", "positional"})
_EMBEDDING_OR_HEAD = re.compile(
    r"(^|[._])(wte|embed\w*|tok_embeddings|word_embeddings|lm_head|embed_out)([._]|$)|(^|\.)output$", re.IGNORECASE)


def is_projection(module: nn.Module) -> bool:
    """Whether ``module`` is a linear map (a projection or an embedding table): it owns a 2-D
    ``weight`` parameter and is not a normalisation layer.

    By duck typing, so that every implementation of a linear layer counts: ``nn.Linear``,
    ``nn.Embedding``, HuggingFace's ``Conv1D`` (weight ``[in, out]``), quantised or fused
    linears of other libraries. Reads the registered parameter (``module._parameters``), never the
    ``weight`` attribute: under SimpleFSDP that attribute all-gathers the unit."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return True
    weight = getattr(module, "_parameters", {}).get("weight")
    return weight is not None and weight.dim() == 2 and "norm" not in type(module).__name__.lower()


def _words(owner: str) -> list[list[str]]:
    """The lower-case words of each component of a module path, so that a role reads the same whatever the
    case or spelling: ``Q_Proj``, ``qProj`` and ``q_proj`` are ``["q", "proj"]``, ``Wqkv`` and ``WQKV`` are
    ``["wqkv"]``, ``dense_h_to_4h`` is ``["dense", "h", "to", "4", "h"]``."""
    return [[word.lower() for word in _WORD.findall(component)] for component in owner.split(".")]


def _is_attention_input(words: list[str]) -> bool:
    """Whether a module named by ``words`` feeds the attention scores: a query, key or value projection, apart
    (``q_proj``, ``wk``, ``value``; DeepSeek's latent ``q_a_proj``, ``kv_b_proj``) or fused (``qkv_proj``,
    ``query_key_value``, ``Wqkv``, ``c_attn``)."""
    return "".join(words) in _FUSED_QKV or any(w in _QKV or (w[:1] == "w" and w[1:] in _QKV) for w in words)


def non_attention_linear(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """GPT-2-style selection (the TAGC paper's): weights of the MLP linears, the attention
    output projection, the token embedding and the LM head, whatever class implements them
    (:func:`is_projection`). Not the attention input projections, apart or fused (:func:`_is_attention_input`),
    layer norms, biases or position embeddings. Which linear map plays which role is not in the module, so it
    is read from the words of the module's path (:func:`_words`), whatever their case: the spellings of
    HuggingFace's decoder families and of nanoGPT's and Meta's Llama all count. Without ``module`` (FSDP1
    units) by the name alone."""
    owner, _, leaf = fqn.rpartition(".")
    if leaf != "weight":
        return False
    if module is not None and not is_projection(module):
        return False
    words = _words(owner)
    if module is None and any(w.startswith("ln") or "norm" in w for ws in words for w in ws):
        return False
    return not any(_is_attention_input(ws) or _POSITIONAL.intersection(ws) for ws in words)


def is_embedding_or_head(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Whether parameter ``fqn`` is an embedding table or an LM head (tied or not): an
    ``nn.Embedding``, or by the names GPT-2, nanoGPT, Llama and BERT-style models give them
    (``wte``, ``embed_tokens``, ``tok_embeddings``, ``word_embeddings``, ``lm_head``, and a module
    named ``output`` as Meta's Llama names its head; not BERT's ``attention.output.dense``).
    A hook that compresses only these leaves every transformer block plain (:mod:`tagc.hooks.adapters.describe`)."""
    return isinstance(module, nn.Embedding) or bool(_EMBEDDING_OR_HEAD.search(fqn.rsplit(".", 1)[0]))


def non_attention_block_linear(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """:func:`non_attention_linear` without the token embedding and the LM head
    (:func:`is_embedding_or_head`): the MLP linears and attention output projections of the
    transformer blocks only, so that the embedding's share of a codec's loss can be measured apart."""
    return non_attention_linear(fqn, module) and not is_embedding_or_head(fqn, module)


def select_all(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Compress every parameter (buckets below the size floor still go plain)."""
    return True


def select_none(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Compress nothing: the hook becomes the plain (fair) reduce-scatter."""
    return False


POLICIES: dict[str, SelectPolicy] = {
    "non_attention_linear": non_attention_linear,
    "non-attn": non_attention_linear,
    "non_attention_block_linear": non_attention_block_linear,
    "blocks": non_attention_block_linear,
    "all": select_all,
    "none": select_none,
}


def ratio_for(pattern: str, ratio: float, otherwise: Union[str, SelectPolicy] = "non_attention_linear") -> SelectPolicy:
    """A policy that compresses the parameters whose name matches ``pattern`` (``re.search``) at
    ``ratio``, and decides the others by ``otherwise``. E.g. ``ratio_for(r"(^|\\.)(wte|lm_head)\\.", 4)``
    keeps a GPT-2's tied embedding and LM head 2.5x denser than ratio 10 does."""
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 1.0 < float(ratio) < float("inf"):
        raise ValueError(f"ratio must be a finite number > 1, got {ratio!r}")
    matches = re.compile(pattern).search
    base = resolve_policy(otherwise)

    def policy(fqn: str, module: Optional[nn.Module] = None) -> Union[bool, float]:
        return float(ratio) if matches(fqn) else base(fqn, module)

    # the name is the fingerprint every rank compares (TAGCHook.settings)
    policy.__name__ = f"ratio_for({pattern!r}, {float(ratio):g}, {getattr(base, '__name__', repr(base))})"
    return policy


def resolve_policy(select: Union[str, SelectPolicy]) -> SelectPolicy:
    """A policy from its name or a callable; clear error otherwise."""
    if callable(select):
        return select
    if isinstance(select, str) and select in POLICIES:
        return POLICIES[select]
    raise ValueError(f"select must be a callable (fqn, module) -> bool or one of {sorted(POLICIES)}, got {select!r}")
