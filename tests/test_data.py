"""transformer.data: Multi30k lookup order, checksummed download and local files, and every bad input."""
import gzip
import hashlib
import http.server
import os
import threading
import tracemalloc
from functools import partial
from pathlib import Path

import pytest

from transformer import data
from transformer.data import (
    LANGS,
    SHA256,
    SPLITS,
    DataError,
    cache_dir,
    download_multi30k,
    load_multi30k,
    multi30k_dir,
    read_parallel,
)

REAL_DATA = os.environ.get("TRANSFORMER_DATA")  # captured before the autouse fixture clears it


def real_multi30k() -> Path:
    "The shared Multi30k copy; CI sets TRANSFORMER_DATA."
    if not REAL_DATA or not (Path(REAL_DATA) / "multi30k").is_dir():
        pytest.fail("set TRANSFORMER_DATA to the directory that holds multi30k/ (CI does)")
    return Path(REAL_DATA) / "multi30k"


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    "No test reads the real environment or writes the real cache."
    monkeypatch.delenv("TRANSFORMER_DATA", raising=False)
    monkeypatch.delenv("TRANSFORMER_DATA_URL", raising=False)
    monkeypatch.delenv("TRANSFORMER_DATA_UNVERIFIED", raising=False)
    monkeypatch.delenv("TRANSFORMER_MAX_TEXT_BYTES", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


DE = ["Ein Hund rennt.", "Zwei Kinder spielen Fußball.", "Eine Frau liest."]
EN = ["A dog runs.", "Two children play soccer.", "A woman reads."]


def gz(lines) -> bytes:
    return gzip.compress(("\n".join(lines) + "\n").encode())


def write_corpus(root: Path, split="val", langs=("de", "en")) -> Path:
    d = root / "multi30k"
    d.mkdir(parents=True, exist_ok=True)
    texts = {"de": DE, "en": EN, "fr": ["Un chien court.", "Deux enfants jouent.", "Une femme lit."]}
    for lang in langs:
        (d / f"{split}.{lang}.gz").write_bytes(gz(texts[lang]))
    return d


# --- directories and lookup order ---------------------------------------------------------------

def test_dirs_follow_environment(tmp_path, monkeypatch):
    assert cache_dir() == tmp_path / "cache" / "transformer-book" / "multi30k"
    assert multi30k_dir() == cache_dir()
    monkeypatch.setenv("TRANSFORMER_DATA", str(tmp_path / "d"))
    assert multi30k_dir() == tmp_path / "d" / "multi30k"
    assert multi30k_dir(tmp_path / "x") == tmp_path / "x" / "multi30k"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "transformer-book" / "multi30k"


# The fake corpora of these tests carry Multi30k's file names, not its checksums: verify=False.

def test_load_from_data_dir_argument(tmp_path):
    write_corpus(tmp_path / "root")
    assert load_multi30k("de", "en", "val", data_dir=tmp_path / "root", download=False,
                         verify=False) == list(zip(DE, EN))
    assert load_multi30k("en", "de", "val", data_dir=tmp_path / "root", download=False,
                         verify=False) == list(zip(EN, DE))


def test_load_from_environment(tmp_path, monkeypatch):
    write_corpus(tmp_path / "root")
    monkeypatch.setenv("TRANSFORMER_DATA", str(tmp_path / "root"))
    assert load_multi30k("de", "en", "val", download=False, verify=False) == list(zip(DE, EN))


def test_falls_back_to_cache(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("TRANSFORMER_DATA", str(tmp_path / "empty"))
    cache = cache_dir()
    cache.mkdir(parents=True)
    (cache / "val.de.gz").write_bytes(gz(DE))
    (cache / "val.en.gz").write_bytes(gz(EN))
    assert load_multi30k("de", "en", "val", download=False, verify=False) == list(zip(DE, EN))


def test_data_dir_wins_over_cache(tmp_path):
    write_corpus(tmp_path / "root")
    cache = cache_dir()
    cache.mkdir(parents=True)
    (cache / "val.de.gz").write_bytes(gz(["anders"] * 3))
    (cache / "val.en.gz").write_bytes(gz(["other"] * 3))
    assert load_multi30k("de", "en", "val", data_dir=tmp_path / "root", download=False,
                         verify=False) == list(zip(DE, EN))


def test_missing_without_download_says_where_and_how(tmp_path):
    with pytest.raises(DataError) as e:
        load_multi30k("de", "en", "val", data_dir=tmp_path / "nothing", download=False)
    msg = str(e.value)
    assert "val.de.gz not found" in msg
    assert str(tmp_path / "nothing" / "multi30k") in msg and str(cache_dir()) in msg
    assert "TRANSFORMER_DATA" in msg and "download=True" in msg


@pytest.mark.parametrize("kwargs, match", [
    (dict(src_lang="xx"), r"src_lang='xx' is not one of \('de', 'en', 'fr'\)"),
    (dict(tgt_lang="EN"), r"tgt_lang='EN' is not one of"),
    (dict(src_lang="en", tgt_lang="en"), r"both 'en'"),
    (dict(split="test"), r"split='test' is not one of \('train', 'val', 'test_2016_flickr'\)"),
])
def test_load_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_multi30k(**kwargs, download=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(splits="dev"), r"split='dev' is not one of"),
    (dict(langs=["de", "cs"]), r"lang='cs' is not one of"),
])
def test_download_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        download_multi30k(**kwargs, dest=tmp_path, base_url="http://127.0.0.1:9")


