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

_ATTENTION_INPUT = re.compile(r"(^|[._])(c_attn|qkv|q_proj|k_proj|v_proj|query|key|value|in_proj\w*|wq|wk|wv)([._]|$)")
_POSITIONAL = re.compile(r"(^|[._])(wpe|pos\w*|position\w*)([._]|$)")
_NORM = re.compile(r"(^|[._])(ln\w*|norm\w*|layernorm\w*)([._]|$)")
_EMBEDDING_OR_HEAD = re.compile(
    r"(^|[._])(wte|embed\w*|tok_embeddings|word_embeddings|lm_head|embed_out)([._]|$)|(^|\.)output$")


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
    if weight is None or weight.dim() != 2:
        return False
    return "norm" not in type(module).__name__.lower()


def non_attention_linear(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """GPT-2-style selection (the TAGC paper's): weights of the MLP linears, the attention
    output projection, the token embedding and the LM head, whatever class implements them
    (:func:`is_projection`). Not the attention QKV projection, layer norms, biases or
    position embeddings. Without ``module`` (FSDP1 units) by the name alone."""
    name = fqn.rsplit(".", 1)
    owner, leaf = (name[0], name[1]) if len(name) == 2 else ("", name[0])
    if leaf != "weight":
        return False
    if module is not None and not is_projection(module):
        return False
    if module is None and _NORM.search(owner):
        return False
    return not (_ATTENTION_INPUT.search(owner) or _POSITIONAL.search(owner))


def is_embedding_or_head(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Whether parameter ``fqn`` is an embedding table or an LM head (tied or not): an
    ``nn.Embedding``, or by the names GPT-2, nanoGPT, Llama and BERT-style models give them
    (``wte``, ``embed_tokens``, ``tok_embeddings``, ``word_embeddings``, ``lm_head``, and a module
    named ``output`` as Meta's Llama names its head; not BERT's ``attention.output.dense``).
    A hook that compresses only these leaves every transformer block plain (:mod:`tagc.hooks.describe`)."""
    if isinstance(module, nn.Embedding):
        return True
    return bool(_EMBEDDING_OR_HEAD.search(fqn.rsplit(".", 1)[0]))


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
