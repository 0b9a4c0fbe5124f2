r"""GPU smoke test: the first run a person with one GPU makes, in about 14 minutes. `benchmark/gpu_smoke.sh` runs this.

    bash benchmark/gpu_smoke.sh                      # on a GPU: Pythia-160m DPO/RLOO/PPO, Qwen2.5-0.5B GRPO on GSM8K
    PYTHIA=/models/pythia-160m QWEN=/models/Qwen2.5-0.5B-Instruct PYTHIA_BIG=/models/pythia-2.8b GSM8K=/data/gsm8k \
        bash benchmark/gpu_smoke.sh                  # offline (of PYTHIA_BIG only config.json is read)
    bash benchmark/gpu_smoke.sh --only torch         # only the part that needs torch and transformers (no vLLM)
    bash benchmark/gpu_smoke.sh --only torch --random-weights   # that part with no hub and no model files
    bash benchmark/gpu_smoke.sh --cpu                # the same checks on CPU with tiny models built here (~4 min)

Two parts. The torch part needs torch and transformers only, and loads each policy (Pythia-160m, Qwen2.5-0.5B) in
turn, in a child process: (a) the learner's peak memory for one micro-batch of the scripts' default size (8
sequences of the scripts' default lengths) through forward, backward and an AdamW step; (b) the logprobs of that
micro-batch computed with gradients equal those computed without (the scripts rely on it: the PPO ratio of the first
update is 1);
(c) how far TF32 matmuls move those logprobs, beside the weight-sync guard's float32 tolerance of 1e-4 (the learner
must run them in IEEE float32, torch's default); (d) a DPO learner's peak at Pythia-2.8b (random weights from its
config) for micro-batches 2 and 8, beside the estimate the multigpu variants choose their micro-batch with. When vLLM
is importable the logprobs are those of the scripts' own `token_logprobs`, else of a copy of it below (the same few
lines of torch).

The run part starts the real scripts as subprocesses with a few learner steps and reads their metrics.jsonl: async
DPO, RLOO and PPO on Pythia-160m with a tiny random reward model (a GPT-NeoX classifier with Pythia's tokenizer, built
here) and prompts made from GSM8K questions; DPO again with vLLM's float32 Triton kernels in TF32 (the guard's gap
must move); the engine in a process of its own (`torchrun --nproc-per-node 1` and `2 multigpu/async_dpo_multigpu.py`,
the path docs/multigpu.md describes; 2 ranks need 2 GPUs, so on one GPU that one is SKIP, see docs/benchmarks.md);
async GRPO on GSM8K with Qwen2.5-0.5B-Instruct.
A run PASSes when it exits 0, its step-0 gap between the engine's and the learner's logprobs (both of policy version 0)
is below 1e-4 (float32), and every metric it logged is finite. Whether the reward rose (mean of the second half of the
steps above that of the first) is reported, not judged: a few steps with a random reward model prove nothing.

With --random-weights (and --only torch) the torch part builds its models from configs the smoke writes itself, the
hub's Pythia-160m, Qwen2.5-0.5B-Instruct and Pythia-2.8b shapes (RANDOM_CONFIGS; their parameter counts are
tested), with random weights: nothing is read from the hub or from model files, so a GPU with torch and transformers
alone runs it. Memory, the grad/no-grad identity and TF32's effect depend on the shapes, not on trained weights.
Without vLLM the peak-vs-estimate row is SKIP (the estimate is the multigpu variant's, which imports vLLM).

With --cpu everything runs on CPU: the models are tiny ones built here (a byte-level BPE tokenizer trained on the
generated arithmetic questions of data/arithmetic, a GPT-NeoX policy and reward model in Pythia's layout, a
Llama-style policy standing in for Qwen) and GRPO trains on data/arithmetic; `tests/test_gpu_smoke.py` runs this mode.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
GUARD_TOLERANCE = 1e-4  # the weight-sync guard's float32 tolerance (check_weight_sync in every script)
TORCH_ROWS = ("learner memory", "grad == no-grad", "TF32 sensitivity")
FIT_SIZES = (2, 8)  # the micro-batches of the peak-vs-estimate check
# --random-weights: the configs the torch part builds its models from, as the hub's config.json files give them
# (EleutherAI/pythia-160m, Qwen/Qwen2.5-0.5B-Instruct, EleutherAI/pythia-2.8b), so a machine with no hub and no model
# files measures the same shapes; with --cpu, tiny models of the same two families
PYTHIA_LAYOUT = dict(
    model_type="gpt_neox",
    hidden_act="gelu",
    rotary_pct=0.25,
    rotary_emb_base=10000,
    use_parallel_residual=True,
    tie_word_embeddings=False,
    layer_norm_eps=1e-5,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=0,
)
QWEN_LAYOUT = dict(
    model_type="qwen2",
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    use_sliding_window=False,
    max_position_embeddings=32768,
    bos_token_id=151643,
    eos_token_id=151645,
)
RANDOM_CONFIGS = {
    "pythia-160m": dict(
        PYTHIA_LAYOUT,
        vocab_size=50304,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
    ),
    "qwen2.5-0.5b": dict(
        QWEN_LAYOUT,
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "pythia-2.8b": dict(
        PYTHIA_LAYOUT,
        vocab_size=50304,
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=32,
        num_attention_heads=32,
    ),
}
TINY_RANDOM_CONFIGS = {
    "pythia": dict(
        PYTHIA_LAYOUT,
        vocab_size=576,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
    ),
    "qwen": dict(
        QWEN_LAYOUT,
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


# ------------------------------------------------------------------------------------------------ the torch part
def local_token_logprobs(model, input_ids, attention_mask, response_mask, temperature):
    """A copy of the scripts' `token_logprobs` (used only when vLLM, which the scripts import, is missing)."""
    import torch
    import torch.nn.functional as F

    start = int(response_mask[:, 1:].argmax(dim=1).min())
    positions = torch.arange(start, input_ids.shape[1] - 1, device=input_ids.device)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=positions, use_cache=False).logits
    logits = logits.float() / temperature
    logprobs = logits.gather(-1, input_ids[:, start + 1 :, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return F.pad(logprobs, (start, 0)) * response_mask[:, 1:]


def scripts_token_logprobs():
    """(token_logprobs, where it comes from): the core script's own when vLLM is importable, else the copy above."""
    if importlib.util.find_spec("vllm") is None:
        return local_token_logprobs, "a copy of the scripts' token_logprobs (vLLM is not installed)"
    try:
        path = REPO / "async_grpo_gsm8k.py"
        spec = importlib.util.spec_from_file_location("smoke_core", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.token_logprobs, "token_logprobs of async_grpo_gsm8k.py"
    except Exception as e:  # noqa: BLE001 -- a script mid-edit must not stop the torch part
        return local_token_logprobs, f"a copy of token_logprobs (async_grpo_gsm8k.py did not import: {e!r:.120})"


def torch_worker(specs: list, device: str, out: str, fit: list):
    """The torch part, in a process of its own: for each (name, model, prompt tokens, response tokens, micro-batch
    size) of `specs` in turn, the three measurements, then the peak-vs-estimate one for `fit` (name, model, prompt
    tokens, response tokens); writes {name: result} as JSON."""
    import gc

    import torch

    token_logprobs, source = scripts_token_logprobs()
    results = {}
    for name, model_path, prompt_tokens, response_tokens, micro_batch_size in specs:
        results[name] = measure(token_logprobs, model_path, prompt_tokens, response_tokens, micro_batch_size, device)
        results[name]["source"] = source
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        Path(out).write_text(json.dumps(results))
    results["fit"] = (
        measure_fit(token_logprobs, *fit[1:], device)
        if importlib.util.find_spec("vllm")
        else dict(skip="the estimate is the multigpu variant's, which imports vLLM (not installed)")
    )
    Path(out).write_text(json.dumps(results))


def measure(
    token_logprobs, model_path: str, prompt_tokens: int, response_tokens: int, micro_batch_size: int, device: str
) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    result = dict(
        model=model_path, device=device, micro_batch_size=micro_batch_size, length=prompt_tokens + response_tokens
    )
    torch.manual_seed(0)
    if has_weights(model_path):
        policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    else:  # --random-weights: a folder holding only the config this script wrote
        with torch.device(device):
            policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32)
        policy.eval()
    result["weights"] = "trained weights" if has_weights(model_path) else "random weights from config.json alone"
    vocab = min(policy.config.vocab_size, policy.get_input_embeddings().weight.shape[0])
    length = prompt_tokens + response_tokens
    input_ids = torch.randint(0, vocab, (micro_batch_size, length), device=device)
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.zeros_like(input_ids)
    response_mask[:, prompt_tokens:] = 1
    temperature = 0.7  # the scripts' default sampling temperature
    try:
        highest = torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # torch refuses the legacy getter once the new fp32_precision API was used
        highest = True
    result["tf32_default"] = bool(torch.backends.cuda.matmul.allow_tf32) or not highest

    # (b) with gradients vs without: same rows, same shapes
    with_grad = token_logprobs(policy, input_ids, attention_mask, response_mask, temperature).detach()
    with torch.no_grad():
        without = token_logprobs(policy, input_ids, attention_mask, response_mask, temperature)
    mask = response_mask[:, 1:].bool()
    diff = (with_grad - without)[mask].abs()
    result.update(grad_bit_equal=bool(torch.equal(with_grad, without)), grad_max_diff=diff.max().item())

    # (c) TF32: logprobs at temperature 1 (what the guard compares) with TF32 matmuls off (torch's default) and on
    if device.startswith("cuda"):
        with torch.no_grad():
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = False
            exact = token_logprobs(policy, input_ids, attention_mask, response_mask, 1.0)
            torch.backends.cuda.matmul.allow_tf32 = True
            tf32 = token_logprobs(policy, input_ids, attention_mask, response_mask, 1.0)
            torch.backends.cuda.matmul.allow_tf32 = previous
        gap = (tf32 - exact)[mask].abs()
        result.update(tf32_max_diff=gap.max().item(), tf32_mean_diff=gap.mean().item())
        del exact, tf32
    del with_grad, without

    # (a) one micro-batch through forward, backward and an AdamW step (the optimizer's two states appear at the step)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7, eps=1e-5)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.time()
    try:
        logprobs = token_logprobs(policy, input_ids, attention_mask, response_mask, temperature)
        (-logprobs.sum() / mask.sum()).backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        result["oom"] = None
    except torch.cuda.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0]
    result["step_seconds"] = time.time() - start
    if device.startswith("cuda"):
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        result["card_gib"] = torch.cuda.get_device_properties(device).total_memory / GIB
        result["memory_kind"] = "torch.cuda.max_memory_allocated"
    else:
        result["peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        result["memory_kind"] = "peak RSS of the process so far (libraries included)"
    result["parameters"] = sum(p.numel() for p in policy.parameters())
    return result


def variant_estimate(model_path: str, length: int) -> tuple:
    """(fixed GiB, GiB per sequence of `length` tokens) by the DPO multigpu variant's own functions, for a learner GPU
    of its own (1 + 1): `learner_gpu_budget`'s models (16 bytes a trained parameter, 4 a frozen reference one) and
    `choose_micro_batch_size`'s activations and logits. Only the device query is answered (80 GiB free: the models'
    term does not depend on it); the per-sequence figure is read from the variant's line for a huge budget."""
    import contextlib
    import dataclasses
    import io
    from unittest import mock

    spec = importlib.util.spec_from_file_location("smoke_variant", REPO / "multigpu" / "async_dpo_multigpu.py")
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    args = variant.RunArgs(model_name_or_path=model_path, learner_device="cuda:1", engine_device="cuda:0", world_size=1)
    with mock.patch("torch.cuda.mem_get_info", lambda device=None: (80 * GIB, 80 * GIB)):
        fixed = 0.9 * 80 - variant.learner_gpu_budget(args, variant.model_config("--model-name-or-path", model_path), 1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        size = variant.choose_micro_batch_size(
            dataclasses.replace(args, learner_device="cpu", micro_batch_memory_gib=1e6), 10**6, length
        )
    return fixed, float(re.search(r"est\. ([\d.]+) GiB", printed.getvalue()).group(1)) / size


def measure_fit(token_logprobs, model_path: str, prompt_tokens: int, response_tokens: int, device: str) -> dict:
    """(d) A DPO learner's peak memory beside the multigpu variants' estimate of it (issue 44), at micro-batches 2 and
    8: the policy (float32, AdamW) and its frozen reference, built from the model's config with random weights (only
    config.json is read), two steps per size, the peak of the second (the optimizer's state is there, as at every
    step after the first). GPU: `torch.cuda.max_memory_allocated`. CPU: the tensors resident before the step plus the
    process's RSS growth during it (its peak reset through /proc/self/clear_refs; RSS follows tensors as the smoke
    sets MALLOC_MMAP_THRESHOLD_ for this process)."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    length, cuda = prompt_tokens + response_tokens, device.startswith("cuda")
    fixed, per_sequence = variant_estimate(model_path, length)
    result = dict(model=model_path, length=length, fixed_gib=fixed, per_sequence_gib=per_sequence, sizes={})
    torch.manual_seed(0)
    with torch.device(device):
        policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path), dtype=torch.float32).eval()
    reference = copy.deepcopy(policy).requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7, eps=1e-5)
    result["parameters"] = sum(p.numel() for p in policy.parameters())
    if cuda:
        result["card_gib"] = torch.cuda.get_device_properties(device).total_memory / GIB
    vocab = min(policy.config.vocab_size, policy.get_input_embeddings().weight.shape[0])
    for size in FIT_SIZES:
        input_ids = torch.randint(0, vocab, (size, length), device=device)
        response_mask = torch.zeros_like(input_ids)
        response_mask[:, prompt_tokens:] = 1
        row = result["sizes"][str(size)] = dict(estimate_gib=fixed + size * per_sequence, oom=None)
        for measured in (False, True):
            if measured:
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                else:
                    resident = sum(
                        t.numel() * t.element_size()
                        for t in [
                            *policy.parameters(),
                            *reference.parameters(),
                            *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)),
                        ]
                    )
                    before = proc_status_kib("VmRSS")
                    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the current RSS
            try:
                logprobs = token_logprobs(policy, input_ids, torch.ones_like(input_ids), response_mask, 0.7)
                (-logprobs.sum() / response_mask[:, 1:].sum()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)  # the scripts' zero_grad: no gradient held between steps
                del logprobs
            except torch.cuda.OutOfMemoryError as e:
                row["oom"] = str(e).splitlines()[0]
                optimizer.zero_grad(set_to_none=True)
                break
        if row["oom"] is None and cuda:
            torch.cuda.synchronize()
            row["peak_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        elif row["oom"] is None:
            row["peak_gib"] = (resident + (proc_status_kib("VmHWM") - before) * 1024) / GIB
        del input_ids, response_mask
        if cuda:
            torch.cuda.empty_cache()
    return result


def proc_status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def fit_row(name: str, r: dict) -> dict:
    """The peak-vs-estimate row: PASS if at every size the measured peak is within the estimate (the micro-batch the
    variants choose fits), or the step ran out of memory where the estimate is above the card too."""
    row, cells, ok = dict(check=f"torch: peak vs estimate ({name})"), [], True
    if "skip" in r:
        return dict(row, status="SKIP", note=r["skip"])
    for size, m in r["sizes"].items():
        if m["oom"]:
            fits = m["estimate_gib"] > r.get("card_gib", float("inf"))
            cells.append(
                f"M {size}: out of memory, estimate {m['estimate_gib']:.3g} GiB "
                f"{'above' if fits else 'WITHIN'} the {r.get('card_gib', 0):.0f} GiB card"
            )
        else:
            fits = m["peak_gib"] <= m["estimate_gib"]
            cells.append(
                f"M {size}: peak {m['peak_gib']:.3g} GiB, estimate {m['estimate_gib']:.3g} "
                f"({m['peak_gib'] / m['estimate_gib']:.2f} of it)"
            )
        ok = ok and fits
    small, large = (r["sizes"][str(s)] for s in FIT_SIZES)
    if "peak_gib" in small and "peak_gib" in large:
        slope = (large["peak_gib"] - small["peak_gib"]) / (FIT_SIZES[1] - FIT_SIZES[0])
        cells.append(
            f"per sequence {slope:.3g} GiB measured, {r['per_sequence_gib']:.3g} estimated "
            f"({r['per_sequence_gib'] / slope:.2f}x)"
            if slope > 0
            else f"per sequence {slope:.3g} GiB"
        )
    head = (
        f"{r['parameters'] / 1e6:.1f}M parameters x {r['length']} tokens, fixed {r['fixed_gib']:.3g} GiB "
        f"(policy + AdamW + reference)"
    )
    return dict(
        row,
        status="PASS" if ok else "FAIL",
        note=f"{head}; " + "; ".join(cells),
        peak="; ".join(f"{s['peak_gib']:.3g}" for s in r["sizes"].values() if "peak_gib" in s) + " GiB",
    )


def torch_rows(specs: list, ctx, fit: tuple) -> list:
    """Run the torch part for every (name, model, prompt tokens, response tokens) in one child process (vLLM, when
    imported for the scripts' token_logprobs, is imported once): three table rows per model, then one for `fit`."""
    out, log = ctx.work / "torch_part.json", ctx.work / "torch_part.log"
    specs = [(name, model, prompt, response, 8) for name, model, prompt, response in specs]  # the default micro-batch
    for name, model, prompt, response, size in specs:
        print(f"== torch part, {name}: {model}, micro-batch {size} x {prompt}+{response} tokens", flush=True)
    print(
        f"== torch part, peak vs estimate, {fit[0]}: {fit[1]} (random weights), micro-batches {FIT_SIZES}", flush=True
    )
    env = {**ctx.env, "MALLOC_MMAP_THRESHOLD_": "65536"} if ctx.device == "cpu" else ctx.env  # freed tensors leave RSS
    start = time.time()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--torch-worker",
                    json.dumps(specs),
                    ctx.device,
                    str(out),
                    json.dumps(fit),
                ],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=ctx.args.timeout,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = f"none within --timeout {ctx.args.timeout:.0f} s"
    print(f"   done in {time.time() - start:.0f} s", flush=True)
    results = json.loads(out.read_text()) if out.exists() else {}
    rows = []
    for name, *_ in specs:
        memory, grad, tf32 = [dict(check=f"torch: {what} ({name})") for what in TORCH_ROWS]
        rows += [memory, grad, tf32]
        if name not in results:
            for row in (memory, grad, tf32):
                row.update(status="FAIL", note=f"exit {returncode}: {tail(log)}")
            continue
        r = results[name]
        where = r["memory_kind"] + (f", of a {r['card_gib']:.0f} GiB card" if "card_gib" in r else "")
        memory.update(
            status="FAIL" if r["oom"] else "PASS",
            peak=f"{r['peak_gib']:.2f} GiB",
            step=f"{r['step_seconds']:.2f}",
            note=(
                f"out of memory: {r['oom']}"
                if r["oom"]
                else f"policy ({r['parameters'] / 1e6:.1f}M parameters, fp32, {r['weights']}) + AdamW + one micro-batch of "
                f"{r['micro_batch_size']} x {r['length']} tokens, forward + backward + step in "
                f"{r['step_seconds']:.2f} s; {where}"
            ),
        )
        grad.update(
            status="PASS" if r["grad_max_diff"] <= 1e-5 else "FAIL",
            note=("bit-equal" if r["grad_bit_equal"] else f"not bit-equal: max diff {r['grad_max_diff']:.1e}")
            + f" ({r['source']})",
        )
        if "tf32_max_diff" in r:
            trips = r["tf32_mean_diff"] > GUARD_TOLERANCE
            tf32.update(
                status="FAIL" if r["tf32_default"] else "PASS",
                note=f"TF32 on moves the logprobs by mean {r['tf32_mean_diff']:.1e}, max "
                f"{r['tf32_max_diff']:.1e} (the guard allows a mean of {GUARD_TOLERANCE:g}: TF32 in the "
                f"learner {'would' if trips else 'would not'} trip it); torch's default here: "
                + ("TF32 ON, the learner is not exact" if r["tf32_default"] else "off, exact float32"),
            )
        else:
            tf32.update(status="PASS", note="not applicable on CPU (TF32 is a GPU matmul mode)")
    rows.append(
        fit_row(fit[0], results["fit"])
        if "fit" in results
        else dict(check=f"torch: peak vs estimate ({fit[0]})", status="FAIL", note=f"exit {returncode}: {tail(log)}")
    )
    return rows


# ------------------------------------------------------------------------------------------------ the run part
def tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no output)"
    interesting = [line for line in text if "Error" in line or "error:" in line]
    return " | ".join((interesting[-2:] if interesting else text[-lines:]))[-600:]


class GpuMemoryPoller:
    """Peak of `nvidia-smi`'s memory.used, summed over the visible GPUs, while a run lasts (other processes count)."""

    def __init__(self):
        self.peak = self.baseline = None
        self.stop = threading.Event()
        self.thread = None

    @staticmethod
    def read():
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            values = [float(v) for v in out.split()]
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible and all(v.strip().isdigit() for v in visible.split(",")):
                values = [values[int(v)] for v in visible.split(",") if int(v) < len(values)]
            return sum(values) / 1024 if values else None  # MiB -> GiB
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def __enter__(self):
        self.baseline = self.peak = self.read()
        if self.baseline is not None:
            self.thread = threading.Thread(target=self.poll, daemon=True)
            self.thread.start()
        return self

    def poll(self):
        while not self.stop.wait(0.5):
            value = self.read()
            if value is not None:
                self.peak = max(self.peak, value)

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=15)


def descendants(root: int, seen: dict):
    """Add {pid: command line} of the processes below `root` (a run and everything it started, whatever their session:
    torchrun starts its ranks in sessions of their own) to `seen`."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:  # field 4 of stat, after the parenthesised name, is the parent's pid
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    tree, grew = {root}, True
    while grew:
        below = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= below
        grew = bool(below)
    for pid in tree - {root}:  # again each time: vLLM names its processes (setproctitle) once they have started
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if command.strip() or pid not in seen:  # a zombie's is empty: keep what it was
            seen[pid] = command


def run_check(
    name: str,
    cmd: list,
    reward_key: str,
    ctx,
    skip: Optional[str] = None,
    min_processes: int = 1,
    env: Optional[dict] = None,
) -> dict:
    """Run one script in a folder of its own (`env`: variables on top of the smoke's), then judge its metrics.jsonl
    (and, given `min_processes`, that the run started at least that many processes: an engine in a process of its
    own is one more)."""
    row = dict(check=name)
    if skip:
        return dict(row, status="SKIP", note=skip)
    if importlib.util.find_spec("vllm") is None:
        return dict(row, status="FAIL", note="vLLM is not installed (bash install.sh), or run --only torch")
    cwd = ctx.work / re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    (cwd / "command.txt").write_text(" ".join(cmd) + "\n")
    print(f"== {name}: {' '.join(str(c).replace(str(REPO) + '/', '') for c in cmd[1:])}", flush=True)
    log = cwd / "output.log"
    start = time.time()
    timed_out, processes, polls = False, {}, 0
    with open(log, "w") as f, GpuMemoryPoller() as gpu:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env={**ctx.env, **(env or {})}, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        while True:  # wait4: this child's own peak RSS (the largest of it and the children it waited for)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() - start > ctx.args.timeout:
                timed_out = True
                for pid in processes:  # those in sessions of their own (torchrun's ranks) first
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            if polls % 5 == 0 and os.path.isdir("/proc"):
                descendants(proc.pid, processes)
            polls += 1
            time.sleep(0.2)
        try:  # whatever the run started and left behind (an engine process, torchrun's ranks)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    returncode = os.waitstatus_to_exitcode(status)
    script = os.path.relpath(next(c for c in cmd if str(c).endswith(".py")), REPO)
    seconds = time.time() - start
    row["wall"] = f"{seconds:.0f} s"
    if ctx.device == "cpu":
        row["peak"] = f"{usage.ru_maxrss * 1024 / GIB:.2f} GiB RSS"
    elif gpu.peak is not None:
        row["peak"] = f"{gpu.peak:.1f} GiB GPU (idle {gpu.baseline:.1f})"
    else:
        row["peak"] = "n/a (no nvidia-smi)"
    metrics_files = list((cwd / "runs").glob("*/metrics.jsonl"))
    metrics = [json.loads(line) for line in metrics_files[0].read_text().splitlines()] if metrics_files else []
    problems = []
    if timed_out:
        problems.append(f"no end within --timeout {ctx.args.timeout:.0f} s")
    elif returncode != 0:
        problems.append(f"exit {returncode}: {tail(log)}")
    if metrics:
        gap = metrics[0].get("async/behaviour_learner_logprob_gap")
        row["gap"], row["gap_value"] = "n/a" if gap is None else f"{gap:.1e}", gap
        if gap is None or not gap < GUARD_TOLERANCE:
            problems.append(f"step-0 logprob gap {gap} is not < {GUARD_TOLERANCE:g}")
        bad = sorted({k for m in metrics for k, v in m.items() if isinstance(v, (int, float)) and not math.isfinite(v)})
        if bad:
            problems.append(f"non-finite metrics: {', '.join(bad)}")
        rewards = [m[reward_key] for m in metrics if reward_key in m]
        if len(rewards) >= 2:
            half = len(rewards) // 2
            first, last = sum(rewards[:half]) / half, sum(rewards[-half:]) / half
            row["reward"] = f"{first:.3f}->{last:.3f} {'yes' if last > first else 'no'}"
        elapsed = [m["time/elapsed"] for m in metrics if "time/elapsed" in m]
        if len(elapsed) >= 2:
            row["step"] = f"{(elapsed[-1] - elapsed[0]) / (len(elapsed) - 1):.2f}"
        syncs = [m["time/weight_sync"] for m in metrics if m.get("time/weight_sync", 0) > 0]
        row["sync"] = f"{sum(syncs) / len(syncs):.2f}" if syncs else "none"
        if len(metrics) < ctx.steps and not problems:
            problems.append(f"{len(metrics)} of {ctx.steps} steps logged")
    elif not problems:
        problems.append("no runs/*/metrics.jsonl")
    processes = {pid: c for pid, c in processes.items() if c.strip()}  # zombies have no command line
    if min_processes > 1 and len(processes) + 1 < min_processes and os.path.isdir("/proc"):
        problems.append(f"{len(processes) + 1} processes seen, fewer than the {min_processes} expected")
    engines = sum("EngineCore" in c for c in processes.values())
    if min_processes > 1 and not engines and not problems:
        problems.append("no process named EngineCore was seen: the engine ran in the learner's process")
    row.update(
        status="FAIL" if problems else "PASS",
        note="; ".join(problems)
        or f"{len(metrics)} steps of {script}; reward: {reward_key}"
        + (
            f"; {len(processes) + 1} processes" + f" ({engines} named EngineCore)" * bool(engines)
            if min_processes > 1
            else ""
        ),
    )
    print(f"   {row['status']} in {seconds:.0f} s" + (f": {row['note']}" if problems else ""), flush=True)
    return row


def tf32_check(ieee: dict, tf32: dict, cpu: bool) -> dict:
    """Judge the run with `TRITON_F32_DEFAULT=tf32` (the scripts keep an inherited value) against the same run in IEEE
    float32: on a GPU vLLM's Triton attention then rounds its inputs to TF32, so the step-0 gap between the engine's and
    the learner's logprobs must grow, or the weight-sync guard stop the run; on CPU (no Triton) it must not move."""
    if ieee["status"] != "PASS" or tf32["status"] != "PASS" and "weight sync failed" not in tf32.get("note", ""):
        return dict(
            tf32,
            status="FAIL",
            note=f"nothing to compare: IEEE run {ieee['status']}, TF32 run {tf32['status']}: {tf32.get('note', '')}",
        )
    if "weight sync failed" in tf32["note"]:
        moved, note = True, "the weight-sync guard stopped the run: " + tf32["note"]
    else:
        moved = tf32["gap_value"] > ieee["gap_value"]
        note = f"step-0 gap {tf32['gap_value']:.2e} with TF32, {ieee['gap_value']:.2e} in IEEE float32"
    ok = tf32.get("gap_value") == ieee["gap_value"] if cpu else moved
    return dict(
        tf32,
        status="PASS" if ok else "FAIL",
        note=note + (" (CPU: no Triton, so the variable must change nothing)" if cpu else ""),
    )


# ------------------------------------------------------------------------------------------------ models and data
def read_questions(folder: Path, n: int):
    path = folder / "train.jsonl"
    if not path.is_file():
        sys.exit(
            f"error: {path} not found: run `bash install.sh` (offline: GSM8K_DIR=/path/to/gsm8k bash install.sh), "
            f"or point GSM8K at a folder holding GSM8K-format train.jsonl and test.jsonl"
        )
    with open(path) as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def write_prompts(questions, path: Path):
    """Prompts in the TL;DR layout ("query" field) that the reward-model scripts read from a local file."""
    with open(path, "w") as f:
        for q in questions:
            f.write(json.dumps({"query": q + "\nTL;DR:"}) + "\n")


def build_tiny_reward_model(policy_path: str, out: Path):
    """A small random GPT-NeoX classifier that shares the policy's tokenizer (its vocabulary size, its files)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, GPTNeoXConfig, GPTNeoXForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    policy = AutoConfig.from_pretrained(policy_path)
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=policy.vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        rotary_pct=0.25,
        use_parallel_residual=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        num_labels=1,
        eos_token_id=eos,
        bos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token else eos,
    )
    GPTNeoXForSequenceClassification(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_models(questions, out: Path):
    """--cpu: a BPE tokenizer trained on `questions` (EOS id 0, also the pad, as in Pythia), a GPT-NeoX policy and
    reward model in Pythia's layout, and a Llama-style policy (head_dim 64, which vLLM's CPU attention needs); each
    policy briefly fine-tuned to end "question TL;DR: a few words" with EOS, so that some responses end."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        questions,
        trainers.BpeTrainer(
            vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    special = dict(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id
    )
    torch.manual_seed(0)
    torch.set_num_threads(1)
    neox = GPTNeoXConfig(
        vocab_size=len(tokenizer) + 64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        rotary_pct=0.25,
        use_parallel_residual=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        **special,
    )
    llama = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **special,
    )
    texts = [q[:120] + "\nTL;DR:" + " ".join(q.split()[:3]) for q in questions[:256]]
    for name, config, causal_lm in (("pythia", neox, GPTNeoXForCausalLM), ("qwen", llama, LlamaForCausalLM)):
        policy = causal_lm(config)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
        for step in range(40):
            batch = [tokenizer(t).input_ids[-40:] + [tokenizer.eos_token_id] for t in texts[(step * 16) % 256 :][:16]]
            width = max(map(len, batch))
            ids = torch.tensor([b + [tokenizer.eos_token_id] * (width - len(b)) for b in batch])
            labels = torch.tensor([b + [-100] * (width - len(b)) for b in batch])
            loss = policy(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        policy.save_pretrained(out / f"{name}_policy")
        tokenizer.save_pretrained(out / f"{name}_policy")
    neox.num_labels = 1
    GPTNeoXForSequenceClassification(neox).save_pretrained(out / "pythia_rm")
    tokenizer.save_pretrained(out / "pythia_rm")
    return out / "pythia_policy", out / "pythia_rm", out / "qwen_policy"


def has_weights(model_path: str) -> bool:
    """Whether a model folder holds weights (a hub id is assumed to); --random-weights folders hold a config alone."""
    folder = Path(model_path)
    return not folder.is_dir() or any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))