# --- reading parallel files: policy -------------------------------------------------------------

def test_plain_and_gzip_read_the_same(tmp_path):
    (tmp_path / "a.de").write_bytes(("\n".join(DE) + "\n").encode())
    (tmp_path / "a.en.gz").write_bytes(gz(EN))
    (tmp_path / "b.de.txt").write_bytes(gz(DE))  # gzip recognised by content, not by name
    assert read_parallel(tmp_path / "a.de", tmp_path / "a.en.gz") == list(zip(DE, EN))
    assert read_parallel(str(tmp_path / "b.de.txt"), str(tmp_path / "a.en.gz")) == list(zip(DE, EN))


@pytest.mark.parametrize("name, src, tgt, expected", [
    ("no final newline", b"a\nb", b"x\ny", [("a", "x"), ("b", "y")]),
    ("windows line ends", b"a\r\nb\r\n", b"x\r\ny\r\n", [("a", "x"), ("b", "y")]),
    ("surrounding spaces", b"  a \n\tb\n", b"x  \ny\n", [("a", "x"), ("b", "y")]),
    ("byte-order mark", b"\xef\xbb\xbfa\nb\n", b"x\ny\n", [("a", "x"), ("b", "y")]),
    ("inner separators stay", "a\u2028b\nc\x85d\n".encode(), b"x\ny\n", [("a\u2028b", "x"), ("c\x85d", "y")]),
    ("inner spaces stay", b"a  b\n", b"x y\n", [("a  b", "x y")]),
])
def test_line_handling(tmp_path, name, src, tgt, expected):
    (tmp_path / "s").write_bytes(src)
    (tmp_path / "t").write_bytes(tgt)
    assert read_parallel(tmp_path / "s", tmp_path / "t") == expected


@pytest.mark.parametrize("src, tgt, kept, lines", [
    (b"a\n\nc\n", b"x\ny\nz\n", [("a", "x"), ("c", "z")], "lines 2"),
    (b"a\nb\nc\n", b"x\n  \nz\n", [("a", "x"), ("c", "z")], "lines 2"),
    (b"\na\n\n", b"\nx\n\n", [("a", "x")], "lines 1, 3"),
])
def test_pairs_with_an_empty_side_are_skipped_with_a_warning(tmp_path, src, tgt, kept, lines):
    (tmp_path / "s").write_bytes(src)
    (tmp_path / "t").write_bytes(tgt)
    skipped = src.count(b"\n") - len(kept)
    with pytest.warns(UserWarning, match=rf"skipped {skipped} of .*\({lines}\)"):
        assert read_parallel(tmp_path / "s", tmp_path / "t") == kept


# --- reading parallel files: bad input, table-driven --------------------------------------------

