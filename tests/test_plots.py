"""Appendix B.1, plots.py, and its commands `plot` and `attend` (appendix C): every figure holds the
data it was given (read back from its artists), every command writes a valid image, every bad input
is one line."""
import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # no display, whatever the environment says

import pytest
import torch

from transformer.__main__ import main
from transformer.engine.checkpoints import read_metrics
from transformer.engine.fast import translate
from transformer.engine.trained import load
from transformer.figures import plots
from transformer.heads import MultiHeadAttention
from transformer.positions import sinusoidal_encoding

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "book" / "results"
MODEL = ROOT / "book" / "model"
A_RUN = RESULTS / "xeon-de-en-dropout0.3"
SENTENCE = "Ein Mann fährt Fahrrad."
PNG, PDF = b"\x89PNG\r\n\x1a\n", b"%PDF-"


def run(*argv):
    "main(argv) in this process: (exit code, stdout, stderr)."
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def assert_image(path: Path, fmt: str):
    data = path.read_bytes()
    assert len(data) > 1000, f"{path}: {len(data)} bytes"
    if fmt == "png":
        assert data.startswith(PNG)
    elif fmt == "pdf":
        assert data.startswith(PDF) and data.rstrip().endswith(b"%%EOF")
    else:
        assert data.startswith(b"<?xml") and b"<svg" in data[:1000] and data.rstrip().endswith(b"</svg>")


def records(n_train: int, n_eval: int, scale: float) -> list[dict]:
    "A made-up metrics.jsonl: train records every 10 steps, eval records every 20."
    out = []
    for i in range(1, n_train + 1):
        out.append({"kind": "train", "step": 10 * i, "loss": scale * 8 / i, "nll": 7 / i,
                    "lr": 1e-3 * i / n_train, "seconds": 3.0 * i, "tokens_per_second": 100.0})
        if i % 2 == 0 and i // 2 <= n_eval:
            out.append({"kind": "eval", "step": 10 * i, "val_loss": scale * 6 / i, "val_nll": 5 / i,
                        "val_ppl": 9.0, "bleu": 3.0 * i, "seconds": 3.0 * i + 1})
    return out


# --- learning curves --------------------------------------------------------------------------

def test_learning_curves_hold_the_records_of_each_run():
    runs = {"first": records(6, 3, 1.0), "Größe-zwei": records(4, 0, 2.0)}   # the second: no evals yet
    fig = plots.learning_curves(runs)
    loss, bleu_step, bleu_time, lr = fig.axes
    assert [(ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes] == list(plots.CURVES)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["first", "Größe-zwei"]
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["training", "validation"]
    for i, (name, recs) in enumerate(runs.items()):
        train = [r for r in recs if r["kind"] == "train"]
        evals = [r for r in recs if r["kind"] == "eval"]
        t_loss, v_loss = loss.get_lines()[2 * i: 2 * i + 2]
        assert t_loss.get_label() == f"{name}: training loss" and t_loss.get_linestyle() == "-"
        assert v_loss.get_label() == f"{name}: validation loss" and v_loss.get_linestyle() == "--"
        assert t_loss.get_xydata().tolist() == [[r["step"], r["loss"]] for r in train]
        assert v_loss.get_xydata().tolist() == [[r["step"], r["val_loss"]] for r in evals]
        assert bleu_step.get_lines()[i].get_xydata().tolist() == [[r["step"], r["bleu"]] for r in evals]
        assert bleu_time.get_lines()[i].get_xydata().tolist() == [[r["seconds"] / 60, r["bleu"]]
                                                                   for r in evals]
        assert lr.get_lines()[i].get_xydata().tolist() == [[r["step"], r["lr"]] for r in train]
        # one colour per run, the same in every panel
        mine = [line for ax in fig.axes for line in ax.get_lines() if line.get_label().startswith(f"{name}:")]
        assert len(mine) == 5 and len({line.get_color() for line in mine}) == 1
    assert loss.get_lines()[0].get_color() != loss.get_lines()[2].get_color()
    # a panel with nothing to draw says so instead of staying blank
    empty = plots.learning_curves({"r": records(3, 0, 1.0)})
    assert [t.get_text() for t in empty.axes[1].texts] == ["no records yet"]
    assert [t.get_text() for t in empty.axes[0].texts] == []


def test_learning_curves_of_committed_run_directories():
    dirs = [RESULTS / "xeon-de-en", A_RUN]
    fig = plots.learning_curves(dirs)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [d.name for d in dirs]
    for i, d in enumerate(dirs):
        evals = [r for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "eval"]
        assert fig.axes[1].get_lines()[i].get_xydata().tolist() == [[r["step"], r["bleu"]] for r in evals]


def test_read_runs_names_and_errors(tmp_path):
    for parent in ("a", "b"):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records(2, 1, 1.0)))
    same = [tmp_path / "a" / "run", tmp_path / "b" / "run"]
    assert list(plots.read_runs(same)) == [str(p) for p in same]      # equal names: the paths
    assert list(plots.read_runs(same[0])) == ["run"]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    (tmp_path / "none").mkdir()
    for dirs, error, match in (([], ValueError, "no run directory"),
                               ([tmp_path / "nowhere"], FileNotFoundError, "no such run directory"),
                               ([tmp_path / "none"], FileNotFoundError, "holds no metrics.jsonl"),
                               ([tmp_path / "empty"], ValueError, "holds no records yet"),
                               ([same[0], same[0]], ValueError, "is given twice")):
        with pytest.raises(error, match=match):
            plots.read_runs(dirs)


