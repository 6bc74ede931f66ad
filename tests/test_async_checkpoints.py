"""Issue 44: checkpoints that do not stop the step (appendix E's `CheckpointWriter`, used by appendix E.2's loop).

The training thread only snapshots the state; one background thread serializes, fsyncs and renames. Proved with
counts and events, never with timings: a write blocked on an event does not block the steps after it, and the file it
writes holds the snapshot, not the weights the later steps made; a write that fails is raised on the training thread
as the one-line `SaveError`; the last checkpoint is complete when `train` returns."""
import errno
import threading

import pytest
import torch
from copy_task import copy_examples as examples

import transformer.engine.checkpoints as checkpoints
from transformer.engine.checkpoints import (
    CheckpointWriter,
    SaveError,
    checkpoint_state,
    host_copy,
    load_checkpoint,
    model_from_checkpoint,
)
from transformer.engine.loop import RunConfig, train
from transformer.model import Transformer, TransformerConfig

pytestmark = pytest.mark.usefixtures("one_thread")
DEADLINE = 120      # seconds a blocked write waits before the test gives up (a hang guard, never asserted)


def tiny_model(tie=False):
    torch.manual_seed(0)
    return Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=1,
                                         dropout=0.0, max_len=32, tie_embeddings=tie))


def config(**kw):
    return RunConfig(**{**dict(batch_tokens=256, warmup=10, eval_every=4, log_every=2, max_steps=8), **kw})


def test_a_blocked_write_does_not_block_the_steps(tmp_path, monkeypatch):
    """last.pt of step 4 is written by a writer blocked until step 7's forward pass: steps 5, 6 and 7 run while
    nothing is on the disk; released, the file is complete, loads, and holds step 4's weights."""
    real = checkpoints.write_checkpoint
    started, release, written = threading.Event(), threading.Event(), []

    def blocked_write(path, state):
        if not written:
            started.set()
            if not release.wait(DEADLINE):
                raise RuntimeError("never released")
        real(path, state)
        written.append((path.name, load_checkpoint(path)))      # read back at once, before the next write
    monkeypatch.setattr(checkpoints, "write_checkpoint", blocked_write)

    model = tiny_model()
    forwards, while_blocked, at_step_4 = [0], [], {}

    def hook(module, inputs, output):
        forwards[0] += 1
        if forwards[0] == 5:         # step 5's forward: the weights are still step 4's
            at_step_4.update({k: v.clone() for k, v in model.state_dict().items()})
        if forwards[0] in (5, 6, 7):
            assert started.wait(DEADLINE)          # the write of step 4 has begun on its thread ...
            while_blocked.append(forwards[0])
            assert not (tmp_path / "last.pt").exists()   # ... and is not on the disk
        if forwards[0] == 7:
            release.set()
        return output
    model.encoder.register_forward_hook(hook)

    result = train(model, examples(100), None, config(), out_dir=tmp_path, progress=False)
    assert result.step == 8 and forwards[0] == 8
    assert while_blocked == [5, 6, 7]                 # three steps ran while the write was blocked
    assert [name for name, _ in written] == ["last.pt", "last.pt"]
    first = written[0][1]
    assert first["progress"]["step"] == 4
    assert first["model"].keys() == at_step_4.keys()
    assert all(torch.equal(first["model"][k], at_step_4[k]) for k in at_step_4)   # the snapshot, not later steps
    assert not any(torch.equal(model.state_dict()[k], at_step_4[k]) for k in ("generator.weight",))
    final = load_checkpoint(tmp_path / "last.pt")                        # the end: step 8, complete
    assert final["progress"]["step"] == 8
    assert all(torch.equal(final["model"][k], v) for k, v in model.state_dict().items())
    assert not list(tmp_path.glob(".*.tmp"))


def _full_disk(obj, f, *args, **kwargs):
    f.write(b"partial")
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("eval_every, raised_at", [(4, 8), (100, 4)])
def test_a_failed_write_is_raised_at_the_next_save_or_at_the_end(tmp_path, monkeypatch, eval_every, raised_at):
    """torch.save fails (a full disk) on the writer's thread: `train` raises the one-line SaveError of a
    synchronous save, at the next save (step 8, after the failed write of step 4) or, when the failed write was
    the last one, before it returns; nothing half-written is left."""
    monkeypatch.setattr(torch, "save", _full_disk)
    model, forwards = tiny_model(), [0]
    model.encoder.register_forward_hook(lambda m, i, o: forwards.__setitem__(0, forwards[0] + 1))
    with pytest.raises(SaveError) as e:
        train(model, examples(100), None, config(eval_every=eval_every, max_steps=raised_at), out_dir=tmp_path,
              progress=False)
    message = str(e.value)
    assert message.startswith(f"no space left on the device while saving {tmp_path}/last.pt; nothing was written")
    assert "\n" not in message and e.value.errno == errno.ENOSPC
    assert forwards[0] == raised_at                  # the steps after the failed write ran
    assert not (tmp_path / "last.pt").exists() and not list(tmp_path.glob(".*.tmp"))
    assert not (tmp_path / ".lock").exists()         # the run's lock released


