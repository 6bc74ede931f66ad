"""Chapter 10, evaluation.py: BLEU (cased and lowercased), chrF, scoring a model."""
import math
from collections import Counter

import pytest
import torch
from sacrebleu.metrics import BLEU

from transformer.engine.fast import bleu_callback, evaluate
from transformer.evaluation import bleu, bleu_lc_tok, chrf, score
from transformer.model import Transformer, TransformerConfig
from transformer.tokens import Tokenizer

HYPS = ["a man in an orange hat looking at something .", "a terrier runs on the green grass .",
        "a girl in a karate uniform breaks a board ."]
REFS = ["a man in an orange hat starring at something .",
        "a boston terrier is running on lush green grass in front of a white fence .",
        "a girl in karate uniform breaking a stick with a front kick ."]


def bleu_oracle(hyps, refs):
    "Papineni et al. (2002) on space-separated tokens: clipped n-gram precisions, brevity penalty."
    match, total, c, r = [0] * 4, [0] * 4, 0, 0
    for h, t in zip(hyps, refs):
        h, t = h.split(), t.split()
        c, r = c + len(h), r + len(t)
        for n in range(1, 5):
            hn = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rn = Counter(tuple(t[i:i + n]) for i in range(len(t) - n + 1))
            match[n - 1] += sum(min(k, rn[g]) for g, k in hn.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    return 100 * min(1, math.exp(1 - r / c)) * math.exp(sum(math.log(m / t) for m, t in zip(match, total)) / 4)


def test_sacrebleu_agrees_with_the_definition():
    assert BLEU(tokenize="none", smooth_method="none").corpus_score(HYPS, [REFS]).score == \
        pytest.approx(bleu_oracle(HYPS, REFS), abs=1e-9)
    # our bleu() tokenizes with 13a; on text already split at punctuation it is the same number
    assert bleu(HYPS, REFS) == pytest.approx(bleu_oracle(HYPS, REFS), abs=0.5)


def test_perfect_and_disjoint():
    assert bleu(REFS, REFS) == pytest.approx(100.0)
    assert chrf(REFS, REFS) == pytest.approx(100.0)
    assert bleu(["xyz qqq"] * 3, REFS) == pytest.approx(0.0, abs=1e-6)


def test_case_only_matters_to_the_cased_score():
    upper = [h.capitalize() for h in HYPS]
    assert bleu_lc_tok(upper, REFS) == pytest.approx(bleu_lc_tok(HYPS, REFS))
    assert bleu(upper, REFS) < bleu(HYPS, REFS)


def test_tokenization_happens_inside():
    detok = [h.replace(" .", ".") for h in HYPS]
    assert bleu(detok, REFS) == pytest.approx(bleu(HYPS, REFS))       # 13a splits the full stop off


def test_score_returns_all_three_with_signatures():
    s = score(HYPS, REFS)
    assert s["bleu"] == pytest.approx(bleu(HYPS, REFS)) and s["chrf"] == pytest.approx(chrf(HYPS, REFS))
    assert s["bleu_lc_tok"] == pytest.approx(bleu_lc_tok(HYPS, REFS))
    assert "case:lc" in s["signatures"]["bleu_lc_tok"] and "tok:13a" in s["signatures"]["bleu_lc_tok"]
    assert "case:mixed" in s["signatures"]["bleu"]


@pytest.mark.parametrize("hyps, refs, error, match", [
    (HYPS, REFS[:2], ValueError, "3 hypotheses but 2 references"),
    ([], [], ValueError, "empty"),
    ("a sentence", REFS, TypeError, "hyps must be a list"),
    (HYPS, [1, 2, 3], TypeError, r"refs\[0\] is a int"),
])
@pytest.mark.parametrize("fn", [bleu, bleu_lc_tok, chrf, score])
def test_bad_inputs(fn, hyps, refs, error, match):
    with pytest.raises(error, match=match):
        fn(hyps, refs)


@pytest.mark.slow
def test_evaluate_and_callback_on_a_model():
    texts = ["one two three", "four five", "six seven eight nine"]
    tokenizer = Tokenizer.train(texts * 50, vocab_size=40)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=40, tgt_vocab=40, d_model=16, d_ff=32, h=2, n_layers=1,
                                          dropout=0.0, max_len=64))
    pairs = [(t, t) for t in texts]
    s = evaluate(model, tokenizer, pairs)
    assert 0 <= s["bleu"] <= 100 and 0 <= s["chrf"] <= 100
    out = bleu_callback(tokenizer, pairs)(model, 7)
    assert set(out) == {"bleu", "bleu_lc_tok", "chrf"} and out["bleu"] == pytest.approx(s["bleu"])
    with pytest.raises(ValueError, match="no \\(source, reference\\) pairs"):
        evaluate(model, tokenizer, [])
    for bad in (-1, 0, 2.5, True):   # refused when the callback is made, not at the first evaluation
        with pytest.raises(ValueError, match=f"batch_size={bad!r} must be a positive int"):
            bleu_callback(tokenizer, pairs, batch_size=bad)


def _tiny_translation_setup():
    texts = ["one two three", "four five", "six seven eight nine", "ten eleven", "two four six"]
    tokenizer = Tokenizer.train(texts * 50, vocab_size=40)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=40, tgt_vocab=40, d_model=16, d_ff=32, h=2, n_layers=1,
                                          dropout=0.0, max_len=64))
    return tokenizer, model, [(t, t) for t in texts]