# --- attention maps ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shipped():
    shipped = load(MODEL)
    model, tokenizer = shipped.model, shipped.tokenizer
    return model, tokenizer, plots.attention_weights(model, tokenizer, SENTENCE)


@pytest.mark.slow
def test_attention_weights_of_the_shipped_model(shipped):
    model, tokenizer, att = shipped
    N, h = model.config.n_layers, model.config.h
    assert att.translation == translate(model, tokenizer, [SENTENCE])[0]   # beam 4, as translate
    assert att.source == tokenizer.pieces(SENTENCE) + ["</s>"]
    assert att.read == ["<s>"] + att.written[:-1] and att.written[-1] == "</s>"
    S, T = len(att.source), len(att.written)
    assert att.encoder.shape == (N, h, S, S) and att.decoder.shape == (N, h, T, T)
    assert att.cross.shape == (N, h, T, S)
    for kind in plots.KINDS:
        assert torch.allclose(getattr(att, kind).sum(-1), torch.tensor(1.0), atol=1e-5), kind
    assert att.decoder.triu(1).abs().max() < 1e-6
    # the same numbers as a teacher-forced pass of our own, layer by layer
    src = torch.tensor([tokenizer.encode(SENTENCE, eos=True)])
    tgt_in = torch.tensor([[tokenizer.piece_to_id(p) for p in att.read]])
    layer = model.decoder.layers[-1].cross_attn
    # the last cross-attention's weights, recorded around the same teacher-forced pass
    with torch.no_grad(), plots.recording_attention([layer]) as records:
        model(src, tgt_in)
    assert len(records[layer]) == 1
    assert torch.allclose(records[layer][0][0], att.cross[-1], atol=1e-6)
    # and the model is left as it was: no hook asks for weights any more
    assert not model.training
    x = torch.zeros(1, 2, model.config.d_model)
    assert all(m(x, x, x)[1] is None for m in model.modules()
               if isinstance(m, MultiHeadAttention))


def test_recording_attention_asks_for_weights_passed_either_way():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad(), plots.recording_attention([mha]) as records:
        out, w = mha(x, x, x)                       # keyword default
        out2, w2 = mha(x, x, x, None, False)        # need_weights=False, positionally
    assert w is not None and w2 is not None and len(records[mha]) == 2
    assert torch.equal(records[mha][0], mha(x, x, x, need_weights=True)[1])
    assert mha(x, x, x)[1] is None                  # the hooks are gone after the block


@pytest.mark.slow
def test_attention_weights_leave_training_mode_and_take_a_beam(shipped):
    model, tokenizer, _ = shipped
    model.train()
    try:
        att = plots.attention_weights(model, tokenizer, SENTENCE, beam_size=2)
        assert model.training
    finally:
        model.eval()
    assert att.translation == translate(model, tokenizer, [SENTENCE], beam_size=2)[0]
    for bad in ("", "   "):
        with pytest.raises(ValueError, match="pass a sentence"):
            plots.attention_weights(model, tokenizer, bad)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(plots.KINDS))