def test_the_last_checkpoint_is_on_the_disk_when_train_returns(tmp_path, monkeypatch):
    """The final write is held back on its thread until a timer (not the test) lets it go: `train` returns only
    after it, and last.pt is then complete, at the last step, with the last weights and snapshots pruned."""
    real = checkpoints.write_checkpoint
    finished = []

    def slow_write(path, state):
        if state.get("progress", {}).get("step") == 12:
            gate = threading.Event()
            threading.Timer(0.3, gate.set).start()
            assert gate.wait(DEADLINE)
        real(path, state)
        finished.append(path.name)
    monkeypatch.setattr(checkpoints, "write_checkpoint", slow_write)
    model = tiny_model(tie=True)
    result = train(model, examples(100), examples(10, 1), config(max_steps=12, keep_checkpoints=2),
                   out_dir=tmp_path, progress=False)
    assert result.step == 12 and finished[-1] == "last.pt"
    assert finished.count("last.pt") == 3 and "step-0000012.pt" in finished
    saved = load_checkpoint(tmp_path / "last.pt")
    assert saved["progress"]["step"] == 12
    assert all(torch.equal(saved["model"][k], v) for k, v in model.state_dict().items())
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-0000008.pt", "step-0000012.pt"]
    assert model_from_checkpoint(tmp_path / "best.pt").config == model.config
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-writer"]


def test_host_copy_is_a_snapshot_that_keeps_tied_tensors_tied():
    model = tiny_model(tie=True)
    state = checkpoint_state(model, progress={"step": 3})
    copy, event = host_copy(state)
    assert event is None                                         # the CPU: copied at once, nothing to wait for
    weights = copy["model"]
    tied = [k for k in weights if k.endswith("embed.embedding.weight") or k == "generator.weight"]
    assert len(tied) == 3 and len({weights[k].data_ptr() for k in tied}) == 1
    with torch.no_grad():
        model.generator.weight.add_(1.0)
    assert not torch.equal(weights["generator.weight"], model.generator.weight)
    assert copy["progress"] == {"step": 3} and copy["model_config"] == state["model_config"]


def test_copies_from_a_gpu_that_is_not_the_current_one_are_waited_for_on_that_gpus_stream(monkeypatch):
    """A model on cuda:1 while cuda:0 is current (`train` called from Python without `torch.cuda.set_device`):
    a non-blocking copy from cuda:1 runs on cuda:1's current stream, so the event the writer waits for must be
    recorded there; recorded on cuda:0's, the writer could save pinned memory the copies had not filled. Torch's
    CUDA calls are mocked: the tensors are CPU tensors that say they live on cuda:1."""
    class OnGPU1(torch.Tensor):
        @property
        def device(self):
            return torch.device("cuda", 1)

    def current_stream(device=None):
        return f"the stream of {torch.device('cuda', 0) if device is None else device}"   # cuda:0 is current

    class Event:          # torch.cuda.Event.record(): on the current device's current stream by default
        def record(self, stream=None):
            recorded.append(stream or current_stream())
    recorded, empty = [], torch.empty
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))   # no pinned memory here
    weights = {"w": torch.arange(6.0).as_subclass(OnGPU1), "b": torch.ones(2).as_subclass(OnGPU1)}
    copy, event = host_copy({"model": weights, "progress": {"step": 3}})
    assert isinstance(event, Event) and recorded == ["the stream of cuda:1"]
    assert torch.equal(copy["model"]["w"], torch.arange(6.0)) and copy["progress"] == {"step": 3}


def test_the_writer_writes_one_at_a_time_and_raises_a_failure_once(tmp_path, monkeypatch):
    order = []
    release = threading.Event()
    real = checkpoints.write_checkpoint

    def write(path, state):
        order.append(("start", path.name))
        if path.name == "a.pt":
            assert release.wait(DEADLINE)
        real(path, state)
        order.append(("end", path.name))
    monkeypatch.setattr(checkpoints, "write_checkpoint", write)
    writer, model = CheckpointWriter(), tiny_model()
    writer.save(tmp_path / "a.pt", checkpoint_state(model))
    threading.Timer(0.2, release.set).start()
    writer.save(tmp_path / "b.pt", checkpoint_state(model))    # waits for a.pt first
    writer.wait()
    assert order == [("start", "a.pt"), ("end", "a.pt"), ("start", "b.pt"), ("end", "b.pt")]
    monkeypatch.setattr(torch, "save", _full_disk)
    writer.save(tmp_path / "c.pt", checkpoint_state(model))
    with pytest.raises(SaveError, match="no space left on the device while saving .*c.pt"):
        writer.wait()
    writer.wait()                                              # raised once, then forgotten
