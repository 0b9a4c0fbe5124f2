"""tools/: the install's data step (GSM8K from a local copy, or a clear message), the arithmetic task's grader."""

import json
import os
import subprocess
import sys

import pytest

from conftest import GSM8K_DIR, REPO, load_script


def prepare(out, gsm8k_dir=None):
    env = {k: v for k, v in os.environ.items() if k != "GSM8K_DIR"}
    env["HF_HUB_OFFLINE"] = "1"  # the hub path must fail fast here, as on any machine without hub access
    if gsm8k_dir is not None:
        env["GSM8K_DIR"] = str(gsm8k_dir)
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "prepare_gsm8k.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_gsm8k_is_copied_from_the_local_copy_named_by_gsm8k_dir(tmp_path):
    source = tmp_path / "copy"
    source.mkdir()
    for split, n in (("train", 5), ("test", 3)):
        with open(GSM8K_DIR / f"{split}.jsonl") as f:
            (source / f"{split}.jsonl").write_text("".join(line for _, line in zip(range(n), f)))
    proc = prepare(tmp_path / "out", source)
    assert proc.returncode == 0, proc.stderr
    assert f"from the local copy in GSM8K_DIR={source}: 5 train problems, 3 test problems" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[0]["answer"].split("####")[-1].strip().isdigit()


@pytest.mark.parametrize("case", ["missing split", "bad json", "no hub"])
def test_bad_gsm8k_sources_fail_with_one_line_naming_the_file(tmp_path, case):
    source = tmp_path / "copy"
    source.mkdir()
    (source / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{not json\n")
    if case == "missing split":
        proc, expected = prepare(tmp_path / "out", source), f"GSM8K_DIR={str(source)!r} has no test.jsonl"
    elif case == "bad json":
        (source / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
        proc, expected = prepare(tmp_path / "out", source), f"{source / 'train.jsonl'}:2 is not valid JSON"
    else:  # no local copy and no hub: the message says how to give a local copy
        proc, expected = prepare(tmp_path / "out"), "set GSM8K_DIR to a folder holding GSM8K's train.jsonl"
    assert proc.returncode != 0
    assert expected in proc.stderr and "Traceback" not in proc.stderr


def test_arithmetic_gold_grader_agrees_with_the_scripts_verifier():
    """benchmark/staleness.py grades with the task's own grader; it must read answers as the GRPO verifier does."""
    arithmetic, grpo = load_script("tools/make_arithmetic.py"), load_script("async_grpo_gsm8k.py")
    completions = [
        "So 5-3 = 2 apples",
        "#### 18",
        "#### 1,234",
        "Ava has 12.\n#### 12.0",
        "x = 7. y is 8.",
        "#### 12\n#### 13",
        "The answer is 12.5",
        "it is 40 + 2 = 42",
        "#### 42 apples",
        "no number",
        "",
    ]
    for difficulty in (1, 2, 4):
        problems = arithmetic.make_arithmetic_problems(100, difficulty, seed=difficulty)
        completions += [p["answer"] for p in problems] + [p["question"] for p in problems]
    answers = ["2", "7", "8", "12", "18", "42", "1234"] + [p["answer"].split("####")[-1].strip() for p in problems]
    disagree = [
        (text, answer)
        for text in completions
        for answer in answers
        if arithmetic.grade(text, answer) != grpo.verify(text, answer, False)[0]
    ]
    assert not disagree, disagree[:5]
    assert sum(arithmetic.grade(p["answer"], p["answer"].split("####")[-1].strip()) for p in problems) == 100