def test_attention_maps_grid_of_every_layer_and_head(shipped, kind):
    model, _, att = shipped
    N, h = model.config.n_layers, model.config.h
    fig = plots.attention_maps(att, kind)
    maps, colorbar = fig.axes[:N * h], fig.axes[N * h:]
    assert len(maps) == N * h and len(colorbar) == 1 and colorbar[0].get_ylabel() == "attention weight"
    rows, cols = att.pieces(kind)
    assert (rows, cols) == {"encoder": (att.source, att.source), "decoder": (att.written, att.read),
                            "cross": (att.written, att.source)}[kind]
    for i, ax in enumerate(maps):
        layer, head = divmod(i, h)
        assert ax.get_title() == f"layer {layer + 1}, head {head + 1}"
        assert torch.equal(torch.tensor(ax.images[0].get_array()), getattr(att, kind)[layer, head])
        assert ax.images[0].get_clim() == (0.0, 1.0)
        # the pieces label the outer panels only: the bottom row and the left column
        assert [t.get_text() for t in ax.get_xticklabels()] == (cols if layer == N - 1 else [])
        assert [t.get_text() for t in ax.get_yticklabels()] == (rows if head == 0 else [])
    assert plots.KINDS[kind] in fig.get_suptitle() and att.translation in fig.get_suptitle()


@pytest.mark.slow
def test_attention_maps_one_layer_one_head_and_errors(shipped):
    model, _, att = shipped
    N, h = model.config.n_layers, model.config.h
    one = plots.attention_maps(att, "encoder", layer=2, head=3)
    assert len(one.axes) == 2 and one.axes[0].get_title() == "layer 2, head 3"
    assert torch.equal(torch.tensor(one.axes[0].images[0].get_array()), att.encoder[1, 2])
    row = plots.attention_maps(att, "cross", layer=N)
    assert [ax.get_title() for ax in row.axes[:h]] == [f"layer {N}, head {i + 1}" for i in range(h)]
    column = plots.attention_maps(att, "decoder", head=1)
    assert [ax.get_title() for ax in column.axes[:N]] == [f"layer {i + 1}, head 1" for i in range(N)]
    for kwargs, match in (({"layer": N + 1}, f"layer={N + 1} is out of range: the model has {N} layers"),
                          ({"layer": 0}, "layer=0 is out of range"),
                          ({"head": h + 1}, f"the model has {h} heads, numbered 1 to {h}"),
                          ({"head": 1.0}, "head=1.0 is out of range"),
                          ({"layer": True}, "layer=True"),
                          ({"kind": "self"}, "kind='self' is not one of encoder, decoder, cross")):
        with pytest.raises(ValueError, match=match):
            plots.attention_maps(att, **{"kind": "cross", **kwargs})


def _glyph_warnings(draw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        draw()
    return [str(w.message) for w in caught if "missing from font" in str(w.message)]


@pytest.mark.slow
def test_german_text_has_every_glyph_whatever_the_default_font(shipped):
    _, _, att = shipped
    runs = {"Läufe mit Größe": records(3, 1, 1.0)}
    with matplotlib.rc_context({"font.family": "cmr10"}):   # a font without umlauts
        # the control: a figure of our own in that font misses glyphs ...
        control = matplotlib.figure.Figure()
        control.text(0.5, 0.5, "fährt ▁Größe")
        assert _glyph_warnings(lambda: control.savefig(io.BytesIO(), format="png"))
        # ... ours do not, drawn and saved in every format
        # one panel of the map (it shows both its axes' pieces: the German source and the English
        # written pieces, with their ▁): the grid's other panels are the same code, and cost 6x more
        figs = [plots.attention_maps(att, "cross", layer=1, head=1), plots.learning_curves(runs)]
        for fig in figs:
            for fmt in plots.FORMATS:
                assert _glyph_warnings(lambda fig=fig, fmt=fmt: plots.to_bytes(fig, fmt)) == [], fmt
    assert len(figs[0].axes) == 2                                   # the panel and its colour bar
    labels = figs[0].axes[0].get_yticklabels() + figs[0].axes[0].get_xticklabels()
    assert {t.get_fontfamily()[0] for t in labels} == {plots.FONT}
    assert any("ä" in t.get_text() for t in labels) and any("▁" in t.get_text() for t in labels)


# --- the positional-encoding table ------------------------------------------------------------

def test_positional_encoding_is_the_table():
    fig = plots.positional_encoding(30, 16)
    ax, colorbar = fig.axes
    assert torch.equal(torch.tensor(ax.images[0].get_array()), sinusoidal_encoding(30, 16))
    assert ax.images[0].get_clim() == (-1.0, 1.0)
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("dimension", "position")
    assert "max_len=30, d_model=16" in ax.get_title() and colorbar.get_ylabel() == "PE[position, dimension]"
    with pytest.raises(ValueError, match="d_model=15"):
        plots.positional_encoding(30, 15)


# --- files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", plots.FORMATS)
@pytest.mark.slow
def test_save_figure_writes_the_format_of_the_extension_and_the_same_bytes_twice(tmp_path, fmt):
    path = plots.save_figure(plots.positional_encoding(20, 8), tmp_path / f"pe.{fmt.upper()}")   # any case
    assert_image(path, fmt)
    # the same figure made again gives the same file: no dates, no random SVG ids
    assert plots.to_bytes(plots.positional_encoding(20, 8), fmt) == path.read_bytes()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]        # no temporary file left


