"""torchrun: two learner processes (DDP, or FSDP2 with --fsdp) train on the same global batch as one process and log
the same losses; the engine (rank 0's, in a process of its own) serves exactly the learners' weights; a crash on a
non-zero rank ends the whole job within seconds, with its traceback. Real engine, tiny models, gloo on CPU."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import ENV, REPO, kill_group, read_metrics, run_script

STEPS = 3
# the multigpu variants, async and sync (--async-steps 0) alternating; DDP, and for RLOO and PPO (two sharded models
# under one optimizer) also FSDP2 (--fsdp): the first micro-batch's pi_old from the training forward under either
RLOO_KEYS = ("losses/policy_loss", "objective/kl", "policy/approx_kl", "policy/grad_norm")
PPO_KEYS = ("losses/policy_loss", "losses/value_loss", "objective/kl", "policy/grad_norm")
CASES = {
    "multigpu/async_dpo_multigpu.py": (
        "losses/dpo_loss",
        "objective/kl",
        "policy/chosen_rejected_logratio",
        "policy/grad_norm",
    ),
    "multigpu/async_rloo_multigpu.py --async-steps 0 --fsdp": RLOO_KEYS,
    "multigpu/async_rloo_multigpu.py": RLOO_KEYS,
    "multigpu/async_ppo_multigpu.py --fsdp": PPO_KEYS,
    "multigpu/async_ppo_multigpu.py --async-steps 0": PPO_KEYS,
    "multigpu/async_grpo_gsm8k_multigpu.py --async-steps 0": (
        "losses/policy_loss",
        "objective/accuracy",
        "policy/approx_kl",
        "policy/grad_norm",
    ),
}


def flags(case, tiny, arithmetic_folder):
    script, *extra = case.split()  # "path --async-steps 0": sync at scale; "path --fsdp": FSDP2, else DDP
    common = (
        *extra,
        "--model-name-or-path",
        str(tiny / "policy"),
        "--response-length",
        "16",
        "--prompts-per-step",
        "4",
        "--num-learner-steps",
        str(STEPS),
        "--learning-rate",
        "3e-3",
        "--seed",
        "5",
        "--kv-cache-gib",
        "0.25",
        "--micro-batch-size",
        "2",
        "--collective-timeout",
        "300",
    )
    if "grpo" in script:  # the tiny policy solves no problem: no reward, no gradient; the decay moves its weights, so
        # that two equal saved policies are not merely the initial one
        return (
            *common,
            "--dataset-path",
            str(arithmetic_folder),
            "--max-prompt-tokens",
            "128",
            "--num-eval-prompts",
            "8",
            "--eval-every",
            "2",
            "--temperature",
            "1.0",
            "--weight-decay",
            "0.01",
        )
    common += (
        "--reward-model-path",
        str(tiny / "rm"),
        "--dataset-name",
        str(tiny / "prompts.jsonl"),
        "--max-prompt-tokens",
        "64",
    )
    if "ppo" in script:  # one mini-batch of four prompts, two samples each: each rank's share is two micro-batches,
        # the first's pi_old and V_old from its training forward, the second's from no-grad passes
        return (*common, "--num-samples-per-prompt", "2")
    if "rloo" in script:  # two mini-batches: each rank's share of the first is one micro-batch, so its training
        # forward gives pi_old (gathered) and runs before the second's no-grad pass; one process: the first mini-batch's
        # first micro-batch from the training forward, its second from a no-grad pass
        return (*common, "--num-mini-batches", "2")
    return common


def torchrun(target, cwd, *args, nproc: int = 2, timeout: float = 900):
    """`torchrun --nproc-per-node nproc target args` in a subprocess; returns (CompletedProcess, seconds)."""
    start = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), str(target), *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), time.time() - start


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_learner_processes_train_like_one(tiny, arithmetic_folder, tmp_path, case):
    args = [*flags(case, tiny, arithmetic_folder)]
    script = case.split()[0]
    one_args = [a for a in args if a != "--fsdp"]  # --fsdp needs two or more processes
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    proc, _ = run_script(script, tmp_path / "one", *one_args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a clean end: the summary's line is the last one printed (the engine's teardown printed a traceback after it,
    # rc 0, when the script had destroyed the process group vLLM made for its in-process engine)
    assert proc.stdout.splitlines()[-1].startswith("plot:"), proc.stdout[-1000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    two, _ = torchrun(REPO / script, tmp_path / "two", *args)
    assert two.returncode == 0, two.stderr[-5000:]
    # the guard compares the tensors the engine shows, though its answer crossed a process (msgpack: lists, not
    # tuples); this engine process shows the norms and embeddings, not the linear layers it repacks
    covered, served = re.search(r"guard: checksums cover (\d+) of (\d+) tensors", two.stdout).groups()
    assert 0 < int(covered) <= int(served), two.stdout[-2000:]

    # the same samples (rank 0's engine, same seeds), the same losses up to float rounding: each rank's share of a
    # mini-batch is half of it, the gradients are averaged, the metrics are the ranks' means
    one, both = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")  # one run folder: rank 0 logs
    assert [m["step"] for m in both] == list(range(STEPS))
    assert [m["episodes"] for m in both] == [m["episodes"] for m in one]
    for key in CASES[case]:
        assert [m[key] for m in both] == pytest.approx([m[key] for m in one], rel=1e-4, abs=1e-5), key
    # the engine runs in a process of its own under torchrun: its logprobs of the first batch equal the learners'
    # (the weight-sync guard also checked every hand-over, or the run would have stopped)
    assert both[0]["async/behaviour_learner_logprob_gap"] < 1e-4
    # the saved policies agree too (under FSDP2 it was gathered from the shards), and they trained
    saved = [
        load_file(next((cwd / "runs").glob("*/model/model.safetensors")))
        for cwd in (tmp_path / "one", tmp_path / "two")
    ]
    assert set(saved[0]) <= set(saved[1])  # gathered from FSDP2 shards, a tied lm_head is saved under its name too
    assert max((saved[0][k] - saved[1][k]).abs().max().item() for k in saved[0]) < 1e-4
    assert not torch.equal(
        saved[0]["model.embed_tokens.weight"],
        load_file(tiny / "policy" / "model.safetensors")["model.embed_tokens.weight"],
    )


def node_launches(target, *args):
    """The docs' multi-node launch, as a scheduler starts it on two nodes, here on one machine: two `torchrun --nnodes 2
    --node-rank R --nproc-per-node 1` agents meeting at one c10d rendezvous (gloo) on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    launch += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return [
        [*launch, "--node-rank", str(node), "--rdzv-conf", f"is_host={int(node == 0)}", str(target), *args]
        for node in (0, 1)
    ]


def run_nodes(launches, cwd, timeout: float = 900):
    """Run the launches to their end, each in a session of its own (as on a node of its own), in one folder (as on a
    shared file system); asserts that each exits 0 (an agent does only once the rendezvous is complete). Returns
    their stdout, joined."""
    nodes = [
        subprocess.Popen(
            launch, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        for launch in launches
    ]
    try:
        outputs = [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            kill_group(node)
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-5000:]
    return "".join(stdout for stdout, _ in outputs)


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_like_one_process_and_stop_and_resume_exactly(tiny, arithmetic_folder, tmp_path):
    """Two nodes on one machine (node_launches) train like one process. A scheduler's SIGTERM to every process of
    both nodes mid-run saves the one checkpoint it announces and ends both nodes cleanly, leaving nothing in
    /dev/shm; two nodes resumed from it log and save what the uninterrupted two nodes did, bit for bit."""
    case = "multigpu/async_dpo_multigpu.py"
    # a stop is taken at the end of a step (~0.35 s here; a run's start-up ~40 s): of 10, a signal sent once the first
    # is logged has 8 to arrive in (seen under load: 1 s, 3 steps)
    steps = 10
    args = [*flags(case, tiny, arithmetic_folder), "--num-learner-steps", str(steps)]
    for folder in ("one", "nodes", "stopped"):
        (tmp_path / folder).mkdir()
    proc, _ = run_script(case, tmp_path / "one", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_nodes(node_launches(REPO / case, *args), tmp_path / "nodes")
    one, both = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "nodes")  # one run folder: global rank 0's
    assert [m["step"] for m in both] == list(range(steps))
    for key in CASES[case]:
        assert [m[key] for m in both] == pytest.approx([m[key] for m in one], rel=1e-4, abs=1e-5), key
    assert both[0]["async/behaviour_learner_logprob_gap"] < 1e-4
    saved = [load_file(next((tmp_path / cwd / "runs").glob("*/model/model.safetensors"))) for cwd in ("one", "nodes")]
    assert max((saved[0][k] - saved[1][k]).abs().max().item() for k in saved[0]) < 1e-4

    # --save-every on (a signal saves a checkpoint), none due within the run; resumable, so left out on resume
    launches = node_launches(REPO / case, *args, "--save-every", "1000")
    output, returncodes, titles, left = stop_by_signal(signal.SIGTERM, launches, tmp_path / "stopped", 1, True)
    # placement by global rank: one engine, global rank 0's, on node 0 (node 1's rank is local rank 0 too)
    assert [sum("EngineCore" in title for title in node) for node in titles] == [1, 0], titles
    announced = re.findall(r"continue with --resume-from (\S+)", output)
    assert len(announced) == 1, output[-3000:]  # global rank 0's line; rank 1, on the other node, ends without one
    assert "SIGTERM: stopped after learner step" in output and "stopped at once" not in output
    assert returncodes == [1, 1], output[-3000:]  # each agent reports its rank's sys.exit: no segfault, no kill
    assert not re.search(r"EngineDead|Segmentation|SIGSEGV|ERROR", output), output[-3000:]
    checkpoint = announced[0]
    assert (tmp_path / "stopped" / checkpoint / "state.pt").exists()
    assert int(checkpoint.split("_")[-1]) < steps  # mid-run: the resume has steps to do
    assert not left, left
    output = run_nodes(node_launches(REPO / case, *args, "--resume-from", checkpoint), tmp_path / "stopped")
    assert f"resuming from {checkpoint}" in output
    resumed = read_metrics(tmp_path / "stopped")
    assert [m["step"] for m in resumed] == list(range(steps))
    untimed = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in run] for run in (both, resumed)]
    assert untimed[1] == untimed[0]  # every loss, score, KL and version, bit for bit
    saved = [
        load_file(next((tmp_path / cwd / "runs").glob("*/model/model.safetensors"))) for cwd in ("nodes", "stopped")
    ]
    assert saved[0].keys() == saved[1].keys() and all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


FSDP2_WORKER = """
import sys, types
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from conftest import load_script
from transformers import AutoModelForCausalLM
variant = load_script(sys.argv[2])
dist.init_process_group("gloo")
model = variant.wrap_model(AutoModelForCausalLM.from_pretrained(sys.argv[3]),
                           types.SimpleNamespace(world_size=2, fsdp=True, learner_device="cpu"))
ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
for last in (False, True):  # two micro-batches of one mini-batch
    with variant.gradient_sync(model, last=last):
        model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()
    grads = [(p.grad is not None and p.grad.to_local().shape == p.to_local().shape) for p in model.parameters()]
    print(f"rank {dist.get_rank()} last={last}: {sum(grads)} of {len(grads)} gradients in shards", flush=True)
    assert all(grads)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_fsdp2_reduce_scatters_every_micro_batch_so_no_rank_holds_an_unsharded_gradient(tiny, tmp_path):
    """Issue 44: under --fsdp the gradients of a mini-batch's first micro-batch are already reduce-scattered into each
    rank's shard (with gradient sync off until the last one, FSDP2 would hold an unsharded float32 gradient, 4 bytes a
    parameter per trained model on every rank: what made the paper's Pythia-2.8b PPO command not fit 80 GB). The four
    variants share `wrap_model` and `gradient_sync` letter for letter (test_twins.py): one copy tested covers them."""
    script = "multigpu/async_ppo_multigpu.py"
    worker = tmp_path / "fsdp2_worker.py"
    worker.write_text(FSDP2_WORKER)
    proc, _ = torchrun(worker, tmp_path, str(REPO / "tests"), script, str(tiny / "policy"), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stdout.count("gradients in shards") == 4, proc.stdout


@pytest.mark.slow
def test_a_crash_on_another_rank_ends_the_job_with_its_traceback(tiny, tmp_path):
    """Rank 1 raises in its first optimizer step; rank 0 must not wait in a collective until --collective-timeout."""
    wrapper = tmp_path / "crash_rank_1.py"
    wrapper.write_text(
        "import os, runpy, sys\nimport torch\n"
        "if os.environ['RANK'] == '1':\n"
        "    def step(self, *args, **kwargs):\n"
        "        raise RuntimeError('injected failure on rank 1')\n"
        "    torch.optim.AdamW.step = step\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    args = [str(REPO / "multigpu/async_rloo_multigpu.py"), *flags("multigpu/async_rloo_multigpu.py --fsdp", tiny, None)]
    # a collective timeout far above any start-up on loaded cores (seen: 214 s), so that ending before it is the proof
    proc, seconds = torchrun(wrapper, tmp_path, *args, "--collective-timeout", "1200", timeout=1500)
    assert proc.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in proc.stderr
    assert seconds < 1200, seconds


@pytest.mark.slow
def test_a_tensor_parallel_engine_serves_the_learners_weights(tiny, tmp_path, monkeypatch):
    """--engine-tensor-parallel-size 2: the engine's two workers run in processes of their own, so the weights reach
    them through shared memory; the weight-sync guard checks every version, and the first batch's logprobs match."""
    monkeypatch.setitem(ENV, "VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per worker (vLLM's CPU default wants NUMA)
    dpo = "multigpu/async_dpo_multigpu.py"
    (tmp_path / "shm").mkdir()  # --weights-dir: the file of each version is deleted once the engine has loaded it
    proc, _ = run_script(
        dpo,
        tmp_path,
        *flags(dpo, tiny, None),
        "--num-learner-steps",
        "4",
        "--engine-tensor-parallel-size",
        "2",
        "--weights-dir",
        str(tmp_path / "shm"),
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert not list((tmp_path / "shm").iterdir())
    metrics = read_metrics(tmp_path)
    assert [m["async/actor_version"] for m in metrics] == [0, 0, 1, 2]  # versions 1 and 2 went through the file
    assert metrics[0]["async/behaviour_learner_logprob_gap"] < 1e-4


def shm_inodes(job):
    """What the job's processes map from /dev/shm, by inode (glibc maps a POSIX semaphore under the temporary name it
    made it with, then links that file to its sem.* name)."""
    inodes = set()
    for process in job:
        with contextlib.suppress(OSError), open(f"/proc/{process.pid}/maps") as maps:  # OSError: it has ended
            inodes |= {int(line.split()[4]) for line in maps if " /dev/shm/" in line}
    return inodes


def stop_by_signal(signum, launches, cwd, after_steps: int, every_process: bool = False):
    """Start the job's launches (one: torchrun, or one process; two: node_launches), each in a session of its own and
    in one folder, and, once `after_steps` learner steps are logged, send `signum` to each launch's process group, as
    a Ctrl-C in a terminal does, or to every process of the job at once, as a cluster's scheduler does (SLURM's time
    limit, scancel); then wait until every process of the job has ended. Returns the job's output (each launch's
    stdout and stderr), the launches' exit codes, each launch's processes at the signal (their command lines; vLLM
    titles its engine's "VLLM::EngineCore"), and what of its own it left in /dev/shm: what its processes mapped there at
    the signal (vLLM's psm_* buffers, multiprocessing's sem.mp-* semaphores), and its weights' folders (named after a
    pid of the job); a name another job makes meanwhile, this function's own folder among them, is not the job's."""
    before = set(os.listdir("/dev/shm"))
    other = tempfile.mkdtemp(prefix="another_job_", dir="/dev/shm")  # made while the job runs
    procs = []
    for n, cmd in enumerate(launches):
        with open(cwd / f"output_{n}", "w") as output:
            procs.append(
                subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
            )

    def output():
        return "".join((cwd / f"output_{n}").read_text() for n in range(len(launches)))

    try:
        deadline = time.time() + 600
        while sum(len(p.read_text().splitlines()) for p in cwd.glob("runs/*/metrics.jsonl")) < after_steps:
            assert all(p.poll() is None for p in procs) and time.time() < deadline, output()[-3000:]
            time.sleep(0.05)
        trees = [[psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)] for p in procs]
        job = [process for tree in trees for process in tree]
        titles = [[" ".join(command_line(process)) for process in tree] for tree in trees]
        # torchrun or the learner, the engine's processes (and vLLM's helpers); each other node's agent and rank
        assert len(job) >= 1 + 2 * len(launches)
        held = shm_inodes(job)
        if every_process:
            for process in job:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)
        else:
            for p in procs:
                os.killpg(p.pid, signum)  # torchrun hands it to every rank's process group
        returncodes = [p.wait(timeout=120) for p in procs]
        _, alive = psutil.wait_procs(job, timeout=5)  # the engine's processes end with the job, not later
        assert not alive, [p.cmdline()[:3] for p in alive]
    finally:
        for p in procs:
            kill_group(p)
        new = {}
        for name in set(os.listdir("/dev/shm")) - before:
            with contextlib.suppress(FileNotFoundError):  # gone meanwhile
                new[name] = os.stat(f"/dev/shm/{name}").st_ino
        os.rmdir(other)
    weights = tuple(f"clean-async-rlhf-{process.pid}-" for process in job)  # a weights folder: its maker's pid
    mine = [name for name, inode in new.items() if inode in held or name.startswith(weights)]
    return output(), returncodes, titles, mine


def command_line(process: psutil.Process):
    """The process's command line, empty if it has ended (a helper of vLLM's may end at any time)."""
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return []


@pytest.mark.slow
def test_a_sigterm_without_save_every_ends_the_engine_process_and_the_weights_folder_with_the_job(tiny, tmp_path):
    """Issue 30: a SIGTERM to a torchrun job without --save-every stops it at once, yet through `finally` and atexit:
    the engine's own process ends with the job (not 8-40 s later) and no copy of the weights stays in --weights-dir."""
    rloo = "multigpu/async_rloo_multigpu.py"
    (tmp_path / "shm").mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        str(REPO / rloo),
        *flags(f"{rloo} --fsdp", tiny, None),
        "--num-learner-steps",
        "1000",
        "--weights-dir",
        str(tmp_path / "shm"),
    ]
    output, *_ = stop_by_signal(signal.SIGTERM, [cmd], tmp_path, after_steps=1)
    assert not list((tmp_path / "shm").iterdir())
    assert "SIGTERM: stopped at once; no checkpoint (--save-every 0)" in output


@pytest.mark.parametrize("launch", ["torchrun", "tensor-parallel"])
@pytest.mark.slow
def test_a_signal_to_the_group_or_to_every_process_saves_the_checkpoint_it_announces_and_resumes_exactly(
    tiny, tmp_path, monkeypatch, launch
):
    """Issue 42: a Ctrl-C (SIGINT to the process group) with --save-every reaches the learners only (vLLM's engine
    processes have a session of their own). Issue 55: a scheduler's SIGTERM to every process of the job at once
    (before: 0 of 2 such stops saved): the engine's processes drop it (only their parent's signals reach vLLM's
    handlers), and a rank that gets it twice (itself, and through torchrun) takes it once. Either way the learner
    takes the batches in flight from the engine, saves, names the checkpoint once (rank 0, after writing it), and
    the job ends cleanly: no traceback, no segfault, no vLLM error, every process gone, nothing left in /dev/shm.
    The run, stopped both ways and resumed twice, logs what an uninterrupted run logs."""
    rloo = "multigpu/async_rloo_multigpu.py"
    cmd = [
        *(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
            if launch == "torchrun"
            else [sys.executable]
        ),
        str(REPO / rloo),
        *flags(rloo, tiny, None),
        "--num-learner-steps",
        "1000",
        "--save-every",
        "2",
    ]
    if launch == "tensor-parallel":  # one learner, the engine's two workers in processes of their own
        monkeypatch.setitem(ENV, "VLLM_CPU_OMP_THREADS_BIND", "0|1")
        cmd += ["--engine-tensor-parallel-size", "2"]
    (tmp_path / "stopped").mkdir()
    checkpoint = None
    for signum, every_process in ((signal.SIGINT, False), (signal.SIGTERM, True)):  # a checkpoint is due at step 2
        resume = ["--resume-from", checkpoint] if checkpoint else []
        after = int(checkpoint.split("_")[-1]) + 1 if checkpoint else 2
        output, returncodes, _, left = stop_by_signal(
            signum, [cmd + resume], tmp_path / "stopped", after, every_process
        )
        announced = re.findall(r"continue with --resume-from (\S+)", output)
        assert len(announced) == 1, output[-3000:]  # rank 0's line; the other rank ends without one
        assert f"{signum.name}: stopped after learner step" in output and "stopped at once" not in output
        assert returncodes == [1], output[-3000:]  # sys.exit's message: no segfault (139), no torchrun kill
        # before: "EngineDeadError" after "saving a checkpoint", a vLLM ERROR line, a segfault at exit
        if launch == "tensor-parallel":  # torchrun reports its ranks' exit code 1 with a traceback of its own
            assert "Traceback" not in output, output[-3000:]
        assert not re.search(r"EngineDead|Segmentation|SIGSEGV|ERROR", output), output[-3000:]
        if checkpoint:
            assert f"resuming from {checkpoint}" in output
        checkpoint = announced[0]
        assert (tmp_path / "stopped" / checkpoint / "state.pt").exists()  # the one it announces, complete
        assert int(checkpoint.split("_")[-1]) >= after + 1  # a stop's own, after the steps it waited for
        assert not left, left  # vLLM's shared memory (a TP-2 stop left 2 x 4 MiB) and the weights' folder
    # an uninterrupted run with the same flags, stopped once it has logged as many steps (a SIGKILL to each of its
    # processes, multiprocessing's resource tracker too, left the TP engine's psm_* buffers and sem.mp-* semaphores)
    steps = int(checkpoint.split("_")[-1])
    (tmp_path / "whole").mkdir()
    *_, left = stop_by_signal(signal.SIGINT, [cmd], tmp_path / "whole", steps)
    assert not left, left
    whole, stopped = read_metrics(tmp_path / "whole")[:steps], read_metrics(tmp_path / "stopped")
    assert [m["step"] for m in stopped] == list(range(steps))
    untimed = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in run] for run in (whole, stopped)]
    assert untimed[1] == untimed[0]  # every loss, score, KL and version, bit for bit
