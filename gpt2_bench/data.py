"""Offline-first data for the GPT-2 benchmark: GPT-2 BPE tokens in nanoGPT's uint16 ``.bin`` files.

This module prepares and serves the tokens; the packages that carry the data are :mod:`gpt2_bench.assets`, the
tokenizer :mod:`gpt2_bench.tokenizer`, the sources (``prepare(dataset=...)``: ``"bbc"``, the default, ``"mix"`` or
local files) :mod:`gpt2_bench.corpora`.

Documents are separated by ``<|endoftext|>``; every ``val_every``-th document goes to
``val.bin`` (a fixed, deterministic split: whole documents, never token offsets). The cache
directory holds ``train.bin``, ``val.bin`` and ``meta.json``; ``meta.json`` is written last, so
its presence marks a complete preparation.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np
import torch

from gpt2_bench.assets import OFFLINE_ASSETS_PIP, DataError
from gpt2_bench.corpora import CORPUS_NAMES, Corpus, resolve_corpus
from gpt2_bench.tokenizer import EOT_TOKEN, get_tokenizer, tokenizer_source

if TYPE_CHECKING:
    import tiktoken

__all__ = ["prepare", "TokenData", "load_meta", "default_cache_dir", "DataError", "EOT_TOKEN", "OFFLINE_ASSETS_PIP"]

_WRITE_BATCH = 512  # documents per tokenizer call


# ----------------------------------------------------------------------------- preparation


def default_cache_dir() -> Path:
    """``$TAGC_DATA_DIR`` if set, else ``~/.cache/tagc/gpt2_bench``."""
    env = os.environ.get("TAGC_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tagc" / "gpt2_bench"


def prepare(dataset: Union[str, Sequence[str]] = "bbc", cache_dir: Optional[Union[str, Path]] = None,
            val_every: Optional[int] = None, force: bool = False, progress: bool = True, **corpus_kwargs: Any) -> Path:
    """Tokenise ``dataset`` once into ``<cache_dir>/<name>/{train,val}.bin`` + ``meta.json``; return that folder.

    Reuses an existing preparation made with the same settings unless ``force``. Document ``i``
    goes to validation when ``i % val_every == val_every - 1`` (default 20, i.e. 5%).
    ``dataset`` may also be a prepared folder (one holding ``meta.json``, e.g. copied to a machine that
    lacks the corpus' packages): it is returned as it is, its splits checked when read.
    """
    if _is_prepared_folder(dataset):
        if force:
            raise ValueError(f"{dataset} is a prepared folder: it cannot be prepared again (force=True); "
                             "prepare its corpus by name instead")
        return Path(dataset).expanduser()
    corpus = resolve_corpus(dataset, **corpus_kwargs)
    val_every = val_every or 20
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
            raise DataError(f"corpus {corpus.name!r} is too small: {counts['documents']} non-empty documents gave "
                            f"{counts['train_tokens']} train / {counts['val_tokens']} val tokens "
                            f"(val: every {val_every}th document)")
        (out / "meta.json").unlink(missing_ok=True)  # incomplete until rewritten
        for split in ("train", "val"):
            (out / f"{split}.bin.{os.getpid()}.tmp").replace(out / f"{split}.bin")
        meta = {"dataset": corpus.name, "tokenizer": "gpt2", "tokenizer_source": tokenizer_source(),
                "vocab_size": enc.n_vocab, "eot_token": EOT_TOKEN, "dtype": "uint16", "config": config, **counts}
        tmp = out / f"meta.json.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.replace(out / "meta.json")
    return out


def _is_prepared_folder(dataset: Any) -> bool:
    """Whether ``dataset`` names a prepared folder (holding ``meta.json``), not a corpus: a corpus name such as
    ``mix`` is always the corpus, whatever folder of that name the working directory holds."""
    return (isinstance(dataset, (str, Path)) and str(dataset) not in CORPUS_NAMES
            and (Path(dataset).expanduser() / "meta.json").is_file())


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
    counts = dict.fromkeys(("documents", "skipped_empty", "train_documents", "val_documents", "train_tokens",
                            "val_tokens"), 0)
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
        raise DataError(f"{data_dir} is not a prepared dataset (no meta.json); run "
                        "`python -m gpt2_bench.data --dataset ...`")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"corrupt {path}: {exc}; re-run preparation with --force") from exc


class TokenData:
    """A prepared dataset: memory-mapped ``train``/``val`` token streams, train batches read without replacement and
    one fixed eval set."""

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

    def windows(self, split: str, block_size: int) -> int:
        """How many non-overlapping windows of ``block_size`` tokens (and their next tokens) ``split`` holds."""
        count = (len(self.tokens(split)) - 1) // block_size
        if count < 1:
            raise DataError(f"{split} split has {len(self.tokens(split))} tokens, too few for block_size {block_size}")
        return count

    def epoch_fraction(self, windows_read: int, block_size: int) -> float:
        """The share of an epoch (one pass over the train split) that ``windows_read`` windows make."""
        return windows_read / self.windows("train", block_size)

    def train_batch(self, step: int, batch_size: int, block_size: int, seed: int,
                    device: Union[str, torch.device] = "cpu", rank: int = 0,
                    world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s windows ``x`` (B, T) for this rank and their next tokens ``y``, int64, on ``device``.

        Sampling without replacement: the train split is cut into non-overlapping windows, and epoch ``e`` reads
        them in the order of a permutation seeded by ``(seed, e)``. Step ``s`` takes the global batch's
        ``batch_size * world_size`` windows from position ``s * batch_size * world_size`` of that sequence, and
        rank ``r`` its own ``batch_size`` slice: no window is read twice within an epoch, ranks see different
        windows and together the single-process global batch, and the batch depends on the step alone, so a
        resumed run reads what an uninterrupted one would.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        count = self.windows("train", block_size)
        first = (step * world_size + rank) * batch_size
        positions = torch.arange(first, first + batch_size)
        epochs = range(first // count, (first + batch_size - 1) // count + 1)
        order = torch.cat([self._permutation(seed, epoch, count) for epoch in epochs])
        windows = order[positions - (first // count) * count]
        return self._windows("train", (windows * block_size).tolist(), block_size, device)

    def eval_batches(
        self, tokens: int, block_size: int, batch_size: int, device: Union[str, torch.device] = "cpu",
        rank: int = 0, world_size: int = 1,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the eval set, in batches of up to ``batch_size`` windows.

        The eval set is the same for every seed, method and batch size: ``tokens // block_size`` windows (rounded
        down to a multiple of ``world_size``, at least one per rank) spread evenly over the whole val split, so
        that every source of a mixed corpus is in it. Rank ``r`` takes windows ``r, r + world_size, ...``.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        length = len(self.tokens("val"))
        count = max(world_size, tokens // block_size // world_size * world_size)
        if length <= block_size:
            raise DataError(f"val split has {length} tokens, too few for block_size {block_size}")
        starts = np.linspace(0, length - block_size - 1, count).astype(np.int64)[rank::world_size].tolist()
        return [self._windows("val", starts[i : i + batch_size], block_size, device)
                for i in range(0, len(starts), batch_size)]

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of epochs per data set, for the data set's life
    def _permutation(self, seed: int, epoch: int, count: int) -> torch.Tensor:
        return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))

    def _windows(self, split: str, starts: list[int], block_size: int,
                 device: Union[str, torch.device]) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.tokens(split)  # a fresh memmap per call, as nanoGPT (avoids a memory leak)
        x = torch.from_numpy(np.stack([data[i : i + block_size].astype(np.int64) for i in starts]))
        y = torch.from_numpy(np.stack([data[i + 1 : i + 1 + block_size].astype(np.int64) for i in starts]))
        device = torch.device(device)
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)


# ----------------------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m gpt2_bench.data --dataset bbc``: prepare (or reuse) a dataset and print its statistics."""
    p = argparse.ArgumentParser(prog="python -m gpt2_bench.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", "--corpus", dest="dataset", nargs="+", default=["bbc"],
                   help="bbc (default, offline), mix (offline, 9.0M tokens), or local file path(s)")
    p.add_argument("--cache-dir", default=None, help=f"default $TAGC_DATA_DIR or {default_cache_dir()}")
    p.add_argument("--val-every", type=int, default=None, help="every N-th document goes to val (default 20)")
    p.add_argument("--hf-cache-dir", default=None, help="where datasets keeps its Arrow copy of local files")
    p.add_argument("--force", action="store_true", help="re-tokenise even if a matching preparation exists")
    args = p.parse_args(argv)
    dataset: Union[str, list[str]] = args.dataset[0] if len(args.dataset) == 1 else args.dataset
    try:
        out = prepare(dataset, cache_dir=args.cache_dir, val_every=args.val_every, force=args.force,
                      hf_cache_dir=args.hf_cache_dir)
        data = TokenData(out)
    except DataError as exc:
        print(f"error: {exc}")
        return 1
    m = data.meta
    print(f"dataset      {m['dataset']}  ({m['config'].get('source')})")
    print(f"folder       {out}")
    print(f"tokenizer    gpt2 BPE from {m['tokenizer_source']}  (vocab {m['vocab_size']})")
    print(f"documents    {m['documents']:,}  (train {m['train_documents']:,}, val {m['val_documents']:,}, "
          f"every {m['config']['val_every']}th; {m['skipped_empty']} empty skipped)")
    print(f"tokens       {m['train_tokens'] + m['val_tokens']:,}  "
          f"(train {m['train_tokens']:,}, val {m['val_tokens']:,})")
    sample = data.tokens("val")[:32].tolist()
    try:
        print(f"val starts   {get_tokenizer().decode(sample)!r}")
    except DataError as err:  # a prepared folder read where no tokenizer is installed
        print(f"val starts   (not decoded: {err})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
