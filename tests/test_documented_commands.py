"""Every command line the docs show runs as written: each `python <script>.py ...` and `torchrun ... <script>.py ...` in
README.md, docs/*.md and the module docstrings of the scripts (the algorithm scripts, benchmark/ and tools/) is
parsed by its script's own parser; an algorithm script's flags then go through its own check_args, with the
environment torchrun --nproc-per-node N [--nnodes M] gives rank 0 (WORLD_SIZE N*M, RANK 0), as at the start of main().
No model loads and no check is mocked: check_args reads configs and tokenizers, as it does before a run.

Where the commands run (a folder per command): the repository's local folders (models/SmolLM2-135M-Instruct,
data/gsm8k, data/arithmetic, data/products; made by `bash install.sh`), what the docs' own `python -c` steps make
before their commands (models/SmolLM2-rm, prompts.jsonl: handmade()), and, at the path of every hub id a command
names, a folder with that model's config (its positions) and a tokenizer shared by its family (HUB_MODELS), which
check_args reads as it would read the hub's (so its tokenizer check compares families, not the real vocabularies).
Benchmark and tool scripts are only parsed: tyro's Args, or the script run as __main__ until its argparse parser
returns (the checks they make after parsing do not run).

How a documented command becomes an argv (the docs' placeholders):
- a line ending in `\\` continues on the next; `# ...` comments and `VAR=value` prefixes are dropped;
- shell loops (`for n in 1 2 4; do ...; done`) are expanded over every value, `<algo>` over the four algorithms,
  and `x.py` (docs/multigpu.md: "every script") over the four multigpu variants;
- `...` and `<the run's flags>` stand for flags the text leaves out: those of the closest command above in the same
  code block that runs the same algorithm with its flags written out, else none (the defaults);
- `[--out DIR]`, an optional part of a synopsis, is written out; `runs/<async run>` becomes runs/async-run;
  `--nproc-per-node P` (a letter) is 2;
- `--replay-from runs/<run>`: the test writes what the recording command above in the block (else this command,
  recording) would have left there: samples/meta.json and an empty file per learner step; 8 stands for the
  micro-batch size a recording chose at run time;
- an absolute --output-dir (/tmp/...) is moved under the command's folder, where check_args probes it.
"""

import argparse
import ast
import functools
import itertools
import json
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass

import pytest

from conftest import REPO, load_script

ALGOS = ("dpo", "rloo", "ppo", "grpo_gsm8k")
ALGORITHM_SCRIPTS = [
    f"{prefix}{algo}{suffix}.py"
    for prefix, suffix in (("async_", ""), ("sync_baselines/sync_", ""), ("multigpu/async_", "_multigpu"))
    for algo in ALGOS
] + ["async_grpo_gsm8k_inflight.py", "async_grpo_gsm8k_tools.py"]
MULTIGPU = [f"multigpu/async_{algo}_multigpu.py" for algo in ALGOS]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
SCRIPTS = ALGORITHM_SCRIPTS + sorted(
    str(p.relative_to(REPO)) for folder in ("benchmark", "tools") for p in (REPO / folder).glob("*.py")
)
# hub id: (model_type, max_position_embeddings, tokenizer family), as in each model's config.json on the hub; a command
# that names a hub id not here fails, asking for its row. Pythia (GPT-NeoX) has 2,048 positions, Qwen2.5 Instruct
# 32,768; Rho-1B continues TinyLlama-1.1B, whose 2,048 are taken here (not read from the hub).
HUB_MODELS = {
    **{
        f"mnoukhov/pythia{size}-{kind}": ("gpt_neox", 2048, "pythia")
        for size in ("410m", "1b", "2.8b")
        for kind in ("sft-tldr", "rm-tldr6.9b")
    },
    "realtreetune/rho-1b-sft-GSM8K": ("llama", 2048, "rho"),
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2", 32768, "qwen2.5"),
    "Qwen/Qwen2.5-1.5B-Instruct": ("qwen2", 32768, "qwen2.5"),
}
LOCAL = ["models/SmolLM2-135M-Instruct", "data/gsm8k", "data/arithmetic", "data/products"]  # install.sh
COMMAND = re.compile(r"(?:\w+=\S*\s+)*(?:python3?|torchrun)\s")
LOOP = re.compile(r"for (\w+) in ([^;]+); do\s*")


