"""A warm launcher for the command lines that must fail before any model loads (conftest.py's `cli` fixture).

Starting a script costs ~20 s here, nearly all of it importing torch, transformers and vLLM; the bad-input tests run
about thirty command lines that stop within a second of that. This process imports those libraries once, then for
each request forks: the child is a fresh process with the request's working folder, environment, argv and output
files, runs the script as `__main__` (runpy, as `python script.py` does), and exits with the script's own exit code,
message and traceback, after the exit handlers (atexit). Only the imports are shared, nothing of any earlier run.
Not for runs that start threads or engines: the child skips the interpreter's teardown, which would join them.

Protocol, one JSON line each way: {"script", "argv", "cwd", "env", "stdout", "stderr"} in; {"pid"} out at once, then
{"returncode"} when the child has ended.
"""

import json
import os
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
    # the exit handlers run as at a normal exit; only the teardown of the imported modules is skipped (~4 s here)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main():
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
