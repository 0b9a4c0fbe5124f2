"""Can the weight-sync guard tell version v from v-1? Measures, per version, the engine-vs-learner probe gap after a
real sync and after a missed one, the learner's move, and whether `check_weight_sync` passes each.

    python benchmark/guard_versions.py --engine-dtype bfloat16            # SmolLM2-135M-Instruct, lr 3e-6, 4 versions
    python benchmark/guard_versions.py --engine-dtype float32 --learning-rate 1e-9

Each version is one AdamW step (the scripts' eps) on a fixed GSM8K-style sentence; the probe is another sentence
repeated to 32 tokens, as the scripts' probe is the run's first prompt repeated. One torch thread, the engine in
process, as in the core scripts. Prints one JSON line per version.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import load_script  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
parser.add_argument("--engine-dtype", default="bfloat16")
parser.add_argument("--learning-rate", type=float, default=3e-6)
parser.add_argument("--versions", type=int, default=4)
flags = parser.parse_args()

dpo = load_script("async_dpo.py")  # sets the engine-in-process variable before vLLM is imported
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

dpo.SET_TORCH_THREADS(1)
args = dpo.Args(model_name_or_path=flags.model, engine_dtype=flags.engine_dtype, engine_device="cpu",
                learner_device="cpu", kv_cache_gib=0.25, gpu_memory_utilization=0.1, max_prompt_tokens=256,
                response_length=16)
tokenizer = AutoTokenizer.from_pretrained(flags.model)
policy = AutoModelForCausalLM.from_pretrained(flags.model, dtype=torch.float32).eval()
llm = dpo.build_engine(args)
dpo.keep_models_eager(policy)
probe = (tokenizer("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                   "How many clips did Natalia sell altogether?").input_ids * 8)[:32]
train = torch.tensor([tokenizer("Weng earns $12 an hour for babysitting. Yesterday, she did 50 minutes of "
                                "babysitting. How much did she earn? #### 10").input_ids])
optimizer = torch.optim.AdamW(policy.parameters(), lr=flags.learning_rate, eps=1e-5, weight_decay=0.0)


def passes(check, previous, version):
    try:
        return dpo.check_weight_sync(llm, check, previous, args, version), True
    except RuntimeError:
        return previous, False


last, ok = passes(dpo.weight_check(policy, probe, args), None, 0)
print(json.dumps(dict(version=0, gap=round((last[1] - last[0]).abs().mean().item(), 6), passes=ok)), flush=True)
for version in range(1, flags.versions + 1):
    optimizer.zero_grad()
    (-dpo.token_logprobs(policy, train, torch.ones_like(train), torch.ones_like(train), 1.0).sum()).backward()
    optimizer.step()
    check = dpo.weight_check(policy, probe, args)
    _, missed_passes = passes(check, last, version)  # the reload never happened: the engine holds v-1
    missed_gap = (last[1] - check[1]).abs().mean().item()
    dpo.push_weights_to_engine(llm, policy.state_dict())
    synced, synced_passes = passes(check, last, version)
    print(json.dumps(dict(version=version, learner_move=round((check[1] - last[0]).abs().mean().item(), 6),
                          gap_synced=round((synced[1] - check[1]).abs().mean().item(), 6), synced_passes=synced_passes,
                          gap_missed=round(missed_gap, 6), missed_passes=missed_passes,
                          engine_move=round((synced[1] - last[1]).abs().mean().item(), 6))), flush=True)
    last = synced
