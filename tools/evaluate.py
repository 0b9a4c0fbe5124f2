"""Greedy held-out accuracy of saved policies on a GSM8K-format test split, graded as the GRPO script grades it.

    python tools/evaluate.py runs/async_dpo__1__1764480000 --dataset-path data/arithmetic
    python tools/evaluate.py runs/a/model runs/b/checkpoint_64/policy --dataset-path data/gsm8k --num-eval-prompts 256

The reward-model scripts trained with `--reward verifier` do not evaluate while they train (their cores stay small);
this is their evaluation, after the fact. A run folder stands for its policy snapshots (`--save-every`,
checkpoint_*/policy, oldest first) and then its final model; a model folder stands for itself, a LoRA adapter folder
(the LoRA variants save these) for its base with the adapter merged in. One vLLM engine is built once and each
policy's weights are loaded into it, then `async_grpo_gsm8k.py`'s own `evaluate` (temperature 0, `verify` on the final
number; with --max-tool-calls, `async_grpo_gsm8k_tools.py`'s, calculator and all) grades the first --num-eval-prompts
test problems, so the numbers compare with a GRPO run's eval.jsonl. One
JSON line per policy goes to stdout and, with --output, to a file.
"""

import argparse
import glob
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def base_of(folder):
    """The model a policy folder builds on: a model folder itself, a LoRA adapter folder its base, else None."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    if os.path.isfile(os.path.join(folder, "adapter_config.json")):  # PEFT's, as the LoRA variants save
        with open(os.path.join(folder, "adapter_config.json")) as f:
            return json.load(f)["base_model_name_or_path"]


def policy_folders(paths):
    """Each path as the policy folders it stands for: a run folder's snapshots by step, then its final model."""
    folders = []
    for path in paths:
        if base_of(path):
            folders.append(path)
            continue
        snapshots = sorted(
            glob.glob(os.path.join(path, "checkpoint_*[0-9]", "policy")),
            key=lambda p: int(Path(p).parent.name.rsplit("_", 1)[1]),
        )
        final = [os.path.join(path, "model")] if base_of(os.path.join(path, "model")) else []
        if not snapshots + final:
            sys.exit(f"error: {path} is no model, adapter or run folder with checkpoint_*/policy or model/")
        folders += snapshots + final
    return folders


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="run folders (runs/{run_name}) or model folders")
    parser.add_argument("--dataset-path", required=True, help="a folder holding a GSM8K-format test.jsonl")
    parser.add_argument("--tokenizer", help="folder of the policy's tokenizer (default: the first folder that has one)")
    parser.add_argument("--prompt-template", help="as the run's --prompt-template (default: the script's)")
    parser.add_argument("--chat-template", action="store_true", help="as the run's --chat-template")
    parser.add_argument("--num-eval-prompts", type=int, default=256, help="the first this many test problems")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--engine-dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache in GiB (CPU default: 1)")
    parser.add_argument("--max-tool-calls", type=int, default=0, help="> 0: async_grpo_gsm8k_tools.py's calculator")
    parser.add_argument("--tool-open", help="as the run's --tool-open (with --max-tool-calls; default: the script's)")
    parser.add_argument("--tool-close", help="as the run's --tool-close (with --max-tool-calls; default: the script's)")
    parser.add_argument("--output", help="also append the JSON lines to this file")
    flags = parser.parse_args()
    folders = policy_folders(flags.paths)
    has_tokenizer = [f for f in folders if os.path.isfile(os.path.join(f, "tokenizer_config.json"))]
    tokenizer_path = flags.tokenizer or (has_tokenizer[0] if has_tokenizer else None)
    if tokenizer_path is None:
        sys.exit("error: none of these folders holds a tokenizer; name the policy's with --tokenizer")
    if not os.path.isfile(os.path.join(flags.dataset_path, "test.jsonl")):
        sys.exit(f"error: --dataset-path {flags.dataset_path!r} holds no test.jsonl")
    if flags.max_tool_calls < 0:
        sys.exit(f"error: --max-tool-calls must be >= 0 (0: no calculator), got {flags.max_tool_calls}")

    if not flags.max_tool_calls and (flags.tool_open or flags.tool_close):
        sys.exit("error: --tool-open and --tool-close need --max-tool-calls > 0")
    script = "async_grpo_gsm8k_tools.py" if flags.max_tool_calls else "async_grpo_gsm8k.py"
    as_run = [("prompt_template", flags.prompt_template), ("max_tool_calls", flags.max_tool_calls)]
    as_run += [("tool_open", flags.tool_open), ("tool_close", flags.tool_close)]
    spec = importlib.util.spec_from_file_location(script[:-3], REPO / script)
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)  # its functions, not its run: __name__ is not "__main__"
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    gpu = torch.cuda.is_available()
    args = grpo.RunArgs(
        model_name_or_path=base_of(tokenizer_path),  # the engine's model; an adapter folder's tokenizer is its base's
        dataset_path=flags.dataset_path,
        chat_template=flags.chat_template,
        max_prompt_tokens=flags.max_prompt_tokens,
        response_length=flags.response_length,
        engine_dtype=flags.engine_dtype,
        engine_device="cuda:0" if gpu else "cpu",
        learner_device="cuda:0" if gpu else "cpu",
        gpu_memory_utilization=0.9 if gpu else 0.1,
        kv_cache_gib=flags.kv_cache_gib if gpu or flags.kv_cache_gib else 1.0,
        **{name: value for name, value in as_run if value},  # the script's own default where none is given
    )
    tokenizer, args.eos_token_ids = grpo.load_tokenizer(args)
    prompts, answers = grpo.build_prompts(grpo.load_problems(args, "test"), tokenizer, args)[:2]
    eval_set = (prompts[: flags.num_eval_prompts], answers[: flags.num_eval_prompts])
    llm = grpo.build_engine(args)
    for folder in folders:
        if base_of(folder) == folder:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        else:  # an adapter: its base with the adapter merged in, as --save-merged saves it
            model = AutoPeftModelForCausalLM.from_pretrained(folder, dtype=torch.float32).merge_and_unload()
        weights = model.state_dict()
        grpo.push_weights_to_engine(llm, {name: t.to(args.engine_device) for name, t in weights.items()})
        result = {
            "policy": folder,
            "num_problems": len(eval_set[0]),
            **{k: v for k, v in grpo.evaluate(llm, eval_set, args, 0).items() if k != "policy_version"},
        }
        print(json.dumps(result), flush=True)
        if flags.output:
            with open(flags.output, "a") as f:
                f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