def test_save_figure_refuses_unknown_formats_and_leaves_nothing(tmp_path):
    fig = plots.positional_encoding(20, 8)
    for name in ("pe.jpg", "pe", "pe.png.txt"):
        with pytest.raises(ValueError, match="unknown image format .*png, .*svg or .*pdf"):
            plots.save_figure(fig, tmp_path / name)
    with pytest.raises(ValueError, match="fmt='eps'"):
        plots.to_bytes(fig, "eps")
    with pytest.raises(FileNotFoundError):
        plots.save_figure(fig, tmp_path / "missing" / "pe.png")
    assert list(tmp_path.iterdir()) == []


def test_figures_never_reach_pyplot():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plots.positional_encoding(10, 8)
    plots.learning_curves({"r": records(2, 1, 1.0)})
    assert plt.get_fignums() == before


# --- the commands -----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", plots.FORMATS)
@pytest.mark.slow
def test_plot_command_writes_the_image(tmp_path, fmt):
    out = tmp_path / f"curves.{fmt}"
    code, stdout, err = run("plot", RESULTS / "xeon-de-en", A_RUN, "--out", out)
    assert code == 0 and err == "", err
    assert stdout == f"wrote {out}: learning curves of xeon-de-en, {A_RUN.name}\n"
    assert_image(out, fmt)


@pytest.mark.slow
def test_commands_write_deterministic_default_names_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("plot", A_RUN)[0] == 0
    assert run("attend", "--model", MODEL, SENTENCE)[0] == 0
    code, stdout, err = run("attend", "--model", MODEL, "--kind", "encoder", "--layer", 1, "--head", 2, SENTENCE)
    assert code == 0 and err == "", err
    assert stdout == ("wrote attention-encoder-layer1-head2.png: encoder self-attention of "
                      "'Ein Mann fährt Fahrrad.' -> 'A man riding a bike.'\n")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["attention-cross.png", "attention-encoder-layer1-head2.png", "curves.png"]
    for name in names:
        assert_image(tmp_path / name, "png")
    first = (tmp_path / "curves.png").read_bytes()
    assert run("plot", A_RUN)[0] == 0 and (tmp_path / "curves.png").read_bytes() == first   # replaced, same


