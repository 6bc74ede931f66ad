"""Appendix E.2, engine/loop.py: `SubwordDropout` (BPE-dropout drawn anew each epoch), in the loop and on the command line."""
import json
import os

import pytest
import torch

from transformer.data import load_multi30k
from transformer.engine.loop import RunConfig, SubwordDropout, merge_children, train
from transformer.model import Transformer, TransformerConfig
from transformer.tokens import BOS, EOS, UNK, Tokenizer
from transformer.training import make_examples

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs():
    root = os.environ.get("TRANSFORMER_DATA")
    if not root:
        pytest.fail("set TRANSFORMER_DATA to the directory that holds multi30k/ (CI does)")
    return load_multi30k("de", "en", "val", data_dir=root, download=False)


@pytest.fixture(scope="module")
def tok(pairs):
    return Tokenizer.train([s for p in pairs for s in p], vocab_size=400)


def test_every_merge_splits_into_two_pieces_of_the_vocabulary(tok):
    children = merge_children(tok)
    assert len(children) == len(tok)
    for i, c in enumerate(children):
        piece = tok.id_to_piece(i)
        if c is None:          # special pieces and single characters cannot be split
            assert i < 4 or len(piece) == 1
        else:
            assert tok.id_to_piece(c[0]) + tok.id_to_piece(c[1]) == piece and UNK not in c


def test_each_epoch_is_a_new_segmentation_of_the_same_text(tok, pairs):
    data = SubwordDropout(tok, pairs, 0.2, seed=3)
    fixed = make_examples(tok, pairs)
    assert data.fixed == fixed and len(data) == len(pairs)
    e0, e1 = list(data(0)), list(data(1))
    assert len(e0) == len(e1) == len(pairs)
    assert e0 != e1 and e0 != fixed                       # new draws each epoch
    for (s, t), (fs, ft) in zip(e1, fixed, strict=True):  # the pieces change, never the text
        assert tok.decode(s) == tok.decode(fs) and tok.decode(t) == tok.decode(ft)
        assert s[-1] == fs[-1] == EOS and t[0] == ft[0] == BOS and t[-1] == EOS
        assert len(s) >= len(fs) and len(t) >= len(ft)   # undoing merges only splits
    grown = sum(len(s) for s, _ in e0) / sum(len(s) for s, _ in fixed)
    assert 1.05 < grown < 1.6


def test_p_is_the_chance_that_a_piece_splits(tok, pairs):
    "A piece of several characters stays whole with probability 1 - p (the share of pieces that come out as one)."
    import numpy as np
    data, rng = SubwordDropout(tok, pairs, 0.3), np.random.default_rng(0)
    pieces = np.array([i for s, t in data.fixed for i in s + t if data.children[i] is not None])
    out, owner = data._split(pieces, rng)
    whole = np.bincount(owner, minlength=len(pieces)) == 1
    assert len(pieces) > 10_000 and abs(whole.mean() - 0.7) < 0.015
    for k in np.flatnonzero(~whole)[:50]:                  # a split piece's parts spell it, left to right
        assert "".join(tok.id_to_piece(int(i)) for i in out[owner == k]) == tok.id_to_piece(int(pieces[k]))


def test_draws_depend_on_seed_and_epoch_only(tok, pairs):
    a, b = SubwordDropout(tok, pairs, 0.2, seed=3), SubwordDropout(tok, pairs, 0.2, seed=3)
    first = list(a(2))
    a(5)
    assert list(b(2)) == first == list(a(2))     # a new object (a resumed run) draws the same
    assert list(SubwordDropout(tok, pairs, 0.2, seed=4)(2)) != first
    assert list(SubwordDropout(tok, pairs, 0.3, seed=3)(2)) != first


