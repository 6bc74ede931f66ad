"""Issue 44: a run ends on one evaluation. Counted on a fake clock (a step takes 1 s, an evaluation 5 s), never timed:
the steps at which the loop's `evaluate` runs, whether the run stops on its time limit or at `max_steps`."""
import types

import pytest
import torch
from copy_task import copy_examples as examples

import transformer.engine.loop as loop
from transformer.engine.loop import RunConfig, train
from transformer.model import Transformer, TransformerConfig

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def evaluations(monkeypatch):
    """Runs `train` on a fake clock; returns (result, the step of every call of `_Loop.evaluate`)."""
    now = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    step, evaluate = loop._Loop.step, loop._Loop.evaluate
    calls = []

    def timed_step(self, *args):
        now[0] += 1.0
        return step(self, *args)

    def counted_evaluate(self):
        calls.append(self.at["step"])
        return evaluate(self)

    def timed_eval(model, step):     # on_eval: the evaluation's 5 s, inside the time it measures
        now[0] += 5.0
        return {}

    monkeypatch.setattr(loop._Loop, "step", timed_step)
    monkeypatch.setattr(loop._Loop, "evaluate", counted_evaluate)

    def run(tmp_path, eval_share=None, **config):
        torch.manual_seed(0)
        model = Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=1,
                                              dropout=0.0, max_len=32))
        base = dict(batch_tokens=256, warmup=10, eval_every=10, log_every=5, max_steps=1000)
        result = train(model, examples(100, 1), examples(8, 2), RunConfig(**{**base, **config}),
                       out_dir=tmp_path, progress=False, on_eval=timed_eval, eval_share=eval_share)
        return result, calls
    run.clock = now                  # the fake clock's reading: where a run ended, in its seconds
    return run


@pytest.mark.parametrize("budget", [16, 18, 20])
def test_a_run_whose_time_runs_out_at_its_first_evaluation_ends_on_it(tmp_path, evaluations, budget):
    """At step 10 (10 s on the clock) no evaluation has been timed yet, so one more step looks affordable; the
    evaluation then takes 5 s, and one more step and a final evaluation (21 s) would pass the budget. The run ends
    on that evaluation (15 s): before, it trained step 11 and evaluated a second time (21 s, past the budget)."""
    result, calls = evaluations(tmp_path, max_minutes=budget / 60)
    assert result.stopped == "max_minutes" and result.step == 10
    assert calls == [10]
    assert [r["step"] for r in result.history if r["kind"] == "eval"] == [10]
    assert evaluations.clock[0] == 15.0 <= budget          # ended on the fake clock at 15 s, within the budget
    saved = torch.load(tmp_path / "last.pt", weights_only=False)
    assert saved["progress"]["step"] == 10                # last.pt holds the step it ended on


def test_a_run_with_time_after_its_evaluation_trains_on_and_evaluates_once_at_the_end(tmp_path, evaluations):
    """Budget 30 s: after step 10's evaluation (15 s) steps 11 to 19 fit (24 s + 1 + 5 = 30 stops there); the
    final evaluation at 19 is the only one after 10."""
    result, calls = evaluations(tmp_path, max_minutes=30 / 60)
    assert result.stopped == "max_minutes" and result.step == 19
    assert calls == [10, 19]


@pytest.mark.parametrize("max_steps, expected", [(20, [10, 20]), (15, [10, 15]), (10, [10])])
def test_a_run_stopped_by_max_steps_evaluates_once_at_its_last_step(tmp_path, evaluations, max_steps, expected):
    result, calls = evaluations(tmp_path, max_steps=max_steps)
    assert result.stopped == "max_steps" and result.step == max_steps
    assert calls == expected


def test_a_run_that_ends_on_its_evaluation_keeps_its_last_step_as_a_snapshot(tmp_path, evaluations):
    "Snapshots every 4 steps: the run that ends on step 10's evaluation also keeps step 10's weights, for averaging."
    result, calls = evaluations(tmp_path, max_minutes=16 / 60, keep_checkpoints=3, snapshot_every=4)
    assert result.step == 10 and calls == [10]
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-0000004.pt", "step-0000008.pt",
                                                                   "step-0000010.pt"]


