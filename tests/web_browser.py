"""The translator widget in a real headless Chromium, driven through the Chrome DevTools protocol
(issue 31): the built site served from localhost, every request the page makes recorded.

Used by tests/test_book.py (the widget translates, draws its map, and nothing leaves localhost)
and run as a script to measure what a reader waits for and downloads:

    python tests/web_browser.py --site _build/html --out book/results/web/chromium-xeon.json

(build the book first: `jupyter-book build .`). The script opens chapter 11 in a fresh profile and
presses Translate once (bytes downloaded, time to the first translation; three times, each in a new
browser), then translates more test sentences with greedy and beam search in one page (time per
sentence). It asserts nothing about time.

Only the standard library and websocket-client (in requirements.txt's lock, through Jupyter)."""
import argparse
import functools
import gzip
import http.server
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import websocket

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--window-size=1280,1600",
         # any host name but localhost fails to resolve: a request for another site cannot leave
         # the machine (the tests also check that none was made)
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1"]
STATE = "document.querySelector('.book-translator') && document.querySelector('.book-translator').dataset.state"


class Handler(http.server.SimpleHTTPRequestHandler):
    "Static files with the types a browser insists on for modules and WASM; quiet; every path recorded."
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map,
                      ".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
                      ".json": "application/json", ".onnx": "application/octet-stream",
                      ".int8": "application/octet-stream"}

    def log_message(self, format, *args):
        self.server.paths.append(self.path)


@contextmanager
def serve(site: Path):
    "The built site on http://127.0.0.1:<free port>; yields (base URL, the list of requested paths)."
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
    server.paths = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.paths
    finally:
        server.shutdown()
        server.server_close()


class Chrome:
    """One headless Chromium and one page, over the DevTools protocol: `call` sends a command and
    returns its result; the events that arrive meanwhile are kept in `events` (the Network domain's
    requests and their sizes)."""

    def __init__(self, executable: str, profile: Path, flags=(), timeout: float = 30):
        self.profile = Path(profile)
        self.process = subprocess.Popen([executable, *FLAGS, *flags, "--remote-debugging-port=0",
                                         f"--user-data-dir={self.profile}", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Chromium did not start: {self.process.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        while True:
            targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout))
            pages = [t for t in targets if t["type"] == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        # skip_utf8_validation: websocket-client checks each text frame's UTF-8 byte by byte in Python
        # (0.4 s of CPU for a 1.5 MB page's DOM) before recv() decodes it, which rejects bad UTF-8 anyway
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True,
                                              skip_utf8_validation=True)
        self.next_id, self.events, self.timeout = 0, [], timeout
        for domain in ("Page", "Runtime", "Network"):
            self.call(f"{domain}.enable")
        self.call("Network.setCacheDisabled", {"cacheDisabled": True})

    def call(self, method: str, params: dict | None = None, timeout: float | None = None) -> dict:
        "Send a command and return its result (waiting up to `timeout` s for it, the connection's timeout if None)."
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params or {}}))
        if timeout is not None:
            self.ws.settimeout(timeout)
        try:
            while True:
                message = json.loads(self.ws.recv())
                if message.get("id") == self.next_id:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return message["result"]
                if "method" in message:
                    self.events.append(message)
        finally:
            if timeout is not None:
                self.ws.settimeout(self.timeout)

    def evaluate(self, expression: str, timeout: float | None = None):
        "The value of a JavaScript expression in the page (awaited if a promise, up to `timeout` s)."
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                           timeout)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, timeout: float = 60) -> None:
        """Navigate and wait for the load event: blocked on the connection until it arrives (no polling:
        a command every 20 ms cost the browser a DevTools round trip each while the page loaded)."""
        seen = len(self.events)
        self.call("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        while True:
            if any(e["method"] == "Page.loadEventFired" for e in self.events[seen:]):
                return
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{url} did not load in {timeout} s")
            self.ws.settimeout(left)
            try:
                message = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                continue
            finally:
                self.ws.settimeout(self.timeout)
            if "method" in message:
                self.events.append(message)

    def wait_for(self, expression: str, done, timeout: float = 120, every: float = 0.05):
        "Poll `expression` until done(value); return the value."
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if done(value):
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression} is still {value!r} after {timeout} s")
            time.sleep(every)

    def settle(self, expression: str, timeout: float = 30, every: float = 0.05) -> bool:
        """Poll the JavaScript `expression` inside the page (a timer there, one DevTools command in all)
        until it is truthy or `timeout` seconds passed: whether it became true. An exception in it is raised."""
        return self.evaluate(f"""new Promise((resolve, reject) => {{
            const end = performance.now() + {timeout * 1000};
            const poll = () => {{
                let value;
                try {{ value = ({expression}); }} catch (e) {{ reject(e); return; }}
                if (value || performance.now() >= end) resolve(Boolean(value));
                else setTimeout(poll, {every * 1000});
            }};
            poll(); }})""", timeout=timeout + self.timeout)

    def requests(self, since: int = 0) -> list[str]:
        "The URLs the page asked for (events from index `since` on)."
        return [e["params"]["request"]["url"] for e in self.events[since:] if e["method"] == "Network.requestWillBeSent"]

    def downloads(self, since: int = 0) -> dict[str, int]:
        "Bytes received over the network per URL (encoded: as sent, headers included)."
        urls = {e["params"]["requestId"]: e["params"]["request"]["url"] for e in self.events
                if e["method"] == "Network.requestWillBeSent"}
        out = {}
        for e in self.events[since:]:
            if e["method"] == "Network.loadingFinished":
                url = urls.get(e["params"]["requestId"], "?")
                out[url] = out.get(url, 0) + int(e["params"]["encodedDataLength"])
        return out

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def local(url: str) -> bool:
    "A request that stays on this machine: the local server, or data and blob URLs."
    parts = urlsplit(url)
    return parts.scheme in ("data", "blob", "about") or parts.hostname in ("127.0.0.1", "localhost")


