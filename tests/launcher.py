"""A warm launcher for the scripts the tests run (conftest.py's `launch`, behind `run_script` and the `cli` fixture).

Starting a script costs ~15 s of CPU here, nearly all of it importing torch, transformers and vLLM, and ~4 s more
tearing them down. This process imports those libraries once, then for each request forks: the child is a fresh process
with the request's working folder, environment, argv and output files, runs the script as `__main__` (runpy, as
`python script.py` does), and exits as the interpreter would: the script's exit code, message and traceback, then its
threads joined and its exit handlers (atexit) run, in that order. Only the imports are shared, nothing of any run.
The parent starts no thread, so forking it is safe; it only forks, and reaps its children, several at once.

Protocol, one JSON line each way: {"id", "script", "argv", "cwd", "env", "stdout", "stderr"} in; {"id", "pid"} out at
once, then {"id", "returncode"} when that child has ended.
"""

import json
import os
import select
import sys

# what every script imports at its top; importing them here is the whole point of this process
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers  # noqa: F401
import tyro  # noqa: F401
from torch.distributed.fsdp import fully_shard  # noqa: F401
from torch.utils.tensorboard import SummaryWriter  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401


def run_child(request):
    """In the forked child: become the script's process, exit as it would, and never return to the loop below."""
    import atexit
    import runpy
    import threading

    os.setsid()  # its own process group, so a timed-out run can be killed with everything it started
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((0, os.devnull), (1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [request["script"], *request["argv"]]
    sys.path[0] = os.path.dirname(request["script"])  # as `python script.py` sets it
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as stop:  # what the interpreter does with sys.exit(x) at the top level
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # an uncaught exception: its traceback, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # what Py_FinalizeEx does next: wait for the threads that are not daemons, then run the exit handlers; only the
    # teardown of the imported modules is skipped (~4 s here)
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    print(json.dumps({"ready": True}), flush=True)
    children, pending, reading = {}, b"", True  # children: pid -> request id
    while reading or children:
        # a short wait, then reap: children end while the parent waits for the next request
        if select.select([0] if reading else [], [], [], 0.05)[0]:
            chunk = os.read(0, 65536)
            reading = bool(chunk)
            pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                run_child(request)
            children[pid] = request["id"]
            print(json.dumps({"id": request["id"], "pid": pid}), flush=True)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            print(json.dumps({"id": children.pop(pid), "returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