def test_eval_share_keeps_the_evaluations_within_their_share_of_the_run(tmp_path, evaluations):
    """A step 1 s, an evaluation 5 s, one due every 10 steps: without `eval_share` all 20 run (5 s of every 15:
    a third of the run). With 0.1 an evaluation is put off while it would pass a tenth of the time so far; the first
    and the final one run, each at a multiple of eval_every or at the end, and the share ends near 0.1, not 1/3
    (on this clock: at steps 10, 90, 140, 180 and 200; 300 steps add 230 and 270, at the same share)."""
    result, calls = evaluations(tmp_path, max_steps=200, eval_share=0.1)
    assert calls[0] == 10 and calls[-1] == 200 and all(s % 10 == 0 for s in calls)
    assert 3 < len(calls) < 20
    clock = evaluations.clock[0]
    assert clock == 200 + 5 * len(calls)
    assert 5 * (len(calls) - 1) <= 0.1 * (clock - 5)                # every evaluation but the final one within 10 %
    assert 5 * len(calls) / clock > 0.05                             # put off, not dropped: the share is used
    saved = [r["step"] for r in result.history if r["kind"] == "eval"]
    assert saved == calls


def test_without_eval_share_every_due_evaluation_runs(tmp_path, evaluations):
    result, calls = evaluations(tmp_path, max_steps=60)
    assert calls == [10, 20, 30, 40, 50, 60]


@pytest.mark.parametrize("share", [0, 1, 1.5, -0.1])
def test_an_eval_share_outside_0_1_is_refused(tmp_path, share):
    with pytest.raises(ValueError, match="eval_share=.* must lie between 0 and 1"):
        train(Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=1)),
              examples(4), None, RunConfig(max_steps=1), eval_share=share)


def test_a_compiling_step_is_not_taken_for_the_pace(tmp_path, evaluations, monkeypatch):
    """Budget 60 s; the first step takes 31 s (compiling, as `train --compile` on an H200 did: 44 s) and step 12
    6 s (a recompile). The loop reserves the fastest of the latest steps (1 s), so it trains on to step 14
    (54 s + 1 + 5 = 60 stops there) and ends at 59 s. Timed by the last step, it stopped after step 1."""
    timed = loop._Loop.step

    def compiling(self, *args):
        evaluations.clock[0] += {0: 30.0, 11: 5.0}.get(self.at["step"], 0.0)
        return timed(self, *args)

    monkeypatch.setattr(loop._Loop, "step", compiling)
    result, calls = evaluations(tmp_path, max_minutes=1.0)
    assert result.stopped == "max_minutes" and result.step == 14
    assert calls == [10, 14]
    assert evaluations.clock[0] == 59.0


def test_each_train_record_splits_its_time_between_batches_steps_and_the_device(tmp_path, evaluations, monkeypatch):
    """On the fake clock a step takes 1 s, a batch 0.5 s to make and the log's read of the device 0.25 s: each
    record of 5 steps (log_every) says 2.5 s waiting for batches, 5 s in steps, 0.25 s waiting for the device, the
    split a GPU run needs to tell a starved GPU (batches), a busy host (steps) and a busy GPU (device) apart."""
    tensors, read = loop._Loop.tensors, loop._Loop.read_window

    def slow_tensors(self, item):
        evaluations.clock[0] += 0.5
        return tensors(self, item)

    def slow_read(self):
        evaluations.clock[0] += 0.25
        return read(self)

    monkeypatch.setattr(loop._Loop, "tensors", slow_tensors)
    monkeypatch.setattr(loop._Loop, "read_window", slow_read)
    # on a GPU each record also says how often CUDA's caching allocator went to the driver (appendix F)
    monkeypatch.setattr(loop, "allocator_counts", lambda device: {"cuda_mallocs": 7, "cuda_alloc_retries": 0})
    result, _ = evaluations(tmp_path, max_steps=20)
    records = [r for r in result.history if r["kind"] == "train"]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for r in records:
        assert (r["batch_wait_seconds"], r["step_seconds"], r["device_wait_seconds"]) == (2.5, 5.0, 0.25)
        assert (r["cuda_mallocs"], r["cuda_alloc_retries"]) == (7, 0)
