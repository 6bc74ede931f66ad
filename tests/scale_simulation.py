"""Issue 32's simulation at WMT scale, on this machine: a synthetic corpus of 4.5 million sentence pairs
built from Multi30k, through `prepare` and the loader of `train --data DIR`.

    python tests/scale_simulation.py --work /root/sim --out book/results/scale/simulation-xeon.json

What it measures (appendix F, "Scaling up", reads the JSON):
- the corpus: pairs, words per English sentence (mean, 99th percentile), its size as text;
- `prepare` (a child process): wall time, peak resident memory, the prepared directory's size;
- the loader on one thread: one epoch's batches of 25,000 padded slots computed from the lengths
  (seconds, bytes held), then `ShardedCorpus.collate` of every piece of the first 400 steps, as target
  tokens per second;
- `train --data DIR` (a child process, the `tiny` model, one thread, 30 steps) on the 4.5M-pair corpus
  and on Multi30k prepared the same way: peak resident memory of each; their difference is what the
  corpus's size costs a training process.

The synthetic pairs: each joins k Multi30k training pairs drawn at random, k = 1 + Poisson(0.9),
at most 6, German with German and English with English. Multi30k's English captions have about 12
words; the join targets a mean near 23 words with a long tail, our assumption for the news text
of WMT14 (the simulation is about memory and throughput, which scale with tokens; the measured
mean is recorded). Nothing here is a test: it takes about half an hour and is not run by pytest.
"""
import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def child(argv: list[str]) -> tuple[float, int]:
    "Run a child process; (wall seconds, its own peak resident memory in bytes, from wait4)."
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{err[-3000:]}")
    return seconds, usage.ru_maxrss * 1024                     # KiB on Linux


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def synthesize(out: Path, pairs: int, seed: int = 0) -> dict:
    from transformer.data import load_multi30k
    train = load_multi30k("de", "en", "train", progress=False)
    rng = np.random.default_rng(seed)
    k = np.minimum(1 + rng.poisson(0.9, pairs), 6)
    picks = rng.integers(0, len(train), int(k.sum()))
    words = np.empty(pairs, np.int32)
    with open(out / "train.de", "w", encoding="utf-8") as de, open(out / "train.en", "w", encoding="utf-8") as en:
        at = 0
        for i, n in enumerate(k.tolist()):
            chosen = [train[j] for j in picks[at:at + n].tolist()]
            at += n
            de.write(" ".join(s for s, _ in chosen) + "\n")
            english = " ".join(t for _, t in chosen)
            en.write(english + "\n")
            words[i] = len(english.split())
    return {"pairs": pairs, "joined_per_pair_mean": float(k.mean()),
            "en_words_mean": float(words.mean()), "en_words_p99": float(np.percentile(words, 99)),
            "en_words_max": int(words.max()),
            "text_bytes": (out / "train.de").stat().st_size + (out / "train.en").stat().st_size}


def loader(corpus_dir: Path, batch_tokens: int, steps: int) -> dict:
    import tracemalloc

    import torch

    from transformer.engine.corpus import ShardedCorpus
    torch.set_num_threads(1)
    corpus = ShardedCorpus(corpus_dir, verify=False, max_len=256)
    start = time.perf_counter()
    epoch = corpus.epoch_batches(batch_tokens, 0, 0)
    batch_seconds = time.perf_counter() - start
    tracemalloc.start()                        # again, measured apart: tracing slows Python down
    corpus.epoch_batches(batch_tokens, 0, 1)
    batch_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    tokens, slots = 0, 0
    start = time.perf_counter()
    for step in epoch[:steps]:
        for piece in step:
            src, tgt = corpus.collate(piece)
            tokens += int((tgt[:, 1:] != 0).sum())
            slots += tgt.numel()
    collate_seconds = time.perf_counter() - start
    epoch_tokens = int(corpus.tgt_lengths.sum()) - len(corpus)
    return {"pairs": len(corpus), "steps_per_epoch": len(epoch), "epoch_batches_seconds": batch_seconds,
            "epoch_batches_peak_bytes": batch_peak, "epoch_target_tokens": epoch_tokens,
            "collated_steps": min(steps, len(epoch)), "collated_target_tokens": tokens,
            "collated_target_slots": slots, "collate_seconds": collate_seconds,
            "collate_target_tokens_per_second": tokens / collate_seconds,
            "target_tokens_per_second_with_batching": (
                tokens / (collate_seconds + batch_seconds * min(steps, len(epoch)) / len(epoch)))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="a directory for the corpus (several GB)")
    p.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    p.add_argument("--pairs", type=int, default=4_500_000)
    p.add_argument("--vocab-size", type=int, default=8000)
    args = p.parse_args()
    data = Path(os.environ.get("TRANSFORMER_DATA", "")) / "multi30k"
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    result = {"cpu": cpu_name(), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    import torch
    result["torch"] = torch.__version__
    if not (work / "train.en").exists() or (work / "train.en").stat().st_size == 0:
        start = time.perf_counter()
        result["corpus"] = synthesize(work, args.pairs)
        result["corpus"]["synthesize_seconds"] = time.perf_counter() - start
        (work / "corpus.json").write_text(json.dumps(result["corpus"]))
    else:
        result["corpus"] = json.loads((work / "corpus.json").read_text())
    held_out = ["--val-files", str(data / "val.de.gz"), str(data / "val.en.gz"),
                "--test-files", str(data / "test_2016_flickr.de.gz"), str(data / "test_2016_flickr.en.gz")]
    prepared = work / "prepared"
    shutil.rmtree(prepared, ignore_errors=True)
    seconds, peak = child([sys.executable, "-m", "transformer", "prepare", "--src-files", str(work / "train.de"),
                           "--tgt-files", str(work / "train.en"), "--out", str(prepared), "--vocab-size",
                           str(args.vocab_size), "--quiet", *held_out])
    manifest = json.loads((prepared / "manifest.json").read_text())
    result["prepare"] = {"seconds": seconds, "peak_rss_bytes": peak, "dir_bytes": dir_bytes(prepared),
                         "shards": len(manifest["shards"]), "dtype": manifest["dtype"],
                         "tokens": sum(s["src_tokens"] + s["tgt_tokens"] for s in manifest["shards"]),
                         "sample_sentences": manifest["tokenizer"]["sample_sentences"]}
    print(json.dumps(result["prepare"]), flush=True)
    result["loader"] = loader(prepared, 25_000, 400)
    print(json.dumps(result["loader"]), flush=True)
    small = work / "multi30k-prepared"
    shutil.rmtree(small, ignore_errors=True)
    child([sys.executable, "-m", "transformer", "prepare", "--src-files", str(data / "train.de.gz"),
           "--tgt-files", str(data / "train.en.gz"), "--out", str(small), "--vocab-size", str(args.vocab_size),
           "--quiet", *held_out])
    train = [sys.executable, "-m", "transformer", "train", "--preset", "tiny", "--max-steps", "30",
             "--eval-every", "30", "--eval-sentences", "16", "--beam", "1", "--average", "0", "--threads", "1",
             "--quiet", "--src", "de", "--tgt", "en"]
    runs = {}
    for name, corpus in (("multi30k", small), ("simulated", prepared)):   # the smaller first: peaks only grow
        out = work / f"train-{name}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, peak = child([*train, "--data", str(corpus), "--out", str(out)])
        runs[name] = {"seconds": seconds, "peak_rss_bytes": peak}
    runs["corpus_cost_bytes"] = runs["simulated"]["peak_rss_bytes"] - runs["multi30k"]["peak_rss_bytes"]
    result["train"] = runs
    print(json.dumps(runs), flush=True)
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
