"""Issue 31, the translator's JavaScript (book/_static/translator/) against the Python it copies, run in
Node: the tokenizer gives sentencepiece's ids on every sentence of Multi30k val and test_2016_flickr
(German and English), on hand-picked hard inputs and on random strings of mixed scripts; its
normalizer matches every rule of the model's compiled nmt_nfkc table; greedy and beam search choose
what transformer/decoding.py chooses on the same fake model; and `node --test tests/js/` (the unit
tests). The tokenizer is checked twice: from book/model/web/tokenizer.json as committed and from a
copy that carries the model's compiled table (normalizer.precompiled_charsmap, exact everywhere). Node missing: a skip with the
way to get it, but a failure under CI (which installs it), as tests/test_book.py treats the browser."""
import base64
import hashlib
import json
import os
import random
import shutil
import subprocess
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import torch

from transformer.decoding import length_penalty
from transformer.engine.fast import beam_search, greedy_search
from transformer.tokens import BOS, EOS, PAD, pad_batch

pytestmark = pytest.mark.slow  # every test starts Node

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "book" / "model"
TOKENIZER_JSON = MODEL / "web" / "tokenizer.json"
RUN_CASES = ROOT / "tests" / "js" / "run_cases.mjs"
NO_NODE = ("no Node.js found: the translator's JavaScript checks skipped; install Node 20 or newer "
           "(Debian: apt-get install nodejs), or set TRANSFORMER_NODE=/path/to/node")

# Inputs where a tokenizer that is only nearly sentencepiece's goes wrong.
TRICKY = [
    "", " ", "   ", "\t\n", "Ein  Hund", " Ein Hund ", "Ein\tHund\n", "Ein\u00a0Hund", "Ein\u3000Hund",
    "ＡＢＣ ｈｕｎｄ １２３", "Cafe\u0301 na\u0308", "Café", "a\u0308\u0301", "e\u0301\u0323", "Ä Ö Ü ä ö ü ß",
    "a\x01b\x7fc\x9fd", "a\x00b", "x\u200by\u200cz\ufeff", "\u2581Hund \u2581\u2581 x", "a\ufffdb", "～~",
    "Hund 🐶🐕 ok", "🐶", "中文字 中 文", "ﬁ ½ ² ™ ℃ Ⅻ ⑴", "\u00a8 \u00b4 x", "Straße!!! ... ---", "<s> </s> <unk> <pad>",
    "naïve façade coöperate", "Ελληνικά Русский עברית العربية", "\u0301a", "A\u030a \u212b \u00c5",
    "1,000.50 € $ £ ¥", "'quoted' \"double\" „deutsch“ «guillemets»", "Hund\r\nKatze", "x" * 300,
    "ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.",
]


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


