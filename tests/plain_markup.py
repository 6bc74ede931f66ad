"""The notebooks' markdown in plain CommonMark, so that it reads right wherever a notebook opens
(issue 43): JupyterLab without extensions, Colab, VS Code, GitHub's viewer and the built site.

- **A number in the prose** is plain text in an HTML span that names the value it was formatted
  from: `<span data-glue="emb_min:.2f">0.13</span>` (myst-nb's `glue(name, value, display=False)`
  in a code cell stores the value; `name:spec` formats it as `format(value, spec)` does, `name`
  alone as `str(value)`; `other.ipynb::name:spec` reads another notebook's record). Every viewer
  shows the number; the span itself is invisible. This script writes the number from the stored
  record, and `tests/test_prose_numbers.py` fails when the text and the record disagree.
- **A folded solution** is an HTML `<details><summary>Solution N: ...</summary>` block, with
  blank lines around its markdown body so that every viewer parses it; a solution's code cell
  (id `exN-solution`) carries the notebook format's own `"jupyter": {"source_hidden": true,
  "outputs_hidden": true}`, which JupyterLab and VS Code fold, beside the site's `hide-cell` tag.

    python tests/plain_markup.py            # check: lists what differs, exits 1 if anything does
    python tests/plain_markup.py --write    # rewrite the numbers from the stored glue records

Run `--write` after `jupyter execute --inplace` changed a glued value. It also converts what an
author may still write out of habit (a myst-nb `{glue:text}` role, a `:::{dropdown}` fence, a
solution cell without the metadata), and is idempotent: a second run changes nothing. It edits
markdown cells and cell metadata only, never code or outputs, and writes the JSON as
nbformat does (indent 1, UTF-8, a final newline).
"""
from __future__ import annotations

import argparse
import copy
import html
import json
import re
import sys
from ast import literal_eval
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"

# a value in the prose: <span data-glue="[notebook.ipynb::]name[:spec]">formatted value</span>
SPAN = re.compile(r'<span data-glue="([^"<>]+)">([^<]*)</span>')
# myst-nb's inline glue roles, {glue}`name` / {glue:text}`name:.2f` / {glue:md}`path::name` ...
ROLE = re.compile(r"\{glue(?::(\w+))?\}`([^`]+)`")
# ... and its directives, ```{glue:figure} name / :::{glue:math} name
DIRECTIVE = re.compile(r"^\s*(?:`{3,}|:{3,})\{glue(?::(\w+))?\}", re.M)
# characters that would make a value mean something else in markdown or HTML
MARKUP = re.compile(r"[\\`*_\[\]<>&$|]")

DROPDOWN = re.compile(r"^:::\{dropdown\}[ \t]*(.*?)[ \t]*\n(.*?)\n:::[ \t]*$", re.M | re.S)
SOLUTION = re.compile(r"ex\d+-solution")
HIDDEN = {"outputs_hidden": True, "source_hidden": True}
# The inline math of the solutions' titles, in HTML: markdown (and so $...$) is not parsed
# inside an HTML block, in any viewer. A title with other math fails; add it here.
TITLE_MATH = {
    r"n = d": "<i>n</i> = <i>d</i>",
    r"d": "<i>d</i>",
    r"h": "<i>h</i>",
    r"q": "<i>q</i>",
    r"\log 8": "log 8",
    r"\sigma^4": "σ<sup>4</sup>",
    r"\sigma^4 d_k": "σ<sup>4</sup> <i>d<sub>k</sub></i>",
    r"W^O": "<i>W</i><sup>O</sup>",
    r"h \cdot d_k": "<i>h</i> · <i>d<sub>k</sub></i>",
    r"\epsilon = 0": "ε = 0",
}


