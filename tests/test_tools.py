"""Tool calls, token-exact (async_grpo_gsm8k_tools.py, issue 57), on the real CPU engine and a tiny model.

What the variant promises: the engine stops at --tool-close, the calculator's result is appended as tokens and the
same sequence goes on as a new request whose prompt is its token ids; the learner trains on exactly those ids, the
result tokens masked out, so its logprobs of the policy's tokens are vLLM's. The calls are known: the tiny policy is
first taught one scripted answer with three calls (the third a division by zero), which greedy decoding repeats; a
second, on SmolLM2's real tokenizer, is taught two calls, the first closed by `>=`, past the tag (issue 65).
"""

import dataclasses
import json
import time

import pytest
import torch

from conftest import REPO, load_script, read_metrics, run_script

CORE, TOOLS = "async_grpo_gsm8k.py", "async_grpo_gsm8k_tools.py"
# the scripted answer: what the policy writes, then what the tool appends, in turn (the policy's text is its own turn)
SCRIPT = [" <calc>12*7</calc>", "=84", " then <calc>2**3+1</calc>", "=9", " and <calc>1/0</calc>"]
SCRIPT += ["=error: division by zero", " so #### 84"]
CALLS = ["=84", "=9", "=error: division by zero"]
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"  # its tokenizer is the real one


@pytest.fixture(scope="module")
def tools():
    return load_script(TOOLS)


@pytest.mark.parametrize(
    "expression,value",
    [
        ("12*7", "84"),
        (" 2**3+1 ", "9"),
        ("7/2", "3.5"),
        ("1/3", "0.333333"),
        ("-(2+3)*4", "-20"),
        ("17//5 + 17%5", "5"),
        ("2**-1", "0.5"),
        ("1.5*4", "6"),
        ("1/0", "error: division by zero"),
        ("5 % 0", "error: division by zero"),
        ("2**65", "error: too large"),  # the exponent bound
        ("9**9**9", "error: too large"),  # refused before any big power is computed
        ("10**20*10**20", "error: too large"),  # a value on the way
        ("1e400", "error: too large"),  # inf
        ("(-8)**0.5", "error: not arithmetic"),  # complex
        ("__import__('os').system('true')", "error: not arithmetic"),
        ("x+1", "error: not arithmetic"),
        ("True+1", "error: not arithmetic"),
        ("'a'*3", "error: not arithmetic"),
        ("1,000+1", "error: not arithmetic"),  # a tuple
        ("", "error: not arithmetic"),
        ("1\x00", "error: not arithmetic"),
        ("1+" * 60 + "1", "error: too long"),
    ],
)
def test_the_calculator_computes_arithmetic_and_refuses_the_rest_with_an_error_string(tools, expression, value):
    assert tools.calculate(expression) == value


def test_a_result_is_the_value_after_the_turns_last_opening_tag(tools):
    args = tools.RunArgs()
    assert tools.tool_result("so <calc>1+1</calc> and <calc>2*3</calc>", args) == "=6"
    assert tools.tool_result("no tag 2*3</calc>", args) == "=error: no opening tag"
    assert tools.tool_result("<calc>hello</calc>", args) == "=error: not arithmetic"


def test_the_policy_mask_drops_exactly_the_result_tokens(tools):
    """Two right-padded rows (prompt 2 and 3 tokens): the result tokens' columns go to 0, the rest stays."""
    response_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1]])
    tool = [[0, 1, 1, 0, 0], [0, 0, 1, 0, 1]]
    expected = torch.tensor([[0, 0, 1, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0, 1, 0]])
    assert torch.equal(tools.policy_tokens(response_mask, tool), expected)
    assert torch.equal(response_mask[0], torch.tensor([0, 0, 1, 1, 1, 1, 1, 0]))  # the input is left as it was


