"""Which micro-batch the multigpu variants choose on an 80 GiB card, per paper configuration and layout (issue 44).

    python benchmark/gpu_fit.py                     # writes benchmark/results/gpu_fit/gpu_fit.md
    python benchmark/gpu_fit.py --results-dir D     # elsewhere (the test suite's run)

Computed, not measured: no GPU is needed, and none ran it. For each configuration the variant's own
`learner_gpu_budget` and `choose_micro_batch_size` run as they would on the learner GPU of each layout, the one
difference being the device query: `torch.cuda.mem_get_info` answers for an 80 GiB card with the CUDA context made
(79.5 GiB free). The models are their published configs (below), written as config.json files: the budget counts the
parameters on the meta device and the activation estimate reads the config, so no weights are needed. The variants'
default flags give the lengths (TL;DR: 512 prompt + 53 response tokens; GSM8K: 512 + 512) and the sequences per rank
(1 + 3: 48 prompts per step, which split over 3 ranks; else the defaults). Layouts, as docs/benchmarks.md names them:
1 GPU (engine and learner share cuda:0), 1 + 1 (learner alone on cuda:1), 1 + 3 DDP and 1 + 3 FSDP2 (three learner
ranks).
"""

import argparse
import contextlib
import dataclasses
import io
import re
from pathlib import Path
from unittest import mock

import common

REPO = common.REPO

GIB = 2**30
FREE, TOTAL = 79.5 * GIB, 80.0 * GIB
# published configs (Hugging Face model cards of EleutherAI/pythia-*, Qwen/Qwen2.5-*, realtreetune/rho-1b-sft-GSM8K)
NEOX = dict(
    model_type="gpt_neox",
    vocab_size=50304,
    rotary_pct=0.25,
    tie_word_embeddings=False,
    max_position_embeddings=2048,
    use_parallel_residual=True,
)
MODELS = {
    "Pythia-410m": dict(NEOX, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "Pythia-1b": dict(NEOX, hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
    "Pythia-2.8b": dict(NEOX, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240),
    "Rho-1B": dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=2048,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=5632,
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    "Qwen2.5-0.5B": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
    "Qwen2.5-1.5B": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    ),
}
# (algorithm, its variant, the policies of the paper's runs of it); PPO trains a value model beside the policy
ROWS = [
    ("DPO", "dpo", ["Pythia-410m", "Pythia-1b", "Pythia-2.8b"]),
    ("RLOO", "rloo", ["Pythia-410m", "Pythia-1b", "Pythia-2.8b"]),
    ("PPO", "ppo", ["Pythia-410m", "Pythia-1b", "Pythia-2.8b"]),
    ("GRPO, GSM8K", "grpo_gsm8k", ["Rho-1B", "Qwen2.5-0.5B", "Qwen2.5-1.5B"]),
]
LAYOUTS = {
    "1 GPU": dict(engine_device="cuda:0", learner_device="cuda:0", world_size=1, fsdp=False),
    "1 + 1": dict(engine_device="cuda:0", learner_device="cuda:1", world_size=1, fsdp=False),
    "1 + 3 DDP": dict(engine_device="cuda:0", learner_device="cuda:1", world_size=3, fsdp=False),
    "1 + 3 FSDP2": dict(engine_device="cuda:0", learner_device="cuda:1", world_size=3, fsdp=True),
}


def write_config(folder: Path, name: str) -> Path:
    from transformers import AutoConfig

    path = folder / name
    spec = dict(MODELS[name])
    AutoConfig.for_model(spec.pop("model_type"), **spec).save_pretrained(path)
    return path


def choice(variant, path: Path, algo: str, layout: dict):
    """(budget GiB, estimate per sequence GiB, micro-batch or 0 if refused, the rank's sequences per mini-batch) as
    the variant's functions give them on that layout's learner GPU."""
    args = variant.RunArgs(model_name_or_path=str(path), **layout)
    if layout["world_size"] > 1:
        args.prompts_per_step = 48
    k = 2 if algo == "dpo" else args.num_samples_per_prompt
    sequences = args.prompts_per_step * k // args.num_mini_batches // args.world_size
    trained = 2 if algo == "ppo" else 1
    out = io.StringIO()
    with mock.patch("torch.cuda.mem_get_info", lambda device=None: (FREE, TOTAL)), contextlib.redirect_stdout(out):
        budget = variant.learner_gpu_budget(args, variant.model_config("--model-name-or-path", str(path)), trained)
        # the same choice for that budget; over ranks the variant takes the minimum, here of equal ranks
        one = dataclasses.replace(args, world_size=1, micro_batch_memory_gib=budget)
        try:
            size = variant.choose_micro_batch_size(
                one, sequences, args.max_prompt_tokens + args.response_length, trained_models=trained
            )
        except SystemExit as refused:
            return budget, float(re.search(r"needs ~([\d.]+) GiB", str(refused)).group(1)), 0, sequences
    estimate = float(re.search(r"est\. ([\d.]+) GiB", out.getvalue()).group(1))
    return budget, estimate / min(size, sequences), size, sequences


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--results-dir", default=str(REPO / "benchmark" / "results" / "gpu_fit"))
    parser.add_argument("--work-dir", default=str(REPO / "benchmark" / "work" / "gpu_fit"))
    options = parser.parse_args()
    work = Path(options.work_dir)
    paths = {name: write_config(work, name) for name in MODELS}
    lines = [
        "Micro-batch each multigpu variant chooses on an 80 GiB card (79.5 GiB free), by its own "
        "`learner_gpu_budget` and `choose_micro_batch_size`; computed by `python benchmark/gpu_fit.py`, no GPU "
        "ran it. Per cell: the micro-batch M (of the rank's sequences per mini-batch), and the budget left for "
        "one micro-batch in GiB; **refused** = not even one sequence fits (the variant stops in one line).",
        "",
        "| algorithm | policy | est. per sequence (GiB) | " + " | ".join(LAYOUTS) + " |",
        "|---|---|---|" + "---|" * len(LAYOUTS),
    ]
    for label, algo, models in ROWS:
        variant = common.load_script(f"multigpu/async_{algo}_multigpu.py")
        for name in models:
            cells, per_sequence = [], None
            for layout in LAYOUTS.values():
                budget, per_sequence, size, sequences = choice(variant, paths[name], algo, layout)
                cells.append(f"{size} of {sequences} ({budget:.1f})" if size else f"**refused** ({budget:.1f})")
            lines.append(f"| {label} | {name} | {per_sequence:.2f} | " + " | ".join(cells) + " |")
    out = Path(options.results_dir) / "gpu_fit.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
