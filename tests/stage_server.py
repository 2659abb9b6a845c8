"""One interpreter that has imported what the stages import, forking a child for each stage run of the tests.

`python tests/stage_server.py SOCKET`: imports torch, transformers, speculators and vLLM, then serves on the
Unix socket SOCKET: each connection sends one JSON line {script, args, env, cwd, stdout, stderr, timeout}, and gets back
two lines: "pid N" when the run starts, then its exit code (or "timeout"). The run is a fork of this process that runs the script as
`python SCRIPT ARGS` runs it (sys.argv, sys.path[0], `__main__`, fds 0-2, the environment, exit code and atexit), so
a stage starts in a second where a fresh interpreter spends 10-30 s importing on a small CPU. Nothing here runs torch:
a fork before any thread or OpenMP pool exists is a clean one (checked: one thread when ready).

`StageServer` is the client side (tests/conftest.py, bench/bench_stage_server.py): it starts the server and runs
stages through it. Each run gets the caller's environment as it is at the call; a variable read when torch or vLLM is
imported (TORCH_LOGS, OMP_NUM_THREADS) takes effect only in a fresh process, so callers run those fresh.
"""
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StageServer:
    """Starts this file as a server (its imports run in the background) and runs stage scripts as its forks."""
    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="stage_server")
        self.socket = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.socket],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.ready = threading.Event()
        self.failed, self.said = "", False
        threading.Thread(target=self._start, daemon=True).start()

    def _start(self):
        lines = []
        for line in self.proc.stdout:
            if line.strip() == "ready":
                break
            lines.append(line)
        else:
            self.failed = "".join(lines[-20:]) or "it exited"
        self.ready.set()
        for _ in self.proc.stdout:  # (its log must not fill the pipe)
            pass

    def usable(self) -> bool:
        """Waits for the server to be ready; False (said once on stderr) if it did not start or has ended."""
        self.ready.wait()
        if self.failed and not self.said:
            self.said = True
            sys.stderr.write(f"tests/stage_server.py did not start, stages run as fresh processes:\n{self.failed}\n")
        return not self.failed and self.proc.poll() is None

    def start(self, script: str, args, timeout: float) -> "ForkedRun":
        """`python SCRIPT ARGS` (SCRIPT relative to the repository) in the current environment, as a fork, in the
        background; returns once its pid is known."""
        out, err = (tempfile.NamedTemporaryFile(dir=self.folder, delete=False).name for _ in range(2))
        request = {"script": os.path.join(ROOT, script), "args": [str(a) for a in args], "env": dict(os.environ),
                   "cwd": ROOT, "stdout": out, "stderr": err, "timeout": timeout}
        conn = socket.socket(socket.AF_UNIX)
        conn.connect(self.socket)
        conn.sendall((json.dumps(request) + "\n").encode())
        return ForkedRun(conn, [script, *args], out, err, timeout)

    def run(self, script: str, args, timeout: float) -> subprocess.CompletedProcess:
        """start() and wait for the end: what subprocess.run(capture_output=True, text=True) returns."""
        run = self.start(script, args, timeout)
        run.wait()
        return subprocess.CompletedProcess(run.args, run.returncode, run.stdout, run.stderr)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        import shutil
        shutil.rmtree(self.folder, ignore_errors=True)


class ForkedRun:
    """A run the server forked, with what the tests use of Popen: pid, poll, wait, send_signal, communicate,
    returncode, and stdout and stderr as text once it has ended."""
    def __init__(self, conn: socket.socket, args: list, out: str, err: str, timeout: float):
        self.conn, self.args, self.files, self.timeout = conn, args, (out, err), timeout
        self.reader = conn.makefile()
        first = self.reader.readline()
        if not first.startswith("pid "):
            raise AssertionError(f"tests/stage_server.py did not start {args[0]}")
        self.pid = int(first.split()[1])
        self.returncode = self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self.conn.settimeout(timeout)
        try:
            code = self.reader.readline().strip()
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        self.conn.close()
        self.stdout, self.stderr = (open(path, errors="replace").read() for path in self.files)
        for path in self.files:
            os.remove(path)
        if code == "timeout":
            raise subprocess.TimeoutExpired(self.args, self.timeout, self.stdout, self.stderr)
        if not code.lstrip("-").isdigit():  # the server (or the run's handler) died: no exit code came back
            raise AssertionError(f"tests/stage_server.py gave no exit code for {self.args[0]}; its stderr:\n"
                                 f"{self.stderr[-3000:]}")
        self.returncode = int(code)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it has just ended
                pass

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout, self.stderr


def preload() -> None:
    import matplotlib.pyplot  # noqa: F401  (04's plot)
    import numpy  # noqa: F401
    import safetensors.torch  # noqa: F401
    import speculators.models.eagle3
    import speculators.train.data  # noqa: F401
    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import vllm  # noqa: F401
    # not common/: its modules are small, and some keep the time they were imported at (common.log.LAUNCH)


def run(request: dict) -> None:
    """In the forked child: become `python SCRIPT ARGS` and never return."""
    for sig in (signal.SIGHUP, signal.SIGTERM):  # as a fresh interpreter has them (a server under nohup ignores SIGHUP)
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in [(0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)]:
        os.dup2(os.open(path, flags), fd)
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    import atexit
    import runpy
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if not isinstance(exit.code, int | None):
            print(exit.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (any exception ends the run with its traceback, as Python ends a script)
        sys.excepthook(*sys.exc_info())
        code = 1
    # what Python's exit does, less tearing down every module this process imported (seconds, for nothing)
    threading._shutdown()  # noqa: SLF001  (the non-daemon threads are waited for)
    atexit._run_exitfuncs()  # noqa: SLF001
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def wait(pid: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "timeout"


def serve(path: str) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(16)
    assert threading.active_count() == 1, threading.enumerate()
    sys.stdout.flush()
    sys.stderr.flush()
    print("ready", flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps each run's handler
    while True:
        conn, _ = server.accept()
        if os.fork():
            conn.close()
            continue
        # the handler of one run: forks the run, answers its exit code
        server.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        request = json.loads(conn.makefile().readline())
        pid = os.fork()
        if pid == 0:
            conn.close()
            run(request)
        conn.sendall(f"pid {pid}\n".encode())
        conn.sendall((wait(pid, request["timeout"]) + "\n").encode())
        os._exit(0)


if __name__ == "__main__":
    preload()
    serve(sys.argv[1])
