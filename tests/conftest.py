"""Shared test fixtures: tiny real models built offline at test time, and helpers to run the scripts end to end.

Nothing here mocks vLLM: the scripts run in subprocesses on a real (CPU) vLLM engine, with a random-init Llama-style
policy (head_dim 64, which vLLM's CPU attention needs) briefly fine-tuned so that it ends responses with EOS,
a tokenizer trained locally, and a random-init sequence-classification reward model (tools/make_tiny_models.py
builds them, once per session).
"""

import atexit
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# GSM8K (MIT), prepared by `bash install.sh` (tools/prepare_gsm8k.py)
GSM8K_DIR = REPO / "data" / "gsm8k"
# one CPU thread per role keeps timings stable on a shared 2-core machine
ENV = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def pytest_configure(config):
    """One torch thread per pytest-xdist worker, as in the runs it starts (OMP_NUM_THREADS above): two workers of two
    threads each on two cores made in-process training 3-4x slower (OpenMP threads spin while they wait)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        import torch

        torch.set_num_threads(1)


def load_script(relative_path: str):
    """Import a script as a module (its `if __name__ == "__main__":` body does not run), as a fresh process would: an
    engine built earlier in this process left `torch.set_num_threads` a no-op (vLLM's CPU worker does that), and a
    script that saved the no-op would leave its generation thread's OpenMP threads unlike the engine's."""
    import torch

    torch.set_num_threads = torch._C.set_num_threads  # the original, which vLLM's patch leaves in place
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tools/make_tiny_models.py's models (the guard benchmark builds the same ones), built once per session: under
    pytest-xdist the first worker to need them builds them in the session's folder and the others wait for it, rather
    than each spend a minute of CPU time on a copy of its own."""
    build = load_script("tools/make_tiny_models.py").build_tiny_models
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(tmp_path_factory.mktemp("tiny"))
    from filelock import FileLock  # a dependency of transformers

    shared = tmp_path_factory.getbasetemp().parent  # the session's folder; each worker's own folders are inside it
    with FileLock(shared / "tiny.lock"):
        if not (shared / "tiny").is_dir():
            build(shared / "tiny.partial").rename(shared / "tiny")
    return shared / "tiny"


@pytest.fixture(scope="session")
def arithmetic_folder(tmp_path_factory):
    """Generated problems of difficulty 1 as a --dataset-path folder, written by the tool's command line."""
    folder = tmp_path_factory.mktemp("arithmetic")
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_arithmetic.py"), "--difficulty", "1", "--out", str(folder)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "7473 train and" in proc.stdout
    return folder


class Launcher:
    """tests/launcher.py, started by the first run in this test process: each run is a fresh process forked from it,
    which has torch, transformers and vLLM imported already (~15 s of CPU saved per run), with ENV as it is at the
    call, several at once (the side-by-side runs). It runs offline (HF_HUB_OFFLINE=1, read at import time): no
    network here, and a hub id that is not cached then fails at once."""

    def __init__(self):
        self.logs = Path(tempfile.mkdtemp(prefix="launcher-"))
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "launcher.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**ENV, "HF_HUB_OFFLINE": "1"},
        )
        self.lock = threading.Lock()
        self.replies = {None: queue.Queue()}  # request id -> its replies; None: the ready line
        threading.Thread(target=self.read, daemon=True).start()
        assert self.replies[None].get(timeout=600) == {"ready": True}
        atexit.register(self.close)

    def read(self):
        for line in self.proc.stdout:
            reply = json.loads(line)
            self.replies[reply.pop("id", None)].put(reply)
        for replies in self.replies.values():  # the launcher is gone: wake every caller
            replies.put({"returncode": None, "pid": None})

    def start(self, script: str, cwd: Path, flags):
        """Fork a run; returns its pid (its process group's too) and wait(timeout) -> CompletedProcess."""
        with self.lock:
            n = len(self.replies)
            self.replies[n] = replies = queue.Queue()
            out, err = self.logs / f"{n}.out", self.logs / f"{n}.err"
            request = dict(id=n, script=str(REPO / script), argv=list(flags), cwd=str(cwd))
            request.update(env={**ENV, "HF_HUB_OFFLINE": "1"}, stdout=str(out), stderr=str(err))
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        pid = replies.get(timeout=60)["pid"]
        assert pid, f"the launcher exited with {self.proc.wait()}"

        def wait(timeout: float):
            try:
                done = replies.get(timeout=timeout)
            except queue.Empty:  # a hang: kill the run and everything it started, then fail the test
                os.killpg(pid, signal.SIGKILL)
                replies.get(timeout=60)
                pytest.fail(f"{script} {' '.join(flags)} did not end within {timeout} s")
            try:  # what the run started and left running, as kill_group does
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, stderr = out.read_text(), err.read_text()
            out.unlink()
            err.unlink()
            return subprocess.CompletedProcess([script, *flags], done["returncode"], stdout, stderr)

        return pid, wait

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.logs)


LAUNCHER, LAUNCH_LOCK = [], threading.Lock()  # this test process's Launcher, once a test needed it


def launch(script: str, cwd: Path, *flags: str):
    """Start a repository script (or any Python file) as `python script *flags` would, in cwd, from this test process's
    launcher; returns its pid and wait(timeout) -> CompletedProcess."""
    with LAUNCH_LOCK:
        if not LAUNCHER:
            LAUNCHER.append(Launcher())
    return LAUNCHER[0].start(script, cwd, flags)


def run_script(script: str, cwd: Path, *flags: str, timeout: float = 1200):
    """Run a repository script end to end; returns (CompletedProcess, seconds). The timeout only catches hangs
    (generous: the shared cores can slow a run several-fold); on timeout the script's whole process group is killed,
    so that the runs a benchmark script starts do not outlive it and starve the tests after it."""
    start = time.time()
    _, wait = launch(script, cwd, *flags)
    return wait(timeout), time.time() - start


@pytest.fixture(scope="session")
def cli():
    """run(script, cwd, *flags, timeout=300) -> CompletedProcess, for command lines that stop before any model loads."""
    return lambda script, cwd, *flags, timeout=300: launch(script, cwd, *flags)[1](timeout)


def kill_group(proc: subprocess.Popen):
    """Kill a process started with start_new_session=True and every process it started, if any is still running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_until_sigterm(script, cwd, args, after_steps: int):
    """Start the script, send it SIGTERM once `after_steps` learner steps are logged, and wait for it to exit."""
    pid, wait = launch(script, cwd, *args)
    deadline = time.time() + 900
    while time.time() < deadline and running(pid):
        logged = list((cwd / "runs").glob("*/metrics.jsonl"))
        if logged and len(logged[0].read_text().splitlines()) >= after_steps:
            os.kill(pid, signal.SIGTERM)
            break
        # a short poll: a step of the tiny models takes well under 0.5 s, so a slower poll let a fast machine run
        # the remaining steps before the signal arrived (seen: the run stopped after its last step)
        time.sleep(0.02)
    proc = wait(600)
    return proc.returncode, proc.stdout, proc.stderr


def running(pid: int) -> bool:
    """Whether a run the launcher started is still running (the launcher reaps its children within 50 ms)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def read_metrics(cwd: Path):
    """The per-step metrics of the single run under cwd/runs/."""
    (path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]
