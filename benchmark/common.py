"""What several benchmarks share: the repository's paths, loading a script of the repository as a module, running
one in a subprocess, the arithmetic task, and the claims and budget checks that let a sweep span invocations.

Every benchmark imports it the same way, `import common`: Python puts a script's own folder, benchmark/, first on
sys.path, and pyproject.toml's pytest `pythonpath` does the same for the tests. It is the only module of benchmark/
that others import besides the benchmarks they extend (a follow-up imports the benchmark whose runs it reuses:
`import staleness`, `import staleness_paper`), and it imports nothing of the repository at its top.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# the environment of a benchmark's runs: vLLM's INFO lines would fill the captured stderr whose tail a failure shows
QUIET = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
# and one CPU thread per role, for the sweeps that run two runs at a time on a shared 2-core machine
ONE_THREAD = {**QUIET, "OMP_NUM_THREADS": "1"}


def load_script(relative_path: str):
    """Import a script of the repository as a module (its `if __name__ == "__main__":` body does not run), for its
    own functions."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def arithmetic_task():
    """tools/make_arithmetic.py: the arithmetic problems and their gold graders (`grade`, `gold_score`)."""
    return load_script("tools/make_arithmetic.py")


def run_script(cmd, cwd: Path, what: str, env: dict = ONE_THREAD):
    """One command line of a script in a subprocess under cwd, its output captured; a failure exits with one line
    naming `what` and the tail of the script's stderr. Returns the CompletedProcess."""
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {what} failed:\n{proc.stderr[-5000:]}")
    return proc


def claim(work: Path, stem: str):
    """Several invocations may share one sweep on a machine (e.g. one per pair of cores): each run is claimed first by
    creating runs/<stem>.claim holding the claimant's pid. A claim whose process is gone is taken over. Returns the
    claim file, or None when another live invocation holds the run."""
    path = work / "runs" / f"{stem}.claim"
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            text = path.read_text() if path.exists() else ""
            if not text.isdigit():
                return None  # being written by its claimant right now, or not ours to judge
            try:
                os.kill(int(text), 0)
                return None  # its claimant is alive
            except ProcessLookupError:
                path.unlink(missing_ok=True)  # left by a killed invocation
                continue
            except PermissionError:
                return None  # a live process of another user
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    return None


def check_same_budget(path: Path, wanted: dict):
    """A finished run is only reused if it had this invocation's budget (`wanted`: flag -> integer value); a silent
    mix would corrupt the table."""
    command = json.loads(path.read_text())["command"]
    found = {flag: int(command[command.index(flag) + 1]) if flag in command else None for flag in wanted}
    if found != wanted:
        sys.exit(
            f"error: {path} was made with {found}, this invocation asks for {wanted}; "
            "pass --force to rerun it or --results-dir to keep both sweeps"
        )
