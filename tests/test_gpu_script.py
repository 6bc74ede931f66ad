"""Issue 44: `.ci/gpu`, the GPU measurement ready for when a GPU is lent, checked without one: its dry run writes
the JSON with every section (each GPU step recorded as skipped), and the parsers it reads a GPU run with (pytest's
summary, `nvidia-smi dmon`, metrics.jsonl) are run on sample text."""
import json
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu"
_loader = SourceFileLoader("gpu_script", str(SCRIPT))      # a script without .py: loaded by hand
gpu = module_from_spec(spec_from_loader("gpu_script", _loader))
_loader.exec_module(gpu)


@pytest.mark.slow
def test_the_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["dry_run"] is True and record["device"] == "no GPU (dry run)"
    assert {"what", "software", "commit", "started_utc", "wall_s"} <= set(record)
    for section in ("tests_gpu", "bench_base_eager", "bench_base_compiled", "train_small"):
        assert record[section]["skipped"] == "dry run (no GPU)" and record[section]["command"]
    assert "--compile" in record["bench_base_compiled"]["command"]
    assert "--compile" not in record["bench_base_eager"]["command"]
    assert "--preset small" in record["train_small"]["command"]
    assert record["train_small"]["gpu_busy"] == {"skipped": "dry run (no GPU)"}
    assert record["train_small"]["curve"]["train_seconds_step_tokens_per_s"] == []
    assert [row["met"] for row in record["targets"]] == [None] * len(gpu.TARGETS)   # nothing measured


def test_without_a_gpu_the_real_run_refuses_in_one_line():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit) as e:
        gpu.main([])
    assert e.value.code == 2


def test_pytest_counts():
    assert gpu.pytest_counts("...\n6 passed, 1 failed, 1 skipped in 80.1s\n") == {
        "passed": 6, "failed": 1, "skipped": 1, "errors": 0}
    assert gpu.pytest_counts("8 skipped in 0.5s") == {"passed": 0, "failed": 0, "skipped": 8, "errors": 0}
    assert gpu.pytest_counts("1 passed, 2 errors in 3s")["errors"] == 2
    assert gpu.pytest_counts("") == {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}


def test_dmon_busy_reads_the_sm_column_from_the_header():
    text = ("# gpu     sm    mem    enc    dec    jpg    ofa\n"
            "# Idx      %      %      %      %      %      %\n"
            "    0     95     40      0      0      -      -\n"
            "    0     80     35      0      0      -      -\n"
            "    0      -      -      -      -      -      -\n"
            "    0    100     50      0      0      -      -\n")
    busy = gpu.dmon_busy(text)
    assert busy["samples"] == 3 and busy["sm_busy_percent"] == [95.0, 80.0, 100.0]
    assert busy["sm_busy_mean_percent"] == round(275 / 3, 1)
    assert busy["share_of_samples_at_least_90_percent"] == round(2 / 3, 3)
    assert gpu.dmon_busy("") == {"samples": 0}


def test_training_curve_reads_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": 50, "seconds": 3.0, "tokens_per_second": 1000.0, "batch_wait_seconds": 0.1,
             "step_seconds": 2.5, "device_wait_seconds": 0.2, "cuda_mallocs": 40, "cuda_alloc_retries": 1},
            {"kind": "train", "step": 100, "seconds": 6.0, "tokens_per_second": 3000.0},
            {"kind": "eval", "step": 100, "seconds": 8.0, "val_loss": 4.0, "bleu_lc_tok": 12.5, "epoch": 0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curve = gpu.training_curve(metrics)
    assert curve["train_seconds_step_tokens_per_s"] == [[3.0, 50, 1000.0], [6.0, 100, 3000.0]]
    assert curve["best_window_tokens_per_s"] == 3000.0
    assert curve["step_waits_s_mallocs_retries"][0] == [50, 0.1, 2.5, 0.2, 40, 1]
    assert curve["step_waits_s_mallocs_retries"][1] == [100, None, None, None, None, None]   # a record from before
    assert curve["evaluations"] == [{"step": 100, "seconds": 8.0, "val_loss": 4.0, "bleu_lc_tok": 12.5}]
    assert gpu.training_curve(tmp_path / "absent.jsonl")["best_window_tokens_per_s"] is None



def test_targets_set_each_goal_beside_what_the_run_measured():
    record = {"train_small": {"gpu_busy": {"sm_busy_mean_percent": 93.4}, "results": {"bleu_lc_tok": 38.2}},
              "bench_base_compiled": {"result": {"flops": {"mfu": {"ours": 0.412, "nn": 0.3}},
                                                 "speedup_vs_nn": 1.31}},
              "bench_base_eager": {"skipped": "dry run (no GPU)"}}
    assert [(r["measured"], r["goal"], r["met"]) for r in gpu.targets(record)] == [
        (93.4, 90, True), (41.2, 35, True), (1.31, 1.5, False), (38.2, 40, False)]
    assert [r["met"] for r in gpu.targets({"train_small": {"exit_code": 1}})] == [None] * 4   # a failed step