NUMBERS = "".join(f"{i}\n" for i in range(2000)).encode()
BAD_INPUTS = [
    # name, src bytes (None = file absent), tgt bytes, pattern of the message
    ("missing source", None, b"x\n", r"src\.txt: no such file"),
    ("missing target", b"a\n", None, r"tgt\.txt: no such file"),
    ("line counts differ", b"a\nb\nc\n", b"x\ny\n",
     r"line counts differ: .*src\.txt has 3 lines, .*tgt\.txt has 2 lines"),
    ("one blank line on one side only", b"a\n\nb\n", b"x\ny\n", r"has 3 lines, .*has 2 lines"),
    ("latin-1 source", "a\nb\nFußball\n".encode("latin-1"), b"x\ny\nz\n",
     r"src\.txt: line 3 is not valid UTF-8 \(byte b'\\xdf' at column 3\)"),
    ("bad byte in gzipped target", b"a\nb\n", gzip.compress(b"x\n\xff\n"), r"tgt\.txt: line 2 is not valid UTF-8"),
    ("truncated gzip", gzip.compress(NUMBERS)[:len(gzip.compress(NUMBERS)) // 2], b"x\n",
     r"src\.txt: not a valid gzip file"),
    ("corrupt gzip body", gzip.compress(NUMBERS)[:20] + bytes(200) + gzip.compress(NUMBERS)[220:], b"x\n",
     r"src\.txt: not a valid gzip file \(Error -3"),
    ("empty files", b"", b"", r"empty corpus: .*src\.txt and .*tgt\.txt"),
    ("only blank lines", b"\n \n", b"\n\n", r"empty corpus"),
    ("gzipped empty file", gzip.compress(b""), gzip.compress(b""), r"empty corpus"),
]


@pytest.mark.parametrize("name, src, tgt, match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_read_parallel_bad_input(tmp_path, name, src, tgt, match):
    for file, content in (("src.txt", src), ("tgt.txt", tgt)):
        if content is not None:
            (tmp_path / file).write_bytes(content)
    with pytest.raises(DataError, match=match):
        read_parallel(tmp_path / "src.txt", tmp_path / "tgt.txt")


def test_random_bytes_named_gz(tmp_path):
    "A file named .gz that is not gzip says so (before: 'not valid UTF-8', which sent the reader to iconv)."
    (tmp_path / "src.de.gz").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "tgt.en.gz").write_bytes(gz(["x"] * 3))
    with pytest.raises(DataError, match=r"src\.de\.gz: not a gzip file .*download or copy it again"):
        read_parallel(tmp_path / "src.de.gz", tmp_path / "tgt.en.gz")


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


# --- download against a local HTTP server -------------------------------------------------------

class Quiet(http.server.SimpleHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        Quiet.requests.append(self.path)
        super().do_GET()


@pytest.fixture
def server(tmp_path):
    "An HTTP server on 127.0.0.1 serving tmp_path/served; yields (base_url, directory)."
    root = tmp_path / "served"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    Quiet.requests = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}/raw", root / "raw"
    httpd.shutdown()
    httpd.server_close()


def serve_small(root: Path) -> dict:
    "Two small files on the server; returns their checksums."
    root.mkdir(parents=True, exist_ok=True)
    sums = {}
    for lang, lines in (("de", DE), ("en", EN)):
        blob = gz(lines)
        (root / f"val.{lang}.gz").write_bytes(blob)
        sums[f"val.{lang}.gz"] = hashlib.sha256(blob).hexdigest()
    return sums


def test_download_checksum_pass(tmp_path, server):
    url, root = server
    sums = serve_small(root)
    dest = download_multi30k("val", ["de", "en"], dest=tmp_path / "dl", base_url=url + "/",
                             checksums=sums, progress=False)
    assert dest == tmp_path / "dl"
    assert sorted(p.name for p in dest.iterdir()) == ["val.de.gz", "val.en.gz"]  # no *.part left
    assert read_parallel(dest / "val.de.gz", dest / "val.en.gz") == list(zip(DE, EN))
    # a second call finds the files with the right sums and fetches nothing
    n = len(Quiet.requests)
    download_multi30k("val", ["de", "en"], dest=dest, base_url=url, checksums=sums, progress=False)
    assert len(Quiet.requests) == n


def test_download_checksum_mismatch(tmp_path, server):
    url, root = server
    sums = serve_small(root)
    sums["val.en.gz"] = "0" * 64
    with pytest.raises(DataError, match=r"checksum mismatch for val\.en\.gz .*expected sha256 0{64}, got [0-9a-f]{64}"):
        download_multi30k("val", ["de", "en"], dest=tmp_path / "dl", base_url=url, checksums=sums,
                          progress=False)
    assert sorted(p.name for p in (tmp_path / "dl").iterdir()) == ["val.de.gz"]  # nothing half-written


def test_corrupt_cached_file_is_fetched_again(tmp_path, server):
    url, root = server
    sums = serve_small(root)
    dest = tmp_path / "dl"
    dest.mkdir()
    (dest / "val.de.gz").write_bytes(b"truncated")
    download_multi30k("val", "de", dest=dest, base_url=url, checksums=sums, progress=False)
    assert (dest / "val.de.gz").read_bytes() == (root / "val.de.gz").read_bytes()


def test_download_http_error(tmp_path, server):
    url, _ = server  # serves nothing
    with pytest.raises(DataError, match=r"could not download http://127\.0\.0\.1:\d+/raw/val\.de\.gz: .*404"):
        download_multi30k("val", "de", dest=tmp_path / "dl", base_url=url, progress=False)


def test_download_unreachable_server(tmp_path):
    with pytest.raises(DataError, match=r"could not download .*TRANSFORMER_DATA_URL"):
        download_multi30k("val", "de", dest=tmp_path, base_url="http://127.0.0.1:9", progress=False)


def test_progress_bar(tmp_path, server, capsys):
    url, root = server
    sums = serve_small(root)
    download_multi30k("val", "de", dest=tmp_path / "dl", base_url=url, checksums=sums, progress=True)
    assert "val.de.gz" in capsys.readouterr().err


def test_original_files_pass_and_a_changed_file_fails(tmp_path, server):
    "The recorded sums are those of the real files; any change to a file is caught."
    url, root = server
    root.mkdir()
    for lang in ("de", "en"):
        (root / f"val.{lang}.gz").write_bytes((real_multi30k() / f"val.{lang}.gz").read_bytes())
    download_multi30k("val", ["de", "en"], dest=tmp_path / "ok", base_url=url, progress=False)
    (root / "val.de.gz").write_bytes(gzip.compress(b"Ein anderer Satz.\n" * 1014))
    with pytest.raises(DataError, match="checksum mismatch for val.de.gz"):
        download_multi30k("val", "de", dest=tmp_path / "bad", base_url=url, progress=False)


def test_load_downloads_missing_files_into_the_cache(tmp_path, server, monkeypatch):
    url, root = server
    root.mkdir()
    for lang in ("fr", "en"):
        (root / f"val.{lang}.gz").write_bytes((real_multi30k() / f"val.{lang}.gz").read_bytes())
    monkeypatch.setenv("TRANSFORMER_DATA_URL", url)
    pairs = load_multi30k("fr", "en", "val", data_dir=tmp_path / "nothing", progress=False)
    assert len(pairs) == 1014
    assert sorted(p.name for p in cache_dir().iterdir()) == ["val.en.gz", "val.fr.gz"]
    assert load_multi30k("fr", "en", "val", data_dir=tmp_path / "nothing", download=False) == pairs


def test_load_reports_a_failed_download(tmp_path, server):
    url, _ = server
    with pytest.raises(DataError, match=r"val\.de\.gz not found in .*downloading it failed: could not download"):
        load_multi30k("de", "en", "val", data_dir=tmp_path, base_url=url, progress=False)


# --- size limit: a gzip bomb or a huge file stops with DataError, not MemoryError ----------------

def bomb(mib: int) -> bytes:
    "`mib` gzip members of 1 MiB of zeros each: about 1 KB a member, read as one stream of zeros."
    return gzip.compress(bytes(2**20)) * mib


SIZE_CASES = [
    # name, file content, limit, pattern of the message
    ("gzip bomb", bomb(64), 2**20,
     r"src: decompresses to more than 1,048,576 bytes, the limit .*TRANSFORMER_MAX_TEXT_BYTES"),
    ("gzip just over", gzip.compress(b"a\n" * 6), 11, r"decompresses to more than 11 bytes"),
    ("plain over", b"a\n" * 6, 11,
     r"src: 12 bytes, more than 11 bytes, the limit for a text file; .*TRANSFORMER_MAX_TEXT_BYTES"),
]


@pytest.mark.parametrize("name, content, limit, match", SIZE_CASES, ids=[c[0] for c in SIZE_CASES])
def test_text_over_the_limit_is_refused(tmp_path, monkeypatch, name, content, limit, match):
    monkeypatch.setenv("TRANSFORMER_MAX_TEXT_BYTES", str(limit))
    (tmp_path / "src").write_bytes(content)
    (tmp_path / "tgt").write_bytes(b"x\n" * 6)
    with pytest.raises(DataError, match=match):
        read_parallel(tmp_path / "src", tmp_path / "tgt")


def test_a_gzip_bomb_stops_in_little_memory(tmp_path, monkeypatch):
    "Decompressed a chunk at a time: the 64 MiB of text never sit in memory at once."
    monkeypatch.setenv("TRANSFORMER_MAX_TEXT_BYTES", str(2**20))
    (tmp_path / "bomb").write_bytes(bomb(64))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="decompresses to more than 1,048,576 bytes"):
            read_parallel(tmp_path / "bomb", tmp_path / "bomb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20


@pytest.mark.parametrize("content", [b"a\n" * 6, gzip.compress(b"a\n" * 6)], ids=["plain", "gzip"])
def test_text_at_the_limit_is_read(tmp_path, monkeypatch, content):
    monkeypatch.setenv("TRANSFORMER_MAX_TEXT_BYTES", "12")
    for name in ("s", "t"):
        (tmp_path / name).write_bytes(content)
    assert read_parallel(tmp_path / "s", tmp_path / "t") == [("a", "a")] * 6


def test_the_default_limit_is_generous(monkeypatch):
    assert data._max_text_bytes() == data.MAX_TEXT_BYTES == 2 * 2**30
    monkeypatch.setenv("TRANSFORMER_MAX_TEXT_BYTES", "")  # empty: as if unset
    assert data._max_text_bytes() == data.MAX_TEXT_BYTES


@pytest.mark.parametrize("value", ["0", "-1", "2G", "1e9", "\u0662"])
def test_bad_limit_variable(tmp_path, monkeypatch, value):
    monkeypatch.setenv("TRANSFORMER_MAX_TEXT_BYTES", value)
    (tmp_path / "s").write_bytes(b"a\n")
    with pytest.raises(ValueError, match=r"TRANSFORMER_MAX_TEXT_BYTES=.* is not a positive whole number of bytes"):
        read_parallel(tmp_path / "s", tmp_path / "s")


# --- local Multi30k files are checked against the original's checksum ---------------------------

def copy_val(tmp_path, de: bytes | None = None) -> Path:
    "A data directory with the real val.en.gz and val.de.gz (or `de` in its place); returns it."
    d = tmp_path / "copy" / "multi30k"
    d.mkdir(parents=True)
    for lang in ("de", "en"):
        (d / f"val.{lang}.gz").write_bytes((real_multi30k() / f"val.{lang}.gz").read_bytes())
    if de is not None:
        (d / "val.de.gz").write_bytes(de)
    return d.parent


def shifted_val_de() -> bytes:
    "val.de.gz with its first line moved to the end: as many lines as val.en.gz, every pair wrong."
    lines = gzip.decompress((real_multi30k() / "val.de.gz").read_bytes()).split(b"\n")[:-1]
    return gzip.compress(b"\n".join(lines[1:] + lines[:1]) + b"\n")


def test_an_unmodified_copy_loads(tmp_path):
    assert len(load_multi30k("de", "en", "val", data_dir=copy_val(tmp_path), download=False)) == 1014


def test_a_shifted_file_is_refused(tmp_path):
    root = copy_val(tmp_path, shifted_val_de())
    with pytest.raises(DataError) as e:
        load_multi30k("de", "en", "val", data_dir=root, download=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{root / 'multi30k' / 'val.de.gz'} differs from the original Multi30k file")
    got = hashlib.sha256((root / "multi30k" / "val.de.gz").read_bytes()).hexdigest()
    assert f"sha256 {got[:12]}..., expected {SHA256['val.de.gz'][:12]}..." in msg
    assert "delete it so it downloads again" in msg and f"{data.BASE_URL}/val.de.gz" in msg
    assert "set TRANSFORMER_DATA_UNVERIFIED=1 (or pass --unverified-data" in msg and "verify=False" in msg


def test_a_modified_file_in_the_cache_is_refused(tmp_path):
    cache = cache_dir()
    cache.mkdir(parents=True)
    (cache / "val.de.gz").write_bytes(shifted_val_de())
    (cache / "val.en.gz").write_bytes((real_multi30k() / "val.en.gz").read_bytes())
    with pytest.raises(DataError, match=rf"{cache / 'val.de.gz'} differs from the original"):
        load_multi30k("de", "en", "val", data_dir=tmp_path / "nothing", download=False)


@pytest.mark.parametrize("how", ["verify=False", "TRANSFORMER_DATA_UNVERIFIED=1", "TRANSFORMER_DATA_UNVERIFIED=yes"])
def test_a_modified_file_loads_when_asked(tmp_path, monkeypatch, how):
    root = copy_val(tmp_path, shifted_val_de())
    kwargs = {}
    if how == "verify=False":
        kwargs["verify"] = False
    else:
        monkeypatch.setenv(*how.split("="))
    pairs = load_multi30k("de", "en", "val", data_dir=root, download=False, **kwargs)
    real = load_multi30k("de", "en", "val", data_dir=real_multi30k().parent, download=False)
    assert pairs[:2] == [(real[1][0], real[0][1]), (real[2][0], real[1][1])]  # what it would train on


@pytest.mark.parametrize("value", ["", "0"])
def test_the_variable_set_to_empty_or_0_keeps_the_check(tmp_path, monkeypatch, value):
    monkeypatch.setenv("TRANSFORMER_DATA_UNVERIFIED", value)
    with pytest.raises(DataError, match="differs from the original"):
        load_multi30k("de", "en", "val", data_dir=copy_val(tmp_path, shifted_val_de()), download=False)


def test_each_file_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(data, "sha256_file", lambda p: calls.append(Path(p).name) or hashlib.sha256(
        Path(p).read_bytes()).hexdigest())
    monkeypatch.setattr(data, "_local_sha256", {})
    root = copy_val(tmp_path)
    for _ in range(3):
        load_multi30k("de", "en", "val", data_dir=root, download=False)
        load_multi30k("en", "de", "val", data_dir=root, download=False)
    assert sorted(calls) == ["val.de.gz", "val.en.gz"]
    path = root / "multi30k" / "val.de.gz"
    path.write_bytes(shifted_val_de())
    os.utime(path, ns=(1, 1))  # a new modification time even on a file system with coarse ones
    with pytest.raises(DataError, match="val.de.gz differs from the original"):
        load_multi30k("de", "en", "val", data_dir=root, download=False)
    assert sorted(calls) == ["val.de.gz", "val.de.gz", "val.en.gz"]


# --- the real corpus (needs $TRANSFORMER_DATA) --------------------------------------------------

def test_recorded_checksums_match_the_shared_copy():
    d = real_multi30k()
    assert set(SHA256) == {f"{s}.{l}.gz" for s in SPLITS for l in LANGS}
    for name, want in SHA256.items():
        assert data.sha256_file(d / name) == want, name


@pytest.mark.parametrize("split, n", [("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)])
def test_real_corpus_sizes_and_alignment(split, n):
    root = real_multi30k().parent
    de_en = load_multi30k("de", "en", split, data_dir=root, download=False)
    fr_en = load_multi30k("fr", "en", split, data_dir=root, download=False)
    assert len(de_en) == len(fr_en) == n
    assert [e for _, e in de_en] == [e for _, e in fr_en]  # the same English sentences
    assert all(s and t and s == s.strip() for s, t in de_en)