@pytest.mark.slow
def test_draws_are_the_same_in_another_process(tok, pairs, tmp_path):
    "What a resumed run in a new process relies on (sentencepiece's own sampling fails this)."
    import hashlib
    import subprocess
    import sys
    tok.save(tmp_path / "tok.model")
    code = ("import hashlib, os; from transformer.data import load_multi30k; "
            "from transformer.tokens import Tokenizer; from transformer.engine.loop import SubwordDropout; "
            "pairs = load_multi30k('de', 'en', 'val', data_dir=os.environ['TRANSFORMER_DATA'], download=False); "
            f"d = SubwordDropout(Tokenizer.load({str(tmp_path / 'tok.model')!r}), pairs[:200], 0.2, seed=3); "
            "print(hashlib.sha256(repr(list(d(4))).encode()).hexdigest())")
    here = hashlib.sha256(repr(list(SubwordDropout(tok, pairs[:200], 0.2, seed=3)(4))).encode()).hexdigest()
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert there == here


def test_a_sampled_pair_too_long_keeps_its_fixed_ids(tok, pairs):
    limit = max(max(len(s), len(t)) for s, t in make_examples(tok, pairs))
    data = SubwordDropout(tok, pairs, 0.5, max_tokens=limit)
    unbounded = list(SubwordDropout(tok, pairs, 0.5)(0))
    too_long = [i for i, (s, t) in enumerate(unbounded) if max(len(s), len(t)) > limit]
    assert too_long                                                   # the limit binds
    examples = list(data(0))
    assert all(examples[i] == data.fixed[i] for i in too_long)
    assert all(examples[i] == unbounded[i] for i in range(len(examples)) if i not in set(too_long))


@pytest.mark.parametrize("p", [0, 1, -0.1, True, "0.1"])
def test_p_must_be_a_probability(tok, pairs, p):
    with pytest.raises(ValueError, match="must be in \\(0, 1\\)"):
        SubwordDropout(tok, pairs[:10], p)


def small_model(tok):
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab=len(tok), tgt_vocab=len(tok), d_model=32, d_ff=64, h=4,
                                         n_layers=1, dropout=0.1, max_len=128, norm_first=True))


def quick(**kw):
    return RunConfig(**{**dict(batch_tokens=1200, max_steps=12, warmup=6, eval_every=6, log_every=1,
                                 subword_dropout=0.1), **kw})


@pytest.mark.slow
def test_the_loop_resumes_a_run_with_subword_dropout_exactly(tok, pairs, tmp_path):
    data = lambda: SubwordDropout(tok, pairs[:150], 0.1)
    model_a = small_model(tok)
    a = train(model_a, data(), None, quick(), out_dir=tmp_path / "a", progress=False)
    assert a.epochs > 2                                   # the run crossed epochs, so it drew anew
    train(small_model(tok), data(), None, quick(max_steps=5), out_dir=tmp_path / "b", progress=False)
    model_b = small_model(tok)
    b = train(model_b, data(), None, quick(), out_dir=tmp_path / "b", resume=True, progress=False)
    losses = lambda d: [json.loads(l)["loss"] for l in (d / "metrics.jsonl").read_text().splitlines()
                        if json.loads(l)["kind"] == "train"]
    assert b.step == 12 and losses(tmp_path / "b") == losses(tmp_path / "a")
    for p, q in zip(model_a.state_dict().values(), model_b.state_dict().values(), strict=True):
        assert torch.equal(p, q)
    # the same run on fixed ids trains on other batches
    fixed = train(small_model(tok), make_examples(tok, pairs[:150]), None, quick(subword_dropout=0.0),
                  out_dir=tmp_path / "c", progress=False)
    assert [r["loss"] for r in fixed.history if r["kind"] == "train"] != losses(tmp_path / "a")


def test_the_config_and_the_examples_must_agree(tok, pairs):
    with pytest.raises(ValueError, match=r"subword_dropout=0.1 but .* pass SubwordDropout\(tokenizer, pairs, 0.1\)"):
        train(small_model(tok), make_examples(tok, pairs[:50]), None, quick(), progress=False)
    with pytest.raises(ValueError, match=r"subword_dropout=0 but .*SubwordDropout\(p=0.2\); set subword_dropout=0.2"):
        train(small_model(tok), SubwordDropout(tok, pairs[:50], 0.2), None, quick(subword_dropout=0.0),
              progress=False)
    with pytest.raises(ValueError, match=r"subword_dropout=1.0 must be in \[0, 1\)"):
        quick(subword_dropout=1.0)