def translate(chrome: Chrome, sentence: str, beam: int, timeout: float = 300) -> dict:
    """Type `sentence`, choose the search, press Translate and wait until the trace is drawn:
    the translation and the widget's own timings (performance measures, seconds)."""
    chrome.evaluate("performance.clearMeasures()")
    clicked = chrome.evaluate(f"""(() => {{
        const root = document.querySelector('.book-translator');
        root.querySelector('.bt-input').value = {json.dumps(sentence)};
        root.querySelector('.bt-search').value = '{beam}';
        root.dataset.state = 'pressed';
        const t = performance.now();
        root.querySelector('.bt-button').click();
        return t; }})()""")
    state = chrome.wait_for(STATE, lambda s: s in ("done", "error"), timeout=timeout)
    if state == "error":
        raise RuntimeError(chrome.evaluate("document.querySelector('.book-translator .bt-status').textContent"))
    measures = chrome.evaluate("""Object.fromEntries(performance.getEntriesByType('measure')
        .filter((m) => m.name.startsWith('book-translator:'))
        .map((m) => [m.name.split(':')[1], [m.startTime, m.duration]]))""")
    end = {name: (start + duration - clicked) / 1000 for name, (start, duration) in measures.items()}
    return {"sentence": sentence, "beam": beam,
            "translation": chrome.evaluate("document.querySelector('.book-translator .bt-output').textContent"),
            "seconds_to_translation": round(end["translate"], 4), "seconds_to_trace": round(end["trace"], 4),
            "translate_seconds": round(measures["translate"][1] / 1000, 4),
            "trace_seconds": round(measures["trace"][1] / 1000, 4),
            **({"load_seconds": round(measures["load"][1] / 1000, 4)} if "load" in measures else {})}


def browser_version(executable: str) -> str:
    return subprocess.run([executable, "--version"], capture_output=True, text=True).stdout.strip()


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def first_press(base: str, executable: str, sentence: str) -> tuple[dict, dict, int]:
    """Chapter 11 in a fresh profile, then one press of Translate: its timings, the bytes of each
    URL it downloaded, and the bytes of the page before it."""
    with tempfile.TemporaryDirectory() as profile, Chrome(executable, Path(profile)) as chrome:
        chrome.open(f"{base}/book/11_traced.html")
        chrome.wait_for(STATE, lambda s: s == "idle")
        page_bytes = sum(chrome.downloads().values())
        mark = len(chrome.events)
        first = translate(chrome, sentence, 1)
        assert all(local(url) for url in chrome.requests()), chrome.requests()
        return first, chrome.downloads(mark), page_bytes