def _bad_cases(tmp: Path) -> list:
    (tmp / "not-a-run").mkdir()
    (tmp / "afile").write_text("x")
    (tmp / "no-model").mkdir()
    ok = ["--out", tmp / "ok.png"]
    return [
        ("no such run directory", ["plot", tmp / "nowhere", *ok], 1, "no such run directory"),
        ("directory without metrics", ["plot", tmp / "not-a-run", *ok], 1, "holds no metrics.jsonl"),
        ("one good run, one without metrics", ["plot", A_RUN, tmp / "not-a-run", *ok], 1,
         "holds no metrics.jsonl"),
        ("no run at all", ["plot", *ok], 2, "the following arguments are required: RUN_DIR"),
        ("unknown extension", ["plot", A_RUN, "--out", tmp / "c.jpg"], 1, "unknown image format .jpg"),
        ("no extension", ["plot", A_RUN, "--out", tmp / "curves"], 1, "unknown image format (no extension)"),
        ("--out is a directory", ["plot", A_RUN, "--out", tmp], 1, "is a directory"),
        ("--out in a missing directory", ["plot", A_RUN, "--out", tmp / "nowhere" / "c.png"], 1,
         "there is no directory"),
        ("--out under a file", ["plot", A_RUN, "--out", tmp / "afile" / "c.png"], 1, "there is no directory"),
        ("missing model", ["attend", "--model", tmp / "nowhere", SENTENCE, *ok], 1, "no such directory"),
        ("directory without a model", ["attend", "--model", tmp / "no-model", SENTENCE, *ok], 1,
         "holds no model"),
        ("layer the model lacks", ["attend", "--model", MODEL, "--layer", 4, SENTENCE, *ok], 1,
         "--layer 4: the model has 3 layers; pass 1 to 3"),
        ("head the model lacks", ["attend", "--model", MODEL, "--head", 5, SENTENCE, *ok], 1,
         "--head 5: the model has 4 heads; pass 1 to 4"),
        ("layer 0", ["attend", "--model", MODEL, "--layer", 0, SENTENCE, *ok], 2, "--layer: 0 must be > 0"),
        ("head not a number", ["attend", "--model", MODEL, "--head", "two", SENTENCE, *ok], 2,
         "'two' is not a number"),
        ("unknown kind", ["attend", "--model", MODEL, "--kind", "self", SENTENCE, *ok], 2, "invalid choice"),
        ("empty sentence", ["attend", "--model", MODEL, " ", *ok], 1, "no sentence"),
        ("unknown extension, attend", ["attend", "--model", MODEL, SENTENCE, "--out", tmp / "a.gif"], 1,
         "unknown image format .gif"),
    ]


@pytest.mark.slow
def test_every_bad_input_is_one_line_and_writes_nothing(tmp_path):
    for what, argv, expected, match in _bad_cases(tmp_path):
        code, out, err = run(*argv)
        assert code == expected, (what, err)
        assert out == "" and err.count("\n") == 1 and err.startswith("error: "), (what, err)
        assert "Traceback" not in err and match in err, (what, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "no-model", "not-a-run"]


def test_a_failed_write_is_one_line(tmp_path, monkeypatch):
    def refuse(fig, path, dpi=150):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(plots, "save_figure", refuse)
    code, out, err = run("plot", A_RUN, "--out", tmp_path / "c.png")
    assert (code, out) == (1, "") and err == f"error: --out {tmp_path / 'c.png'}: could not write it " \
                                             "(permission denied)\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_directory_is_refused_before_any_work(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, out, err = run("plot", A_RUN, "--out", locked / "c.png")
    finally:
        locked.chmod(0o700)
    assert code == 1 and "cannot write there" in err and list(locked.iterdir()) == []


@pytest.mark.slow
def test_python_dash_m_plot(tmp_path):
    """The figures' commands as a user runs them, in a fresh process (nothing has chosen matplotlib's
    backend), from a directory of their own, with no screen and no backend named. One process: `plot`,
    the cheaper of the two. attend, in this process: it writes its default names here
    (test_commands_write_deterministic_default_names_in_the_current_directory), and its --out goes
    through the same writer as plot's, whose every format test_plot_command_writes_the_image checks
    (attend's own --out reaches it: the bad case 'unknown extension, attend'). A bad input's one line
    and exit status: test_every_bad_input_is_one_line_and_writes_nothing, and test_cli's
    test_python_dash_m_runs_main for `python -m`'s exit status."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND")}
    env["PYTHONPATH"] = str(ROOT)                      # no screen, no backend named
    plot = subprocess.run([sys.executable, "-m", "transformer", "plot", str(A_RUN)],
                          cwd=tmp_path, capture_output=True, text=True, env=env)
    assert plot.returncode == 0 and plot.stderr == "", plot.stderr
    assert plot.stdout == f"wrote curves.png: learning curves of {A_RUN.name}\n"
    assert_image(tmp_path / "curves.png", "png")
