"""Issue 44 (and 42's one device picker): appendix F's `pick_device` is the one reader of `--device` for every
command. `auto` is CUDA, then Apple's MPS, then the CPU; an absent device or `--compile` on MPS is one line that says
what to pass instead; batches for MPS are not pinned and its precision is float32. Torch's answers about the hardware
are mocked: this machine has neither GPU."""
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import transformer.cli.bench as bench
import transformer.cli.train as cli_train
import transformer.cli.use as cli_use
from transformer.cli.commands import build_parser
from transformer.data import UserError
from transformer.engine import devices
from transformer.engine.devices import (
    DEVICES,
    DeviceError,
    choose_precision,
    pick_device,
    pins_memory,
    prefetch,
)


def hardware(cuda: bool, mps: bool):
    "Torch told that this machine has (or lacks) a CUDA GPU and an Apple GPU."
    return (mock.patch("torch.cuda.is_available", return_value=cuda),
            mock.patch("torch.backends.mps.is_available", return_value=mps))


@pytest.mark.parametrize("cuda, mps, chosen", [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"),
                                               (False, False, "cpu")])
def test_auto_picks_cuda_then_mps_then_the_cpu(cuda, mps, chosen):
    a, b = hardware(cuda, mps)
    with a, b:
        assert pick_device("auto") == torch.device(chosen)
        assert pick_device() == torch.device(chosen)                 # auto is the default
        assert pick_device("cpu") == torch.device("cpu")             # the CPU is always there


@pytest.mark.parametrize("name, cuda, mps, message", [
    ("cuda", False, True, r"^--device cuda: no CUDA device is available here .*use --device auto or --device cpu$"),
    ("mps", True, False, r"^--device mps: no Apple silicon GPU is available here .*use --device auto or --device cpu$"),
    ("tpu", True, True, r"^--device tpu: not one of auto, cpu, cuda, mps$"),
])
def test_an_absent_device_names_the_problem_and_the_fix(name, cuda, mps, message):
    a, b = hardware(cuda, mps)
    with a, b, pytest.raises(DeviceError, match=message) as e:
        pick_device(name)
    assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)   # one line on the command line


@pytest.mark.parametrize("name", ["mps", "auto"])
def test_compile_on_mps_is_refused_in_one_line(name):
    a, b = hardware(False, True)
    with a, b:
        with pytest.raises(DeviceError, match=r"^--compile on mps: .*drop --compile, or pass --device cpu"):
            pick_device(name, compile=True)
        assert pick_device("cpu", compile=True) == torch.device("cpu")
    a, b = hardware(True, True)
    with a, b:
        assert pick_device("auto", compile=True) == torch.device("cuda")


def test_mps_gets_float32_and_unpinned_batches_in_line(monkeypatch):
    "prefetch for MPS: no pin_memory, no thread, a plain copy (here to a stand-in for the MPS device)."
    assert choose_precision(torch.device("mps")).dtype is None                     # float32, even with amp=True
    assert choose_precision(torch.device("mps"), amp=True, cpu_bf16=True).dtype is None
    assert not pins_memory("mps") and not pins_memory("cpu") and pins_memory("cuda")

    def no_pinning(self, *args, **kwargs):
        raise AssertionError("pin_memory asked for a batch bound for mps")
    moved = []

    def to(self, device, non_blocking=False):
        moved.append((torch.device(device).type, non_blocking))
        return self
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    monkeypatch.setattr(torch.Tensor, "to", to)
    out = list(prefetch(range(3), lambda i: [torch.full((2,), i)], "mps"))
    assert [item for item, _ in out] == [0, 1, 2]
    assert moved == [("mps", False)] * 3


def test_every_command_reads_device_through_the_one_picker():
    parser = build_parser()
    for argv in (["train"], ["translate", "--model", "m", "x"], ["evaluate", "--model", "m"]):
        args = parser.parse_args([*argv, "--device", "mps"])
        assert args.device == "mps"
    for command in ("train", "translate", "evaluate"):
        action = next(a for a in parser._subparsers._group_actions[0].choices[command]._actions
                      if "--device" in a.option_strings)
        assert tuple(action.choices) == DEVICES and action.default == "auto"
    assert cli_train.pick_device is devices.pick_device and cli_use.pick_device is devices.pick_device
    assert bench.pick_device is devices.pick_device
    assert not hasattr(__import__("transformer.cli.commands", fromlist=["x"]), "pick_device")
    assert not hasattr(__import__("transformer.cli.measure", fromlist=["x"]), "resolve_device")


def test_bench_refuses_an_absent_device_before_any_work(capsys):
    a, b = hardware(False, False)
    with a, b, pytest.raises(SystemExit) as e:
        bench.main(["--device", "mps"])
    assert e.value.code == 2 and "--device mps: no Apple silicon GPU is available here" in capsys.readouterr().err


class NoFloat64(TorchDispatchMode):
    "A device without float64, as MPS: an op that makes a float64 tensor raises (torch's TypeError on MPS)."
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_leaves(out)):
            raise TypeError(f"{func}: MPS has no float64")
        return out


def test_training_validating_and_beam_search_keep_their_sums_in_float32_on_mps(monkeypatch):
    """The loop's sums (its log window, the validation loss) and beam search's scores are float64 where the
    device has it; MPS has none. Here the CPU plays MPS: `sum_dtype` answers as for MPS, and an op that makes a
    float64 tensor raises."""
    from copy_task import copy_examples

    from transformer.engine import fast, loop
    from transformer.model import Transformer, TransformerConfig
    from transformer.tokens import pad_batch
    assert fast.sum_dtype(torch.device("mps")) == torch.float32
    assert fast.sum_dtype("cpu") == fast.sum_dtype(torch.device("cuda", 1)) == torch.float64
    for module in (loop, fast):
        monkeypatch.setattr(module, "sum_dtype", lambda device: torch.float32, raising=False)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(src_vocab=16, tgt_vocab=16, d_model=16, d_ff=32, h=2, n_layers=1))
    examples = copy_examples(40)
    with NoFloat64():
        result = loop.train(model, examples, examples[:8], loop.RunConfig(batch_tokens=256, max_steps=4,
                            eval_every=2, log_every=2), progress=False)
        hyps = fast.beam_search(model.eval(), pad_batch([ids for ids, _ in examples[:3]])[0], beam_size=3)
    assert result.step == 4 and [r["kind"] for r in result.history] == ["train", "eval"] * 2
    assert len(hyps) == 3


def test_float32_asks_for_no_autocast_context_which_torch_2_4_lacks_on_mps(monkeypatch):
    """torch 2.4 has no autocast on MPS (it came in 2.5): there even `torch.autocast("mps", enabled=False)` raises.
    MPS computes in float32, whose precision enters no autocast context. torch 2.4 simulated."""
    import torch.amp.autocast_mode as autocast_mode
    available = autocast_mode.is_autocast_available
    monkeypatch.setattr(autocast_mode, "is_autocast_available", lambda device: device != "mps" and available(device))
    with pytest.raises(RuntimeError, match="unsupported autocast device_type 'mps'"):
        torch.autocast("mps", enabled=False)
    with choose_precision(torch.device("mps")).autocast():
        assert not torch.is_autocast_enabled("cpu")
