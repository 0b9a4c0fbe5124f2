"""Every bad input we found fails with one line naming the flag or the file, before any model loads, and leaves no
run folder behind; and the details of generation that other model families expose: seeds, EOS ids, a missing pad.

The table runs each case as a user would, as a process on the command line (forked from conftest.py's warm launcher);
the other tests use a real vLLM engine on the tiny models of conftest.py.
"""

import shutil
import subprocess
import sys

import pytest

from conftest import ENV, load_script

RM_FLAGS = (
    "--max-prompt-tokens",
    "64",
    "--response-length",
    "16",
    "--prompts-per-step",
    "4",
    "--num-samples-per-prompt",
    "2",
    "--num-learner-steps",
    "2",
    "--kv-cache-gib",
    "0.25",
)


def rm_flags(tiny, *extra):
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--reward-model-path",
        str(tiny / "rm"),
        "--dataset-name",
        str(tiny / "prompts.jsonl"),
        *RM_FLAGS,
        *extra,
    )


def grpo_flags(tiny, folder, *extra):
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--dataset-path",
        str(folder),
        "--max-prompt-tokens",
        "128",
        "--response-length",
        "16",
        "--prompts-per-step",
        "4",
        "--num-learner-steps",
        "2",
        "--num-eval-prompts",
        "4",
        "--kv-cache-gib",
        "0.25",
        *extra,
    )


def corrupt_jsonl(tmp, tiny, arithmetic):  # line 1 holds a raw U+2028 in a string: valid JSON, one line to an editor
    lines = ['{"query": "a line\u2028separator"}'] + (tiny / "prompts.jsonl").read_text().splitlines()[1:]
    (tmp / "bad.jsonl").write_text("\n".join(lines[:2] + ['{"query": "cut off'] + lines[2:]) + "\n")


def corrupt_problems(tmp, tiny, arithmetic):
    shutil.copytree(arithmetic, tmp / "problems")
    lines = (arithmetic / "train.jsonl").read_text().splitlines()
    (tmp / "problems" / "train.jsonl").write_text("\n".join(lines[:4] + ["{'question': 1}"] + lines[4:]) + "\n")


def rm_with_another_tokenizer(tmp, tiny, arithmetic):
    """The tiny reward model with one more token in its tokenizer: its vocabulary is not smaller than the policy's,
    the case that used to train without a word."""
    from transformers import AutoTokenizer

    shutil.copytree(tiny / "rm", tmp / "rm2")
    tokenizer = AutoTokenizer.from_pretrained(tiny / "rm")
    tokenizer.add_tokens(["<an extra token>"])
    tokenizer.save_pretrained(tmp / "rm2")


