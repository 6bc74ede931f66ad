"""Appendix C, issue 42: train's model and training flags are generated from the config dataclasses, each named
after its field (- for _), the preset filling what is not given; the older names stay aliases."""
import contextlib
import io
import os
from dataclasses import fields
from typing import get_args, get_type_hints

import pytest
import torch

from transformer.__main__ import main
from transformer.cli.commands import CONFIG_FLAGS, build_parser
from transformer.cli.train import _configs
from transformer.engine.loop import RunConfig
from transformer.model import POSITIONS, PRESETS, TransformerConfig
from transformer.modern.gpt import ARCHS

V = 300                                                    # the vocabulary the tokenizer would give
FROM_TOKENIZER = {"src_vocab", "tgt_vocab", "pad_id"}      # set by --vocab-size and the tokenizer, no flag of their own


def configs(*flags, preset="tiny"):
    return _configs(build_parser().parse_args(["train", "--preset", preset, *map(str, flags)]), V)


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def config_fields():
    "Every field train can set: chapter 7.1's and chapter 8's configs, and chapter 19.1's `arch`."
    hints = {**get_type_hints(TransformerConfig), "arch": str, **get_type_hints(RunConfig)}
    return {name: kind for name, kind in hints.items() if name not in FROM_TOKENIZER}


def test_every_config_field_has_a_flag_of_its_own_name():
    assert {f.name for f in fields(TransformerConfig)} & {f.name for f in fields(RunConfig)} == set()
    assert set(CONFIG_FLAGS) == set(config_fields())
    options = {o: a for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
               for o in a.option_strings}
    for name in config_fields():
        flag = "--" + name.replace("_", "-")
        assert CONFIG_FLAGS[name][0] == flag and options[flag].dest == name, name
        assert options[flag].help, f"{flag} has no help"


def _another_value(name, kind, now):
    "A valid value of field `name` other than `now` (the preset's), as the command line writes it."
    kind = next(k for k in (bool, int, float, str) if k in (kind, *get_args(kind)))
    if kind is bool:
        return not now
    if kind is str:
        return next(c for c in {"positions": POSITIONS, "arch": ARCHS}[name] if c != now)
    if kind is float:
        return 0.25 if now != 0.25 else 0.5
    return 2 * now if now else 3                           # doubled: d_model stays divisible by h


@pytest.mark.parametrize("name", sorted(config_fields()))
def test_each_field_flag_sets_its_field(name):
    kind = config_fields()[name]
    model, train = configs()
    config = train if name in RunConfig.__dataclass_fields__ else model
    value = _another_value(name, kind, getattr(config, name, "encoder-decoder"))
    flag = CONFIG_FLAGS[name][0]
    argv = [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, value]
    model, train = configs(*argv)
    assert getattr(train if name in RunConfig.__dataclass_fields__ else model, name) == value


# every flag train had before issue 42 -> the field it sets, and the config's own name for it
OLD_FLAGS = [  # (old flags, new flags, the fields they set)
    (["--heads", 2], ["--h", 2], dict(h=2)),
    (["--layers", 3], ["--n-layers", 3], dict(n_layers=3)),
    (["--average", 4], ["--keep-checkpoints", 4], dict(keep_checkpoints=4)),
    (["--norm", "pre"], ["--norm-first"], dict(norm_first=True)),
    (["--norm", "post"], ["--no-norm-first"], dict(norm_first=False)),
    (["--d-model", 32], ["--d-model", 32], dict(d_model=32)),
    (["--d-ff", 48], ["--d-ff", 48], dict(d_ff=48)),
    (["--d-k", 8], ["--d-k", 8], dict(d_k=8)),
    (["--positions", "learned"], ["--positions", "learned"], dict(positions="learned")),
    (["--arch", "decoder-only"], ["--arch", "decoder-only"], dict(arch="decoder-only")),
    (["--dropout", 0.2], ["--dropout", 0.2], dict(dropout=0.2)),
    (["--attention-dropout", 0.1], ["--attention-dropout", 0.1], dict(attention_dropout=0.1)),
    (["--ffn-dropout", 0.1], ["--ffn-dropout", 0.1], dict(ffn_dropout=0.1)),
    (["--max-steps", 7], ["--max-steps", 7], dict(max_steps=7)),
    (["--max-minutes", 1.5], ["--max-minutes", 1.5], dict(max_minutes=1.5)),
    (["--seed", 5], ["--seed", 5], dict(seed=5)),
    (["--compile"], ["--compile"], dict(compile=True)),
    (["--batch-tokens", 900], ["--batch-tokens", 900], dict(batch_tokens=900)),
    (["--accum-steps", 2], ["--accum-steps", 2], dict(accum_steps=2)),
    (["--warmup", 9], ["--warmup", 9], dict(warmup=9)),
    (["--lr-scale", 0.5], ["--lr-scale", 0.5], dict(lr_scale=0.5)),
    (["--label-smoothing", 0], ["--label-smoothing", 0], dict(label_smoothing=0.0)),
    (["--clip-norm", 0], ["--clip-norm", 0], dict(clip_norm=None)),        # 0: off
    (["--clip-norm", 2], ["--clip-norm", 2], dict(clip_norm=2.0)),
    (["--subword-dropout", 0.1], ["--subword-dropout", 0.1], dict(subword_dropout=0.1)),
    (["--cpu-bf16"], ["--cpu-bf16"], dict(cpu_bf16=True)),
    (["--no-cpu-bf16"], ["--no-cpu-bf16"], dict(cpu_bf16=False)),
    (["--eval-every", 11], ["--eval-every", 11], dict(eval_every=11)),
    (["--log-every", 3], ["--log-every", 3], dict(log_every=3)),
    (["--snapshot-every", 6], ["--snapshot-every", 6], dict(snapshot_every=6)),
]