def summary(runs: list[dict]) -> dict:
    return {"sentences": len(runs),
            **{f"{stat.__name__}_{key}": round(stat(r[key] for r in runs), 4)
               for stat in (statistics.median, statistics.mean) for key in ("seconds_to_translation", "seconds_to_trace")},
            "runs": runs}


def measure(site: Path, executable: str, sentences: list[str], note: str = "", repeats: int = 3) -> dict:
    "What a reader downloads and waits for, on this machine (see the module's docstring)."
    config = json.loads((site / "_static" / "translator" / "model" / "config.json").read_text())
    lock = json.loads((ROOT / "book" / "_static" / "translator" / "package-lock.json").read_text())
    load_before = os.getloadavg()
    with serve(site) as (base, _):
        presses = [first_press(base, executable, sentences[0]) for _ in range(repeats)]
        with tempfile.TemporaryDirectory() as profile, Chrome(executable, Path(profile)) as chrome:
            chrome.open(f"{base}/book/11_traced.html")
            chrome.wait_for(STATE, lambda s: s == "idle")
            translate(chrome, sentences[0], 1)                        # the first press, not counted here
            after = {name: summary([translate(chrome, s, beam) for s in sentences[1:]])
                     for name, beam in (("greedy", 1), ("beam4", 4))}
            assert all(local(url) for url in chrome.requests()), chrome.requests()
    first, files, page_bytes = presses[0]
    sizes = {}
    for url, n in files.items():
        path = site / urlsplit(url).path.lstrip("/")
        sizes[urlsplit(url).path.removeprefix("/_static/translator/")] = {
            "bytes": n, "gzip_bytes": len(gzip.compress(path.read_bytes(), 6)) if path.is_file() else None}
    return {
        "what": "the translator widget of chapter 11 in headless Chromium: the built site served from localhost by "
                "Python's http.server (no compression, browser cache off); the first press of Translate in a fresh "
                f"profile ({repeats} times, each in a new browser), then more sentences of test_2016_flickr with "
                "greedy and beam 4 in one page (seconds from the press to the translation shown, and to the "
                "trace drawn)",
        "cpu": cpu_name(), "cpu_count": os.cpu_count(), "browser": browser_version(executable),
        "onnxruntime_web": lock["packages"]["node_modules/onnxruntime-web"]["version"],
        "model": {"precision": config["precision"], "weights_sha256": config["weights_sha256"]},
        "note": note,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "page_bytes_before_translate": page_bytes,
        "first_translate": {
            "sentence": first["sentence"], "translation": first["translation"],
            "bytes_downloaded": sum(files.values()), "requests": len(files),
            "gzip_bytes_if_compressed": sum(s["gzip_bytes"] or s["bytes"] for s in sizes.values()),
            "median_seconds_to_translation": round(statistics.median(p[0]["seconds_to_translation"] for p in presses), 4),
            "median_seconds_to_trace": round(statistics.median(p[0]["seconds_to_trace"] for p in presses), 4),
            "median_load_seconds": round(statistics.median(p[0]["load_seconds"] for p in presses), 4),
            "presses": [p[0] for p in presses],
            "files": dict(sorted(sizes.items()))},
        "after": after,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "_build" / "html", help="the built book (_build/html)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    parser.add_argument("--sentences", type=int, default=20, help="test sentences after the first (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="first presses, each in a fresh browser (default 3)")
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    parser.add_argument("--browser", default=os.environ.get("TRANSFORMER_BROWSER") or shutil.which("chromium")
                        or shutil.which("google-chrome"), help="Chrome or Chromium (default: on PATH)")
    args = parser.parse_args(argv)
    from transformer.data import load_multi30k
    test = [s for s, _ in load_multi30k("de", "en", "test_2016_flickr", progress=False)]
    result = measure(args.site, args.browser, ["Ein Hund läuft im Schnee.", *test[:args.sentences]], args.note, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "after"} | {
        k: {m: v[m] for m in v if m != "runs"} for k, v in result["after"].items()}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