def read(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def write(nb: dict, path: Path) -> None:
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def source(cell: dict) -> str:
    return "".join(cell["source"])


def set_source(cell: dict, text: str) -> None:
    "The cell's source as nbformat stores it: a list of lines, each but the last with its newline."
    cell["source"] = re.findall(r"[^\n]*\n|[^\n]+$", text)


def text_of(data: dict) -> str:
    value = data.get("text/plain", "")
    return "".join(value) if isinstance(value, list) else value


def glued(nb: dict) -> dict[str, list[tuple[str, dict]]]:
    "name -> [(cell id, stored MIME bundle without the glue prefix)], in the order glued."
    out: dict[str, list] = {}
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            meta = output.get("metadata", {}).get("scrapbook")
            if output.get("output_type") == "display_data" and meta:
                prefix = meta.get("mime_prefix", "")
                data = {k[len(prefix):]: v for k, v in output["data"].items()
                        if k.startswith(prefix)}
                out.setdefault(meta["name"], []).append((cell.get("id"), data))
    return out


def format_value(text: str, spec: str) -> str:
    """The stored repr formatted as myst-nb's `{glue:text}` did (`format_plain_text`): the
    literal's value, `str` of it without a spec, else `format` after a cast the spec implies."""
    try:
        value = literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if spec == "":
        return str(value)
    kind = spec[-1]
    if kind == "s":
        value = str(value)
    elif kind in "bcdoxX":
        value = int(value)
    elif kind in "eEfFgGn%":
        value = float(value)
    return format(value, spec)


def split(body: str) -> tuple[str, str, str]:
    "'[path::]name[:spec]' -> (notebook stem or '', name, spec)."
    doc, _, key = body.rpartition("::")
    name, _, spec = key.partition(":")
    return Path(doc).stem, name, spec


class Records:
    "The stored glue records of the book's notebooks, read once each."

    def __init__(self, book: Path = BOOK):
        self.book, self.cache = book, {}

    def of(self, stem: str) -> dict:
        if stem not in self.cache:
            path = self.book / f"{stem}.ipynb"
            self.cache[stem] = glued(read(path)) if path.exists() else {}
        return self.cache[stem]

    def value(self, body: str, here: str) -> str:
        """The text a span `body` in notebook `here` must hold; ValueError saying why there is
        none (an unknown name, a spec that does not apply, a value with markup characters)."""
        doc, name, spec = split(body)
        records = self.of(doc or here)
        if name not in records:
            raise ValueError(f"{body!r}: {doc or here} glues no value named {name!r}")
        data = records[name][0][1]
        if "text/plain" not in data:
            raise ValueError(f"{body!r}: the record of {name!r} has no text/plain")
        try:
            text = format_value(text_of(data), spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{body!r}: {spec!r} does not apply to {text_of(data)!r}: {e}") from e
        if MARKUP.search(text) or "\n" in text:
            raise ValueError(f"{body!r}: the value {text!r} holds a markdown character; "
                             "glue a plain value")
        return text


def title_html(title: str) -> str:
    "A solution's title in HTML: escaped, `code` as <code>, $math$ from TITLE_MATH."
    parts = re.split(r"(\$[^$]+\$|`[^`]+`)", title)
    out = []
    for part in parts:
        if part.startswith("$") and part.endswith("$") and len(part) > 1:
            if part[1:-1] not in TITLE_MATH:
                raise ValueError(f"no HTML for the math {part!r} in the title {title!r}: "
                                 "add it to TITLE_MATH")
            out.append(TITLE_MATH[part[1:-1]])
        elif part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
        else:
            out.append(html.escape(part, quote=False))
    return "".join(out)


def details(match: re.Match) -> str:
    title, body = match.group(1), match.group(2).strip("\n")
    return f"<details><summary>{title_html(title)}</summary>\n\n{body}\n\n</details>"


def fix_markdown(text: str, here: str, records: Records) -> tuple[str, list[str]]:
    "The markdown with glue roles as spans, numbers from the records, dropdowns as <details>."
    problems = []
    text = ROLE.sub(lambda m: (f'<span data-glue="{m.group(2)}"></span>'
                               if m.group(1) == "text" else m.group(0)), text)

    def number(m: re.Match) -> str:
        try:
            return f'<span data-glue="{m.group(1)}">{records.value(m.group(1), here)}</span>'
        except ValueError as e:
            problems.append(str(e))
            return m.group(0)

    text = SPAN.sub(number, text)
    try:
        text = DROPDOWN.sub(details, text)
    except ValueError as e:
        problems.append(str(e))
    return text, problems


def fix(nb: dict, here: str, records: Records | None = None) -> tuple[dict, list[str]]:
    """A copy of notebook `here` (its file name's stem) with its markdown and solution metadata
    fixed, and what could not be fixed. Its own values are read from `nb`, another notebook's
    from its file."""
    nb, problems = copy.deepcopy(nb), []
    records = records or Records()
    records.cache[here] = glued(nb)
    for cell in nb["cells"]:
        where = f"{here} cell {cell.get('id')}"
        if cell["cell_type"] == "markdown":
            text, found = fix_markdown(source(cell), here, records)
            problems += [f"{where}: {p}" for p in found]
            if text != source(cell):
                set_source(cell, text)
        elif cell["cell_type"] == "code" and SOLUTION.fullmatch(cell.get("id", "")):
            meta = cell["metadata"]
            hidden = {**meta.get("jupyter", {}), **HIDDEN}
            hidden = {k: hidden[k] for k in sorted(hidden)}  # nbformat writes the keys sorted
            if list(hidden.items()) != list(meta.get("jupyter", {}).items()):
                meta["jupyter"] = hidden
                if list(meta) != sorted(meta):
                    cell["metadata"] = {k: meta[k] for k in sorted(meta)}
    return nb, problems


def number_problems(nb: dict, here: str, records: Records | None = None) -> list[str]:
    """The prose numbers of notebook `here` that are wrong, one line each: a number that differs
    from its stored glue value formatted, a span naming an unknown value (or one whose format does
    not apply), a myst-nb glue role or directive left."""
    records = records or Records()
    records.cache[here] = glued(nb)
    problems = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        where, text = f"{here} cell {cell.get('id')}", source(cell)
        for m in SPAN.finditer(text):
            try:
                value = records.value(m.group(1), here)
            except ValueError as e:
                problems.append(f"{where}: {e}")
                continue
            if m.group(2) != value:
                problems.append(f"{where}: {m.group(1)!r} reads {m.group(2)!r}, its stored "
                                f"value formats as {value!r}")
        for m in [*ROLE.finditer(text), *DIRECTIVE.finditer(text)]:
            problems.append(f"{where}: a myst-nb glue role or directive, {m.group(0)!r}")
    return problems


def fold_problems(nb: dict, here: str) -> list[str]:
    "A dropdown fence left, a solution cell without the collapse metadata."
    problems = []
    for cell in nb["cells"]:
        where = f"{here} cell {cell.get('id')}"
        if cell["cell_type"] == "markdown" and DROPDOWN.search(source(cell)):
            problems.append(f"{where}: a {{dropdown}} fence (use <details>)")
        elif cell["cell_type"] == "code" and SOLUTION.fullmatch(cell.get("id", "")):
            if any(cell["metadata"].get("jupyter", {}).get(k) is not True for k in HIDDEN):
                problems.append(f"{where}: a solution without {{'jupyter': {HIDDEN}}}")
    return problems


def check(nb: dict, here: str, records: Records | None = None) -> list[str]:
    "Everything `--write` would fix, or cannot."
    return number_problems(nb, here, records) + fold_problems(nb, here)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the fixed notebooks back")
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to fix (default: every book/*.ipynb)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted(BOOK.glob("*.ipynb"))
    records, changed, problems = Records(), [], []
    for path in paths:
        old = read(path)
        nb, found = fix(old, path.stem, records)
        problems += found
        if json.dumps(nb) != json.dumps(old):                # key order too
            changed.append(path)
            if args.write:
                write(nb, path)
    for path in changed:
        print(f"{'rewrote' if args.write else 'differs'}: {path.relative_to(ROOT)}")
        if not args.write:
            problems += check(read(path), path.stem, records)
    for problem in dict.fromkeys(problems):
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems or (changed and not args.write) else 0


if __name__ == "__main__":
    sys.exit(main())
