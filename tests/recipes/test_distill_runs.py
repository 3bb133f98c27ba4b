"""recipes/distill.py in the slow tier: the student learning from an SFT teacher, self-distillation learning what
its privileged context teaches, and ZeRO-3 x2 against one process with kill -9 / resume. (The losses by hand:
tests/algos/test_distill_losses.py; the teacher/student tokenizer check: tests/models/test_loading.py.)"""

import json
import math

import pytest
import torch
from helpers import assert_resume_bit_identical, launch_cmd, metrics, numbers, recipe_cmd, run

from verl_kit.models import load_tokenizer


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """The tiny model after 60 steps of the SFT recipe on its embedded task (held-out SFT loss 6.5 -> 2.1): a teacher
    that knows the task's replies, still far from sharp."""
    out = tmp_path_factory.mktemp("teacher") / "sft"
    run(recipe_cmd("sft.py", ["--config", "recipes/configs/sft_tiny.yaml", "--output_dir", str(out), "--max_steps",
                              "60", "--dataset_test_split", "none", "--logging_steps", "60"]), timeout=300)
    return str(out / "final")


def sft_held_out_loss(model_path: str, n: int = 64) -> float:
    """Token-mean NLL of the assistant replies of the SFT task's first `n` held-out conversations."""
    from transformers import AutoModelForCausalLM

    from verl_kit.data import TINY_SFT, sft_examples

    with open(f"{TINY_SFT}/test.jsonl") as f:
        rows = [json.loads(line) for line in f][:n]
    examples = sft_examples(rows, load_tokenizer(model_path), 64, 128, "tiny_sft[test]")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    nll = tokens = 0.0
    with torch.no_grad():
        for e in examples:
            ids, learned = torch.tensor([e.input_ids]), torch.tensor(e.loss_mask[1:])
            logps = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            nll, tokens = nll - float(logps[learned].sum()), tokens + float(learned.sum())
    return nll / tokens


@pytest.mark.slow
def test_student_learns_from_sft_teacher(teacher, tiny_model_path, tmp_path):
    """Student = the fresh tiny model, default loss (reverse-KL advantages, clipped policy loss), 12 steps: the
    held-out per-token reverse KL to the teacher falls by at least half, and the student's held-out SFT loss (the
    task it never saw as data) falls."""
    out = tmp_path / "run"
    run(recipe_cmd("distill.py", ["--config", "recipes/configs/distill_tiny.yaml", "--teacher_model_name_or_path",
                                  teacher, "--output_dir", str(out), "--max_steps", "12"]), timeout=420)
    rows = metrics(out)
    held_out = [(r["step"], r["eval/teacher_kl"]) for r in rows if "eval/teacher_kl" in r]
    train_kl = [r["teacher_kl"] for r in rows if "teacher_kl" in r]
    before, after = sft_held_out_loss(tiny_model_path), sft_held_out_loss(str(out / "final"))
    print(f"held-out teacher_kl {held_out}; teacher_kl {[round(x, 3) for x in train_kl]}; "
          f"SFT held-out loss {before:.3f} -> {after:.3f}")
    assert held_out[0][0] == 0 and held_out[-1][0] == 12
    assert held_out[-1][1] <= 0.5 * held_out[0][1], held_out
    assert train_kl[-1] < train_kl[0], train_kl
    assert after < before - 0.5, (before, after)
    for key in ["teacher_kl", "actor/loss", "actor/entropy", "grad_norm", "eval/reward_mean", "timing_s/teacher"]:
        assert key in rows[-1], key
    with open(out / "samples.jsonl") as f:
        sample = json.loads(f.readline())
    assert math.isfinite(sample["teacher_kl"]) and len(sample["disputed"]) == 3, sample


KIND, RUDE = "Reply kindly.", "Reply dismissively."


