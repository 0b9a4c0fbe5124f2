"""The reading layout of every script, as docs/async.md's table shows it (tests/test_documented_commands.py checks
that the table and the README's line range are this output, so no quoted line number drifts).

    python tools/layout.py            # the markdown table
    python tools/layout.py --write    # writes it into docs/async.md, and the loops' lines into README.md
"""

import argparse
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ALGOS = {"DPO": "dpo", "RLOO": "rloo", "PPO": "ppo", "GRPO": "grpo_gsm8k"}
LOSS = {
    "dpo": "dpo_loss(",
    "rloo": "clipped_policy_loss(",
    "ppo": "clipped_policy_loss(",
    "grpo_gsm8k": "grpo_policy_loss(",
}

# the variants beside the cores: each is its core plus one feature (docs/async.md's layout)
VARIANTS = (
    ("GRPO in flight", "async_grpo_gsm8k_inflight.py", "grpo_gsm8k"),
    ("GRPO with tools", "async_grpo_gsm8k_tools.py", "grpo_gsm8k"),
    ("DPO LoRA", "async_dpo_lora.py", "dpo"),
    ("GRPO LoRA", "async_grpo_gsm8k_lora.py", "grpo_gsm8k"),
)


def read(path: str):
    return (REPO / path).read_text().splitlines()


def first(lines, prefix: str):
    """The 1-based number of the first line that starts with `prefix`."""
    return next(i for i, line in enumerate(lines, 1) if line.startswith(prefix))


def loop_line(lines):
    """Where `main()`'s learner loop starts (the generation thread's own loop is indented deeper)."""
    return first(lines, "    for step")


def loss_offset(lines, algo: str):
    """How many lines into the learner loop the loss is first called."""
    loop = loop_line(lines)
    return next(i for i, line in enumerate(lines, 1) if i > loop and LOSS[algo] in line) - loop


def mean_characters(lines):
    text = [line for line in lines if line.strip()]
    return sum(len(line) for line in text) / len(text)


def changed_lines(a: str, b: str):
    """`diff a b | grep -c "^[<>]"`: the lines only one of the two files has."""
    out = subprocess.run(["diff", str(REPO / a), str(REPO / b)], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line[:1] in "<>")


def table():
    rows = [
        "| file | lines | characters per non-blank line | learner loop at | `# PLUMBING` at | loss, lines into "
        "the loop | sync twin: lines (loop at), changed lines | multigpu: lines (loop at), changed lines |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, algo in ALGOS.items():
        core, twin, variant = f"async_{algo}.py", f"sync_baselines/sync_{algo}.py", f"multigpu/async_{algo}_multigpu.py"
        lines = read(core)
        twin_lines, variant_lines = read(twin), read(variant)
        rows.append(
            f"| {name} | {len(lines):,} | {mean_characters(lines):.1f} | {loop_line(lines)} | "
            f"{first(lines, '# PLUMBING')} | +{loss_offset(lines, algo)} | {len(twin_lines):,} ({loop_line(twin_lines)}), {changed_lines(core, twin)} | "
            f"{len(variant_lines):,} ({loop_line(variant_lines)}), {changed_lines(core, variant)} |"
        )
    for name, variant, algo in VARIANTS:
        core = f"async_{algo}.py"
        lines = read(variant)
        rows.append(
            f"| {name} | {len(lines):,} | {mean_characters(lines):.1f} | {loop_line(lines)} | "
            f"{first(lines, '# PLUMBING')} | +{loss_offset(lines, algo)} | – | – (changed lines to its core, "
            f"`{core}`: {changed_lines(core, variant)}) |"
        )
    return rows


def loops():
    """The cores' learner-loop lines, smallest to largest, as "A–B"."""
    at = sorted(loop_line(read(f"async_{algo}.py")) for algo in ALGOS.values())
    return f"{at[0]}–{at[-1]}"


# where the two documents hold them
MARKERS = ("<!-- tools/layout.py: begin -->", "<!-- tools/layout.py: end -->")
# the README wraps its lines anywhere
README_LOOPS = r"(the\s+learner\s+loop\s+\(in\s+the\s+cores\s+it\s+starts\s+at\s+line\s+)[0-9]+–[0-9]+(\))"


def documented():
    """What docs/async.md and README.md hold now: (the table's rows, the README's loop lines)."""
    doc = (REPO / "docs" / "async.md").read_text()
    rows = doc.split(MARKERS[0])[1].split(MARKERS[1])[0].strip().splitlines()
    found = re.search(README_LOOPS, (REPO / "README.md").read_text().replace("\n", " "))
    return rows, found.group(0)[len(found.group(1)) : -1] if found else None


def write():
    path = REPO / "docs" / "async.md"
    before, rest = path.read_text().split(MARKERS[0])
    after = rest.split(MARKERS[1])[1]
    path.write_text(before + MARKERS[0] + "\n" + "\n".join(table()) + "\n" + MARKERS[1] + after)
    path = REPO / "README.md"
    path.write_text(re.sub(README_LOOPS, lambda m: m.group(1) + loops() + m.group(2), path.read_text()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the table and the loops' lines into the docs")
    if parser.parse_args().write:
        write()
    print("\n".join(table()) + f"\nloops {loops()}")
