"""GPT-2's BPE through ``tiktoken``, from the ranks shipped in ``openai-whisper`` (byte-identical to tiktoken's
``r50k_base``, checked by hash): no download."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path
from typing import Optional

try:
    import tiktoken
    import tiktoken.load
except ImportError:  # reading prepared token files needs no tokenizer: the error waits for the first encoding
    tiktoken = None

from gpt2_bench.assets import OFFLINE_ASSETS_PIP, DataError, ensure_offline_assets, whisper_bpe_path

EOT_TOKEN = 50256  # <|endoftext|>
GPT2_VOCAB = 50257
# tiktoken's r50k_base / gpt2 pre-tokenisation pattern and the sha256 of its ranks file.
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def _check_gpt2(enc: tiktoken.Encoding) -> tiktoken.Encoding:
    """Refuse anything that is not GPT-2's BPE (vocabulary size, known ids, end-of-text id)."""
    if enc.n_vocab != GPT2_VOCAB or enc.eot_token != EOT_TOKEN or enc.encode_ordinary("Hello world") != [15496, 995]:
        raise DataError(f"tokenizer {enc.name!r} is not GPT-2's BPE (n_vocab={enc.n_vocab}, eot={enc.eot_token})")
    return enc


def load_whisper_bpe(path: Optional[Path] = None) -> tiktoken.Encoding:
    """GPT-2's BPE built from the ranks file shipped in ``openai-whisper`` (checked against r50k_base's hash)."""
    path = path or whisper_bpe_path()
    if path is None:
        ensure_offline_assets(bpe=True, corpus=False)
    assert path is not None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != R50K_SHA256:
        raise DataError(f"{path} is not GPT-2's BPE ranks file (sha256 {digest}, expected r50k_base's {R50K_SHA256})")
    ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    enc = tiktoken.Encoding(name="gpt2", pat_str=R50K_PAT_STR, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": EOT_TOKEN}, explicit_n_vocab=GPT2_VOCAB)
    return _check_gpt2(enc)


@lru_cache(maxsize=None)
def _tokenizer() -> tuple[tiktoken.Encoding, str]:
    if tiktoken is None:
        raise DataError("tokenising needs tiktoken, which is not installed: pip install tiktoken")
    path = whisper_bpe_path()
    if path is None:
        raise DataError(f"GPT-2 BPE unavailable: the offline copy is not installed.\nInstall it with:\n"
                        f"    {OFFLINE_ASSETS_PIP}")
    return load_whisper_bpe(path), f"openai-whisper:{path.name}"


def get_tokenizer() -> tiktoken.Encoding:
    """GPT-2's BPE from the offline copy in ``openai-whisper``."""
    return _tokenizer()[0]


def tokenizer_source() -> str:
    """Where :func:`get_tokenizer` got its ranks from (recorded in ``meta.json``)."""
    return _tokenizer()[1]