@dataclass
class Command:
    where: str  # file:line
    script: str
    flags: tuple
    world_size: int  # torchrun's learner processes; 1 for python
    recorded: tuple | None = None  # --replay-from: the flags of the run that recorded the samples

    def __str__(self):
        launcher = "python" if self.world_size == 1 else f"torchrun (WORLD_SIZE {self.world_size})"
        return f"{self.where}: {launcher} {self.script} {shlex.join(self.flags)}"


def texts():
    """(name, first line number, text, is_markdown) for each doc and each script's module docstring."""
    for name in DOCS:
        yield name, 1, (REPO / name).read_text(), True
    for name in SCRIPTS:
        node = ast.parse((REPO / name).read_text()).body[0]
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield name, node.lineno, node.value.value, False


def blocks(text: str, markdown: bool):
    """Code blocks as lists of (line index, logical line), and the prose with those lines blanked (for inline code).
    A block is a fenced block, the command lines of a docstring, or else a single command line."""
    lines, prose, found, fence = text.split("\n"), [], [], None
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if markdown and stripped.startswith("```"):
            if fence is not None:
                found.append(fence)
            fence = [] if fence is None else None
            prose.append("")
            i += 1
            continue
        start = i
        logical = stripped
        if fence is not None or COMMAND.match(stripped) or LOOP.match(stripped):
            while logical.endswith("\\") and i + 1 < len(lines):
                i += 1
                logical = logical[:-1].rstrip() + " " + lines[i].strip()
            prose.extend([""] * (i - start + 1))
            if fence is not None:
                fence.append((start, logical))
            else:
                found.append([(start, logical)])
        else:
            prose.append(lines[i])
        i += 1
    if not markdown:  # a docstring's commands form one block, for `...`
        found = [[line for block in found for line in block]]
    return found, "\n".join(prose)


def command_lines(block):
    """(line index, command text) for each command in a block, shell loops expanded over their values."""
    loops = []
    for index, line in block:
        text = line
        pushed = 0
        while m := LOOP.match(text):
            loops.append((m[1], m[2].split()))
            text, pushed = text[m.end() :], pushed + 1
        one_line = re.search(r";\s*done\s*$", text)
        if one_line:
            text = text[: one_line.start()]
        if text.strip() == "done":
            del loops[-1:]
            continue
        if COMMAND.match(text.strip()):
            for values in itertools.product(*(v for _, v in loops)):
                expanded = text
                for (name, _), value in zip(loops, values):
                    expanded = re.sub(r"\$\{?" + name + r"\b\}?", value, expanded)
                yield index, expanded.strip()
        if one_line:
            del loops[len(loops) - pushed :]


def argv(text: str):
    """The argvs one documented command stands for (placeholders substituted), each as (launcher tokens, script,
    flags, elided): `<algo>` and `x.py` give several."""
    if re.match(r"(?:\w+=\S*\s+)*python3?\s+-", text):  # python -c "...", python -m pytest
        return
    text = text.replace("<the run's flags>", "...")
    text = re.sub(r"(\s)\[([^\]'\"]*)\]", r"\1\2", text)  # `[--out data/gsm8k]`: the optional part, written out
    scripts = [text]
    if "<algo>" in text:
        scripts = [text.replace("<algo>", algo) for algo in ALGOS]
    if re.search(r"(^|\s)x\.py\b", text):
        scripts = [re.sub(r"(^|\s)x\.py\b", rf"\g<1>{script}", text) for script in MULTIGPU]
    for one in scripts:
        one = re.sub(r"<([\w ]+)>", lambda m: m[1].replace(" ", "-"), one)  # runs/<async run> -> runs/async-run
        tokens = shlex.split(one, comments=True)
        # "$(cat docs/tool_prompt.txt)": the file's text, as the shell passes it
        tokens = [(REPO / t[6:-1]).read_text().rstrip("\n") if re.fullmatch(r"\$\(cat \S+\)", t) else t for t in tokens]
        while re.fullmatch(r"\w+=\S*", tokens[0]):
            tokens.pop(0)
        script = next((i for i, token in enumerate(tokens) if token.endswith(".py")), None)
        if script is None:
            continue
        flags = [token for token in tokens[script + 1 :] if token != "..."]
        yield tokens[:script], tokens[script], tuple(flags), len(flags) < len(tokens) - script - 1


