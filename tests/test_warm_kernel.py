"""tests/warm_kernel.py: the notebooks' kernels forked from a zygote are the processes a cold start
gives (what nbval would start), can be interrupted, and do not outlive the process Jupyter manages."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import ipykernel.kernelspec
import pytest
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager
from warm_kernel import SOCKET_ENV, Zygote

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sys.platform != "linux", reason="the zygote forks: Linux only")]
BOOK = Path(__file__).resolve().parents[1] / "book"

# what a kernel reports of itself: everything a notebook could see of how its process started
PROBE = """
import json, os, random, signal, sys
first = sorted(m for m in ("pandas", "altair", "matplotlib", "tqdm.autonotebook") if m in sys.modules)
forked = "warm_kernel.py" in open("/proc/self/cmdline", "rb").read().decode()
import pandas as pd, torch
from ipykernel.kernelapp import IPKernelApp
print(json.dumps({"argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ),
                  "poller": type(IPKernelApp.instance().poller).__name__,
                  "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "torch_seed": torch.initial_seed(), "random": random.random(), "pid": os.getpid(),
                  "preloaded": first, "forked": forked,
                  "wide": repr(pd.DataFrame([[0.5] * 12], columns=[f"column {i}" for i in range(12)]))}))
"""


class _Spec(KernelSpecManager):
    "A kernel spec manager that knows one spec, whatever the name."
    spec: dict = {}

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(resource_dir=ipykernel.kernelspec.RESOURCES, **self.spec)


def _start(spec: dict, env: dict | None = None):
    manager = _Spec()
    manager.spec = spec
    km = KernelManager(kernel_name="probe", kernel_spec_manager=manager)
    km.start_kernel(cwd=str(BOOK), **({"env": env} if env else {}))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def _run(kc, code: str, timeout: float = 120) -> tuple[str, dict]:
    out = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda m: out.append(
        m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
    return "".join(out), reply["content"]


def _probe(spec: dict, env: dict | None = None) -> dict:
    km, kc = _start(spec, env)
    try:
        return json.loads(_run(kc, PROBE)[0])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def test_a_warm_kernel_is_the_process_a_cold_one_is(zygote):
    cold = _probe(ipykernel.kernelspec.get_kernel_dict())
    warm, warm2 = _probe(zygote.kernel_spec()), _probe(zygote.kernel_spec())
    assert warm["forked"] and not cold["forked"]           # a fork of the zygote, which imported torch
    assert Path(warm["argv"][0]).name == Path(cold["argv"][0]).name == "ipykernel_launcher.py"
    assert warm["argv"][1] == cold["argv"][1] == "-f"
    for key in ("wide", "path", "cwd", "poller", "sigint", "preloaded"):
        assert warm[key] == cold[key], key
    assert warm["poller"] == "ParentPollerUnix" and warm["cwd"] == str(BOOK)
    assert warm["preloaded"] == [] and "..." not in warm["wide"]   # a kernel's pandas: not a terminal's
    differ = {k for k in {*warm["env"], *cold["env"]} if warm["env"].get(k) != cold["env"].get(k)}
    assert differ <= {"JPY_PARENT_PID"} and SOCKET_ENV not in warm["env"], differ
    for key in ("random", "torch_seed"):              # fresh entropy, as each new process draws
        assert warm[key] != warm2[key] != cold[key], key


def test_another_environment_for_what_imports_read_starts_cold(zygote):
    "A kernel asked for with another OMP_NUM_THREADS than the zygote imported torch with is exec'd cold."
    other = str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)
    report = _probe(zygote.kernel_spec(), env={**os.environ, "OMP_NUM_THREADS": other})
    assert not report["forked"] and report["env"]["OMP_NUM_THREADS"] == other     # exec'd afresh


def test_an_interrupt_reaches_a_warm_kernel(zygote):
    km, kc = _start(zygote.kernel_spec())
    try:
        msg_id = kc.execute("import time; time.sleep(60)")
        time.sleep(1)
        km.interrupt_kernel()                   # SIGINT to the launcher's process group: forwarded
        reply = kc.get_shell_msg(timeout=30)
        while reply["parent_header"].get("msg_id") != msg_id:              # an earlier request's reply
            reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert _run(kc, "print(1 + 1)")[0].strip() == "2"                # and it goes on
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_killed_launcher_takes_its_kernel_with_it(zygote):
    km, kc = _start(zygote.kernel_spec())
    pid = int(_run(kc, "import os; print(os.getpid())")[0])
    assert pid != km.provisioner.process.pid                               # a fork, not the launcher
    kc.stop_channels()
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"kernel {pid} outlived its killed launcher")
    km.cleanup_resources()


def test_the_zygote_goes_when_the_process_that_started_it_dies():
    "A pytest worker killed outright leaves no zygote behind (nor its kernels: the zygote kills them)."
    import subprocess
    starter = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                                "from warm_kernel import Zygote; z = Zygote(); print(z.process.pid, flush=True); "
                                "time.sleep(600)", str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True)
    zygote = int(starter.stdout.readline())
    starter.kill()
    starter.wait()
    deadline = time.monotonic() + 10
    while _running(zygote) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(zygote), f"zygote {zygote} outlived the process that started it"


def _running(pid: int) -> bool:
    "Alive and not a zombie (an orphan's zombie waits for init to reap it)."
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
