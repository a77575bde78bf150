"""Which parameters TAGC compresses: a policy over parameter names and module types.

Selection is by module role, never by parameter counts. A policy is any callable
``(param_fqn, module) -> bool``; the shipped ones are also reachable by name.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Union

import torch.nn as nn

SelectPolicy = Callable[[str, Optional[nn.Module]], bool]

_ATTENTION_INPUT = re.compile(r"(^|[._])(c_attn|qkv|q_proj|k_proj|v_proj|query|key|value|in_proj\w*|wq|wk|wv)([._]|$)")
_POSITIONAL = re.compile(r"(^|[._])(wpe|pos\w*|position\w*)([._]|$)")


def non_attention_linear(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """GPT-2-style selection (the TAGC paper's): weights of the MLP linears, the attention
    output projection, the token embedding and the LM head. Not the attention QKV
    projection, layer norms, biases or position embeddings."""
    name = fqn.rsplit(".", 1)
    owner, leaf = (name[0], name[1]) if len(name) == 2 else ("", name[0])
    if leaf != "weight":
        return False
    if module is not None and not isinstance(module, (nn.Linear, nn.Embedding)):
        return False
    if module is None and re.search(r"(^|[._])(ln\w*|norm\w*|layernorm\w*)([._]|$)", owner):
        return False
    return not (_ATTENTION_INPUT.search(owner) or _POSITIONAL.search(owner))


def select_all(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Compress every parameter (buckets below the size floor still go plain)."""
    return True


def select_none(fqn: str, module: Optional[nn.Module] = None) -> bool:
    """Compress nothing: the hook becomes the plain (fair) reduce-scatter."""
    return False


POLICIES: dict[str, SelectPolicy] = {
    "non_attention_linear": non_attention_linear,
    "non-attn": non_attention_linear,
    "all": select_all,
    "none": select_none,
}


def resolve_policy(select: Union[str, SelectPolicy]) -> SelectPolicy:
    """A policy from its name or a callable; clear error otherwise."""
    if callable(select):
        return select
    if isinstance(select, str) and select in POLICIES:
        return POLICIES[select]
    raise ValueError(f"select must be a callable (fqn, module) -> bool or one of {sorted(POLICIES)}, got {select!r}")
