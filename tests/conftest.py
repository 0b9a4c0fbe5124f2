"""Shared test fixtures: tiny real models built offline at test time, and helpers to run the scripts end to end.

Nothing here mocks vLLM: the scripts run in subprocesses on a real (CPU) vLLM engine, with a random-init Llama-style
policy (head_dim 64, which vLLM's CPU attention needs) briefly fine-tuned so that it ends responses with EOS,
a tokenizer trained locally, and a random-init sequence-classification reward model.
"""

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# GSM8K (MIT), prepared by `bash install.sh` (tools/prepare_gsm8k.py)
GSM8K_DIR = REPO / "data" / "gsm8k"
# one CPU thread per role keeps timings stable on a shared 2-core machine
ENV = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def load_script(relative_path: str):
    """Import a script as a module (its `if __name__ == "__main__":` body does not run)."""
    path = REPO / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gsm8k_questions(n: int):
    path = GSM8K_DIR / "train.jsonl"
    if not path.exists():
        pytest.fail(f"GSM8K not found at {path}: run `bash install.sh` (offline: with GSM8K_DIR naming a local copy)")
    with open(path) as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def short_sft(policy, tokenizer, questions):
    """A short SFT on "question TL;DR: a few words<EOS>", so that sampled responses often end with EOS."""
    import torch

    texts = [q[:120] + "\nTL;DR:" + " ".join(q.split()[:3]) for q in questions[:512]]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for step in range(120):
        batch = [tokenizer(t).input_ids[-40:] + [tokenizer.eos_token_id] for t in texts[(step * 16) % 512 :][:16]]
        width = max(map(len, batch))
        ids = torch.tensor([b + [tokenizer.eos_token_id] * (width - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
        loss = policy(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def build_tiny_models(out: Path):
    """Llama-style policy and reward model (policy/, rm/), GPT-NeoX ones as in Pythia (neox_policy/, neox_rm/), and a
    prompt file; one tokenizer trained here, whose EOS is id 0 and doubles as pad, as in Pythia."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    questions = gsm8k_questions(2000)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        questions,
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    # pad == EOS, as in Pythia and SmolLM2: the scripts must never infer lengths from the pad id
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    special = dict(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **special,
    )
    # Pythia's layout: partial rotary (25% of head_dim 64), parallel residual, untied output layer, and an embedding
    # padded beyond the tokenizer (50,304 rows for 50,277 tokens in Pythia)
    neox = GPTNeoXConfig(
        vocab_size=len(tokenizer) + 64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        rotary_pct=0.25,
        use_parallel_residual=True,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **special,
    )
    for name, config, causal_lm, classifier in (
        ("", llama, LlamaForCausalLM, LlamaForSequenceClassification),
        ("neox_", neox, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification),
    ):
        policy = causal_lm(config)
        short_sft(policy, tokenizer, questions)
        policy.save_pretrained(out / f"{name}policy")
        tokenizer.save_pretrained(out / f"{name}policy")
        config.num_labels = 1
        classifier(config).save_pretrained(out / f"{name}rm")
        tokenizer.save_pretrained(out / f"{name}rm")
    # prompts in the TL;DR layout; a few are far longer than the tests' --max-prompt-tokens 64, to be dropped
    with open(out / "prompts.jsonl", "w") as f:
        for i, q in enumerate(gsm8k_questions(64)):
            query = (q * 6 if i % 16 == 0 else q[:80]) + "\nTL;DR:"
            f.write(json.dumps({"query": query}) + "\n")
    return out


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_tiny_models(tmp_path_factory.mktemp("tiny"))


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


def run_script(script: str, cwd: Path, *flags: str, timeout: float = 1200):
    """Run a repository script in a subprocess; returns (CompletedProcess, seconds). The timeout only catches hangs
    (generous: the shared cores can slow a run several-fold); on timeout the script's whole process group is killed,
    so that the runs a benchmark script starts do not outlive it and starve the tests after it."""
    start = time.time()
    args = [sys.executable, str(REPO / script), *flags]
    proc = subprocess.Popen(
        args, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr), time.time() - start


@pytest.fixture(scope="session")
def cli(tmp_path_factory):
    """run(script, cwd, *flags, timeout=300) -> CompletedProcess, for command lines that stop before any model loads:
    each is a fresh process forked from tests/launcher.py, which has torch, transformers and vLLM imported already
    (~20 s saved per command line), with ENV as it is at the call. The launcher runs offline (HF_HUB_OFFLINE=1, read
    at import time): no network here, and a hub id that is not cached then fails at once."""
    logs = tmp_path_factory.mktemp("cli")
    launcher = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "launcher.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**ENV, "HF_HUB_OFFLINE": "1"},
    )
    pending = bytearray()

    def reply(timeout: float):
        """The launcher's next JSON line, or None after timeout seconds (read unbuffered, so select sees it all)."""
        deadline = time.time() + timeout
        while b"\n" not in pending:
            if not select.select([launcher.stdout], [], [], max(0.0, deadline - time.time()))[0]:
                return None
            chunk = os.read(launcher.stdout.fileno(), 65536)
            assert chunk, f"the launcher exited with {launcher.wait()}"
            pending.extend(chunk)
        line, _, rest = bytes(pending).partition(b"\n")
        pending[:] = rest
        return json.loads(line)

    assert reply(600) == {"ready": True}

    def run(script: str, cwd: Path, *flags: str, timeout: float = 300):
        n = len(list(logs.iterdir()))
        out, err = logs / f"{n}.out", logs / f"{n}.err"
        request = dict(
            script=str(REPO / script),
            argv=list(flags),
            cwd=str(cwd),
            env={**ENV, "HF_HUB_OFFLINE": "1"},
            stdout=str(out),
            stderr=str(err),
        )
        launcher.stdin.write(json.dumps(request).encode() + b"\n")
        launcher.stdin.flush()
        pid = reply(60)["pid"]
        done = reply(timeout)
        if done is None:  # a hang: kill the run and everything it started, then fail the test
            os.killpg(pid, signal.SIGKILL)
            reply(60)
            pytest.fail(f"{script} {' '.join(flags)} did not end within {timeout} s")
        return subprocess.CompletedProcess([script, *flags], done["returncode"], out.read_text(), err.read_text())

    yield run
    launcher.stdin.close()
    launcher.wait(timeout=60)


def kill_group(proc: subprocess.Popen):
    """Kill a process started with start_new_session=True and every process it started, if any is still running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_until_sigterm(script, cwd, args, after_steps: int):
    """Start the script, send it SIGTERM once `after_steps` learner steps are logged, and wait for it to exit."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / script), *args],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 900
        while time.time() < deadline and proc.poll() is None:
            logged = list((cwd / "runs").glob("*/metrics.jsonl"))
            if logged and len(logged[0].read_text().splitlines()) >= after_steps:
                proc.send_signal(signal.SIGTERM)
                break
            # a short poll: a step of the tiny models takes well under 0.5 s, so a slower poll let a fast machine run
            # the remaining steps before the signal arrived (seen: the run stopped after its last step)
            time.sleep(0.02)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    return proc.returncode, stdout, stderr


def read_metrics(cwd: Path):
    """The per-step metrics of the single run under cwd/runs/."""
    (path,) = list((cwd / "runs").glob("*/metrics.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines()]