def world_size(launcher):
    """WORLD_SIZE under `torchrun --nproc-per-node N [--nnodes M] ...` (a letter, as in `--nproc-per-node P`, gives
    2: the smallest torchrun run, the one the tests make); 1 for python."""
    if launcher[0] != "torchrun":
        return 1
    options, tokens = {}, launcher[1:]
    while tokens:
        name = tokens.pop(0)
        if "=" in name:
            name, value = name.split("=", 1)
        else:
            value = "" if name == "--standalone" else tokens.pop(0)
        options[name.lstrip("-").replace("_", "-")] = value
    count = [int(n) if n.isdigit() else 2 for n in (options["nproc-per-node"], options.get("nnodes", "1"))]
    return count[0] * count[1]


def algorithm(script: str):
    """What `...` looks for above: the same algorithm, in any of its three files."""
    return re.sub(r"^(a?sync_)|(_multigpu)$", "", os.path.basename(script)[:-3])


@functools.cache
def collect():
    commands = []
    for name, first_line, text, markdown in texts():
        found, prose = blocks(text, markdown)
        units = [(block, True) for block in found]
        spans = [(m.start(), m[1]) for m in re.finditer(r"`([^`]+)`", prose) if "\n\n" not in m[1]]
        spans += [(m.start(), m[1]) for m in re.finditer(r":\s\s+((?:python3?|torchrun)\s.*)$", prose, re.MULTILINE)]
        for start, span in spans:  # inline code, and a command after "...:  " in a docstring's prose
            span = " ".join(span.split())
            if COMMAND.match(span):
                units.append(([(prose[:start].count("\n"), span)], False))
        for block, in_block in units:
            above = []  # (algorithm, flags, written out in full, a recording) of the commands above, in this block
            for index, line in command_lines(block):
                for launcher, script, flags, elided in argv(line):
                    if elided:
                        flags = (
                            next((f for a, f, full, _ in reversed(above) if a == algorithm(script) and full), ())
                            + flags
                        )
                    recorded = None
                    if "--replay-from" in flags:  # the recording above, else this command's flags, recording
                        at = flags.index("--replay-from")
                        recorded = next(
                            (f for a, f, _, rec in reversed(above) if a == algorithm(script) and rec),
                            flags[:at] + flags[at + 2 :] + ("--record-samples",),
                        )
                    where = f"{name}:{first_line + index}"
                    commands.append(Command(where, script, flags, world_size(launcher), recorded))
                    if in_block:
                        above.append((algorithm(script), flags, not elided, "--record-samples" in flags))
    return commands


def test_the_documented_commands_are_found():
    """The collector itself: every algorithm script has documented commands, the headline torchrun ones among them."""
    commands = collect()
    assert {c.script for c in commands} >= set(ALGORITHM_SCRIPTS)
    assert all((REPO / c.script).is_file() for c in commands), [
        str(c) for c in commands if not (REPO / c.script).is_file()
    ]
    for script in MULTIGPU:  # its docstring's headline: the paper's 1 engine + 3 learners
        assert any(c.script == script and c.world_size == 3 and c.where.startswith(script) for c in commands), script


# ----------------------------------------------------------------------------------- where the commands run
def standin_tokenizer(folder, family: str):
    """A tokenizer whose vocabulary names its family: the same for a family's policy and reward model, else not."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.WordLevel({"<unk>": 0, f"<{family}>": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>").save_pretrained(folder)


def handmade(root):
    """What the docs' `python -c` steps make before their commands (docs/dpo.md, rloo.md, ppo.md): a reward model
    on SmolLM2, of which check_args reads the config and tokenizer (the weights are left out), and the prompt file."""
    policy, rm = REPO / "models" / "SmolLM2-135M-Instruct", root / "models" / "SmolLM2-rm"
    rm.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (rm / name).write_bytes((policy / name).read_bytes())
    with open(root / "prompts.jsonl", "w") as f, open(REPO / "data" / "gsm8k" / "train.jsonl") as problems:
        f.writelines(json.dumps({"query": json.loads(line)["question"] + "\nTL;DR:"}) + "\n" for line in problems)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The folder a command's own folder links to: local folders, handmade files, hub stand-ins."""
    missing = [path for path in LOCAL if not (REPO / path).is_dir()]
    if missing:
        pytest.fail(f"{missing} not found: run `bash install.sh` first (the documented commands name them)")
    root = tmp_path_factory.mktemp("documented")
    for path in LOCAL:
        (root / path).parent.mkdir(exist_ok=True)
        (root / path).symlink_to(REPO / path)
    handmade(root)
    tokenizers = root / "tokenizers"
    for hub_id, (model_type, positions, family) in HUB_MODELS.items():
        if not (tokenizers / family).is_dir():
            standin_tokenizer(tokenizers / family, family)
        folder = root / hub_id
        folder.mkdir(parents=True)
        for tokenizer_file in (tokenizers / family).iterdir():
            (folder / tokenizer_file.name).write_bytes(tokenizer_file.read_bytes())
        (folder / "config.json").write_text(
            json.dumps({"model_type": model_type, "max_position_embeddings": positions})
        )
    return root


