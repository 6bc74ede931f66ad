"""The install is a lock: requirements.in holds the ranges, requirements.txt pins every package
for every platform (compiled by .ci/lock.py), and the environment the tests run in is the lock."""
import importlib.util
import os
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.txt"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
_spec = importlib.util.spec_from_file_location("lock_script", ROOT / ".ci" / "lock.py")
lock_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock_script)


def package_lines(text: str) -> list[str]:
    "The requirement lines of a requirements file: no comments, no options, no `-e .`."
    lines = [line.split(" #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def pins(text: str) -> dict[str, list[tuple[str, Marker | None]]]:
    "name -> [(version, marker)]: one entry per line (a package may differ by platform)."
    out: dict[str, list] = {}
    for line in package_lines(text):
        req = Requirement(line)
        (version,) = [s.version for s in req.specifier]
        out.setdefault(canonicalize_name(req.name), []).append((version, req.marker))
    return out


def applies(marker: Marker | None) -> bool:
    return marker is None or marker.evaluate()


def test_every_line_of_the_lock_is_an_exact_pin():
    text = LOCK.read_text()
    assert "python .ci/lock.py" in text.splitlines()[1]             # compiled, not written by hand
    assert [line for line in text.splitlines() if line.startswith("-")] == ["-e ."]
    for line in package_lines(text):
        spec = str(Requirement(line).specifier)
        assert re.fullmatch(r"==[0-9][0-9A-Za-z.+!-]*", spec), f"not an exact pin: {line}"
    for name, entries in pins(text).items():                         # at most one pin applies anywhere
        if len(entries) > 1:
            assert all(marker is not None for _, marker in entries), f"{name}: two unconditional pins"


@pytest.mark.skipif(os.environ.get("TRANSFORMER_UNLOCKED") == "1",
                    reason="the weekly job installs the newest versions the ranges allow")
def test_the_installed_packages_are_the_lock():
    "What this environment runs is what a fresh clone installs (`pip install -r requirements.txt`)."
    wrong = []
    for name, entries in pins(LOCK.read_text()).items():
        here = [version for version, marker in entries if applies(marker)]
        if not here:
            continue                                                  # another platform's package
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name} missing (lock {here[0]})")
            continue
        if Version(have).public != Version(here[0]).public:          # torch's +cpu build is 2.13.0
            wrong.append(f"{name} {have} (lock {here[0]})")
    assert not wrong, ("this environment is not the lock: pip install -r requirements.txt\n  "
                       + "\n  ".join(wrong))


def test_the_lock_satisfies_every_range_it_was_compiled_from():
    locked = pins(LOCK.read_text())
    wanted = [Requirement(line) for line in package_lines((ROOT / "requirements.in").read_text())]
    project = PYPROJECT["project"]
    wanted += [Requirement(d) for d in project["dependencies"]]
    wanted += [Requirement(d) for extra in project["optional-dependencies"].values() for d in extra]
    for req in wanted:
        entries = locked.get(canonicalize_name(req.name))
        assert entries, f"{req.name} is asked for but not in the lock: python .ci/lock.py"
        for version, _ in entries:
            assert req.specifier.contains(version, prereleases=True), f"lock {req.name}=={version} vs {req}"


def test_the_package_declares_true_ranges_and_its_figures_extra():
    project = PYPROJECT["project"]
    deps = {Requirement(d).name: str(Requirement(d).specifier) for d in project["dependencies"]}
    assert deps["torch"] == ">=2.4"         # is_autocast_enabled("cpu"), fused Adam on the CPU: 2.4
    assert not any(s.startswith("==") for s in deps.values())          # a library does not pin
    figures = {Requirement(d).name for d in project["optional-dependencies"]["figures"]}
    assert figures == {"altair", "matplotlib"}
    assert project["requires-python"] == f">={lock_script.PYTHON}"   # the lock covers the oldest


def test_binder_has_the_lock_with_the_cpu_build_of_the_same_torch():
    lock, binder = LOCK.read_text(), (ROOT / "binder" / "requirements.txt").read_text()
    assert f"--extra-index-url {lock_script.CPU_INDEX}" in binder.splitlines()
    assert "-e ." in binder.splitlines()
    ours, theirs = pins(lock), pins(binder)
    cuda = {name for name in ours if lock_script.CUDA_RUNTIME.match(f"{name}==")}
    for platform in ("darwin", "win32"):                              # Linux's alone
        assert cuda and not any(m.evaluate({"sys_platform": platform}) for n in cuda for _, m in ours[n])
    assert set(theirs) == set(ours) - cuda
    for name, entries in theirs.items():
        expected = [(v + "+cpu" if name == "torch" else v, m) for v, m in ours[name]]
        assert [(v, str(m)) for v, m in entries] == [(v, str(m)) for v, m in expected], name
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    assert runtime == f"python-{lock_script.PYTHON}"


@pytest.mark.parametrize("module, missing", [("plots", "matplotlib"), ("viz", "altair")])
def test_without_the_figures_extra_the_error_names_it(module, missing, monkeypatch):
    import importlib

    import transformer.figures
    from transformer.cli.commands import CLIError
    from transformer.cli.use import _plots

    monkeypatch.setitem(sys.modules, missing, None)                   # as if not installed
    monkeypatch.delitem(sys.modules, f"transformer.figures.{module}", raising=False)
    monkeypatch.delattr(transformer.figures, module, raising=False)
    with pytest.raises(ImportError, match=re.escape("pip install 'transformer-book[figures]'")):
        importlib.import_module(f"transformer.figures.{module}")
    if module == "plots":                                             # `plot` and `attend` say so
        with pytest.raises(CLIError, match=re.escape("'transformer-book[figures]'")):
            _plots()
