"""Notebook kernels forked from a process that has already imported torch: nbval's kernels, started in
a tenth of the time (tests/conftest.py turns them on).

nbval runs each notebook in a fresh kernel process, as a reader's Jupyter does. A cold kernel spends
about 3 s of CPU before a notebook's first line runs, most of it importing torch, and the suite starts
about 40 of them. Here one *zygote* process per pytest worker imports the heavy third-party modules
once (`PRELOAD`: never this project's package, so a notebook that forgets an import of ours still
fails) and forks a kernel for each notebook. The fork starts as `python -m ipykernel_launcher -f FILE`
would, in the notebook's directory with the environment nbval gives it: the same `sys.argv`,
`sys.path`, working directory and environment variables, and fresh seeds for Python's, numpy's and
torch's global generators (a cold process draws them from the OS). The
test `tests/test_warm_kernel.py` compares a warm kernel with a cold one on all of these.

    python tests/warm_kernel.py serve SOCKET        the zygote: listens on a Unix socket
    python tests/warm_kernel.py launch -f FILE      the kernel command nbval starts (its kernel spec)

`launch` stands in for the kernel process that Jupyter manages: it hands its stdin, stdout and
stderr to the zygote, which forks the kernel onto them; it forwards SIGINT (Jupyter's interrupt)
and SIGTERM to the kernel and exits with the kernel's status. When `launch` is killed, the zygote
kills its kernel; when the zygote exits, it kills every kernel it forked, and it exits when the
process that started it dies. Linux only.
"""
import json
import os
import selectors
import signal
import socket
import struct
import sys

SOCKET_ENV = "TRANSFORMER_WARM_KERNEL"        # the zygote's socket, for `launch`
# Only modules whose import does not depend on the process it runs in: not ipykernel.kernelapp (its
# class reads JPY_PARENT_PID, set for each kernel), not pandas (it sizes its display options by
# whether it is imported in a terminal or a kernel: a zygote's DataFrames would print truncated)
PRELOAD = ("numpy", "torch", "ipykernel.ipkernel")
# what those imports read from the environment once: a kernel asked for with other values of these
# starts cold (exec'd), so that it is exactly the process nbval would have started
READ_AT_IMPORT = ("OMP_", "MKL_", "OPENBLAS_", "KMP_", "GOMP_", "PYTHON", "LD_", "TORCH", "PYTORCH",
                  "CUDA", "NUMPY", "PANDAS", "IPYTHON", "TRANSFORMER_SEED_SHIFT")


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv(conn: socket.socket):
    head = _recv_exactly(conn, 4)
    return None if head is None else json.loads(_recv_exactly(conn, struct.unpack("!I", head)[0]))


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _become_kernel(request: dict, fds: list[int], started: dict) -> None:
    """In the forked child: turn into `python -m ipykernel_launcher` started as `request` says
    (exec it cold where the environment differs from the zygote's `started` in what imports read)."""
    import random
    import runpy
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    os.chdir(request["cwd"])
    env = request["env"]
    if any(env.get(k) != started.get(k) for k in {*env, *started} if k.startswith(READ_AT_IMPORT)):
        os.execve(sys.executable, [sys.executable, "-m", "ipykernel_launcher", *request["argv"][1:]], env)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = list(request["argv"])
    sys.path[0] = os.getcwd()                     # what `python -m` puts first
    random.seed()                                 # fresh entropy, as a new process draws
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)


def serve(path: str) -> None:
    "The zygote: import PRELOAD, then fork a kernel for each request on the Unix socket `path`."
    import importlib
    started = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    kernels: dict[int, socket.socket] = {}        # pid -> the connection of its `launch`
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)

    def stop(*_):
        for pid in kernels:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        if os.getppid() != parent:                # the pytest worker died without closing us
            stop()
        for key, _ in sel.select(timeout=0.2):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
                size = struct.unpack("!I", msg[:4])[0]
                request = json.loads(msg[4:] + (_recv_exactly(conn, size + 4 - len(msg)) or b""))
                pid = os.fork()
                if pid == 0:
                    try:
                        sel.close()
                        listener.close()
                        conn.close()
                        _become_kernel(request, fds, started)
                    except SystemExit as e:
                        os._exit(e.code if isinstance(e.code, int) else 1)
                    except BaseException:
                        import traceback
                        traceback.print_exc()
                        os._exit(1)
                    os._exit(0)
                for fd in fds:
                    os.close(fd)
                kernels[pid] = conn
                _send(conn, {"pid": pid})
                sel.register(conn, selectors.EVENT_READ, pid)
            else:                                 # a `launch` closed its end: it is gone
                pid = key.data
                sel.unregister(key.fileobj)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while kernels:                            # reap the kernels that exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = kernels.pop(pid, None)
            if conn is not None:
                try:
                    sel.unregister(conn)
                except (KeyError, ValueError):
                    pass
                try:
                    _send(conn, {"status": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                conn.close()


class Zygote:
    """A zygote process of this machine's Python and the kernel spec that forks its kernels (what
    tests/conftest.py hands nbval). `close()` stops it and every kernel it forked."""

    def __init__(self):
        import subprocess
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="warm-kernel-")
        self.path = os.path.join(self.dir, "socket")
        self.process = subprocess.Popen([sys.executable, __file__, "serve", self.path],
                                        stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{__file__}: the zygote did not start (exit {self.process.wait()})")

    def kernel_spec(self) -> dict:
        "ipykernel's own spec for this Python, with `launch` in place of `-m ipykernel_launcher`."
        import ipykernel.kernelspec
        spec = ipykernel.kernelspec.get_kernel_dict()
        assert spec["argv"][1:3] == ["-m", "ipykernel_launcher"], spec["argv"]
        spec["argv"] = [sys.executable, __file__, "launch", *spec["argv"][3:]]
        spec["env"] = {**spec.get("env", {}), SOCKET_ENV: self.path}
        return spec

    def close(self) -> None:
        import shutil
        self.process.terminate()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def launch(argv: list[str]) -> int:
    "The kernel's stand-in: ask the zygote for a kernel, forward signals to it, return its status."
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_ENV])
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    request = {"argv": ["ipykernel_launcher", *argv], "cwd": os.getcwd(), "env": env}
    data = json.dumps(request).encode()
    socket.send_fds(conn, [struct.pack("!I", len(data)) + data], [0, 1, 2])
    pid = _recv(conn)["pid"]

    def forward(signum, _):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    reply = _recv(conn)                           # a forwarded signal does not interrupt it (PEP 475)
    return 1 if reply is None else reply["status"]


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "launch":
        sys.exit(launch(sys.argv[2:]))
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET | launch -f CONNECTION_FILE")