def rm_with_a_smaller_embedding(tmp, tiny, arithmetic):
    """The tiny reward model with 8 embedding rows fewer than its tokenizer's 512 tokens: it passed every check and
    failed at its first score, after the engine had started ("index out of range", a run folder left)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny / "rm")
    model.resize_token_embeddings(len(AutoTokenizer.from_pretrained(tiny / "rm")) - 8)
    model.save_pretrained(tmp / "rm_small")
    AutoTokenizer.from_pretrained(tiny / "rm").save_pretrained(tmp / "rm_small")


def one_long_prompt(tmp, tiny, arithmetic):
    (tmp / "one.jsonl").write_text((tiny / "prompts.jsonl").read_text().splitlines()[0] + "\n")  # 6 questions long


def null_prompt(tmp, tiny, arithmetic):
    lines = (tiny / "prompts.jsonl").read_text().splitlines()
    (tmp / "null.jsonl").write_text("\n".join(lines[:2] + ['{"query": null}'] + lines[2:]) + "\n")


def empty_prompt(tmp, tiny, arithmetic):  # once dropped without a word, counted as longer than --max-prompt-tokens
    lines = (tiny / "prompts.jsonl").read_text().splitlines()
    (tmp / "empty.jsonl").write_text("\n".join(lines[:2] + ['{"query": ""}'] + lines[2:]) + "\n")


def empty_file(tmp, tiny, arithmetic):
    (tmp / "empty.jsonl").write_text("")


def output_file(tmp, tiny, arithmetic):
    (tmp / "out").write_text("a file, not a folder")


def nothing(tmp, tiny, arithmetic):
    pass


# (script, flag builder, extra flags, setup, message); "{tmp}" in flags and message is the run's working folder
BAD_INPUTS = [
    # async_dpo_lora.py (issue 56): what vLLM would not serve, refused before any model loads
    (
        "async_dpo_lora.py",
        rm_flags,
        ("--lora-target-modules", "q_proj", "lm_head"),
        nothing,
        "--lora-target-modules ['lm_head']: vLLM applies adapters of a llama model to",
    ),
    (
        "async_dpo_lora.py",
        rm_flags,
        ("--lora-target-modules", "q_prj"),
        nothing,
        "--lora-target-modules ['q_prj']: vLLM applies adapters",
    ),
    ("async_dpo_lora.py", rm_flags, ("--lora-rank", "0"), nothing, "--lora-rank must be in 1-512, got 0"),
    ("async_dpo_lora.py", rm_flags, ("--lora-rank", "600"), nothing, "--lora-rank must be in 1-512"),
    (
        "async_dpo_lora.py",
        rm_flags,
        ("--lora-alpha", "0"),
        nothing,
        "--lora-alpha must be > 0, got 0",
    ),
    (
        "async_dpo_lora.py",
        rm_flags,
        ("--model-name-or-path", "{tiny}/neox_policy", "--reward-model-path", "{tiny}/neox_rm"),
        nothing,
        "--model-name-or-path is a 'gpt_neox' model; this script knows the modules vLLM applies adapters to",
    ),
    # async_grpo_gsm8k_lora.py: the same check_lora_args, reached through the GRPO variant's check_args
    (
        "async_grpo_gsm8k_lora.py",
        grpo_flags,
        ("--lora-target-modules", "q_proj", "lm_head"),
        nothing,
        "--lora-target-modules ['lm_head']: vLLM applies adapters of a llama model to",
    ),
    ("async_grpo_gsm8k_lora.py", grpo_flags, ("--lora-rank", "-1"), nothing, "--lora-rank must be in 1-512"),
    (
        "async_grpo_gsm8k_lora.py",
        grpo_flags,
        ("--model-name-or-path", "{tiny}/neox_policy"),
        nothing,
        "--model-name-or-path is a 'gpt_neox' model; this script knows the modules vLLM applies adapters to",
    ),
    (
        "async_dpo.py",
        rm_flags,
        ("--output-dir", "{tmp}/out"),
        output_file,
        "--output-dir '{tmp}/out' is a file; the model is saved as a folder",
    ),
    (
        "async_grpo_gsm8k.py",
        grpo_flags,
        ("--output-dir", "{tmp}/out"),
        output_file,
        "--output-dir '{tmp}/out' is a file; the model is saved as a folder",
    ),
    (
        "sync_baselines/sync_ppo.py",
        rm_flags,
        ("--output-dir", "{tmp}/out"),
        output_file,
        "--output-dir '{tmp}/out' is a file; the model is saved as a folder",
    ),
    (
        "async_rloo.py",
        rm_flags,
        ("--reward-model-path", "{tmp}/rm2"),
        rm_with_another_tokenizer,
        "--reward-model-path '{tmp}/rm2' does not have the tokenizer of --model-name-or-path",
    ),
    (
        "async_ppo.py",
        rm_flags,
        ("--model-name-or-path", "./models/SmolLM2-typo"),
        nothing,
        "--model-name-or-path './models/SmolLM2-typo': no such folder (relative paths start at {tmp})",
    ),
    (
        "async_grpo_gsm8k.py",
        grpo_flags,
        ("--model-name-or-path", "models/SmolLM2-typo"),
        nothing,  # offline: see env
        "--model-name-or-path 'models/SmolLM2-typo' is neither a folder in {tmp} nor a model on the hub",
    ),
    (
        "sync_baselines/sync_dpo.py",
        rm_flags,
        ("--dataset-name", "{tmp}/empty.jsonl"),
        empty_file,
        "{tmp}/empty.jsonl holds no JSON objects (one per line)",
    ),
    (
        "async_ppo.py",
        rm_flags,
        ("--output-dir", "{tmp}/out/model"),
        output_file,
        "--output-dir '{tmp}/out/model' is not a folder this run can write to (Not a directory)",
    ),
    (
        "async_dpo.py",
        rm_flags,
        ("--output-dir", "{tiny}/policy"),
        nothing,
        "--output-dir is --model-name-or-path: the trained policy would overwrite the initial one",
    ),
    (
        "async_dpo.py",
        rm_flags,
        ("--dataset-name", "{tmp}/null.jsonl"),
        null_prompt,
        "--prompt-field 'query' is blank or not a text field of record 3 of {tmp}/null.jsonl",
    ),
    (
        "multigpu/async_ppo_multigpu.py",
        rm_flags,
        ("--dataset-name", "{tmp}/empty.jsonl"),
        empty_prompt,
        "--prompt-field 'query' is blank or not a text field of record 3 of {tmp}/empty.jsonl",
    ),
    (
        "async_dpo.py",
        rm_flags,
        ("--dataset-name", "{tmp}/bad.jsonl"),
        corrupt_jsonl,
        "{tmp}/bad.jsonl line 3: not valid JSON (Unterminated string",
    ),
    (
        "async_grpo_gsm8k.py",
        grpo_flags,
        ("--dataset-path", "{tmp}/problems"),
        corrupt_problems,
        "{tmp}/problems/train.jsonl line 5: not valid JSON (Expecting property name enclosed in double quotes)",
    ),
    (
        "async_dpo.py",
        rm_flags,
        ("--max-prompt-tokens", "500", "--response-length", "53"),
        nothing,
        "--max-prompt-tokens 500 + --response-length 53 is more than the 512 positions of --model-name-or-path",
    ),
    (
        "sync_baselines/sync_grpo_gsm8k.py",
        grpo_flags,
        ("--response-length", "400"),
        nothing,
        "--max-prompt-tokens 128 + --response-length 400 is more than the 512 positions of --model-name-or-path",
    ),
    ("async_rloo.py", rm_flags, ("--track",), nothing, "--track: wandb did not start"),
    (
        "multigpu/async_rloo_multigpu.py",
        rm_flags,
        ("--fsdp",),
        nothing,
        "--fsdp shards the learner over torchrun's processes: start it with torchrun --nproc-per-node 2 or more",
    ),
    (
        "multigpu/async_dpo_multigpu.py",
        rm_flags,
        ("--micro-batch-memory-gib", "0"),
        nothing,  # its default is None
        "--micro-batch-size must be >= 1 (or None: see --help) and --micro-batch-memory-gib > 0",
    ),
    # issue 55: AdamW's traceback after the models loaded, and an empty run folder left
    (
        "async_rloo.py",
        rm_flags,
        ("--learning-rate", "-1"),
        nothing,
        "--learning-rate and --weight-decay must be >= 0, got -1 and 0",
    ),
    (
        "sync_baselines/sync_grpo_gsm8k.py",
        grpo_flags,
        ("--weight-decay", "nan"),
        nothing,
        "--learning-rate and --weight-decay must be >= 0, got 3e-06 and nan",
    ),
    (
        "async_grpo_gsm8k_inflight.py",
        grpo_flags,
        ("--learning-rate", "-1"),
        nothing,
        "--learning-rate and --weight-decay must be >= 0, got -1 and 0",
    ),
    (
        "multigpu/async_ppo_multigpu.py",
        rm_flags,
        ("--learning-rate", "-1e-5"),
        nothing,
        "--learning-rate and --weight-decay must be >= 0, got -1e-05 and 0",
    ),
    (
        "async_dpo.py",
        rm_flags,
        ("--reward-model-path", "{tmp}/rm_small"),
        rm_with_a_smaller_embedding,
        "--reward-model-path '{tmp}/rm_small' embeds 504 token ids, fewer than the 512 of its tokenizer",
    ),
    (
        "multigpu/async_rloo_multigpu.py",
        rm_flags,
        ("--reward-model-path", "{tmp}/rm_small"),
        rm_with_a_smaller_embedding,
        "--reward-model-path '{tmp}/rm_small' embeds 504 token ids, fewer than the 512 of its tokenizer",
    ),
    (  # "all 1 prompts" once
        "async_ppo.py",
        rm_flags,
        ("--dataset-name", "{tmp}/one.jsonl"),
        one_long_prompt,
        "the one prompt is empty or longer than --max-prompt-tokens 64",
    ),
]


@pytest.mark.parametrize(
    "index", range(len(BAD_INPUTS)), ids=[f"{case[0].split('/')[-1]}:{' '.join(case[2])}" for case in BAD_INPUTS]
)
def test_bad_input_fails_with_one_line_before_any_model_loads(
    tiny, arithmetic_folder, tmp_path, monkeypatch, cli, index
):
    script, build, extra, setup, message = BAD_INPUTS[index]
    setup(tmp_path, tiny, arithmetic_folder)
    # no network here; offline, a hub id that is not cached fails at once instead of after a minute of retries
    monkeypatch.setitem(ENV, "HF_HUB_OFFLINE", "1")
    if "--track" in extra:  # a user who never ran `wandb login`
        monkeypatch.setitem(ENV, "HOME", str(tmp_path))
        for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR"):
            monkeypatch.delitem(ENV, name, raising=False)
    extra = [flag.replace("{tmp}", str(tmp_path)).replace("{tiny}", str(tiny)) for flag in extra]
    proc = cli(script, tmp_path, *build(tiny, *([arithmetic_folder] if build is grpo_flags else [])), *extra)
    assert proc.returncode != 0
    assert f"error: {message.replace('{tmp}', str(tmp_path))}" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "Initializing a V1 LLM engine" not in proc.stderr + proc.stdout
    if "--track" in extra:
        assert "wandb login" in proc.stderr and "WANDB_MODE=offline" in proc.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or not any(runs.iterdir()), "a failed start left a run folder behind"


@pytest.mark.parametrize(
    "body",
    [
        "import sys; print('out'); sys.exit('error: a message')",
        "import os; print(os.getcwd()); raise ValueError('boom')",
        "import atexit, sys; atexit.register(print, 'bye'); print(sys.argv[1:])",
        # a thread the script leaves running is joined before the exit handlers run
        "import atexit, threading, time; atexit.register(print, 'bye'); "
        "threading.Thread(target=lambda: time.sleep(1) or print('joined', flush=True)).start()",
    ],
)
def test_the_launcher_ends_a_command_line_as_python_does(tmp_path, cli, body):
    """Every run of the tests goes through the launcher: exit code, output and traceback must be what `python` gives."""
    (tmp_path / "script.py").write_text(body + "\n")
    launched = cli(str(tmp_path / "script.py"), tmp_path, "--a-flag", "1")
    plain = subprocess.run(
        [sys.executable, str(tmp_path / "script.py"), "--a-flag", "1"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert (launched.returncode, launched.stdout) == (plain.returncode, plain.stdout)
    assert launched.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1] if plain.stderr else not launched.stderr
    assert ("Traceback" in launched.stderr) == ("Traceback" in plain.stderr)


@pytest.mark.parametrize(
    "flag",
    [
        "--run-name",
        "--mini-batch-size",
        "--learner-device",
        "--engine-device",
        "--eos-token-ids",
        "--rank",
        "--world-size",
        "--local-rank",
    ],
)
def test_computed_fields_are_not_flags(flag, monkeypatch, capsys):
    import tyro

    for script in ("async_dpo.py", "sync_baselines/sync_grpo_gsm8k.py", "multigpu/async_ppo_multigpu.py"):
        module = load_script(script)
        monkeypatch.setitem(sys.modules, module.__name__, module)  # tyro reads the docstrings for its message
        with pytest.raises(SystemExit):
            tyro.cli(module.RunArgs, args=[flag, "1"])
        assert f"Unrecognized options: {flag}" in capsys.readouterr().err


def test_two_runs_started_in_the_same_second_get_their_own_folders(tmp_path, monkeypatch):
    grpo = load_script("async_grpo_gsm8k.py")
    monkeypatch.chdir(tmp_path)
    names = []
    for _ in range(3):
        names.append(grpo.create_run_folder("async_grpo_gsm8k__1__1796000000"))
    assert names == [
        "async_grpo_gsm8k__1__1796000000",
        "async_grpo_gsm8k__1__1796000000-1",
        "async_grpo_gsm8k__1__1796000000-2",
    ]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(names)


# ---------------------------------------------------------------- seeds, EOS ids, pad
@pytest.fixture(scope="module")
def other_family(tiny, tmp_path_factory):
    """The tiny policy as a model family unlike Pythia: no pad token, and a second EOS id in its generation config
    (as Llama 3 and Qwen have), chosen as a token the policy samples often so that responses do stop on it."""
    from transformers import AutoTokenizer, GenerationConfig

    folder = tmp_path_factory.mktemp("other_family") / "policy"
    shutil.copytree(tiny / "policy", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(folder)
    second_eos = tokenizer.convert_tokens_to_ids("Ġthe")
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, second_eos], bos_token_id=0).save_pretrained(folder)
    return folder, second_eos


@pytest.fixture(scope="module")
def engine(other_family):
    """A real engine on the other family's folder: vLLM reads the EOS ids to stop on from the model's own files."""
    rloo = load_script("async_rloo.py")
    args = rloo.RunArgs(
        model_name_or_path=str(other_family[0]),
        max_prompt_tokens=64,
        response_length=16,
        prompts_per_step=4,
        num_samples_per_prompt=2,
        temperature=1.5,
        kv_cache_gib=0.25,
        gpu_memory_utilization=0.1,
        engine_device="cpu",
    )
    return rloo, args, rloo.build_engine(args)


@pytest.mark.slow
def test_vllm_seeds_sample_c_with_seed_plus_c_so_requests_are_strided(engine):
    """Why the seeds are strided: vLLM gives sample c of an n-sample request the seed of request seed + c."""
    from vllm import SamplingParams

    rloo, args, llm = engine
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    params = dict(temperature=1.5, max_tokens=16, detokenize=False)
    pair, single = llm.generate(
        [prompt, prompt],
        [SamplingParams(n=2, seed=100, **params), SamplingParams(n=1, seed=101, **params)],
        use_tqdm=False,
    )
    assert list(pair.outputs[1].token_ids) == list(single.outputs[0].token_ids)
    # the same prompt four times over two steps: with seeds one apart, sample 1 of a prompt would repeat sample 0 of
    # the next; strided, all 16 samples are different draws
    responses = [tuple(r) for step in (0, 1) for r in rloo.generate(llm, [[5, 6, 7, 8]] * 4, args, step)[0]]
    assert len(set(responses)) == len(responses) == 16


@pytest.mark.slow
def test_a_response_ending_in_any_eos_id_counts_as_finished(other_family, engine, tiny, capsys):
    rloo, _, llm = engine
    folder, second_eos = other_family
    # micro_batch_size given: the script resolves its default before the generation thread starts, this test does not
    args = rloo.RunArgs(
        model_name_or_path=str(folder),
        max_prompt_tokens=64,
        response_length=16,
        prompts_per_step=4,
        num_samples_per_prompt=4,
        temperature=1.0,
        kv_cache_gib=0.25,
        engine_device="cpu",
        gpu_memory_utilization=0.1,
        micro_batch_size=8,
    )
    tokenizer, args.eos_token_ids = rloo.load_tokenizer(args)
    # a missing pad token falls back to EOS, with one line saying so
    assert tokenizer.pad_token == tokenizer.eos_token
    assert (
        capsys.readouterr().out.strip() == "note: the tokenizer has no pad token; padding with its EOS token "
        f"{tokenizer.eos_token!r}"
    )
    assert args.eos_token_ids == tuple(sorted({tokenizer.eos_token_id, second_eos}))
    from transformers import AutoModelForSequenceClassification

    reward_model = AutoModelForSequenceClassification.from_pretrained(tiny / "rm", num_labels=1).eval()
    prompts = [
        tokenizer(q).input_ids
        for q in ("Ava has 3 apples.", "The farmer sells the eggs", "Tom reads the", "What is the")
    ]
    batch = rloo.produce_batch(llm, reward_model, tokenizer, args, prompts, [None] * 4, step=0)
    stopped = [len(r) < args.response_length for r in batch["responses"]]
    assert any(r[-1] == second_eos for r in batch["responses"]), "no response stopped on the second EOS id"
    # vLLM stopped every short response on one of the EOS ids, and each of those counts as finished (no penalty)
    assert all(r[-1] in args.eos_token_ids for r, s in zip(batch["responses"], stopped) if s)
    assert batch["val/eos_rate"] == pytest.approx(sum(stopped) / len(stopped))
    unfinished = [not s for s in stopped]
    assert all(score == args.missing_eos_penalty for score, u in zip(batch["scores"].tolist(), unfinished) if u)
    # and the padded batch the learner builds pads with EOS
    input_ids, _, _ = rloo.pad_sequences(batch["prompts"], batch["responses"], tokenizer.pad_token_id, "cpu")
    assert input_ids.shape[0] == 16
