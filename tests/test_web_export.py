"""Issue 31, appendix I (transformer/cli/web.py): the model for the browser. The shipped files in
book/model/web/ (tokenizer.json, the two ONNX graphs, the shared int8 embedding, config.json) are what
`export_web` writes, their sha256 are recorded, they weigh at most 10 MB, and the graphs keep their
batch and length dimensions dynamic: run at shapes other than the export's example, they equal the
PyTorch modules (1e-4 in float32; the measured bounds of the notebook in int8). `export --web`
writes them and says so, and says what to install when onnx or onnxruntime is missing. The BLEU of
the int8 graphs on all 1,000 test sentences is the notebook's (book/i_web.ipynb)."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from transformer.cli import web
from transformer.engine.trained import load
from transformer.masking import causal_mask, padding_mask
from transformer.model import Transformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "book" / "model"
WEB = MODEL / "web"

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def shipped():
    return load(MODEL)


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", src_vocab=300, tgt_vocab=300, tie_embeddings=True)
    return Transformer(config).eval()


def inputs(B, S, T, vocab, seed=0):
    "Random ids (B, S) and (B, T) with one padded source row: shapes unlike the export's (2, 4, 2)."
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (B, S), generator=g)
    src[:, -1] = 3
    if B > 1:
        src[1, S // 2:], src[1, S // 2 - 1] = 0, 3
    tgt = torch.randint(4, vocab, (B, T), generator=g)
    tgt[:, 0] = 2
    return src, tgt


def differences(model, web_dir, B, S, T):
    "max |ONNX - PyTorch| of the memory, the log-probabilities and the cross-attention."
    src, tgt = inputs(B, S, T, model.config.src_vocab)
    with torch.no_grad():
        memory = web.WebEncoder(model).eval()(src)
        log_probs, cross = web.WebDecoder(model).eval()(tgt, memory, src)
    runner = web.WebModel(web_dir)
    m = runner.encode(src.numpy())
    lp, cr = runner.step(tgt.numpy(), memory.numpy(), src.numpy())
    assert m.shape == (B, S, model.config.d_model) and lp.shape == (B, model.config.tgt_vocab)
    assert cr.shape == (model.config.n_layers, B, model.config.h, S)
    return (np.abs(m - memory.numpy()).max(), np.abs(lp - log_probs.numpy()).max(),
            np.abs(cr - cross.numpy()).max())


# --- the shipped files -------------------------------------------------------------------------------

def test_tokenizer_json_has_the_agreed_format_and_is_current(shipped):
    tj = json.loads((WEB / "tokenizer.json").read_text(encoding="utf-8"))
    assert list(tj) == ["format", "model_type", "pieces", "unk_id", "bos_id", "eos_id", "pad_id",
                        "normalizer", "tokenizer_sha256"]
    assert tj == web.tokenizer_json(shipped.tokenizer)
    assert tj["format"] == "transformer-book/sentencepiece-bpe/1" and tj["model_type"] == "bpe"
    assert tj["normalizer"] == {"name": "nmt_nfkc", "add_dummy_prefix": True,
                                "remove_extra_whitespaces": True, "escape_whitespaces": True}
    assert tj["tokenizer_sha256"] == hashlib.sha256((MODEL / "tokenizer.model").read_bytes()).hexdigest()
    sp = shipped.tokenizer.sp
    assert len(tj["pieces"]) == sp.get_piece_size()
    for i in (0, 1, 2, 3, 4, 100, 7999):
        piece, score, kind = tj["pieces"][i]
        assert piece == sp.id_to_piece(i) and score == sp.get_score(i)
        assert kind == {0: 3, 1: 2, 2: 3, 3: 3}.get(i, 1)     # pad, bos, eos control; unk unknown
    assert (tj["pad_id"], tj["unk_id"], tj["bos_id"], tj["eos_id"]) == (0, 1, 2, 3)


def test_config_records_every_file_and_the_shipped_decoding():
    config = json.loads((WEB / "config.json").read_text())
    results = json.loads((MODEL / "results.json").read_text())
    assert set(config["sha256"]) == {"encoder.onnx", "decoder.onnx", web.EMBEDDING_FILE, "tokenizer.json"}
    for name, digest in config["sha256"].items():
        assert hashlib.sha256((WEB / name).read_bytes()).hexdigest() == digest, name
    assert config["beam_size"] == results["source_results"]["beam"]
    assert config["alpha"] == results["source_results"]["alpha"]
    assert config["weights_sha256"] == results["weights_sha256"]
    assert (config["pad_id"], config["unk_id"], config["bos_id"], config["eos_id"]) == (0, 1, 2, 3)
    assert config["precision"] == "int8" and config["max_len"] == web.WEB_MAX_LEN
    total = sum((WEB / n).stat().st_size for n in [*config["sha256"], "config.json"])
    assert total <= 10e6, total


def test_the_graphs_name_their_inputs_and_outputs_with_dynamic_dimensions():
    def io(graph):
        def dims(v):
            return [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        return ({v.name: (dims(v), v.type.tensor_type.elem_type) for v in graph.input},
                {v.name: (dims(v), v.type.tensor_type.elem_type) for v in graph.output})
    i64, f32 = onnx.TensorProto.INT64, onnx.TensorProto.FLOAT
    encoder = onnx.load(str(WEB / "encoder.onnx"), load_external_data=False)
    decoder = onnx.load(str(WEB / "decoder.onnx"), load_external_data=False)
    assert io(encoder.graph) == ({"src": (["batch", "src_len"], i64)},
                                 {"memory": (["batch", "src_len", 256], f32)})
    ins, outs = io(decoder.graph)
    assert ins == {"tgt": (["batch", "tgt_len"], i64), "memory": (["batch", "src_len", 256], f32),
                   "src": (["batch", "src_len"], i64)}
    assert outs["log_probs"] == (["batch", 8000], f32)
    assert outs["cross_attention"][0][0] == 3 and outs["cross_attention"][0][1:] == ["batch", 4, "src_len"]
    for graph in (encoder, decoder):                      # one external file: the shared embedding
        external = [t for t in graph.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        assert [(t.dims, {e.key: e.value for e in t.external_data}["location"]) for t in external] == \
            [([8000, 256], web.EMBEDDING_FILE)]


@pytest.mark.slow
def test_the_int8_graphs_stay_within_the_measured_bounds_at_new_shapes(shipped):
    model = shipped.model.float().eval()
    for B, S, T in ((1, 5, 1), (3, 17, 6)):   # the export's example: (2, 4, 2)
        memory, log_probs, cross = differences(model, WEB, B, S, T)
        assert log_probs < 0.5 and cross < 0.05, (B, S, T, memory, log_probs, cross)


def test_webmodel_greedy_follows_eos_and_padding(shipped):
    runner = web.WebModel(WEB)
    src = np.array([shipped.tokenizer.encode("Ein Hund läuft im Schnee.", eos=True)])
    (ids,) = runner.greedy(src)
    assert ids and 3 not in ids and 0 not in ids
    assert "dog" in shipped.tokenizer.decode(ids)


# --- export on a tiny random model: the mechanics, fast -------------------------------------------------

@pytest.mark.slow
def test_float32_graphs_equal_pytorch_at_shapes_other_than_the_example(tiny_model, tmp_path):
    web.export_graphs(tiny_model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"encoder": "encoder.onnx", "decoder": "decoder.onnx"}))
    for B, S, T in ((1, 3, 1), (3, 11, 5), (5, 30, 9)):
        assert max(differences(tiny_model, tmp_path, B, S, T)) < 1e-4, (B, S, T)


def test_the_wrapper_equals_the_chapters_decoding_path(tiny_model):
    src, tgt = inputs(3, 9, 4, 300)
    with torch.no_grad():
        log_probs, cross = web.WebDecoder(tiny_model).eval()(tgt, web.WebEncoder(tiny_model).eval()(src), src)
        mask = padding_mask(src)
        hidden = tiny_model.decode(tgt, tiny_model.encode(src, mask), mask, causal_mask(4))
        reference = tiny_model.generator(hidden[:, -1]).log_softmax(-1)
    assert (log_probs - reference).abs().max() < 1e-5
    assert torch.allclose(cross.sum(-1), torch.ones_like(cross.sum(-1)))
    assert (cross[:, 1, :, 9 // 2:] == 0).all()           # no weight on the padded source


@pytest.mark.slow
def test_quantize_int8_shares_one_embedding_and_shrinks_the_graphs(tiny_model, tmp_path):
    paths = web.export_graphs(tiny_model, tmp_path)
    before = sum(p.stat().st_size for p in paths)
    c = tiny_model.config
    shared = [web.quantize_int8(p, c.tgt_vocab, c.d_model) for p in paths]
    assert shared[0] == shared[1] == (tmp_path / web.EMBEDDING_FILE).read_bytes()
    after = sum(p.stat().st_size for p in paths) + len(shared[0])
    assert after < before / 2
    ops = {n.op_type for n in onnx.load(str(paths[1])).graph.node}
    assert "DequantizeLinear" in ops and "MatMulInteger" not in ops     # weight-only


# --- the command -------------------------------------------------------------------------------------------

def export(*argv, capsys):
    "`python -m transformer export --web ...`: the command table, `cmd_export`'s dispatch to `cmd_export_web`."
    from transformer.__main__ import main
    code = main(["export", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_export_parser_has_the_web_flag():
    from transformer.cli.commands import build_parser
    args = build_parser().parse_args(["export", "--web", "--model", "m", "--out", "o"])
    assert args.web and args.half and args.checkpoint == "chosen"
    assert not build_parser().parse_args(["export", "--model", "m", "--out", "o"]).web


def test_export_web_without_onnx_says_what_to_install(monkeypatch, tmp_path, capsys):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    code, out, err = export("--web", "--model", MODEL, "--out", tmp_path / "web", capsys=capsys)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert "onnxruntime not installed" in err and "pip install 'transformer-book[web]'" in err
    assert not (tmp_path / "web").exists()


def test_export_web_refuses_a_directory_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "x").write_text("x")
    code, out, err = export("--web", "--model", MODEL, "--out", tmp_path, capsys=capsys)
    assert code == 1 and "is not an empty directory" in err


@pytest.mark.slow
def test_export_web_writes_the_shipped_files(tmp_path, capsys):
    code, out, err = export("--web", "--model", MODEL, "--out", tmp_path / "web", capsys=capsys)
    assert code == 0, err
    assert "int8" in out and "MB in all" in out
    assert json.loads((tmp_path / "web" / "config.json").read_text()) == \
        json.loads((WEB / "config.json").read_text())
    for name in ("encoder.onnx", "decoder.onnx", "embedding.int8", "tokenizer.json", "config.json"):
        assert (tmp_path / "web" / name).read_bytes() == (WEB / name).read_bytes(), name   # byte for byte


@pytest.mark.slow
def test_float32_graphs_translate_test_sentences_as_pytorch_does(shipped, tmp_path, multi30k):
    from transformer.data import load_multi30k
    from transformer.engine.fast import translate
    web.export_web(MODEL, tmp_path, precision="float32")
    sources = [s for s, _ in load_multi30k("de", "en", "test_2016_flickr")][::25]   # 40 sentences
    assert web.WebModel(tmp_path).translate(shipped.tokenizer, sources) == \
        translate(shipped.model.float().eval(), shipped.tokenizer, sources, beam_size=1)