@pytest.fixture(scope="module")
def instructed(tmp_path_factory):
    """The tiny model after 120 SFT steps on the tone task's pairs where the user's message ends in an instruction
    (KIND -> the kind reply, RUDE -> the dismissive one) or has none (either, at random): it follows the
    instruction (held-out kind_reply, sampled: 0.57 with KIND, 0.01 with RUDE, 0.14 without). And the prompts of the
    self-distillation run, each with KIND as its privileged_context. -> (model, prompts directory)."""
    import random

    from verl_kit.models import TINY_PREFS

    root, rng = tmp_path_factory.mktemp("instructed"), random.Random(0)
    (root / "sft").mkdir()
    (root / "prompts").mkdir()
    with open(f"{TINY_PREFS}/train.jsonl") as f, open(root / "sft" / "train.jsonl", "w") as out:
        for row in map(json.loads, f):
            q, good, bad = (row[k][-1]["content"] for k in ("prompt", "chosen", "rejected"))
            for user, reply in ((f"{q}\n\n{KIND}", good), (f"{q}\n\n{RUDE}", bad), (q, rng.choice([good, bad]))):
                out.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                   {"role": "assistant", "content": reply}]}) + "\n")
    for split in ("train", "test"):
        with open(f"{TINY_PREFS}/{split}.jsonl") as f, open(root / "prompts" / f"{split}.jsonl", "w") as out:
            for row in map(json.loads, f):
                out.write(json.dumps({"prompt": row["prompt"], "privileged_context": KIND}) + "\n")
    run(recipe_cmd("sft.py", ["--config", "recipes/configs/sft_tiny.yaml", "--dataset_name", str(root / "sft"),
                              "--output_dir", str(root / "model"), "--max_steps", "120", "--learning_rate", "0.003",
                              "--per_device_train_batch_size", "16", "--packing_length", "1024",
                              "--dataset_test_split", "none", "--logging_steps", "120", "--save_steps", "1000"]),
        timeout=420)
    return str(root / "model" / "final"), str(root / "prompts")


@pytest.mark.slow
def test_self_distillation_learns_what_the_context_teaches(instructed, tmp_path):
    """--teacher_model_kind base: the teacher is the student's initial weights reading each prompt with KIND after
    it; the student never sees KIND. 8 steps: the held-out reverse KL to that teacher falls by more than half and
    the student's held-out kind_reply, without the instruction, rises toward the teacher's (measured 0.23 -> 0.45)."""
    model, prompts = instructed
    out = tmp_path / "run"
    run(recipe_cmd("distill.py", ["--config", "recipes/configs/distill_tiny.yaml", "--model_name_or_path", model,
                                  "--teacher_model_name_or_path", "", "--teacher_model_kind", "base",
                                  "--dataset_name", prompts, "--output_dir", str(out), "--max_steps", "8",
                                  "--eval_steps", "8", "--learning_rate", "0.0005"]), timeout=420)
    held_out = {r["step"]: r for r in metrics(out) if "eval/teacher_kl" in r}
    print({s: (round(r["eval/reward_mean"], 3), round(r["eval/teacher_kl"], 4)) for s, r in held_out.items()})
    assert sorted(held_out) == [0, 8]
    assert held_out[8]["eval/teacher_kl"] < 0.5 * held_out[0]["eval/teacher_kl"], held_out
    assert held_out[8]["eval/reward_mean"] > held_out[0]["eval/reward_mean"] + 0.12, held_out


def _args(out, teacher, *extra):
    """4 steps of the generalized JSD (beta 0.5) on a LoRA student, checkpoint at 2; top_k 1 makes the samples
    greedy, so one process and two draw the same responses."""
    return ["--config", "recipes/configs/distill_tiny.yaml", "--teacher_model_name_or_path", teacher,
            "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2", "--logging_steps", "1",
            "--eval_steps", "2", "--prompts_per_step", "8", "--dataset_test_split", "test[:8]", "--loss_type", "jsd",
            "--beta", "0.5", "--use_peft", "--lora_target_modules", "q_proj,v_proj,lm_head", "--lora_dropout", "0",
            "--top_k", "1", *extra]


@pytest.mark.slow
def test_jsd_lora_resume_bit_identical_and_sharded_equals_one_process(teacher, tmp_path):
    """One process, --loss_type jsd, LoRA student: run B, SIGKILLed once checkpoint-2 is complete and resumed, ends
    with the same adapter as run A bit for bit. Then 2 processes under ZeRO-3 (student engine, sharded teacher) and
    under FSDP2 (student and teacher fully_shard-ed) give A's held-out and step metrics (same greedy samples; sums
    in another order)."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert_resume_bit_identical(lambda out, *x: recipe_cmd("distill.py", _args(out, teacher, *x)), a, b, 2,
                                weights="adapter_model.safetensors", compare_steps=(3, 4))
    for config in ("zero3.yaml", "fsdp2.yaml"):
        z = tmp_path / config.removesuffix(".yaml")
        run(launch_cmd(config, 2, "distill.py", _args(z, teacher)), timeout=420)
        one, two = numbers(a), numbers(z)
        for step, keys in ((0, ["eval/teacher_kl"]), (1, ["teacher_kl", "actor/loss", "actor/entropy"]),
                           (2, ["teacher_kl", "actor/loss", "eval/teacher_kl"])):
            for k in keys:
                assert two[step][k] == pytest.approx(one[step][k], rel=1e-3), (config, step, k, one[step][k],
                                                                               two[step][k])
    assert one[2]["teacher_kl"] != one[1]["teacher_kl"]  # the update changed the student
