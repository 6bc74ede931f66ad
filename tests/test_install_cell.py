"""The guarded install cell at the top of every notebook: the package installed only where it is
missing (Colab, Binder, a checkout not installed yet), from the checkout the notebook sits in or from a
shallow clone of the repository that _config.yml names, whose book/ the notebook then runs in (the
shipped model and the recorded runs are files there); a no-op here and under nbval."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text())
ENTRIES = [c["file"] for p in TOC["parts"] for c in p["chapters"]] + \
          [s["file"] for p in TOC["parts"] for c in p["chapters"] for s in c.get("sections", [])]
# the pages that are notebooks (appendix G, the API reference, is a reStructuredText page)
NOTEBOOKS = [e for e in ENTRIES if (ROOT / f"{e}.ipynb").exists()]
CLONE = f'git clone --quiet --depth 1 --branch {CONFIG["repository"]["branch"]} {CONFIG["repository"]["url"]}'


def install_cell(notebook: str) -> str:
    cells = json.loads((ROOT / f"{notebook}.ipynb").read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    assert first.get("id") == "install", f"{notebook}: the first code cell must be the install cell"
    return "".join(first["source"])


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_notebook_starts_with_the_install_cell_for_the_configured_repository(notebook):
    source = install_cell(notebook)
    assert f"!{CLONE}\n" in source, \
        f"{notebook}: the install cell must clone _config.yml's repository ({CLONE}); a fork changes _config.yml " \
        "and this cell in every notebook the same way"
    assert source == install_cell(NOTEBOOKS[0])                         # one cell, the same everywhere


def _run_cell(source: str, importable: bool, cwd: Path) -> list[str]:
    "Run the cell in an IPython shell in `cwd`; return the magics and shell commands it ran (recorded, not run)."
    import os

    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    calls = []
    real = shell.run_line_magic, shell.system
    shell.run_line_magic = lambda name, line, *a, **k: calls.append(f"%{name} {shell.var_expand(line)}")
    shell.system = lambda command: calls.append(f"!{command}")
    saved, here = sys.modules.get("transformer"), os.getcwd()
    if not importable:
        sys.modules["transformer"] = None                              # import transformer -> ImportError
    try:
        os.chdir(cwd)
        result = shell.run_cell(source)
        assert result.error_in_exec is None and result.error_before_exec is None
    finally:
        os.chdir(here)
        shell.run_line_magic, shell.system = real
        if saved is not None:
            sys.modules["transformer"] = saved
        else:
            sys.modules.pop("transformer", None)
    return calls


def test_the_cell_does_nothing_where_the_package_is_installed_and_installs_where_it_is_missing(tmp_path):
    source = install_cell(NOTEBOOKS[0])
    assert _run_cell(source, importable=True, cwd=ROOT / "book") == []  # here, and under nbval: a no-op
    # a checkout not installed yet (VS Code, JupyterLab on a clone): install it, nothing to fetch
    assert _run_cell(source, importable=False, cwd=ROOT / "book") == ["%pip install --quiet .."]
    # Colab: a notebook alone; clone the repository and run in its book/
    assert _run_cell(source, importable=False, cwd=tmp_path) == [
        f"!{CLONE}", "%pip install --quiet ./transformer-book"]   # pip reads a bare name as a project on PyPI
    (tmp_path / "transformer-book" / "book").mkdir(parents=True)       # what the clone wrote
    assert _run_cell(source, importable=False, cwd=tmp_path) == [    # run again: no second clone
        "%pip install --quiet ./transformer-book", "%cd transformer-book/book"]
    # the runtime restarted: the package is installed, the working directory is back where it was
    assert _run_cell(source, importable=True, cwd=tmp_path) == ["%cd transformer-book/book"]


@pytest.mark.slow
def test_the_clone_installs_in_an_empty_venv_and_holds_what_the_chapters_read(tmp_path):
    """The cell's clone, pointed at this checkout (a file:// URL, so that --depth 1 holds): it brings the
    shipped model and the recorded runs, and the package installs from it. The installer is uv (locked in
    requirements.txt): it builds the directory the same way as the cell's %pip (setuptools, isolated), and
    needs neither pip in the venv nor a pip upgrade from the registry."""
    from uv import find_uv_bin
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", CONFIG["repository"]["branch"]],
                      capture_output=True).returncode != 0:
        pytest.skip(f"this checkout has no branch {CONFIG['repository']['branch']!r} to clone")
    local = CLONE.replace(CONFIG["repository"]["url"], ROOT.as_uri())
    assert local != CLONE and local.startswith("git clone --quiet --depth 1 --branch ")
    subprocess.run([*local.split(), "transformer-book"], cwd=tmp_path, check=True, timeout=300)
    clone = tmp_path / "transformer-book"
    for needed in ("book/model/model.safetensors", "book/model/tokenizer.model", "book/results/ship-de-en/results.json"):
        assert (clone / needed).is_file(), needed
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # --no-deps: the dependencies (torch, ...) are the requirements' business, not this cell's
    # the cell's own argument, from the folder the clone lies in: a path ("./..."), which pip and uv install as one;
    # a bare name would be a project on PyPI to both
    source = re.search(r'else "([^"]+)"', install_cell(NOTEBOOKS[0]))[1]
    assert source.startswith("./") and (tmp_path / source).resolve() == clone
    done = subprocess.run([find_uv_bin(), "pip", "install", "--quiet", "--python", str(python), "--no-deps",
                           source], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    where = subprocess.run([str(python), "-c", "import importlib.util as u, importlib.metadata as m; "
                            "print(u.find_spec('transformer').origin); "
                            "print(*m.files('transformer-book'), sep='\\n')"],
                           capture_output=True, text=True, cwd=tmp_path)   # not this checkout's copy
    origin, *files = where.stdout.splitlines()
    assert str(venv) in origin and origin.endswith("transformer/__init__.py"), where
    for module in ("training.py", "engine/loop.py", "engine/devices.py", "cli/commands.py",
                   "modern/gpt.py", "figures/plots.py"):       # the generated modules came along, subpackages too
        assert f"transformer/{module}" in files