@pytest.fixture(scope="module")
def node() -> str:
    "Node.js: $TRANSFORMER_NODE, else `node` on PATH. None: a failure under CI, a skip elsewhere."
    named = os.environ.get("TRANSFORMER_NODE")
    found = shutil.which(named or "node")
    if named and not found:
        pytest.fail(f"TRANSFORMER_NODE={named!r} is not an executable file; point it at Node 20 or newer")
    if not found:
        if _on_ci():
            pytest.fail("no Node.js found: install Debian's `nodejs` (apt-get install nodejs); CI needs it")
        pytest.skip(NO_NODE)
    version = subprocess.run([found, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 20:
        pytest.fail(f"{found} is Node {version}; the translator's tests need Node 20 or newer")
    return found


@pytest.fixture(scope="module")
def sp() -> spm.SentencePieceProcessor:
    return spm.SentencePieceProcessor(model_file=str(MODEL / "tokenizer.model"))


def _proto_field(message: bytes, number: int) -> bytes:
    "The bytes of length-delimited field `number` of a protobuf message (no protobuf package needed)."
    def varint(i):
        value = shift = 0
        while True:
            byte = message[i]
            value, shift, i = value | (byte & 0x7F) << shift, shift + 7, i + 1
            if not byte & 0x80:
                return value, i
    i = 0
    while i < len(message):
        key, i = varint(i)
        if key & 7 == 0:
            _, i = varint(i)
        elif key & 7 == 2:
            n, i = varint(i)
            if key >> 3 == number:
                return message[i:i + n]
            i += n
        else:
            i += {1: 8, 5: 4}[key & 7]
    raise KeyError(number)


def charsmap() -> bytes:
    "The model's compiled normalization table: NormalizerSpec.precompiled_charsmap (field 2)."
    spec = spm.SentencePieceNormalizer(model_file=str(MODEL / "tokenizer.model")).serialized_normalizer_spec()
    return _proto_field(spec, 2)


@pytest.fixture(scope="module", params=["committed", "with-table"])
def tokenizer_json(request, tmp_path_factory) -> Path:
    """book/model/web/tokenizer.json, and a copy with the model's compiled table (base64): the JS
    normalizes exactly as sentencepiece with the table, by NFKC + nmt rules without it."""
    if request.param == "committed":
        return TOKENIZER_JSON
    spec = json.loads(TOKENIZER_JSON.read_text(encoding="utf-8"))
    spec["normalizer"]["precompiled_charsmap"] = base64.b64encode(charsmap()).decode()
    path = tmp_path_factory.mktemp("web") / "tokenizer.json"
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return path


def exact(tokenizer_json: Path) -> bool:
    "Whether this tokenizer.json carries the compiled table."
    table = json.loads(tokenizer_json.read_text(encoding="utf-8"))["normalizer"].get("precompiled_charsmap")
    if table is not None:
        assert base64.b64decode(table) == charsmap(), f"{tokenizer_json}: precompiled_charsmap is not the model's"
    return table is not None


def has_mark(text: str) -> bool:
    return any(unicodedata.category(c).startswith("M") for c in text)


def run_node(node: str, mode: str, request: dict, tmp_path: Path) -> dict:
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    result = subprocess.run([node, str(RUN_CASES), mode, str(path)], capture_output=True, text=True,
                            encoding="utf-8", timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"node {RUN_CASES.name} {mode} failed:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout)


def tokenize(node, sp, tokenizer_json, texts, tmp_path):
    "JS ids, pieces and decodings of `texts` next to sentencepiece's."
    want_ids = sp.encode(texts)
    got = run_node(node, "tokenize", {"tokenizer": str(tokenizer_json), "texts": texts,
                                      "decode": want_ids}, tmp_path)
    return want_ids, got


def test_tokenizer_json_is_the_models_tokenizer():
    spec = json.loads(TOKENIZER_JSON.read_text(encoding="utf-8"))
    assert spec["tokenizer_sha256"] == hashlib.sha256((MODEL / "tokenizer.model").read_bytes()).hexdigest(), (
        "book/model/web/tokenizer.json was written from another tokenizer.model: rerun the web export")


def test_tokenizer_matches_sentencepiece_on_multi30k(node, sp, tokenizer_json, multi30k, tmp_path):
    from transformer.data import load_multi30k
    sides = {}                                                   # "val.de": its sentences, ...
    for split in ("val", "test_2016_flickr"):
        pairs = load_multi30k("de", "en", split, progress=False)
        sides |= {f"{split}.de": [s for s, _ in pairs], f"{split}.en": [t for _, t in pairs]}
    # one Node process for the four sides (a process each cost more than the tokenizing), read side by side
    want_all, got_all = tokenize(node, sp, tokenizer_json, [t for texts in sides.values() for t in texts], tmp_path)
    counts, start = {}, 0
    for side, texts in sides.items():
        end = start + len(texts)
        want = want_all[start:end]
        got = {key: got_all[key][start:end] for key in ("ids", "pieces", "decoded")}
        start = end
        same = sum(w == g for w, g in zip(want, got["ids"]))
        counts[side] = (same, len(texts))
        wrong = [(t, w, g) for t, w, g in zip(texts, want, got["ids"]) if w != g]
        assert not wrong, f"{side}: {len(wrong)} of {len(texts)} differ; first: {wrong[:3]}"
        decoded = sp.decode(want)
        assert got["decoded"] == decoded, f"{side}: decode differs from sentencepiece's"
        assert got["pieces"] == sp.encode(texts, out_type=str)
    assert start == len(want_all) == len(got_all["ids"]) == len(got_all["pieces"]) == len(got_all["decoded"])
    print(f"sentences whose JS ids equal sentencepiece's ({tokenizer_json.parent.name}/{tokenizer_json.name}):",
          counts)
    assert sum(n for _, n in counts.values()) == 2 * (1014 + 1000)


# Where NFKC of the whole text and sentencepiece's longest rule at each position part: combining
# marks out of canonical order (NFKC reorders them, then composes; the table's rules do not).
RULES_DIFFER = ["e\u0301\u0323"]


def test_tokenizer_matches_sentencepiece_on_hard_inputs(node, sp, tokenizer_json, tmp_path):
    want, got = tokenize(node, sp, tokenizer_json, TRICKY, tmp_path)
    wrong = [t for t, w, g in zip(TRICKY, want, got["ids"]) if w != g]
    assert wrong == ([] if exact(tokenizer_json) else RULES_DIFFER), (
        f"JS ids differ from sentencepiece's on {len(wrong)} inputs: {wrong}")
    assert [p for t, p in zip(TRICKY, got["pieces"]) if t not in wrong] == sp.encode(
        [t for t in TRICKY if t not in wrong], out_type=str)
    # decode(encode(x)): sentencepiece's text, " ⁇ " for unknown characters included
    assert got["decoded"] == sp.decode(want)
    assert got["decoded"][TRICKY.index("Hund 🐶🐕 ok")] == "Hund  \u2047  ok"   # one <unk> for the run
    # any ids, control pieces and <unk> anywhere included
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, sp.get_piece_size(), (int(n),), generator=g).tolist()
           for n in torch.randint(0, 12, (300,), generator=g)]
    ids += [[2, 24], [1, 24], [7900, 7900, 24], [3, 2, 24, 3, 24], [1, 1], [24, 1, 7934], [0, 3, 2]]
    decoded = run_node(node, "tokenize", {"tokenizer": str(tokenizer_json), "texts": [], "decode": ids},
                       tmp_path)["decoded"]
    assert decoded == sp.decode(ids)


# Characters to draw random strings from: ASCII, Latin, combining marks, Vietnamese, whitespace and
# controls, full-width forms, emoji, Hangul syllables and jamo, kana with their voicing marks.
POOLS = [range(0x20, 0x7F), range(0xA0, 0x250), range(0x300, 0x370), range(0x1E00, 0x1F00),
         [0x9, 0xA, 0x20, 0xA0, 0x3000, 0x200B, 0x1, 0x7F, 0x2581], range(0xFF01, 0xFF5F),
         range(0x1F600, 0x1F650), range(0xAC00, 0xAC40), range(0x1100, 0x1200), range(0x3040, 0x30A0)]


def test_tokenizer_on_random_strings(node, sp, tokenizer_json, tmp_path):
    """20,000 random strings of 1 to 8 characters: with the table, every one as sentencepiece; by
    rules, all but a few, each with combining marks (measured: 9 of 20,000 on seed 0)."""
    rng = random.Random(0)
    texts = ["".join(chr(rng.choice(rng.choice(POOLS))) for _ in range(rng.randint(1, 8)))
             for _ in range(20_000)]
    want, got = tokenize(node, sp, tokenizer_json, texts, tmp_path)
    wrong = [t for t, w, g in zip(texts, want, got["ids"]) if w != g]
    print(f"{tokenizer_json.parent.name}/{tokenizer_json.name}: {len(texts) - len(wrong)} of {len(texts)} "
          "random strings tokenized as sentencepiece does")
    if exact(tokenizer_json):
        assert not wrong, [[hex(ord(c)) for c in t] for t in wrong[:5]]
    else:
        assert all(has_mark(t) for t in wrong), [[hex(ord(c)) for c in t] for t in wrong if not has_mark(t)]
        assert len(wrong) <= 20, len(wrong)


@pytest.fixture(scope="module")
def decompiled() -> list[list[str]]:
    "The model's compiled nmt_nfkc table, decompiled (a second of CPU): its rules [from, to], for both checks below."
    normalizer = spm.SentencePieceNormalizer(model_file=str(MODEL / "tokenizer.model"))
    return [list(r) for r in normalizer.decompile()]


@pytest.mark.parametrize("table", [False, True], ids=["rules", "table"])
def test_normalizer_matches_every_rule_of_the_model(node, table, decompiled, tmp_path):
    """The model's compiled nmt_nfkc table, decompiled: 225,276 rules (from -> to), each checked in JS,
    by NFKC + nmt rules and by the table's trie."""
    rules = decompiled
    assert len(rules) > 200_000
    request = {"name": "nmt_nfkc", "rules": rules}
    if table:
        request["charsmap"] = base64.b64encode(charsmap()).decode()
    wrong = run_node(node, "rules", request, tmp_path)["wrong"]
    assert not wrong, f"{len(wrong)} of {len(rules)} rules differ (from, to, JS): {wrong[:10]}"


# The fake model of tests/js/fake_model.mjs: logits from a hash of (source, prefix, token), float32.
V = 12


def fake_logits(src: list[int], prefix: list[int]) -> list[float]:
    out = []
    for v in range(V):
        h = 2166136261
        for x in [*src, 0xFFFF, *prefix, v]:
            h = ((h ^ x) * 16777619) & 0xFFFFFFFF
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        h ^= h >> 16
        logit = h / 2**32 * 8 - 4
        if v == EOS:
            logit += 0.35 * (len(prefix) - 1)
        if v in (PAD, BOS):
            logit = -30.0
        out.append(logit)
    return out


class FakeState:
    "decoding.py's decoder state (next_logits, reorder) for the fake model: a row's logits from its prefix."

    def __init__(self, src: torch.Tensor, copies: int):
        self.sources = [[i for i in row if i != PAD] for row in src.tolist()]
        self.copies = copies

    def next_logits(self, ys: torch.Tensor) -> torch.Tensor:
        return torch.tensor([fake_logits(self.sources[r // self.copies], row)
                             for r, row in enumerate(ys.tolist())], dtype=torch.float32)

    def reorder(self, rows) -> None:
        "Rows move only within a sentence; the logits depend on the prefix alone."


class FakeModel:
    "What greedy_search and beam_search ask of a model that decodes its own way (section 19.1's hook)."
    config = SimpleNamespace(pad_id=PAD, max_len=1024)

    def decoding_state(self, src, copies, cache, capacity):
        return FakeState(src, copies)


def log_p(src: list[int], out: list[int], eos: bool) -> float:
    "log P of an output under the fake model, in float64 from its float32 logits."
    total, prefix = 0.0, [BOS]
    for token in out + ([EOS] if eos else []):
        total += torch.tensor(fake_logits(src, prefix), dtype=torch.float32).double().log_softmax(-1)[token].item()
        prefix.append(token)
    return total


def test_search_matches_decoding_py_on_a_fake_model(node, tmp_path):
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(4, V, (int(n),), generator=g).tolist() + [EOS]
               for n in torch.randint(0, 10, (60,), generator=g)]
    settings = [(1, 0.6, 50), (1, 0.6, 2), (4, 0.6, 50), (4, 0.6, 3), (4, 0.0, 50), (4, 1.5, 50), (2, 0.6, 50),
                (6, 0.6, 5)]
    cases, want = [], []
    for beam, alpha, extra in settings:
        src, _ = pad_batch(sources, pad_id=PAD)
        hyps = (greedy_search(FakeModel(), src, extra_len=extra) if beam == 1 else
                beam_search(FakeModel(), src, beam_size=beam, alpha=alpha, extra_len=extra))
        for s, h in zip(sources, hyps):
            cases.append({"src": s, "beamSize": beam, "alpha": alpha, "extraLen": extra})
            want.append(h)
    got = run_node(node, "search", {"cases": cases}, tmp_path)["results"]
    wrong = [(c, w, r["ids"]) for c, w, r in zip(cases, want, got) if w != r["ids"]]
    assert not wrong, f"{len(wrong)} of {len(cases)} searches differ (case, Python, JS): {wrong[:5]}"
    # JS's score is log P / lp(length, EOS included) of the chosen output
    for c, r in zip(cases, got):
        if c["beamSize"] > 1 and r["ids"]:
            limit = len(c["src"]) + c["extraLen"]
            eos = len(r["ids"]) < limit
            lp = length_penalty(len(r["ids"]) + eos, c["alpha"])
            assert r["score"] == pytest.approx(log_p(c["src"], r["ids"], eos) / lp, abs=1e-5)
    # the cases exercise what differs: beam 4 beats greedy on half the sources (30 of 60), and
    # outputs stop at the limit (extraLen 2 and 3) as well as at EOS
    n = len(sources)
    greedy, beam4 = want[:n], want[2 * n:3 * n]
    assert sum(a != b for a, b in zip(greedy, beam4)) >= n // 4
    assert any(len(w) == len(c["src"]) + c["extraLen"] for c, w in zip(cases, want))
    print(f"{len(cases)} searches: JS chose what decoding.py chose in all")


COUNT_LOOKUPS = """
import fs from 'node:fs';
import { Tokenizer } from '%s';
const [spec, texts] = [process.argv[1], process.argv[2]].map((f) => JSON.parse(fs.readFileSync(f, 'utf8')));
const tokenizer = new Tokenizer(spec);
const merges = tokenizer.merges;
let lookups = 0;
tokenizer.merges = { get: (pair) => { lookups += 1; return merges.get(pair); } };
const answer = texts.map((text) => { lookups = 0; const ids = tokenizer.encode(text); return { ids, lookups }; });
process.stdout.write(JSON.stringify(answer));
"""


def test_bpe_work_grows_with_the_text_not_its_square(node, sp, tmp_path):
    """Issue 41: 40,000 characters (a shared link's sentence) cost a minute, as BPE rescanned every pair at each merge.
    Counted, not timed: the pair lookups are at most 3 per code point (one per first pair, two per merge), and the
    ids are still sentencepiece's."""
    texts = ["Ein Mann fährt Fahrrad. " * 1700, "x" * 40_000, "ein orangefarbenerHut" * 2000]
    (tmp_path / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    script = COUNT_LOOKUPS % (ROOT / "book" / "_static" / "translator" / "tokenizer.js").as_uri()
    result = subprocess.run([node, "--input-type=module", "-e", script, str(TOKENIZER_JSON), str(tmp_path / "texts.json")],
                            capture_output=True, text=True, encoding="utf-8", timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for text, got in zip(texts, json.loads(result.stdout)):
        assert len(text) >= 40_000 and got["lookups"] <= 3 * len(text), (len(text), got["lookups"])
        assert got["ids"] == sp.encode(text)


def test_node_unit_tests(node):
    result = subprocess.run([node, "--test", "tests/js/"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


WEB = MODEL / "web"
ORT_NODE = ROOT / "tests" / "js" / "node_modules" / "onnxruntime-node"


@pytest.fixture(scope="module")
def ort_node() -> None:
    "onnxruntime-node, pinned in tests/js/package-lock.json. Missing: a failure under CI, a skip elsewhere."
    if not (WEB / "encoder.onnx").is_file():
        pytest.skip("book/model/web/encoder.onnx not exported yet: python -m transformer export --web")
    if not ORT_NODE.is_dir():
        how = "npm ci --prefix tests/js (onnxruntime-node, pinned in tests/js/package-lock.json)"
        if _on_ci():
            pytest.fail(f"onnxruntime-node is not installed: {how}")
        pytest.skip(f"onnxruntime-node is not installed; to run the JS model: {how}")


def test_js_greedy_translations_equal_pythons(node, ort_node, multi30k, tmp_path):
    """The first 20 sentences of test_2016_flickr: JS greedy search on the exported graphs
    (onnxruntime-node) gives the ids of Python greedy search on the same graphs (onnxruntime,
    transformer.cli.web.WebModel) on every one; against PyTorch's float32 weights the int8 weights
    change a few (measured with WebModel on all 1,000: 952 the same; 19 of these 20)."""
    from transformer import load
    from transformer.data import load_multi30k
    from transformer.engine.fast import translate
    texts = [s for s, _ in load_multi30k("de", "en", "test_2016_flickr", progress=False)[:20]]
    got = run_node(node, "onnx", {"web": str(WEB), "texts": texts, "beamSize": 1}, tmp_path)["results"]
    trained = load(MODEL)
    assert [r["srcIds"] for r in got] == trained.tokenizer.encode_batch(texts, eos=True)
    torch_texts = translate(trained.model, trained.tokenizer, texts, beam_size=1)
    same = sum(r["text"] == t for r, t in zip(got, torch_texts))
    print(f"JS greedy (int8 ONNX) == PyTorch greedy (float32) on {same} of {len(texts)} sentences")
    assert same >= 15, [(r["text"], t) for r, t in zip(got, torch_texts) if r["text"] != t]
    try:
        from transformer.cli.web import WebModel
    except ImportError:
        pytest.skip("transformer.cli.web.WebModel not available: the same-graph comparison needs it")
    pytest.importorskip("onnxruntime", reason="the same-graph comparison runs the graphs in Python too")
    src, _ = pad_batch(trained.tokenizer.encode_batch(texts, eos=True), pad_id=PAD)
    want = WebModel(WEB).greedy(src.numpy())
    assert [r["ids"] for r in got] == want


SITE_RUNTIME = ROOT / "book" / "_static" / "translator" / "node_modules" / "onnxruntime-web"
TRACED = ["Ein Hund läuft im Schnee.", "Zwei junge Männer spielen auf einer Wiese Fußball.",
          "Eine Frau mit einem roten Hut sitzt vor einem Café und liest die Zeitung.", "Jeanskleid"]


@pytest.fixture(scope="module", params=["node", "web"])
def runtime(request, ort_node) -> str:
    """The runtime the JS runs the graphs on: onnxruntime-node (native, tests/js's lock), and
    onnxruntime-web's single-threaded WASM, the very file the book's site serves (the translator's
    lock, book/_static/translator/package-lock.json; the book build installs it)."""
    if request.param == "web" and not SITE_RUNTIME.is_dir():
        how = "npm ci --prefix book/_static/translator (onnxruntime-web, pinned in its package-lock.json)"
        if _on_ci():
            pytest.fail(f"onnxruntime-web is not installed: {how}")
        pytest.skip(f"onnxruntime-web is not installed; to run the page's runtime in Node: {how}")
    return request.param


def test_js_cross_attention_equals_python_onnxruntime(node, runtime, tmp_path):
    """What the widget shows, from the same graphs in Python: for a few sentences, translator.js's
    trace (each teacher-forced step of its greedy translation: the cross-attention of every layer
    and head, and the top 5 next pieces) equals Python onnxruntime's decoder step on the same
    prefix to 1e-4 (measured: under 1e-6), on onnxruntime-web's WASM with the widget's session options
    and on onnxruntime-node.

    Python runs the graphs as written (each int8 weight dequantized, then a float32 MatMul), with
    onnxruntime's basic graph optimizations. Its default level fuses each DequantizeLinear + MatMul
    into MatMulNBits (8 bits, accuracy_level 4: the activations too are rounded to int8, blocks of
    32), which moves the cross-attention by up to about 1e-2; onnxruntime-web's WASM (1.30) does
    not, and matches the basic level. onnxruntime-node (which runs the same native kernels as
    Python) is asked for the basic level too.

    Python onnxruntime against PyTorch (appendix I, asserted there and in tests/test_web_export.py):
    on float32 graphs the cross-attention agrees with PyTorch's to 4e-7 (log-probabilities 8e-6);
    with the shipped int8 graphs (at onnxruntime's default level) it differs from PyTorch float32 by
    up to 0.015 (log-probabilities 0.17): the weights' rounding, not the runtime."""
    np = pytest.importorskip("numpy")
    ort = pytest.importorskip("onnxruntime", reason="the comparison runs the same graphs in Python")
    options = {"node": {"graphOptimizationLevel": "basic"}, "web": {}}[runtime]
    got = run_node(node, "onnx", {"web": str(WEB), "texts": TRACED, "beamSize": 1, "trace": True,
                                  "runtime": runtime, "sessionOptions": options}, tmp_path)
    config = json.loads((WEB / "config.json").read_text())
    session = ort.SessionOptions()
    session.intra_op_num_threads = session.inter_op_num_threads = 1
    session.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    encoder, decoder = (ort.InferenceSession(str(WEB / config[k]), session, providers=["CPUExecutionProvider"])
                        for k in ("encoder", "decoder"))
    worst_attention = worst_p = 0.0
    for result, steps in zip(got["results"], got["traces"]):
        assert [s["id"] for s in steps] == result["ids"] + [config["eos_id"]]
        src = np.array([result["srcIds"]], dtype=np.int64)
        memory = encoder.run(None, {"src": src})[0]
        for t, s in enumerate(steps):
            tgt = np.array([[config["bos_id"], *result["ids"][:t]]], dtype=np.int64)
            log_probs, cross = decoder.run(None, {"tgt": tgt, "memory": memory, "src": src})  # (1, V), (N, 1, h, S)
            js = np.array(s["attention"])                                                     # (N, h, S)
            assert js.shape == cross[:, 0].shape, (js.shape, cross.shape)
            worst_attention = max(worst_attention, float(np.abs(js - cross[:, 0]).max()))
            # the top 5: each piece's probability as Python's, and the five largest of Python's
            # (two pieces within float noise of each other may come in either order)
            p = np.exp(log_probs[0].astype(np.float64))
            top5 = np.sort(p)[::-1][:5]
            worst_p = max(worst_p, *(abs(x["p"] - p[x["id"]]) for x in s["top"]),
                          *(abs(x["p"] - q) for x, q in zip(s["top"], top5)))
    print(f"{runtime}: {sum(len(t) for t in got['traces'])} steps of {len(TRACED)} sentences, "
          f"max |JS - Python| cross-attention {worst_attention:.1e}, top-5 probability {worst_p:.1e}")
    assert worst_attention < 1e-4 and worst_p < 1e-4
    assert any("dog" in r["text"] for r in got["results"])


def test_js_cross_attention_on_float32_graphs_equals_pytorch(node, ort_node, tmp_path):
    """The chain closed in one test: the same model exported as float32 graphs (export_web's
    `precision="float32"`), traced by translator.js on onnxruntime-node, gives PyTorch's own
    cross-attention (every layer and head, teacher-forced on the JS translation) and PyTorch's
    next-piece probabilities to 1e-4, and the same greedy translation. The shipped int8 graphs
    differ from PyTorch by their weights' rounding only (the test above and appendix I)."""
    pytest.importorskip("onnxruntime", reason="export_web checks its graphs with onnxruntime")
    from transformer import load
    from transformer.cli.web import export_web
    from transformer.figures.plots import recording_attention
    web32 = tmp_path / "float32"
    export_web(MODEL, web32, precision="float32")
    got = run_node(node, "onnx", {"web": str(web32), "texts": TRACED, "beamSize": 1, "trace": True,
                                  "runtime": "node", "sessionOptions": {}}, tmp_path)
    trained = load(MODEL)
    model, tokenizer = trained.model, trained.tokenizer
    crosses = [layer.cross_attn for layer in model.decoder.layers]
    worst_attention = worst_p = 0.0
    for text, result, steps in zip(TRACED, got["results"], got["traces"]):
        src = torch.tensor([tokenizer.encode(text, eos=True)])                     # (1, S)
        assert result["ids"] == greedy_search(model, src)[0]                       # same translation
        with torch.no_grad(), recording_attention(crosses) as records:
            logits = model(src, torch.tensor([[BOS] + result["ids"]]))             # (1, T, V)
        cross = torch.stack([records[m][0][0] for m in crosses])                   # (N, h, T, S)
        probs = logits[0].double().softmax(-1)                                     # (T, V)
        for t, s in enumerate(steps):
            js = torch.tensor(s["attention"], dtype=torch.float64)                 # (N, h, S)
            worst_attention = max(worst_attention, (js - cross[:, :, t].double()).abs().max().item())
            worst_p = max(worst_p, *(abs(x["p"] - probs[t, x["id"]].item()) for x in s["top"]))
    print(f"float32 graphs in JS against PyTorch: cross-attention {worst_attention:.1e}, "
          f"top-5 probability {worst_p:.1e}")
    assert worst_attention < 1e-4 and worst_p < 1e-4
