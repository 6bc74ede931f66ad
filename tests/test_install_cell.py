"""The guarded install cell at the top of every notebook: the package from the repository that
_config.yml names, installed only where it is missing (Colab, Binder), a no-op here and under nbval."""
import json
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
SPEC = f'transformer-book @ git+{CONFIG["repository"]["url"]}@{CONFIG["repository"]["branch"]}'


def install_cell(notebook: str) -> str:
    cells = json.loads((ROOT / f"{notebook}.ipynb").read_text())["cells"]
    first = next(c for c in cells if c["cell_type"] == "code")
    assert first.get("id") == "install", f"{notebook}: the first code cell must be the install cell"
    return "".join(first["source"])


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_every_notebook_starts_with_the_install_cell_for_the_configured_repository(notebook):
    source = install_cell(notebook)
    assert f'%pip install --quiet "{SPEC}"' in source, \
        f"{notebook}: the install cell must name _config.yml's repository ({SPEC}); a fork changes _config.yml " \
        "and this cell in every notebook the same way"
    assert source == install_cell(NOTEBOOKS[0])                         # one cell, the same everywhere


def _run_cell(source: str, importable: bool) -> list[str]:
    "Run the cell in an IPython shell; return the %pip lines it ran (recorded, not executed)."
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    calls = []
    real = shell.run_line_magic
    shell.run_line_magic = lambda name, line, *a, **k: calls.append(f"%{name} {line}")
    saved = sys.modules.get("transformer")
    if not importable:
        sys.modules["transformer"] = None                              # import transformer -> ImportError
    try:
        result = shell.run_cell(source)
        assert result.error_in_exec is None and result.error_before_exec is None
    finally:
        shell.run_line_magic = real
        if saved is not None:
            sys.modules["transformer"] = saved
        else:
            sys.modules.pop("transformer", None)
    return calls


def test_the_cell_does_nothing_where_the_package_is_installed_and_installs_where_it_is_missing():
    source = install_cell(NOTEBOOKS[0])
    assert _run_cell(source, importable=True) == []                     # here, and under nbval: a no-op
    assert _run_cell(source, importable=False) == [f'%pip install --quiet "{SPEC}"']


@pytest.mark.slow
def test_the_spec_installs_in_an_empty_venv_from_the_local_checkout(tmp_path):
    """The cell's requirement, pointed at this checkout: the package is built from git and installed.
    The installer is uv (locked in requirements.txt): it reads the same PEP 508 string as the cell's
    %pip, clones and builds the same way (setuptools, isolated), and needs neither pip in the venv nor
    a pip upgrade from the registry. Its cache keeps a wheel per commit, so an unchanged commit is not
    built twice."""
    from uv import find_uv_bin
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", CONFIG["repository"]["branch"]],
                      capture_output=True).returncode != 0:
        pytest.skip(f"this checkout has no branch {CONFIG['repository']['branch']!r} to install from")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    local = SPEC.replace(CONFIG["repository"]["url"], ROOT.as_uri())
    assert local != SPEC and local.startswith("transformer-book @ git+file://")
    # --no-deps: the dependencies (torch, ...) are the requirements' business, not this cell's
    done = subprocess.run([find_uv_bin(), "pip", "install", "--quiet", "--python", str(python), "--no-deps",
                           local], capture_output=True, text=True, timeout=600)
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
