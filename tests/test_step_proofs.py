"""Issue 44: what a training step costs the host, counted on a CPU (counts, never timings).

- The trainer's Python work per step does not grow with the batch: the Python function calls that
  `_Loop.step` makes (every `call` event `sys.setprofile` sees on the training thread, generator
  resumptions included) are the same, step for step, at about 32 and about 512 sentences a step.
- A step never reads the device: between two log lines the training thread makes no host read
  (test_host_syncs' counter: `item`, `tolist`, `__bool__`, `nonzero`, boolean indexing, `.cpu()`,
  `torch.tensor` ...); reads happen only at the steps that log, evaluate or save. The batches are
  made on the prefetch thread, as on a GPU (`prefetch(threaded=True)`), so the counter sees the
  trainer's thread alone."""
import functools
import sys

import pytest
import torch
from copy_task import copy_examples as examples
from test_host_syncs import HostSyncs
from torch import nn

import transformer.engine.fast as fast
import transformer.engine.loop as loop
from transformer.engine.devices import prefetch
from transformer.engine.loop import RunConfig, train
from transformer.model import Transformer, TransformerConfig
from transformer.training import Seq2SeqLoss

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


DATA = examples(3000)


def tiny_model():
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=2,
                                         dropout=0.1, max_len=32))


def python_calls_per_step(monkeypatch, batch_tokens, steps=6, **run):
    """(calls of every step, sentences of every step): the Python function calls `_Loop.step` makes on the
    training thread; `run`: more of the RunConfig (log_every, accum_steps)."""
    step, calls, sentences = loop._Loop.step, [], []

    def counted(self, tensors, n):
        count = [0]

        def profile(frame, event, arg):
            if event == "call":
                count[0] += 1
        sys.setprofile(profile)
        try:
            return step(self, tensors, n)
        finally:
            sys.setprofile(None)
            calls.append(count[0])
            sentences.append(sum(t.size(0) for t in tensors[::2]))
    monkeypatch.setattr(loop._Loop, "step", counted)
    train(tiny_model(), DATA, None, RunConfig(**{**dict(batch_tokens=batch_tokens, max_steps=steps, warmup=10,
                                                        log_every=3, eval_every=100), **run}), progress=False)
    monkeypatch.setattr(loop._Loop, "step", step)
    return calls, sentences


def test_the_python_calls_of_a_step_do_not_grow_with_the_batch(monkeypatch):
    python_calls_per_step(monkeypatch, 320, steps=1)   # what a process does once (torch's lazy set-ups)
    small, small_sentences = python_calls_per_step(monkeypatch, 320)
    large, large_sentences = python_calls_per_step(monkeypatch, 5120)
    assert max(small_sentences) <= 64 and min(large_sentences) >= 400, (small_sentences, large_sentences)
    assert small == large, (small, large)             # step for step: the first (Adam's state made) included
    assert small[1:] == [small[1]] * 5                # and the same at every step after the first
    assert min(small) > 100                           # the counter sees the step's Python (the model's modules ...)


def test_the_python_calls_of_a_step_do_not_grow_with_accumulated_pieces_either(monkeypatch):
    "With accum_steps=2 each step runs two pieces: a constant more per step, whatever the batch."
    def run(batch_tokens):
        return python_calls_per_step(monkeypatch, batch_tokens, steps=4, log_every=2, accum_steps=2)[0]
    run(640)                                          # what a process does once (torch's lazy set-ups)
    assert run(640) == run(10240)


class StepSyncs(HostSyncs):
    """test_host_syncs' counter, less `.to(device)` onto the device a tensor is already on: it copies nothing on
    any device (on this CPU run, the CPU is the training device, as a GPU is on a GPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "to" and isinstance(args[0], torch.Tensor):
            to = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
            if to and torch.device(to[0]) == args[0].device:
                return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


def gpu_branches(monkeypatch):
    """The branches a GPU takes where appendix D.2's CPU fast paths would: chapter 8's loss on every position
    (not the boolean-indexed real targets) and PyTorch's dropout (not the CPU's cheaper mask); the batches made
    on the prefetch thread."""
    monkeypatch.setattr(fast.FastSeq2SeqLoss, "forward", Seq2SeqLoss.forward)
    monkeypatch.setattr(fast.Dropout, "forward", nn.Dropout.forward)
    monkeypatch.setattr(loop, "prefetch", functools.partial(prefetch, threaded=True))


def reads_per_iteration(monkeypatch, tmp_path, **config):
    """{step: host reads on the training thread from the start of that step to the start of the next} over a
    run on the GPU's branches."""
    gpu_branches(monkeypatch)
    step, marks = loop._Loop.step, []
    syncs = StepSyncs()

    def marked(self, tensors, n):
        marks.append((self.at["step"] + 1, syncs.total))
        return step(self, tensors, n)
    monkeypatch.setattr(loop._Loop, "step", marked)
    base = dict(batch_tokens=320, max_steps=12, warmup=10, log_every=4, eval_every=6, keep_checkpoints=2)
    with syncs:
        result = train(tiny_model(), DATA, examples(40, seed=1), RunConfig(**{**base, **config}),
                       out_dir=tmp_path, progress=False)
        end = syncs.total
    marks.append((None, end))
    return {s: after - before for (s, before), (_, after) in zip(marks, marks[1:])}, result, syncs


@pytest.mark.parametrize("cpu_bf16", [False, True])   # float32, and under autocast as on a GPU
@pytest.mark.filterwarnings("ignore:cpu_bf16=True on a CPU without bf16")
def test_a_step_reads_nothing_from_the_device_between_two_log_lines(monkeypatch, tmp_path, cpu_bf16):
    reads, result, syncs = reads_per_iteration(monkeypatch, tmp_path, cpu_bf16=cpu_bf16)
    assert result.step == 12 and sorted(reads) == list(range(1, 13))
    log, evaluate = {4, 8, 12}, {6, 12}
    quiet = [s for s in reads if s not in log | evaluate]
    assert quiet == [1, 2, 3, 5, 7, 9, 10, 11]
    assert {s: reads[s] for s in quiet} == dict.fromkeys(quiet, 0), syncs.calls
    assert all(reads[s] > 0 for s in log | evaluate)    # the counter sees the reads the loop does make
    # a log line reads the window once: two tolist calls (the sums; the flags and the gradient norm)
    assert reads[4] == reads[8] == 2, reads



def test_a_batchs_tensors_cost_the_same_python_calls_at_32_and_at_512_sentences():
    """The prefetch thread's work per step does not grow with the batch either: the loop packs a list of examples
    once an epoch (appendix A.1's `Pairs`), and `collate` gathers a batch with numpy. Chapter 8's `collate` (a tensor
    per sentence) makes about 22 calls a sentence; the packed one the same number at 32 and at 512 sentences, and
    the same tensors."""
    import cProfile
    import pstats

    from transformer.engine.corpus import Pairs
    from transformer.training import collate
    packed = Pairs.of(DATA)

    def calls(f, *args):
        profile = cProfile.Profile()
        profile.runcall(f, *args)
        return pstats.Stats(profile).total_calls

    counts = {}
    for n in (32, 512):
        indices = list(range(0, 5 * n, 5))
        assert all(torch.equal(a, b) for a, b in zip(packed.collate(indices), collate(DATA, indices), strict=True))
        counts[n] = calls(packed.collate, indices), calls(collate, DATA, indices)
    assert counts[32][0] == counts[512][0] < counts[32][1] < counts[512][1], counts
