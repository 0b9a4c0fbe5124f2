"""Write seeded arithmetic word problems in GSM8K's format: a task a 135M model can learn on a CPU in minutes.

    python tools/make_arithmetic.py --difficulty 1 --out data/arithmetic      # run by install.sh
    python tools/make_arithmetic.py --kind products --out data/products      # the calculator's task
    python async_grpo_gsm8k.py --dataset-path data/arithmetic ...

A chain problem starts from an amount and applies `difficulty` operations to it; a product problem is one product of
two factors of `difficulty + 1` digits, which a calculator gets right and a 135M model rarely does by itself. The
answer is exact and the worked solution ends in "#### <n>", so the GSM8K verifier grades it unchanged. The test split is drawn with another seed and
drops every question the train split holds. Same flags, same files: the generator is fully seeded.
`grade` is the task's own gold grader, for benchmarks that need a gold reward apart from the scripts' verifier;
`gold_score` is its continuous form, for benchmarks where a proxy reward model is optimised against it.
"""

import argparse
import json
import os
import random
import re

NAMES = ("Ava", "Ben", "Chloe", "Dan", "Emma", "Finn", "Grace", "Hugo")
ITEMS = ("apples", "marbles", "stickers", "pencils", "coins", "books")


def make_arithmetic_problems(num_problems: int, difficulty: int, seed: int):
    """GSM8K-format problems {"question", "answer"}: a start amount, then `difficulty` operations on it. Operands lie
    in 1..10*difficulty-1; from difficulty 3 on, an operation may also double or triple the amount. Subtractions never
    go below zero."""
    rng = random.Random(seed)
    high = 10 * difficulty - 1
    problems = []
    for _ in range(num_problems):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        total = rng.randint(1, high)
        question, solution = [f"{name} has {total} {item}."], [f"{name} starts with {total} {item}."]
        for _ in range(difficulty):
            op = rng.choice(("add", "sub", "mul") if difficulty >= 3 else ("add", "sub"))
            if op == "sub" and total > 0:
                n = rng.randint(1, min(total, high))
                question.append(f"Then {name} gives away {n} {item}.")
                solution.append(f"After giving away {n}: {total} - {n} = {total - n}.")
                total -= n
            elif op == "mul":
                n = rng.choice((2, 3))
                question.append(f"Then the number of {item} {name} has {('doubles', 'triples')[n - 2]}.")
                solution.append(f"After it {('doubles', 'triples')[n - 2]}: {total} * {n} = {total * n}.")
                total *= n
            else:
                n = rng.randint(1, high)
                question.append(f"Then {name} gets {n} more {item}.")
                solution.append(f"After getting {n} more: {total} + {n} = {total + n}.")
                total += n
        question.append(f"How many {item} does {name} have now?")
        problems.append({"question": " ".join(question), "answer": "\n".join(solution) + f"\n#### {total}"})
    return problems


def make_product_problems(num_problems: int, difficulty: int, seed: int):
    """GSM8K-format problems {"question", "answer"} whose answer is a product of two factors of `difficulty + 1` digits
    (difficulty 1: 23 * 47), no factor a multiple of 10."""
    rng = random.Random(seed)
    factors = [n for n in range(10**difficulty, 10 ** (difficulty + 1)) if n % 10]
    problems = []
    for _ in range(num_problems):
        name, item, boxes, each = rng.choice(NAMES), rng.choice(ITEMS), rng.choice(factors), rng.choice(factors)
        question = f"{name} packs {boxes} boxes with {each} {item} in each box. How many {item} does {name} pack?"
        solution = f"{boxes} boxes of {each} {item}: {boxes} * {each} = {boxes * each}.\n#### {boxes * each}"
        problems.append({"question": question, "answer": solution})
    return problems


# a whole number, maybe with thousands commas or ".0" (answers are never negative, but a model may write a minus sign;
# the minus of "5-3" is not one); no part of a decimal such as 12.5 counts as a whole number
INTEGER = re.compile(r"(?:(?<![\w.])-)?(?<![\d.,])\d+(?:,\d{3})*(?:\.0+)?(?![\d.]*\d)")


def final_answer(text: str):
    """The whole number a response answers (commas and ".0" dropped), or None: the number after the first "####" (the
    format the solutions teach), else the last number in the text, as the GSM8K verifier of the scripts reads it."""
    marked = re.search(r"####\s*(" + INTEGER.pattern + ")", text)
    numbers = INTEGER.findall(text)
    final = marked.group(1) if marked else (numbers[-1] if numbers else None)
    return None if final is None else final.replace(",", "").split(".")[0]


def grade(text: str, answer: str) -> float:
    """Gold reward of a response: 1.0 when its final answer equals `answer`, else 0.0; tests check that this agrees
    with the scripts' verifier on this task."""
    return float(final_answer(text) == answer)


def gold_score(text: str, answer: str) -> float:
    """Continuous gold reward of a response, in [0, 1]: 0.8 / (1 + |final - answer|) for how close its final number is
    (0.8 exact, 0.4 one off, 0.27 two off, 0 without a number), plus 0.2 if it ends as the solutions teach, with
    "#### <number>" on its last line. Partial credit makes every pair of samples informative and lets a proxy reward
    model be wrong by degrees, as a learned gold model is in the paper's TL;DR task."""
    final = final_answer(text)
    closeness = 0.0 if final is None else 1.0 / (1.0 + abs(int(final) - int(answer)))
    formatted = re.search(r"####\s*-?\d[\d,]*(?:\.0+)?\s*$", text) is not None
    return 0.8 * closeness + 0.2 * formatted


def make_splits(difficulty: int, num_train: int, num_test: int, kind: str = "chain"):
    """Train (seed 0) and test (seed 1, questions the train split holds removed) problems of a kind."""
    make = make_product_problems if kind == "products" else make_arithmetic_problems
    train = make(num_train, difficulty, seed=0)
    seen = {p["question"] for p in train}
    test = [p for p in make(num_test, difficulty, seed=1) if p["question"] not in seen]
    return train, test


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kind", choices=("chain", "products"), default="chain", help="chained operations or a product"
    )
    parser.add_argument(
        "--difficulty", type=int, default=1, help="operations per chain; a product's factors' digits - 1"
    )
    parser.add_argument("--out", default="data/arithmetic", help="destination folder (train.jsonl, test.jsonl)")
    parser.add_argument("--num-train", type=int, default=7473, help="train problems (GSM8K's split size)")
    parser.add_argument("--num-test", type=int, default=1319, help="test problems drawn before removing overlap")
    args = parser.parse_args()
    if args.difficulty < 1 or args.num_train < 1 or args.num_test < 1:
        parser.error("--difficulty, --num-train and --num-test must be >= 1")
    train, test = make_splits(args.difficulty, args.num_train, args.num_test, args.kind)
    os.makedirs(args.out, exist_ok=True)
    for split, problems in (("train", train), ("test", test)):
        with open(os.path.join(args.out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in problems)
    print(f"{len(train)} train and {len(test)} test {args.kind} problems of difficulty {args.difficulty} in {args.out}")