@pytest.mark.parametrize("old, new, want", OLD_FLAGS, ids=[" ".join(map(str, o[0])) for o in OLD_FLAGS])
def test_an_old_flag_still_sets_what_it_set(old, new, want):
    for flags in (old, new):
        model, train = configs(*flags)
        assert {k: getattr(train if k in RunConfig.__dataclass_fields__ else model, k) for k in want} == want
    assert configs(*old) == configs(*new)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_preset_fills_every_flag_not_given(preset):
    "The config's defaults stay the single source: a flag left out is unset, and the configs are the preset's."
    args = build_parser().parse_args(["train", "--preset", preset])
    assert all(getattr(args, name) is None for name in CONFIG_FLAGS)
    assert _configs(args, V) == (TransformerConfig.preset(preset, src_vocab=V, tgt_vocab=V), RunConfig.preset(preset))


def test_help_lists_each_group_and_every_flag():
    code, out, _ = run("train", "--help")
    assert code == 0
    for group in ("run:", "model: TransformerConfig", "training: RunConfig", "evaluation:"):
        assert f"\n{group}" in out, group
    for flags in CONFIG_FLAGS.values():
        assert all(flag in out for flag in flags), flags
    groups = out.split("\n\n")                          # the usage, the description, then a paragraph a group
    model, = (g for g in groups if g.startswith("model: "))
    assert "\n  --d-model N" in model and "\n  --h N, --heads N" in model and "--batch-tokens" not in model


@pytest.mark.parametrize("argv, match", [
    # an error names the flag as typed, the field's name or the older alias
    (["--h", "0"], "argument --h: 0 must be > 0"),
    (["--heads", "0"], "argument --heads: 0 must be > 0"),
    (["--n-layers", "0"], "argument --n-layers: 0 must be > 0"),
    (["--keep-checkpoints", "-1"], "argument --keep-checkpoints: -1 must be >= 0"),
    (["--beta2", "1"], "argument --beta2: 1 must be in [0, 1)"),
    (["--adam-eps", "0"], "argument --adam-eps: 0 must be > 0"),
    (["--max-len", "0"], "argument --max-len: 0 must be > 0"),
    (["--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["--h"], "argument --h: expected one argument"),
    (["--buckets", "0"], "argument --buckets: 0 must be > 0"),
    (["--buckets", "8"], "error: --buckets 8 pads batches for a compiled step; add --compile, or drop --buckets"),
    (["--preset", "tiny", "--d-model", "100", "--h", "3"], "error: --d-model 100 is not divisible by --h 3; choose"),
    (["--preset", "tiny", "--n-layers", "2", "--heads", "3"], "error: --d-model 64 is not divisible by --heads 3"),
])
def test_a_wrong_value_is_one_line_in_the_flags_words(argv, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                            # train's default --out is runs/<preset>-de-en
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        monkeypatch.setenv(name, os.environ.get(name, "1024"))   # train sets it on a CPU: put back after
    code, out, err = run("train", *argv)
    assert code in (1, 2) and out == "" and err.count("\n") == 1 and match in err, err
    assert list(tmp_path.iterdir()) == [], "a refused command left files behind"


def test_eval_share_defaults_to_a_tenth_and_takes_a_share():
    "train --eval-share: the evaluations' most share of the run's time (appendix E.2); 1 evaluates every --eval-every."
    from transformer.cli.commands import CLIError, build_parser
    parse = build_parser().parse_args
    assert parse(["train"]).eval_share == 0.1 and parse(["train", "--eval-share", "1"]).eval_share == 1
    for bad in ("0", "-0.1", "1.5", "x"):
        with pytest.raises(CLIError, match="argument --eval-share: "):
            parse(["train", "--eval-share", bad])


def test_buckets_default_to_one_graph_of_dynamic_shapes():
    "train --buckets M (appendix E.2's train(buckets=M)) is off unless asked for."
    parse = build_parser().parse_args
    assert parse(["train"]).buckets is None and parse(["train", "--compile", "--buckets", "8"]).buckets == 8
