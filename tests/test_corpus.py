"""Appendix A.1, a corpus prepared once: `prepare` + `ShardedCorpus` give chapter 8's `make_examples` ids
for every pair, the batches from the lengths alone are `epoch_batches`' (and chapter 1's `token_batches'`),
two processes' shares are disjoint and cover the epoch, and bad corpora are one-line errors."""
import gzip
import json
import random

import numpy as np
import pytest

from transformer.data import DataError, load_multi30k, multi30k_dir
from transformer.engine.corpus import ShardedCorpus, length_batches, main, prepare, sample_texts
from transformer.engine.loop import my_pieces
from transformer.tokens import Tokenizer, token_batches
from transformer.training import collate, epoch_batches, make_examples

N = 2000                         # a slice of Multi30k's training set: the fast lane


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory, multi30k):
    "The slice as a gzipped source file, a plain target file, both split in two plain files, and a tokenizer."
    tmp = tmp_path_factory.mktemp("corpus")
    pairs = load_multi30k("de", "en", "train")[:N]
    with gzip.open(tmp / "src.de.gz", "wt", encoding="utf-8") as f:
        f.writelines(s + "\n" for s, _ in pairs)
    (tmp / "tgt.en").write_text("".join(t + "\n" for _, t in pairs))
    (tmp / "tgt1.en").write_text("".join(t + "\n" for _, t in pairs[:N // 2]))
    (tmp / "tgt2.en").write_text("".join(t + "\n" for _, t in pairs[N // 2:]))
    (tmp / "src1.de").write_text("".join(s + "\n" for s, _ in pairs[:N // 2]))
    (tmp / "src2.de").write_text("".join(s + "\n" for s, _ in pairs[N // 2:]))
    tokenizer = Tokenizer.train([s for p in pairs for s in p], vocab_size=500)
    return tmp, pairs, tokenizer


@pytest.fixture(scope="module")
def prepared(corpus_files):
    tmp, pairs, tokenizer = corpus_files
    out = prepare([tmp / "src1.de", tmp / "src2.de"], [tmp / "tgt1.en", tmp / "tgt2.en"], tmp / "out",
                  tokenizer=tokenizer, shard_pairs=700, chunk_pairs=300, quiet=True)
    return ShardedCorpus(out), make_examples(tokenizer, pairs)


def test_every_pair_has_make_examples_ids(prepared):
    corpus, examples = prepared
    assert len(corpus) == len(examples) == N and len(corpus.index) == 3        # 700 + 700 + 600
    assert [corpus.pair(i) for i in range(N)] == examples
    assert corpus.dtype == np.uint16 and corpus[-1] == examples[-1]
    assert corpus.src_lengths.tolist() == [len(s) for s, _ in examples]
    src, tgt = collate(corpus, [5, 17, 3])
    want = collate(examples, [5, 17, 3])
    assert src.equal(want[0]) and tgt.equal(want[1])


def test_gzipped_and_plain_files_give_the_same_corpus(corpus_files, prepared, tmp_path):
    tmp, _, tokenizer = corpus_files
    tokenizer.save(tmp_path / "tok.model")
    other = ShardedCorpus(prepare(tmp / "src.de.gz", tmp / "tgt.en", tmp_path / "gz",
                                  tokenizer=tmp_path / "tok.model", quiet=True))
    corpus, _ = prepared
    assert [other.pair(i) for i in range(0, N, 97)] == [corpus.pair(i) for i in range(0, N, 97)]
    assert other.manifest["tokenizer"]["sha256"] == corpus.manifest["tokenizer"]["sha256"]


@pytest.mark.parametrize("seed,epoch", [(0, 0), (1, 3)])
@pytest.mark.parametrize("pieces", [1, 4])
def test_batches_equal_epoch_batches(prepared, seed, epoch, pieces):
    corpus, examples = prepared
    want = epoch_batches(examples, 600, seed, epoch, pieces)
    got = corpus.epoch_batches(600, seed, epoch, pieces)
    assert len(want) > 10 and [[p.tolist() for p in step] for step in got] == want


@pytest.mark.parametrize("options", [dict(shuffle=False), dict(max_sentences=7, seed=5),
                                     dict(seed=2), dict(seed=9, max_tokens=131)])
def test_length_batches_equal_token_batches(prepared, options):
    _, examples = prepared
    src, tgt = [s for s, _ in examples], [t for _, t in examples]
    options = {"max_tokens": 300, **options}
    want = token_batches(src, tgt, **options)
    got = length_batches([len(s) for s in src], [len(t) for t in tgt], **options)
    assert [b.tolist() for b in got] == want


def test_length_batches_refuse_what_token_batches_refuse():
    for args in (([5, 90], [3, 4], 37), ([], [], 10), ([1], [1, 2], 10), ([1], [1], 0)):
        with pytest.raises(ValueError) as want:
            token_batches([[0] * n for n in args[0]], [[0] * n for n in args[1]], args[2])
        with pytest.raises(ValueError) as got:
            length_batches(*args)
        assert str(got.value).split()[:2] == str(want.value).split()[:2]


def test_two_ranks_share_the_epoch_disjointly(prepared):
    corpus, _ = prepared
    steps = corpus.epoch_batches(600, 0, 0, pieces=4)
    shares = [[i for step in steps for p in my_pieces(step, rank, 2) for i in p.tolist()] for rank in (0, 1)]
    every = [i for step in steps for p in step for i in p.tolist()]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(every) and len(set(every)) == len(every) > 0.95 * N


def test_the_sample_is_chapter_10_1s_text_when_the_corpus_is_smaller():
    pairs = [(f"s{i}", f"t{i}") for i in range(10)]
    assert sample_texts(pairs, 100) == [x for p in pairs for x in p]
    sample = sample_texts(((f"s{i}", f"t{i}") for i in range(10_000)), 50, seed=1)
    assert len(sample) == 50 == len(set(sample)) and sample == sample_texts(
        ((f"s{i}", f"t{i}") for i in range(10_000)), 50, seed=1)
    assert max(int(x[1:]) for x in sample) > 1000                   # not the first 50


def test_prepare_trains_chapter_10_1s_tokenizer_on_a_small_corpus(corpus_files, tmp_path):
    tmp, pairs, _ = corpus_files
    corpus = ShardedCorpus(prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path, vocab_size=300, quiet=True))
    assert corpus.tokenizer == Tokenizer.train([s for p in pairs[:N // 2] for s in p], vocab_size=300)
    assert corpus.manifest["tokenizer"]["trained_on"] == "sample"


def test_pairs_with_an_empty_side_are_skipped_as_in_appendix_a(tmp_path, corpus_files):
    _, _, tokenizer = corpus_files
    (tmp_path / "a").write_text("Ein Hund.\n\nZwei Katzen.\n")
    (tmp_path / "b").write_text("A dog.\nNothing.\nTwo cats.")            # no final newline
    with pytest.warns(UserWarning, match="skipped 1 of 3 pairs"):
        corpus = ShardedCorpus(prepare(tmp_path / "a", tmp_path / "b", tmp_path / "out",
                                       tokenizer=tokenizer, quiet=True))
    assert [corpus.pair(i) for i in range(len(corpus))] == make_examples(
        tokenizer, [("Ein Hund.", "A dog."), ("Zwei Katzen.", "Two cats.")])


def one_line(e) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


def test_misaligned_files_are_refused_by_name(corpus_files, tmp_path):
    tmp, pairs, tokenizer = corpus_files
    (tmp_path / "short.de").write_text("".join(s + "\n" for s, _ in pairs[:N // 2 - 1]))
    with pytest.raises(DataError) as e:
        prepare([tmp / "src1.de", tmp_path / "short.de"], [tmp / "tgt1.en", tmp / "tgt2.en"],
                tmp_path / "out", tokenizer=tokenizer)
    assert one_line(e) == (f"line counts differ: {tmp_path / 'short.de'} has {N // 2 - 1} lines, "
                           f"{tmp / 'tgt2.en'} has {N // 2} lines; line i of one file must translate "
                           "line i of the other")
    with pytest.raises(DataError, match="2 source files but 1 target files"):
        prepare([tmp / "src1.de", tmp / "src2.de"], [tmp / "tgt1.en"], tmp_path / "out")
    with pytest.raises(DataError, match="no such file"):
        prepare([tmp_path / "missing.de"], [tmp / "tgt1.en"], tmp_path / "out")
    (tmp_path / "fake.gz").write_text("not gzip\n")
    with pytest.raises(DataError, match="not a gzip file"):
        prepare([tmp_path / "fake.gz"], [tmp / "tgt1.en"], tmp_path / "out")
    with pytest.raises(ValueError, match="vocab_size=0"):
        prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path / "out", vocab_size=0)


@pytest.mark.parametrize("damage", ["truncate", "alter", "delete", "manifest"])
def test_a_damaged_corpus_is_one_line_naming_the_file(corpus_files, tmp_path, damage):
    tmp, _, tokenizer = corpus_files
    out = prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path / "c", tokenizer=tokenizer, quiet=True)
    shard = out / "src-00000.npy"
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        shard.write_bytes(data[:-2])
    elif damage == "alter":
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (out / "manifest.json").write_text("{")
    with pytest.raises(DataError) as e:
        ShardedCorpus(out)
    message = one_line(e)
    assert str(out / ("manifest.json" if damage == "manifest" else "src-00000.npy")) in message
    assert "re-run prepare" in message
    if damage == "alter":
        assert len(ShardedCorpus(out, verify=False)) == N // 2       # sizes only: the change is not seen
    with pytest.raises(DataError, match="no such file; run prepare"):
        ShardedCorpus(tmp_path / "nothing")


def test_the_command(corpus_files, tmp_path, capsys):
    tmp, _, tokenizer = corpus_files
    tokenizer.save(tmp_path / "tok.model")
    assert main(["--src-files", str(tmp / "src1.de"), "--tgt-files", str(tmp / "tgt1.en"),
                 "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok.model"), "--quiet"]) == 0
    assert capsys.readouterr().out.startswith(f"{N // 2:,} pairs in 1 shard, vocabulary 500 (uint16)")
    assert main(["--src-files", str(tmp / "src1.de"), "--tgt-files", str(tmp / "src.de.gz"),
                 "--out", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: line counts differ") and "src.de.gz" in err


def test_python_m_transformer_prepare_runs_the_command(corpus_files, tmp_path, capsys):
    "`python -m transformer prepare ...` reaches `main` (transformer/__main__.py hands it over)."
    from transformer.__main__ import main as cli
    tmp, _, tokenizer = corpus_files
    tokenizer.save(tmp_path / "tok.model")
    assert cli(["prepare", "--src-files", str(tmp / "src2.de"), "--tgt-files", str(tmp / "tgt2.en"),
                "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok.model"), "--quiet"]) == 0
    assert (tmp_path / "out" / "manifest.json").exists() and len(ShardedCorpus(tmp_path / "out")) == N // 2
    assert cli(["prepare", "--src-files", str(tmp_path / "missing.de"), "--tgt-files", str(tmp / "tgt2.en"),
                "--out", str(tmp_path / "bad")]) == 1
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_all_of_multi30k_train(multi30k, tmp_path):
    "The whole training set: every pair and the batches of two seeds (seconds; the notebook shows it too)."
    d = multi30k_dir()
    pairs = load_multi30k("de", "en", "train")
    tokenizer = Tokenizer.train([s for p in random.Random(0).sample(pairs, 3000) for s in p], vocab_size=2000)
    corpus = ShardedCorpus(prepare([d / "train.de.gz"], [d / "train.en.gz"], tmp_path, tokenizer=tokenizer,
                                   shard_pairs=8000, quiet=True))
    examples = make_examples(tokenizer, pairs)
    assert [corpus.pair(i) for i in range(len(corpus))] == examples
    for seed, pieces in ((0, 1), (4, 4)):
        assert [[p.tolist() for p in s] for s in corpus.epoch_batches(4000, seed, 2, pieces)] == \
            epoch_batches(examples, 4000, seed, 2, pieces)


# --- training reads a prepared corpus (issue 32, phase 2) ------------------------------------------

def test_collate_is_chapter_8s_collate_across_shards_and_with_max_len(prepared, corpus_files):
    corpus, examples = prepared
    rng = np.random.default_rng(0)
    for _ in range(10):
        idx = rng.choice(N, 40, replace=False)                    # pairs of all three shards, in any order
        for got, want in zip(corpus.collate(idx), collate(examples, idx.tolist()), strict=True):
            assert got.dtype == want.dtype and got.equal(want)
    with pytest.warns(UserWarning, match=r"dropped \d+ of 2000 pairs longer than max_len=20 tokens") as said:
        short = ShardedCorpus(corpus.dir, max_len=20)              # as make_examples(..., max_len=20)
        kept = make_examples(corpus_files[2], corpus_files[1], 20)
    assert len(said) == 2 and str(said[0].message) == str(said[1].message)   # the same words
    assert 0 < len(short) == len(kept) < N and [short[i] for i in range(len(short))] == kept
    assert short.src_lengths.tolist() == [len(s) for s, _ in kept]
    idx = rng.choice(len(short), 40, replace=False)
    assert all(a.equal(b) for a, b in zip(short.collate(idx), collate(kept, idx.tolist()), strict=True))
    assert [p.tolist() for step in short.epoch_batches(600, 1, 2) for p in step] == [
        p for step in epoch_batches(kept, 600, 1, 2) for p in step]


def test_held_out_pairs_are_kept_as_text(corpus_files, tmp_path):
    tmp, pairs, tokenizer = corpus_files
    out = prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path / "c", tokenizer=tokenizer, quiet=True,
                  val_files=(tmp / "src2.de", tmp / "tgt2.en"), test_files=[tmp / "src.de.gz", tmp / "tgt.en"])
    corpus = ShardedCorpus(out)
    assert corpus.split("val") == pairs[N // 2:] and corpus.split("test") == pairs
    (out / "val.tgt.txt").write_text("changed\n")
    with pytest.raises(DataError, match="val.tgt.txt: .*re-run prepare"):
        corpus.split("val")
    bare = ShardedCorpus(prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path / "bare",
                                 tokenizer=tokenizer, quiet=True))
    with pytest.raises(DataError) as e:
        bare.split("test")
    assert one_line(e).endswith("holds no test pairs; run prepare again with --test-files SRC TGT")
    with pytest.raises(DataError, match="line counts differ"):               # before any work
        prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path / "x", tokenizer=tokenizer,
                val_files=(tmp / "src1.de", tmp / "tgt.en"))
    assert not (tmp_path / "x").exists()
    with pytest.raises(DataError, match="give two"):
        prepare([tmp / "src1.de"], [tmp / "tgt1.en"], tmp_path / "x", val_files=tmp / "src1.de")


def _tiny(vocab=500):
    import torch

    from transformer.model import Transformer, TransformerConfig
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab=vocab, tgt_vocab=vocab, d_model=32, d_ff=64, h=4,
                                         n_layers=1, dropout=0.0, max_len=64, norm_first=True))


def _quick(**kw):
    from transformer.engine.loop import RunConfig
    return RunConfig(**{**dict(batch_tokens=1200, max_steps=6, warmup=10, eval_every=3, log_every=1), **kw})


def _losses(result):
    return [r["loss"] for r in result.history if r["kind"] == "train"]


def _logging(corpus):
    "The corpus, with every piece it collates recorded in `corpus.read`."
    corpus.read, collate_ = [], corpus.collate
    corpus.collate = lambda idx, device=None: (corpus.read.append(np.asarray(idx).tolist()),
                                                collate_(idx, device))[1]
    return corpus


def _open64(directory):
    "The prepared slice opened for a model of max_len 64, which says how many pairs it leaves out."
    with pytest.warns(UserWarning, match=r"dropped \d+ of 2000 pairs longer than max_len=64 tokens"):
        return ShardedCorpus(directory, max_len=64)


@pytest.fixture(scope="module")
def long_corpus(prepared):
    "The prepared slice opened for a model of max_len 64, and make_examples' list of the same pairs."
    corpus, examples = prepared
    return _open64(corpus.dir), [e for e in examples if max(map(len, e)) <= 64]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")       # a tiny model: a second thread only waits on a busy machine
def test_training_on_a_prepared_corpus_is_training_on_its_examples(long_corpus, tmp_path):
    from transformer.engine.loop import train
    corpus, examples = long_corpus
    a = train(m := _tiny(), examples, examples[:50], _quick(accum_steps=2), progress=False)
    b = train(n := _tiny(), corpus, examples[:50], _quick(accum_steps=2), progress=False)
    assert _losses(a) == _losses(b) and len(_losses(a)) == 6
    assert a.tokens == b.tokens and all(x.equal(y) for x, y in zip(m.parameters(), n.parameters()))
    assert [r["val_loss"] for r in a.history if r["kind"] == "eval"] == [
        r["val_loss"] for r in b.history if r["kind"] == "eval"]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")       # a tiny model: a second thread only waits on a busy machine
def test_resume_in_the_middle_of_an_epoch_continues_with_the_next_batch(long_corpus, tmp_path):
    from transformer.engine.loop import train
    corpus, _ = long_corpus
    config = _quick(batch_tokens=800, max_steps=8, eval_every=4)
    whole = train(_tiny(), _logging(_open64(corpus.dir)), None, config,
                  out_dir=tmp_path / "whole", progress=False)
    steps = corpus.epoch_batches(800, 0, 0)
    assert len(steps) > 8                                           # step 4 is mid-epoch
    train(_tiny(), corpus, None, _quick(batch_tokens=800, max_steps=4, eval_every=4),
          out_dir=tmp_path / "cut", progress=False)
    resumed_corpus = _logging(_open64(corpus.dir))
    resumed = train(_tiny(), resumed_corpus, None, config, out_dir=tmp_path / "cut", resume=True,
                    progress=False)
    assert resumed_corpus.read[0] == steps[4][0].tolist()           # the next batch, not the epoch's first
    assert resumed_corpus.read == [p.tolist() for step in steps[4:8] for p in step]
    assert _losses(resumed) == _losses(whole)[4:]


def _ddp_worker(rank, world_size, port, corpus_dir, out):
    import torch
    import torch.distributed as dist

    from transformer.engine.loop import train
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        corpus = _logging(ShardedCorpus(corpus_dir, max_len=64))
        result = train(_tiny(), corpus, None, _quick(max_steps=4, eval_every=4), progress=False)
        torch.save({"read": corpus.read, "losses": _losses(result)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")       # a tiny model: a second thread only waits on a busy machine
def test_two_gloo_processes_read_disjoint_shares_of_each_step(long_corpus, tmp_path):
    "Each process reads only its pieces from the shards; together they are the steps, and the losses are one process's."
    import socket

    import torch
    import torch.multiprocessing as mp

    from transformer.engine.loop import train
    corpus, examples = long_corpus
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked, not spawned: torch and this package come imported (a spawned process imports them
    # again, seconds of CPU each); each process sets one thread before its first torch op
    mp.start_processes(_ddp_worker, args=(2, port, str(corpus.dir), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    steps = corpus.epoch_batches(1200, 0, 0, pieces=2)[:4]
    for rank, got in enumerate(ranks):
        assert got["read"] == [p.tolist() for step in steps for p in my_pieces(step, rank, 2)]
    read = [[i for p in r["read"] for i in p] for r in ranks]
    assert not set(read[0]) & set(read[1])
    assert sorted(read[0] + read[1]) == sorted(i for step in steps for p in step for i in p.tolist())
    one = train(_tiny(), examples, None, _quick(max_steps=4, eval_every=4, accum_steps=2), progress=False)
    for got in ranks:
        assert got["losses"] == pytest.approx(_losses(one), rel=1e-5)


# --- WMT14 from the release's archives (tested on local archives only) -------------------------------

def _wmt14_archives(raw, pairs):
    "The three archives, with the member names of the real ones, each holding a slice of `pairs`."
    import io
    import tarfile

    from transformer.engine.corpus import WMT14_DE_EN
    slices = {}
    for k, (archive, base) in enumerate(WMT14_DE_EN.items()):
        part = pairs[k * 100:(k + 1) * 100]
        prefix = "" if "commoncrawl" in archive else "training/"
        with tarfile.open(raw / archive, "w:gz") as tar:
            for lang, side in (("de", 0), ("en", 1), ("cs", 0)):
                data = "".join(p[side] + "\n" for p in part).encode()
                info = tarfile.TarInfo(f"{prefix}{base.replace('de-en', 'cs-en') if lang == 'cs' else base}.{lang}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        slices[archive] = part
    return slices


def test_wmt14_streams_the_german_english_files_out_of_the_three_archives(corpus_files, tmp_path, capsys):
    from transformer.engine.corpus import wmt14_text
    tmp, pairs, tokenizer = corpus_files
    raw = tmp_path / "raw"
    raw.mkdir()
    slices = _wmt14_archives(raw, pairs)
    en, de = wmt14_text(raw)
    assert [f.name for f in en] == ["europarl-v7.de-en.en", "commoncrawl.de-en.en", "news-commentary-v9.de-en.en"]
    assert [line for f in de for line in f.read_text().splitlines()] == [s for p in slices.values() for s, _ in p]
    sources = json.loads((raw / "de-en" / "sources.json").read_text())
    assert set(sources) == set(slices) and all(len(v) == 64 for v in sources.values())
    tokenizer.save(tmp_path / "tok.model")
    assert main(["--wmt14", str(raw), "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tok.model"),
                 "--quiet"]) == 0
    corpus = ShardedCorpus(tmp_path / "out")
    assert len(corpus) == 300 and corpus[0] == make_examples(tokenizer, [(pairs[0][1], pairs[0][0])])[0]  # en -> de
    capsys.readouterr()
    (raw / "training-parallel-nc-v9.tgz").unlink()
    assert main(["--wmt14", str(raw), "--out", str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "download https://www.statmt.org/wmt14/training-parallel-nc-v9.tgz" in err
    (raw / "training-parallel-nc-v9.tgz").write_bytes(b"\x1f\x8b not really")
    with pytest.raises(DataError, match="not a whole .tgz archive"):
        wmt14_text(raw)
    with pytest.raises(SystemExit):                              # neither files nor --wmt14
        main(["--out", str(tmp_path / "out3")])
