"""Lint: `ruff check` (pyproject.toml, [tool.ruff]: pyflakes, import order, bugbear) is clean on the
package, the tests and the notebooks' code (ruff reads .ipynb). Fast: not marked slow."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["transformer", "book", "tests"]


def ruff_command() -> list[str]:
    "ruff from this environment: the module (pip's ruff) or, failing that, the binary beside python."
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    binary = Path(sys.executable).with_name("ruff")
    if binary.exists():
        return [str(binary)]
    message = "ruff is not installed (pip install -r requirements.txt)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}: CI must lint")
    pytest.skip(message)


def test_ruff_finds_nothing():
    result = subprocess.run([*ruff_command(), "check", "--no-cache", "--output-format", "concise",
                             *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"ruff check {' '.join(PATHS)}:\n{result.stdout}{result.stderr}"