@pytest.fixture
def workdir(sandbox, tmp_path, monkeypatch):
    for entry in sandbox.iterdir():
        if entry.name != "tokenizers":
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@functools.cache
def script_module(script: str):
    """Each script imported once (its `__main__` body does not run), the environment as it was before."""
    environ = dict(os.environ)
    try:
        return load_script(script)
    finally:
        os.environ.clear()
        os.environ.update(environ)


# ----------------------------------------------------------------------------------- the checks
class Parsed(Exception):
    """Raised once a benchmark or tool script's own argparse parser has read the flags: the script stops there."""


def parse(module, flags):
    import tyro

    return tyro.cli(getattr(module, "RunArgs", module.Args), args=list(flags))  # a core splits its flags in two


def write_recording(module, command: Command, folder):
    """--replay-from: samples/meta.json as the recording run writes it (replay_flags), one empty file per step."""
    recorded = parse(module, command.recorded)
    recorded.micro_batch_size = recorded.micro_batch_size or 8
    (folder / "samples").mkdir(parents=True)
    (folder / "samples" / "meta.json").write_text(json.dumps(module.replay_flags(recorded)))
    for step in range(recorded.num_learner_steps):
        (folder / "samples" / f"step_{step:06d}.pt").touch()


def check_algorithm_command(command: Command, workdir, monkeypatch):
    module = script_module(command.script)
    monkeypatch.setitem(sys.modules, module.__name__, module)  # tyro reads the docstrings for its messages
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if command.world_size > 1:  # what torchrun sets for rank 0
        monkeypatch.setenv("WORLD_SIZE", str(command.world_size))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
    flags = list(command.flags)
    for i, flag in enumerate(flags[:-1]):
        if flag == "--output-dir" and os.path.isabs(flags[i + 1]):
            flags[i + 1] = str(workdir / flags[i + 1].lstrip("/"))
    args = parse(module, flags)
    models = [args.model_name_or_path] + ([args.reward_model_path] if getattr(args, "reward", "") == "model" else [])
    unknown = [path for path in models if not os.path.isdir(path)]
    assert not unknown, f"{unknown}: neither a local folder nor in HUB_MODELS (add its config's row)"
    if getattr(args, "replay_from", None):
        write_recording(module, command, workdir / args.replay_from)
    module.check_args(args)


def check_other_command(command: Command, monkeypatch):
    """A benchmark or tool script: tyro's Args, else the script runs as __main__ until its argparse parser returns."""
    if re.search(r"tyro\.cli\((Run)?Args\)", (REPO / command.script).read_text()):
        module = script_module(command.script)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        parse(module, command.flags)
        return
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, *args, **kwargs):
        raise Parsed(original(parser, *args, **kwargs))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [command.script, *command.flags])
    with pytest.raises(Parsed):
        runpy.run_path(str(REPO / command.script), run_name="__main__")


@pytest.mark.parametrize("command", collect(), ids=lambda c: f"{c.where}:{c.script}")
def test_a_documented_command_passes_its_scripts_checks(command, workdir, monkeypatch, capsys):
    try:
        if command.script in ALGORITHM_SCRIPTS:
            check_algorithm_command(command, workdir, monkeypatch)
        else:
            check_other_command(command, monkeypatch)
        return
    except SystemExit as e:  # a parser's or check_args's one line (--help: the help, and exit code 0)
        if e.code == 0 and "--help" in command.flags:
            return
        message = e.code if isinstance(e.code, str) else " ".join(capsys.readouterr().err.split())[-600:]
    pytest.fail(f"{command}\n  exits: {message}", pytrace=False)


def test_the_layout_quoted_in_the_docs_is_the_code_s():
    """docs/async.md's layout table and the README's learner-loop lines are what `tools/layout.py` measures now (issue
    53: hand-typed line numbers had drifted in every row); after a change, `python tools/layout.py --write`."""
    layout = load_script("tools/layout.py")
    rows, loops = layout.documented()
    assert rows == layout.table(), "stale: run python tools/layout.py --write"
    assert loops == layout.loops(), "stale: run python tools/layout.py --write"
