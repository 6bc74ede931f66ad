"""Refresh the lock: `python .ci/lock.py` (CONTRIBUTING, "Refreshing the lock").

1. requirements.in (ranges) -> requirements.txt: every package, transitive ones included, pinned
   for every platform at once (uv's universal resolution writes environment markers where
   platforms or Python versions differ; torch's CUDA libraries carry `sys_platform == 'linux'`).
2. requirements.txt -> binder/requirements.txt: the same pins for Binder, which has no GPU: the
   CPU build of the same torch from PyTorch's index, and none of torch's CUDA libraries.

Extra arguments go to `uv pip compile`: `--upgrade` takes the newest versions the ranges allow,
`--upgrade-package NAME` one package; without them the pins that still fit are kept.
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = "3.11"   # the oldest Python that pyproject.toml supports: the lock covers it and newer
CUDA_RUNTIME = re.compile(r"^(nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|triton)==")   # torch's, on Linux
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def binder_lines(lock: str) -> list[str]:
    "The lock's package lines for Binder: torch's CPU build, no CUDA runtime."
    out = []
    for line in lock.splitlines():
        if not line or line.startswith(("#", " ")) or CUDA_RUNTIME.match(line):
            continue
        out.append(re.sub(r"^torch==([^\s;+]+)", r"torch==\1+cpu", line))
    return out


def main(args: list[str]) -> None:
    subprocess.run(["uv", "pip", "compile", "requirements.in", "--universal", "--python-version",
                    PYTHON, "--quiet", "--custom-compile-command", "python .ci/lock.py",
                    "-o", "requirements.txt", *args], cwd=ROOT, check=True)
    lock = (ROOT / "requirements.txt").read_text()
    header = ["# Binder (mybinder.org) builds from this file, generated from the lock by .ci/lock.py:",
              "# the pins of ../requirements.txt, with PyTorch's CPU-only wheel of the same torch and",
              "# none of its CUDA libraries (Binder has no GPU; they are about 3 GB).",
              f"--extra-index-url {CPU_INDEX}"]
    (ROOT / "binder" / "requirements.txt").write_text("\n".join(header + binder_lines(lock)) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
