"""Tiny real models for tests and benchmarks, built offline in a minute: a Llama-style policy and reward model and
GPT-NeoX ones as in Pythia, with one byte-level BPE tokenizer trained here on GSM8K's questions.

    python tools/make_tiny_models.py --out /tmp/tiny      # policy/, rm/, neox_policy/, neox_rm/, prompts.jsonl

The policies are random-init (head_dim 64, which vLLM's CPU attention needs), then briefly fine-tuned so that their
responses often end with EOS; the reward models are random-init sequence classifiers. Seeded: the same files each time.
The tests build them once per session (tests/conftest.py's `tiny`), benchmark/guard_table.py under its --work-dir.
"""

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# GSM8K (MIT), prepared by `bash install.sh` (tools/prepare_gsm8k.py)
GSM8K_DIR = REPO / "data" / "gsm8k"


def gsm8k_questions(n: int):
    path = GSM8K_DIR / "train.jsonl"
    if not path.exists():
        sys.exit(
            f"error: GSM8K not found at {path}: run `bash install.sh` (offline: with GSM8K_DIR naming a local copy)"
        )
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the models and the prompt file into")
    options = parser.parse_args()
    print(f"tiny models in {build_tiny_models(Path(options.out))}")


if __name__ == "__main__":
    main()
