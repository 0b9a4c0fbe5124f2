"""Prepare GSM8K (Cobbe et al., 2021; MIT license) as data/gsm8k/{train,test}.jsonl, the files tests and docs use.

    python tools/prepare_gsm8k.py [--out data/gsm8k]            # run by install.sh

Where the data comes from, in this order:
  1. the folder named by the environment variable GSM8K_DIR (a local copy holding train.jsonl and test.jsonl,
     e.g. from github.com/openai/grade-school-math): for machines without hub access;
  2. the `openai/gsm8k` dataset ("main" config) through `datasets`, which needs hub access.
Each line is {"question": ..., "answer": "... #### <final number>"}. The files are git-ignored: never commit data.
"""

import argparse
import json
import os
import shutil
import sys

SPLITS = {"train": 7473, "test": 1319}  # GSM8K's published split sizes


def check_file(path: str):
    """One line naming the file and the line when a file is not GSM8K-format JSONL."""
    count = 0
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"error: {path}:{number} is not valid JSON ({e.msg})")
            if not isinstance(row, dict) or not {"question", "answer"} <= set(row):
                sys.exit(f"error: {path}:{number} lacks the GSM8K fields question and answer")
            count += 1
    if count == 0:
        sys.exit(f"error: {path} holds no problem")
    return count


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/gsm8k", help="destination folder")
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    source = os.environ.get("GSM8K_DIR")
    if source:
        paths = [os.path.join(source, f"{split}.jsonl") for split in SPLITS]
        for path in paths:
            if not os.path.isfile(path):
                sys.exit(
                    f"error: GSM8K_DIR={source!r} has no {os.path.basename(path)} (it must hold train.jsonl and "
                    f"test.jsonl)"
                )
        for path in paths:
            check_file(path)
            shutil.copyfile(path, os.path.join(out, os.path.basename(path)))
        origin = f"the local copy in GSM8K_DIR={source}"
    elif all(os.path.isfile(os.path.join(out, f"{split}.jsonl")) for split in SPLITS):
        origin = f"the files already in {out}"
    else:
        try:
            import datasets

            for split in SPLITS:
                rows = datasets.load_dataset("openai/gsm8k", "main", split=split)
                with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
                    for row in rows:
                        f.write(json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n")
        except Exception as e:  # no hub access, most often: say what to do instead
            sys.exit(
                f"error: could not download openai/gsm8k ({type(e).__name__}: {str(e)[:200]}); on a machine "
                f"without hub access set GSM8K_DIR to a folder holding GSM8K's train.jsonl and test.jsonl and "
                f"run the install again"
            )
        origin = "openai/gsm8k from the hub"
    counts = {split: check_file(os.path.join(out, f"{split}.jsonl")) for split in SPLITS}
    print(f"GSM8K in {out} from {origin}: " + ", ".join(f"{n} {split} problems" for split, n in counts.items()))