def write_random_configs(out: Path, cpu: bool) -> dict:
    """--random-weights: {name: folder holding only config.json} for RANDOM_CONFIGS (TINY_RANDOM_CONFIGS with --cpu)."""
    from transformers import AutoConfig

    folders = {}
    for name, fields in (TINY_RANDOM_CONFIGS if cpu else RANDOM_CONFIGS).items():
        fields = dict(fields)
        folders[name] = out / name
        AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(folders[name])
    return folders


# ------------------------------------------------------------------------------------------------ main
def gpu_names() -> str:
    try:
        return (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
            )
            .stdout.strip()
            .replace("\n", ", ")
            or "?"
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"


class Context:
    pass


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        return torch_worker(json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="run on CPU with tiny models built here (~4 min)")
    parser.add_argument(
        "--only",
        choices=["all", "torch", "runs"],
        default="all",
        help="torch: only the part that needs torch and transformers (no vLLM); runs: only the runs",
    )
    parser.add_argument(
        "--runs",
        default="dpo,rloo,ppo,own-process,grpo",
        help="which runs, comma-separated (default: all of dpo,rloo,ppo,own-process,grpo)",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="the torch part from configs this script writes (Pythia-160m, Qwen2.5-0.5B, Pythia-2.8b; tiny ones with "
        "--cpu), random weights: no hub, no model files; needs --only torch (the runs need tokenizers)",
    )
    parser.add_argument("--steps", type=int, default=None, help="learner steps per run (default: 8 on GPU, 4 on CPU)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take before it is killed")
    parser.add_argument(
        "--work-dir",
        default=None,
        help="keep the runs, logs and built models here (default: a temporary folder, deleted at the end)",
    )
    args = parser.parse_args()

    runs = args.runs.split(",")
    if not set(runs) <= {"dpo", "rloo", "ppo", "own-process", "grpo"}:
        sys.exit(f"error: --runs {args.runs!r}: choose among dpo,rloo,ppo,own-process,grpo")
    if args.random_weights and args.only != "torch":
        sys.exit("error: --random-weights needs --only torch: the runs need the models' tokenizers and weights")
    ctx = Context()
    ctx.args = args
    ctx.steps = args.steps or (4 if args.cpu else 8)
    if ctx.steps < 3:
        sys.exit("error: --steps must be >= 3 (with K = 1 the first weight sync is before the batch of step 2)")
    # local folders as absolute paths: every run starts in a folder of its own
    pythia, qwen, pythia_big = (
        os.path.abspath(p) if os.path.isdir(p) else p
        for p in (
            os.environ.get("PYTHIA", "EleutherAI/pythia-160m"),
            os.environ.get("QWEN", "Qwen/Qwen2.5-0.5B-Instruct"),
            os.environ.get("PYTHIA_BIG", "EleutherAI/pythia-2.8b"),
        )
    )  # PYTHIA_BIG: only its config.json is read
    gsm8k = Path(os.environ.get("GSM8K", str(REPO / "data" / "gsm8k"))).resolve()
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if args.cpu:
        env["OMP_NUM_THREADS"] = "1"  # one thread per role, as the scripts' --torch-threads 1
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode means CPU, even on a machine with a GPU
        env.setdefault("HF_HUB_OFFLINE", "1")
    elif args.random_weights or all(os.path.isdir(p) for p in (pythia, qwen, pythia_big)):
        env.setdefault("HF_HUB_OFFLINE", "1")  # all local: never ask the hub
    ctx.env = env

    import torch  # after the environment is settled; this process never touches a GPU (the runs need its memory)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("error: no GPU visible to torch; run with --cpu for the CPU mode")
    ctx.device = "cpu" if args.cpu else "cuda:0"
    num_gpus = 0 if args.cpu else torch.cuda.device_count()  # NVML: no CUDA context in this process
    temporary = args.work_dir is None
    ctx.work = Path(tempfile.mkdtemp(prefix="gpu_smoke_") if temporary else args.work_dir).resolve()
    ctx.work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    print(
        f"gpu_smoke: {'CPU, tiny models' if args.cpu else f'{num_gpus} GPU(s): {gpu_names()}'}, "
        f"{ctx.steps} learner steps per run"
        + (", random weights from configs written here" if args.random_weights else "")
        + f", work dir {ctx.work}",
        flush=True,
    )

    # models and data
    if args.random_weights:
        print("== writing the models' configs (random weights, no model files)", flush=True)
        configs = write_random_configs(ctx.work / "configs", args.cpu)
        pythia, qwen = (str(configs[n]) for n in (("pythia", "qwen") if args.cpu else ("pythia-160m", "qwen2.5-0.5b")))
        pythia_big = str(configs.get("pythia-2.8b", pythia))
        questions, problems = [], None
    elif args.cpu:
        arithmetic = REPO / "data" / "arithmetic"
        questions = read_questions(arithmetic, 2000)
        print("== building tiny models (tokenizer, GPT-NeoX policy and reward model, Llama policy)", flush=True)
        pythia, reward_model, qwen = (str(p) for p in build_tiny_models(questions, ctx.work / "models"))
        problems = arithmetic
    else:
        questions = read_questions(gsm8k, 512)
        problems = gsm8k
    prompts = ctx.work / "prompts.jsonl"
    write_prompts(questions[:256], prompts)

    rows = []
    if args.only in ("all", "torch"):
        # the scripts' default lengths: DPO/RLOO/PPO 512 prompt + 53 response tokens, GRPO 512 + 512
        # and the learner's peak at Pythia-2.8b (the paper's largest; on CPU the tiny policy) beside the estimate
        fit = ("pythia", pythia) if args.cpu else ("pythia-2.8b", pythia_big)
        rows += torch_rows([("pythia", pythia, 512, 53), ("qwen", qwen, 512, 512)], ctx, (*fit, 512, 53))
    if args.only in ("all", "runs"):
        if not args.cpu:
            print(f"== tiny reward model for {pythia}", flush=True)
            reward_model = str(build_tiny_reward_model(pythia, ctx.work / "pythia_rm"))
        size = (
            [
                "--max-prompt-tokens",
                "64",
                "--response-length",
                "16",
                "--prompts-per-step",
                "4",
                "--learning-rate",
                "1e-3",
                "--kv-cache-gib",
                "0.25",
            ]
            if args.cpu
            else [
                "--max-prompt-tokens",
                "256",
                "--response-length",
                "53",
                "--prompts-per-step",
                "16",
                "--learning-rate",
                "1e-5",
            ]
        )
        common = [*size, "--num-learner-steps", str(ctx.steps), "--seed", "1"]
        rm_flags = [
            "--model-name-or-path",
            pythia,
            "--reward-model-path",
            reward_model,
            "--dataset-name",
            str(prompts),
            *common,
        ]
        python = [sys.executable]
        for algo in [a for a in ("dpo", "rloo", "ppo") if a in runs]:
            rows.append(
                run_check(
                    f"{algo} (pythia)", [*python, str(REPO / f"async_{algo}.py"), *rm_flags], "objective/scores", ctx
                )
            )
        if "dpo" in runs:  # the same run with vLLM's float32 Triton kernels in TF32: the guard's gap must see it
            ieee = next(row for row in rows if row["check"] == "dpo (pythia)")
            rows.append(
                tf32_check(
                    ieee,
                    run_check(
                        "dpo (pythia), engine TF32",
                        [*python, str(REPO / "async_dpo.py"), *rm_flags],
                        "objective/scores",
                        ctx,
                        env={"TRITON_F32_DEFAULT": "tf32"},
                    ),
                    args.cpu,
                )
            )
        # the engine in a process of its own: under torchrun, with 1 learner rank (one GPU: rank 0 shares it with the
        # engine, a process group of one) and with 2 (docs/multigpu.md). Two NCCL ranks cannot share a GPU
        torchrun = [*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        for ranks in (1, 2) if "own-process" in runs else ():  # torchrun's agent, the ranks, >= 1 engine process
            skip = None if args.cpu or num_gpus >= ranks else f"needs {ranks} GPUs: 2 NCCL ranks cannot share 1 GPU"
            rows.append(
                run_check(
                    f"dpo engine in own process (torchrun {ranks})",
                    [
                        *torchrun,
                        str(ranks),
                        str(REPO / "multigpu" / "async_dpo_multigpu.py"),
                        *rm_flags,
                        "--collective-timeout",
                        "600",
                    ],
                    "objective/scores",
                    ctx,
                    skip=skip,
                    min_processes=2 + ranks,
                )
            )
        grpo = (
            [
                "--model-name-or-path",
                qwen,
                "--dataset-path",
                str(problems),
                "--prompt-template",
                "{question}",
                "--max-prompt-tokens",
                "128",
                "--response-length",
                "16",
                "--prompts-per-step",
                "2",
                "--learning-rate",
                "1e-3",
                "--kv-cache-gib",
                "0.25",
            ]
            if args.cpu
            else [
                "--model-name-or-path",
                qwen,
                "--dataset-path",
                str(problems),
                "--chat-template",
                "--prompt-template",
                "{question}\nReason step by step, then give the final number after ####.",
                "--max-prompt-tokens",
                "256",
                "--response-length",
                "256",
                "--prompts-per-step",
                "8",
                "--learning-rate",
                "1e-6",
            ]
        )
        if "grpo" in runs:
            rows.append(
                run_check(
                    f"grpo ({'arithmetic' if args.cpu else 'gsm8k'}, qwen)",
                    [
                        *python,
                        str(REPO / "async_grpo_gsm8k.py"),
                        *grpo,
                        "--num-learner-steps",
                        str(ctx.steps),
                        "--seed",
                        "1",
                        "--num-eval-prompts",
                        "0",
                    ],
                    "objective/accuracy",
                    ctx,
                )
            )

    print_table(rows)
    failed = [r["check"] for r in rows if r["status"] == "FAIL"]
    skipped = [r["check"] for r in rows if r["status"] == "SKIP"]
    total = time.time() - started
    print(
        f"\n{len(rows) - len(failed) - len(skipped)} PASS, {len(failed)} FAIL, {len(skipped)} SKIP in "
        f"{total / 60:.1f} min ({'CPU' if args.cpu else 'GPU'} mode). 'reward rose' compares the mean of the second "
        f"half of the steps with the first; with {ctx.steps} steps (and a random reward model) it is reported, not "
        f"judged."
    )
    if temporary and not failed:
        shutil.rmtree(ctx.work, ignore_errors=True)
    else:
        print(f"runs, logs (output.log) and models: {ctx.work}")
    sys.exit(1 if failed else 0)


def print_table(rows):
    columns = [
        ("check", "check"),
        ("status", "status"),
        ("gap", "step-0 gap"),
        ("reward", "reward 1st->2nd half, rose?"),
        ("step", "s/step"),
        ("sync", "s/sync"),
        ("peak", "peak memory"),
        ("wall", "wall"),
    ]
    widths = [max(len(title), *(len(str(r.get(key, "-"))) for r in rows)) for key, title in columns]
    print("\n" + "  ".join(title.ljust(w) for (_, title), w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(r.get(key, "-")).ljust(w) for (key, _), w in zip(columns, widths)))
    print()
    for r in rows:
        print(f"{r['status']}  {r['check']}: {r.get('note', '')}")


if __name__ == "__main__":
    main()