def _sharded_callback_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    import transformer.engine.fast as ev  # bleu_callback and the score it calls
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        tokenizer, model, pairs = _tiny_translation_setup()
        scored = []
        real_score = ev.score
        ev.score = lambda hyps, refs: (scored.append(list(hyps)), real_score(hyps, refs))[1]
        out = ev.bleu_callback(tokenizer, pairs)(model, 1)
        torch.save({"out": out, "hyps": scored}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_bleu_callback_with_two_processes_translates_shares_and_scores_all(tmp_path):
    import socket

    import torch.multiprocessing as mp

    from transformer.engine.fast import translate
    tokenizer, model, pairs = _tiny_translation_setup()
    expected_hyps = translate(model, tokenizer, [s for s, _ in pairs])
    expected = bleu_callback(tokenizer, pairs)(model, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked, not spawned: the two processes start with torch and this package imported (a spawned one imports
    # them again, seconds of CPU each); each sets one thread before its first torch op
    mp.start_processes(_sharded_callback_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["hyps"] == [expected_hyps]                      # every process scored every sentence, in order
        assert got["out"] == pytest.approx(expected)


@pytest.mark.slow
def test_final_evaluation_averages_chooses_on_val_and_scores_test(tmp_path):
    from transformer.engine.checkpoints import load_checkpoint, save_checkpoint
    from transformer.engine.loop import final_evaluation
    tokenizer, model, pairs = _tiny_translation_setup()
    save_checkpoint(tmp_path / "best.pt", model)
    for step in (1, 2, 3):
        torch.manual_seed(step)
        other = Transformer(model.config)
        save_checkpoint(tmp_path / f"step-{step:07d}.pt", other, progress={"step": step})
    final = final_evaluation(tmp_path, tokenizer, pairs[:3], pairs[3:], beam_size=2, average=2,
                             run={"tokenizer_sha256": "abc"})
    assert final["averaged"] == ["step-0000002.pt", "step-0000003.pt"]    # the last `average` snapshots
    saved = load_checkpoint(tmp_path / "averaged.pt")
    assert saved["run"] == {"tokenizer_sha256": "abc"}
    assert set(final["val_by_checkpoint"]) == {"best", "averaged"}
    chosen = final["checkpoint"]
    assert final["val"] == final["val_by_checkpoint"][chosen]
    assert max(s["bleu"] for s in final["val_by_checkpoint"].values()) == final["val"]["bleu"]
    expected_test = evaluate(final["model"], tokenizer, pairs[3:], beam_size=2)
    assert final["test"]["bleu"] == pytest.approx(expected_test["bleu"])
    assert final["greedy"]["bleu"] == pytest.approx(evaluate(final["model"], tokenizer, pairs[3:])["bleu"])
    with pytest.raises(ValueError, match="holds no best.pt and no model was given"):
        final_evaluation(tmp_path / "empty", tokenizer, pairs)


@pytest.mark.slow
def test_final_evaluation_tries_windows_and_alphas_on_val(tmp_path):
    from transformer.engine.checkpoints import load_checkpoint, save_checkpoint
    from transformer.engine.loop import averaging_windows, final_evaluation
    assert averaging_windows(20) == [20, 10, 5] and averaging_windows(5) == [5]
    assert averaging_windows(8) == [8] and averaging_windows(1) == []
    tokenizer, model, pairs = _tiny_translation_setup()
    save_checkpoint(tmp_path / "best.pt", model)
    for step in range(1, 11):
        torch.manual_seed(step)
        save_checkpoint(tmp_path / f"step-{step:07d}.pt", Transformer(model.config),
                        progress={"step": step})
    final = final_evaluation(tmp_path, tokenizer, pairs[:3], pairs[3:], beam_size=2,
                             alpha=(0.6, 1.0), average=10)
    # best.pt, the mean of 10 and the mean of 5, each with both penalties
    assert [(r["snapshots"], r["alpha"]) for r in final["val_grid"]] == [
        (0, 0.6), (0, 1.0), (10, 0.6), (10, 1.0), (5, 0.6), (5, 1.0)]
    top = max(r["bleu"] for r in final["val_grid"])
    assert final["val"]["bleu"] == top and final["alpha"] in (0.6, 1.0)
    winner = next(r for r in final["val_grid"] if r["bleu"] == top)    # the first wins a tie
    assert final["alpha"] == winner["alpha"]
    assert final["checkpoint"] == ("best" if winner["snapshots"] == 0 else "averaged")
    # averaged.pt is the window that did best on val
    best_window = max((10, 5), key=lambda n: max(r["bleu"] for r in final["val_grid"]
                                                 if r["snapshots"] == n))
    assert len(final["averaged"]) == best_window
    assert load_checkpoint(tmp_path / "averaged.pt")["progress"]["averaged"] == final["averaged"]
    expected = evaluate(final["model"], tokenizer, pairs[3:], beam_size=2, alpha=final["alpha"])
    assert final["test"]["bleu"] == pytest.approx(expected["bleu"])
    # greedy search has no length penalty: one alpha only
    greedy = final_evaluation(tmp_path, tokenizer, pairs[:3], beam_size=1, alpha=(0.6, 1.0),
                              average=10)
    assert {r["alpha"] for r in greedy["val_grid"]} == {0.6}