def scripted_policy(policy, tokenizer, script, folder, prompts=4, steps=120):
    """`policy` taught `script` after `prompts` prompts, with the tokens laid out as the variant lays them: each
    turn's text and each result encoded on its own (as the tool appends them), then EOS."""
    eos = tokenizer.eos_token_id
    answer = [t for piece in script for t in tokenizer.encode(piece, add_special_tokens=False)] + [eos]
    rows = prompts_of(tokenizer, prompts)
    width = max(map(len, rows)) + len(answer)
    ids = torch.tensor([r + answer + [eos] * (width - len(r) - len(answer)) for r in rows])
    labels = torch.tensor([[-100] * len(r) + answer + [-100] * (width - len(r) - len(answer)) for r in rows])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = policy(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def scripted(tiny, tmp_path_factory):
    """The tiny policy taught SCRIPT: its folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny / "policy")
    policy = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32)
    return scripted_policy(policy, tokenizer, SCRIPT, tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def engine(scripted):
    """One real engine on the scripted policy: (the script as a module, its Args, the engine, tokenizer, policy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tools = load_script(TOOLS)
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    args = tools.RunArgs(
        model_name_or_path=str(scripted),
        engine_device="cpu",
        learner_device="cpu",
        kv_cache_gib=0.25,
        max_prompt_tokens=96,
        response_length=96,
        temperature=1.0,
        num_samples_per_prompt=2,
        prompts_per_step=4,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(scripted, dtype=torch.float32).eval()
    llm = tools.build_engine(args)
    tools.keep_models_eager(model)
    return tools, args, llm, tokenizer, model


class Recording:
    """The engine, passed through, with every request it was given and what it answered (the test's own spy)."""

    def __init__(self, llm):
        self.llm, self.turns, self.seconds = llm, [], []

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def generate(self, requests, params, use_tqdm):
        start = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=use_tqdm)
        self.seconds.append(time.perf_counter() - start)
        self.turns.append([(r["prompt_token_ids"], o) for r, o in zip(requests, outputs)])
        return outputs


def prompts_of(tokenizer, n):
    return [tokenizer(f"Problem: what is {a} times {a + 3}?\n\nSolution:").input_ids for a in range(n)]


@pytest.mark.slow
def test_greedy_decoding_makes_the_scripted_calls_each_turn_continuing_the_last_ones_tokens(engine):
    """The three known calls, in four turns; each turn's prompt is the previous turn's prompt, its sampled ids and
    the result's ids, nothing re-tokenised; the result tokens are the tool's, flagged; the text is the script."""
    from vllm import SamplingParams

    tools, args, llm, tokenizer, model = engine
    prompts = prompts_of(tokenizer, 2)
    recording = Recording(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.response_length, **tools.stop_at_call(args))
    samples = tools.sample_with_tools(recording, prompts, [params] * 2, args)
    assert [s.calls for s in samples] == [CALLS, CALLS]
    assert tokenizer.decode(samples[0].tokens, skip_special_tokens=True) == "".join(SCRIPT)
    assert [len(turn) for turn in recording.turns] == [2, 2, 2, 2]  # a turn per call and the one after the last
    print("engine seconds per turn:", [f"{t:.3f}" for t in recording.seconds])
    for j, sample in enumerate(samples):
        turns = [turn[j] for turn in recording.turns]
        for (prompt, output), call, (next_prompt, _) in zip(turns, CALLS, turns[1:]):
            result = tokenizer.encode(call, add_special_tokens=False)
            assert output.outputs[0].text.endswith("</calc>") and output.outputs[0].stop_reason == "</calc>"
            assert next_prompt == prompt + list(output.outputs[0].token_ids) + result
        last_prompt, last = turns[-1]
        assert last_prompt + list(last.outputs[0].token_ids) == prompts[j] + sample.tokens
        assert sum(sample.tool) == sum(len(tokenizer.encode(call, add_special_tokens=False)) for call in CALLS)
    # one call allowed: the second tag is only text, and the tool appends nothing to it
    one = tools.sample_with_tools(llm, prompts, [params] * 2, dataclasses.replace(args, max_tool_calls=1))
    assert [s.calls for s in one] == [CALLS[:1]] * 2
    assert [sum(s.tool) for s in one] == [len(tokenizer.encode(CALLS[0], add_special_tokens=False))] * 2
    assert "=84 then <calc>2**3+1</calc>" in tokenizer.decode(one[0].tokens)  # what follows is the policy's


@pytest.mark.slow
def test_the_evaluation_reads_which_calls_gave_the_answer(engine):
    """Greedy, the scripted policy calls 12*7 (=84), 2**3+1 (=9) and 1/0, then answers 84: against the reference
    answers 84, 9 and 5, one answer is right, two made a call whose result is the reference answer (84, 9), all three
    took their final number from a call; cut at 12 tokens, every answer is truncated."""
    tools, args, llm, tokenizer, model = engine
    eval_set = (prompts_of(tokenizer, 3), ["84", "9", "5"])
    result = tools.evaluate(llm, eval_set, args, 0)
    assert result["eval/calls_per_sample"] == 3 and result["eval/accuracy"] == pytest.approx(1 / 3)
    assert result["eval/right_call_rate"] == pytest.approx(2 / 3) and result["eval/answer_from_call_rate"] == 1
    assert result["eval/truncated_rate"] == 0
    cut = tools.evaluate(llm, eval_set, dataclasses.replace(args, response_length=12), 0)
    assert cut["eval/truncated_rate"] == 1


@pytest.mark.slow
def test_the_learners_logprobs_of_the_policys_tokens_are_vllms_on_multi_call_samples(engine):
    """Sampled at temperature 1 through `generate`, laid out as main() lays them out: the learner's logprobs of the
    policy's tokens equal vLLM's (the core's gap check), with the result tokens read as context and masked out."""
    tools, args, llm, tokenizer, model = engine
    prompts = prompts_of(tokenizer, 4)
    tools.push_weights_to_engine(llm, model.state_dict())  # the learner's weights, bit for bit
    responses, logprobs, tool_masks, calls, carried = tools.generate(llm, prompts, args, step=0)
    assert sum(len(c) >= 2 for c in calls) >= 2, "too few multi-call samples: the test would prove little"
    repeated = [p for p in prompts for _ in range(2)]
    input_ids, attention_mask, response_mask = tools.pad_sequences(repeated, responses, 0, "cpu")
    mask = tools.policy_tokens(response_mask, tool_masks)
    with torch.no_grad():
        learner = tools.token_logprobs(model, input_ids, attention_mask, mask, args.temperature)
    gap, count = tools.logprob_gap(learner, mask, logprobs, torch.arange(len(logprobs))).tolist()
    assert count == sum(map(len, logprobs)) and gap / count < 1e-4, gap / count
    assert (learner[~mask[:, 1:].bool()] == 0).all()  # nothing is trained on a result token
    with pytest.raises(RuntimeError):  # the unmasked layout has more tokens than vLLM has logprobs for
        tools.behaviour_logprobs_tensor(logprobs, response_mask)
    for tokens, tool, made, held in zip(responses, tool_masks, calls, carried):
        results = [t for t, is_tool in zip(tokens, tool) if is_tool]
        appended = [
            t for c, h in zip(made, held) for t in tokenizer.encode(c.removeprefix(h), add_special_tokens=False)
        ]
        # the last result is cut where the sample spends its --response-length
        assert results == appended[: len(results)] and (results == appended or len(tokens) == args.response_length)
    retokenised = [tokenizer(tokenizer.decode(p + r)).input_ids for p, r in zip(repeated, responses)]
    print(f"{sum(a != p + r for a, p, r in zip(retokenised, repeated, responses))} of 8 re-tokenise differently")


@pytest.mark.slow
def test_without_calls_the_variant_samples_the_cores_tokens_bit_for_bit(engine):
    """--max-tool-calls 0: no stop string, one turn, the core's SamplingParams: the same ids and logprobs."""
    tools, args, llm, tokenizer, model = engine
    core = load_script(CORE)
    prompts = prompts_of(tokenizer, 4)
    off = dataclasses.replace(args, max_tool_calls=0)
    responses, logprobs, tool_masks, calls, _ = tools.generate(llm, prompts, off, step=3)
    assert (responses, logprobs) == core.generate(llm, prompts, off, step=3)
    assert not any(map(sum, tool_masks)) and not any(calls)
    assert any("</calc>" in tokenizer.decode(r) for r in responses), "the policy wrote no tag: this would prove little"


@pytest.mark.slow
def test_the_budget_counts_result_tokens_and_cuts_a_result_at_it(engine):
    tools, args, llm, tokenizer, model = engine
    for length in (17, 30, 60):  # inside the first result, the second turn, the error string
        short = dataclasses.replace(args, response_length=length)
        responses, logprobs, tool_masks, *_ = tools.generate(llm, prompts_of(tokenizer, 2), short, step=0)
        assert all(len(r) <= length and len(t) == len(r) for r, t in zip(responses, tool_masks))
        assert [len(lp) for lp in logprobs] == [t.count(0) for t in tool_masks]


# SmolLM2's tokenizer merges across a tag's end (`</calc>=84` is '</', 'calc', '>=', '8', '4'): the first call's
# closing token holds the result's `=` past the tag, the second's is a bare `>` that a re-tokeniser merges with `=9`
MERGING = [" <calc>12*7</calc>=", "84", " then <calc>2**3+1</calc>", "=9", " so #### 84"]


@pytest.fixture(scope="module")
def merging(tmp_path_factory):
    """A real engine on a tiny policy with SmolLM2-135M-Instruct's tokenizer, taught MERGING (greedy repeats it)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} is absent (`bash install.sh` puts it there): no tokenizer that merges across `>=`")
    tools = load_script(TOOLS)
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,  # vLLM's CPU attention needs 64
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    folder = tmp_path_factory.mktemp("smollm2")
    # two prompts and 80 steps: each step's logits span 49,152 tokens, and greedy decoding already repeats the script
    path = scripted_policy(LlamaForCausalLM(config), tokenizer, MERGING, folder, prompts=2, steps=80)
    args = tools.RunArgs(
        model_name_or_path=str(path),
        engine_device="cpu",
        learner_device="cpu",
        kv_cache_gib=0.25,
        max_prompt_tokens=96,
        response_length=96,
        temperature=0.0,
        num_samples_per_prompt=1,
    )
    return tools, args, tools.build_engine(args), tokenizer


@pytest.mark.slow
def test_a_closing_token_that_carries_text_past_the_tag_is_read_as_written_and_never_re_tokenised(merging):
    """The first call's closing token is `>=`: vLLM's text stops at `</calc>`, its ids do not, so the result goes
    after the `=` the policy wrote (`</calc>=84`, not `</calc>==84`), and the overrun is counted; each turn goes on
    from the engine's ids and the result's (re-tokenised, `>` + `=9` would become `>=` + `9`)."""
    tools, args, llm, tokenizer = merging
    prompts, recording = prompts_of(tokenizer, 2), Recording(llm)
    batch = tools.produce_batch(recording, tokenizer, args, prompts, ["84", "84"], step=0)
    texts = tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
    assert texts == ["".join(MERGING)] * 2
    assert batch["tools/overrun_rate"] == 0.5 and batch["rewards"].tolist() == [1.0, 1.0]
    results = [tokenizer.encode(piece, add_special_tokens=False) for piece in MERGING[1::2]]
    for j, sample in enumerate(batch["responses"]):
        turns = [turn[j] for turn in recording.turns]
        assert tokenizer.decode(turns[0][1].outputs[0].token_ids[-1]) == ">="  # the overrun this test is about
        for (prompt, output), result, (next_prompt, _) in zip(turns, results, turns[1:]):
            assert next_prompt == prompt + list(output.outputs[0].token_ids) + result
        last_prompt, last = turns[-1]
        assert last_prompt + list(last.outputs[0].token_ids) == prompts[j] + sample


def test_a_run_logs_the_tool_metrics_and_its_logprobs_are_vllms(scripted, arithmetic_folder, tmp_path):
    """Two learner steps of the script at --async-steps 0 (so the gap is the sync's, ~0) on the scripted policy; then
    tools/evaluate.py with the calculator on the policy it started from."""
    proc, _ = run_script(
        TOOLS,
        tmp_path,
        *("--model-name-or-path", str(scripted), "--dataset-path", str(arithmetic_folder)),
        *("--max-prompt-tokens", "128", "--response-length", "96", "--prompts-per-step", "4"),
        *("--num-samples-per-prompt", "2", "--temperature", "1.0", "--num-learner-steps", "2", "--async-steps", "0"),
        *("--num-eval-prompts", "4", "--kv-cache-gib", "0.25", "--output-dir", str(tmp_path / "model")),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:  # on these prompts the scripted policy strays from its script: its calls fail more often
        assert m["tools/calls_per_sample"] > 0 and 0 < m["tools/result_tokens_share"] < 1
        assert 0 <= m["tools/error_rate"] <= 1 and m["tools/overrun_rate"] == 0  # no tiny token holds `>` and more
        assert m["async/behaviour_learner_logprob_gap"] < 1e-4  # the result tokens kept out of the gap
    assert any(m["tools/error_rate"] > 0 for m in metrics)
    evaluations = [json.loads(line) for line in next((tmp_path / "runs").glob("*/eval.jsonl")).read_text().splitlines()]
    assert all(e["eval/calls_per_sample"] > 0 for e in evaluations)
    # tools/evaluate.py --max-tool-calls grades the policy the run started from as the run graded it
    proc, _ = run_script(
        "tools/evaluate.py",
        tmp_path,
        *(str(scripted), "--dataset-path", str(arithmetic_folder), "--max-tool-calls", "4", "--num-eval-prompts", "4"),
        *("--max-prompt-tokens", "128", "--response-length", "96", "--kv-cache-gib", "0.25"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    graded = json.loads(proc.stdout.splitlines()[-1])
    assert {k: v for k, v in graded.items() if k.startswith("eval/")} == {
        k: v for k, v in evaluations[0].items() if k.startswith("eval/")
    }


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--max-tool-calls", "-1"), "--max-tool-calls must be >= 0 (0: no calculator), got -1"),
        (
            ("--tool-close", "<|endoftext|>"),
            "--tool-open/--tool-close ('<calc>', '<|endoftext|>') hold the tokenizer's special token '<|endoftext|>'",
        ),
        (
            ("--tool-open", "x<|endoftext|>"),
            "--tool-open/--tool-close ('x<|endoftext|>', '</calc>') hold the tokenizer's special token '<|endoftext|>'",
        ),
        (("--tool-open", "</calc>"), "--tool-open and --tool-close must be two different non-empty texts"),
        (("--response-length", "4"), "--response-length 4 is too short for one calculator call ('<calc>1</calc>=1'"),
    ],
)
def test_bad_tool_flags_fail_with_one_message_before_any_model_loads(
    tiny, arithmetic_folder, tmp_path, cli, flags, message
):
    proc = cli(
        TOOLS,
        tmp_path,
        *("--model-name-or-path", str(tiny / "policy"), "--dataset-path", str(arithmetic_folder)),
        *("--num-learner-steps", "2", "--max-prompt-tokens", "128", "--response-length", "64", *flags),
    )
    assert proc.returncode != 0
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1
    assert "Initializing a V1 LLM engine" not in proc.stderr + proc.stdout
