"""The packaged real model, `--model_name_or_path smollm2-135m` (SmolLM2-135M-Instruct): converted offline from the
GGUF `make install` fetched, reloaded with tied embeddings, answering a question; its pad token IS its EOS token, so
nothing may take a real EOS for padding (rollout masks, DPO data and scoring); DPO under ZeRO-3 exports it tied.
Run them with `pytest -m real_model`."""

import json
import math
import time

import pytest
import torch
from helpers import launch_cmd, metrics, run

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM

    from verl_kit.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, load_tokenizer(smollm2_path)


def _prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_converted_directory(smollm2_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    config = json.load(open(f"{smollm2_path}/config.json"))
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (config["head_dim"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (64, 3, True)
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id
    assert config["eos_token_id"] == config["pad_token_id"] == tok.eos_token_id
    generation = json.load(open(f"{smollm2_path}/generation_config.json"))
    assert generation["eos_token_id"] == generation["pad_token_id"] == tok.eos_token_id
    assert tok.chat_template and "<|im_start|>assistant\n" in tok.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True)
    with safe_open(f"{smollm2_path}/model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert str(f.get_slice("model.embed_tokens.weight").get_dtype()) == "F32"
    assert "lm_head.weight" not in keys and len(keys) == 272


def test_reloads_tied_and_answers_greedily(smollm2):
    model, tok = smollm2
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = torch.tensor([_prompt_ids(tok, QUESTION)])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    response = out[0, ids.shape[1]:].tolist()
    assert response[-1] == tok.eos_token_id, tok.decode(response)
    assert tok.decode(response, skip_special_tokens=True) == ANSWER


def test_rollout_keeps_the_eos_that_is_also_pad(smollm2):
    """HFGenerateBackend, greedy (top_k=1), two prompts of different lengths: left padding and the fill after an
    early EOS are both the EOS id. The short answer's EOS must be in response_mask, the fill after it must not, and
    the padded batch must generate what the prompt alone does."""
    from verl_kit.rollout import HFGenerateBackend, SamplingParams

    model, tok = smollm2
    eos = tok.eos_token_id
    backend = HFGenerateBackend(model, tok, "cpu", torch.float32)
    params = SamplingParams(top_k=1, max_new_tokens=14)
    france = _prompt_ids(tok, QUESTION)
    other = _prompt_ids(tok, [{"role": "user", "content": "Write a long poem about the sea, the wind and the sky."}])
    assert len(other) > len(france) and france.count(eos) == 2  # the prompt itself holds EOS (=pad) tokens
    alone = backend.generate([france], params)
    ro = backend.generate([france, other], params)
    n = int(ro.response_mask[0].sum())
    assert ro.response_ids[0, n - 1] == eos and not ro.truncated[0]
    assert tok.decode(ro.response_ids[0, :n], skip_special_tokens=True) == ANSWER
    assert ro.response_mask[0, :n].all() and not ro.response_mask[0, n:].any()
    assert ro.response_ids.shape[1] > n  # the other row went on: row 0 has fill after its EOS
    assert (ro.response_ids[0, n:] == tok.pad_token_id).all()
    assert ro.truncated[1] and ro.response_mask[1].all()
    assert torch.equal(alone.response_ids[0], ro.response_ids[0, :n]) and alone.response_mask.all()
    # the sampling log-probs are kept on the EOS (top_k=1: log 1 = 0) and zeroed outside the mask
    assert (ro.sampling_logprobs[0] == 0).all()


def test_dpo_data_scores_the_eos(smollm2):
    """preference_examples + scoring on a standard and a conversational pair: the EOS closing each completion is
    in the completion ids and scored; padding with the same id (padded layout) is not."""
    from verl_kit.data import layout, preference_examples
    from verl_kit.train import completion_sequences, sequence_logprobs

    model, tok = smollm2
    eos = tok.eos_token_id
    rows = [{"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon, I think, or maybe Nice."},
            {"prompt": QUESTION, "chosen": [{"role": "assistant", "content": ANSWER}],
             "rejected": [{"role": "assistant", "content": "I don't know."}]}]
    exs = preference_examples(rows, tok, None, 128, "test")
    assert exs[0].chosen_ids[-1] == eos and exs[0].rejected_ids[-1] == eos  # standard: EOS appended
    assert exs[1].chosen_ids[-2:] == [eos] + tok("\n", add_special_tokens=False)["input_ids"]  # ChatML: "<|im_end|>\n"
    items = [completion_sequences(e.prompt_ids, [e.chosen_ids, e.rejected_ids]) for e in exs]
    seqs = [s for it in items for s in it[0]]
    masks = [m for it in items for m in it[1]]
    expected = []
    with torch.no_grad():
        for s, m in zip(seqs, masks):  # one sequence at a time, no padding: every completion token, EOS included
            logp = model(input_ids=torch.tensor([s])).logits[0, :-1].float().log_softmax(-1)
            picked = logp.gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1)
            expected.append(picked[torch.tensor(m[1:])].sum())
            eos_at = [i for i in range(1, len(s)) if m[i] and s[i] == eos]
            assert eos_at and all(picked[i - 1] < 0 for i in eos_at)
        expected = torch.stack(expected)
        for packing in (True, False):
            batch = layout(seqs, masks, tok.pad_token_id, packing=packing)
            assert batch.num_tokens == sum(map(len, seqs))
            assert int(batch.loss_mask.sum()) == sum(sum(m) for m in masks)
            got = sequence_logprobs(model, batch)
            torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-4)


def test_missing_gguf_is_a_one_line_user_error(tmp_path, monkeypatch):
    from verl_kit.errors import UserError
    from verl_kit.models import resolve_model_path

    monkeypatch.setenv("VERL_KIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VERL_KIT_SMOLLM2_GGUF", str(tmp_path / "nothing.gguf"))
    with pytest.raises(UserError, match="run `make install`") as e:
        resolve_model_path("smollm2-135m")
    assert "\n" not in str(e.value)


def test_dpo_sharded_two_processes_exports_tied(smollm2_path, tmp_path, config="zero3.yaml"):
    """SmolLM2 (tied embeddings) under ZeRO-3 x2: the exported model is tied, trained, and loads. (FSDP2's export
    of the tied model, gathered from DTensor shards: tests/models/test_lora.py and tests/recipes/test_grpo_runs.py on
    the tied tiny model.)"""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    t0 = time.time()
    run(launch_cmd(config, 2, "dpo.py", [
        "--model_name_or_path", "smollm2-135m", "--output_dir", str(out), "--per_device_train_batch_size", "2",
        "--max_steps", "2", "--logging_steps", "1", "--dataset_train_split", "train[:8]", "--dataset_test_split",
        "none", "--max_length", "128", "--max_prompt_length", "96", "--gradient_checkpointing", "false"]),
        timeout=420)
    rows = [r for r in metrics(out) if "loss" in r]
    print(f"dpo run {time.time() - t0:.1f}s, step_time_s {[round(r['timing_s/step'], 2) for r in rows]}")
    assert [r["step"] for r in rows] == [1, 2]
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-4, rows[0]  # policy == reference before the first update
    assert math.isfinite(rows[1]["loss"]) and rows[1]["loss"] != rows[0]["loss"]

    final = out / "final"
    with safe_open(str(final / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        if "lm_head.weight" in keys:
            assert torch.equal(f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight"))
    assert json.load(open(final / "config.json"))["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(f"{smollm2_path}/model.safetensors", "pt") as f:
        before = f.get_tensor("model.embed_tokens.weight")
    assert not torch.equal(before, model.model.embed_tokens.weight)  # trained, and the export holds it


ARITH_CONFIG = "recipes/configs/grpo_arith.yaml"


def test_arith_task_data_rewards_and_two_grpo_steps(smollm2_path, tmp_path):
    """The RLVR task for the real model (verl_kit.data.tasks arith, recipes/configs/grpo_arith.yaml): the shipped data
    is what `python -m verl_kit.data arith` writes (fixed seed), loads as chat prompts with a string `answer`
    column, and holds out problems the train split never shows; through Rewards with the `answer` column math_answer
    scores a right and a wrong reference completion 1/0, and so does the config's final_number, which also refuses the
    bare restated question that math_answer credits; a 2-step GRPO run with the config completes and logs
    eval/reward_mean (no learning asserted here: at the config's 8 x 8 responses per step that takes ~5 steps)."""
    from helpers import recipe_cmd

    from verl_kit.data import ARITH, load_prompts, load_split, write_arith
    from verl_kit.models import load_tokenizer
    from verl_kit.rewards import Rewards, reward_columns

    write_arith(str(tmp_path / "arith"))
    for split in ("train", "test"):
        assert (tmp_path / "arith" / f"{split}.jsonl").read_bytes() == open(f"{ARITH}/{split}.jsonl", "rb").read()
    train, test = list(load_split(ARITH, "train")), list(load_split(ARITH, "test"))
    assert (len(train), len(test)) == (3000, 128)
    assert set(train[0]) == set(test[0]) == {"prompt", "answer"} and isinstance(test[0]["answer"], str)
    question = lambda row: row["prompt"][-1]["content"]
    assert not {question(r) for r in train} & {question(r) for r in test}
    tok = load_tokenizer(smollm2_path)
    ids = load_prompts(test[:2], tok, 96, "arith[test]")
    assert tok.decode(ids[0]).endswith(question(test[0]) + "<|im_end|>\n<|im_start|>assistant\n")

    row = test[0]
    a, b = (int(x) for x in question(row).split("?")[0].removeprefix("What is ").split(" + "))
    assert int(row["answer"]) == a + b
    completions = [f"{a} + {b} = {a + b}.", f"{a} + {b} = {a + b + 1}.", f"{a} + {b}"]
    rows = [row] * len(completions)
    truncated = torch.zeros(len(completions), dtype=torch.bool)
    for spec, want in (("verl_kit.rewards:math_answer", [1.0, 0.0, 1.0]),  # the echo: math-verify evaluates a + b
                       ("verl_kit.rewards:final_number", [1.0, 0.0, 0.0])):
        rewards = Rewards(spec, None, None)
        got = rewards.total(rewards.sources([r["prompt"] for r in rows], completions, reward_columns(rows)), truncated)
        assert got.tolist() == want, spec

    out = tmp_path / "run"
    t0 = time.time()
    run(recipe_cmd("grpo.py", ["--config", ARITH_CONFIG, "--output_dir", str(out), "--max_steps", "2",
                               "--prompts_per_step", "2", "--num_generations", "4", "--dataset_test_split", "test[:8]",
                               "--rollout", "hf", "--logging_steps", "1"]), timeout=300)
    rows = metrics(out)
    print(f"grpo arith 2 steps {time.time() - t0:.1f}s: {[(r['step'], r.get('eval/reward_mean')) for r in rows]}")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2]
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]  # before the first update and at the end
    assert all(0.0 <= r["eval/reward_mean"] <= 1.0 and r["eval/response_length"] > 0 for r in evals), evals
    assert (out / "final" / "model.safetensors").is_file()
