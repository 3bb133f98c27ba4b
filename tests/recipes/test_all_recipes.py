"""Every recipe as a user runs it, in the fast tier (`make test-fast`): each of the seven runs 2 steps end to end on the
embedded tiny model (held-out evaluation before and after, a checkpoint, the HF export, the plots; DPO and KTO also
report to TensorBoard and W&B; DPO and GRPO run with --bf16); every shipped config parses into its recipe's flags;
user mistakes end with one line and exit code 2, and a failed restart leaves what a run saved as it was. The slow
tier checks that they learn (one file per recipe beside this one)."""

import json
import math
import os
import shutil

import pytest
from helpers import REPO, metrics, recipe_args, recipe_cmd, run

from verl_kit.config import parse

RECIPES = ["sft.py", "reward_model.py", "dpo.py", "kto.py", "ppo.py", "grpo.py", "distill.py"]
SMOKE = ["--max_steps", "2", "--logging_steps", "1", "--eval_steps", "2", "--save_steps", "2"]
ONLINE = ["--prompts_per_step", "8", "--dataset_test_split", "test[:8]"]
OFFLINE = ["--dataset_test_split", "test[:16]"]
BF16 = ["--bf16", "true"]  # DPO and GRPO run in bf16 on CPU (docs/gpu.md), the others in fp32
EXTRA = {"sft.py": OFFLINE, "reward_model.py": OFFLINE,
         "dpo.py": [*OFFLINE, "--report_to", "tensorboard,wandb", *BF16,
                    "--chat_template_kwargs", '{"enable_thinking": false}'],
         "kto.py": [*OFFLINE, "--report_to", "wandb"], "ppo.py": ONLINE, "grpo.py": [*ONLINE, *BF16],
         # teacher = student (teacher_kl 0): the task reward, mixed into the advantage, is what trains it here
         "distill.py": [*ONLINE, "--teacher_model_name_or_path", "tiny-llama", "--num_generations", "2",
                        "--task_reward_coef", "0.5"]}


XDIST_UNIT = "test"  # the one module fixture, `smoke`, is a recipe's run shared by at most two tests


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One 2-step run per recipe, made when a test first asks for it: recipe -> (output_dir, wandb dir, stderr)."""
    done = {}

    def get(recipe):
        if recipe not in done:
            root = tmp_path_factory.mktemp(recipe.removesuffix(".py"))
            out = root / "run"
            p = run(recipe_cmd(recipe, ["--output_dir", str(out), *SMOKE, *EXTRA[recipe]]), timeout=300,
                    WANDB_DIR=str(root))
            done[recipe] = out, root, p.stderr
        return done[recipe]

    return get


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_steps_end_to_end(recipe, smoke):
    out, root, stderr = smoke(recipe)
    rows = metrics(out)
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update(r)
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    assert sorted(by_step) == [0, 1, 2], sorted(by_step)
    assert any(k.startswith("eval/") for k in by_step[0]) and any(k.startswith("eval/") for k in by_step[2])
    trained = {"ppo.py": "reward/mean", "grpo.py": "reward/mean", "distill.py": "teacher_kl"}.get(recipe, "loss")
    assert trained in by_step[1] and trained in by_step[2], by_step
    if recipe in ("ppo.py", "grpo.py"):  # no reward call timed out or raised (none was scored by a fallback)
        assert by_step[2]["reward/timeouts"] == 0 and by_step[2]["reward/errors"] == 0, by_step[2]
    assert sorted(os.listdir(out / "checkpoint-2"))  # the checkpoint, written atomically
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "config.json").is_file()
    assert (out / "final" / "tokenizer_config.json").is_file()
    assert (out / "curves.png").stat().st_size > 1000
    assert "step 2: " in stderr  # the INFO line
    # the memory plan, made before any weight was loaded, next to the measured peak (train.memory_plan)
    plan, peak = by_step[0]["memory/plan_total_gib"], by_step[2]["perf/peak_rss_gib"]
    assert "memory plan per training process" in stderr and abs(plan - peak) <= 0.25 * peak, (recipe, plan, peak)
    if recipe == "dpo.py":  # two trackers at once
        assert list(out.glob("**/events.out.tfevents.*")), sorted(p.name for p in out.rglob("*"))
    if recipe in ("dpo.py", "kto.py"):
        assert list(root.glob("wandb/offline-run-*")), sorted(p.name for p in root.rglob("*"))


def test_failed_restart_damages_nothing_saved(smoke, tmp_path):
    """A restart that fails on bad data must leave the checkpoints, metrics and export as they were."""
    out = tmp_path / "run"
    shutil.copytree(smoke("dpo.py")[0], out)
    snapshot = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    listing = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "chosen": "", "rejected": "c"}\n')
    p = run(recipe_cmd("dpo.py", ["--output_dir", str(out), "--dataset_name", str(data), *SMOKE,
                                  "--resume_from_checkpoint", "auto"]), check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == snapshot
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == listing


def test_resume_refuses_other_data_or_maths(smoke, tmp_path):
    """Resuming SFT's checkpoint-2 on an edited copy of its data (one reply changed) with another --learning_rate is
    refused in one line naming both changes and the override, before the checkpoint loads."""
    from verl_kit.data import TINY_SFT

    out = tmp_path / "run"
    shutil.copytree(smoke("sft.py")[0], out)
    data = tmp_path / "data"
    shutil.copytree(TINY_SFT, data)
    rows = (data / "train.jsonl").read_text().splitlines()
    rows[3] = rows[3].replace('."}]}', ' indeed."}]}')
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    p = run(recipe_cmd("sft.py", ["--output_dir", str(out), *SMOKE, *EXTRA["sft.py"], "--dataset_name", str(data),
                                  "--learning_rate", "1e-3", "--resume_from_checkpoint", "auto"]), check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith(f"error: --resume_from_checkpoint {out / 'checkpoint-2'}: changed "
                                                 "since the checkpoint: the training data ("), p.stderr[-2000:]
    assert "--learning_rate 0.0005 -> 0.001" in last and last.endswith("(resume anyway with --resume_ignore_changes)")


# ---- configs --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "recipes" / "configs").glob("*.yaml")))
def test_shipped_configs_parse(config):
    """Every shipped yaml names only known flags of its recipe (dpo_*.yaml -> dpo.py, reward_model_*.yaml ->
    reward_model.py, ...) with valid types and choices, and its lengths and flags pass every check of its roles."""
    recipe = max((r.name for r in (REPO / "recipes").glob("*.py") if config.startswith(r.stem + "_")), key=len)
    parse(["--config", str(REPO / "recipes" / "configs" / config)], **recipe_args(recipe))


# ---- user mistakes, as a user meets them: one line on stderr, exit code 2, no traceback ----------------------------


def bad_prefs(tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n')
    return str(data), f"error: {data} row 2: missing field 'rejected'"


def bad_margin(tmp_path):
    from verl_kit.models import TINY_PREFS

    rows = [json.loads(line) for line in open(f"{TINY_PREFS}/test.jsonl")][:4]
    data = tmp_path / "margins.jsonl"
    data.write_text("".join(json.dumps({**r, "margin": None if i == 2 else 1.0}) + "\n" for i, r in enumerate(rows)))
    return str(data), f"error: {data} row 3: field 'margin' must be a finite number, got None"


def bad_chat(tmp_path):
    data = tmp_path / "chat.jsonl"
    user, reply = {"role": "user", "content": "Tell me about the sea."}, {"role": "assistant", "content": "Calm."}
    data.write_text(json.dumps({"messages": [user, reply]}) + "\n" + json.dumps({"messages": [user]}) + "\n")
    return str(data), (f"error: {data} row 2: field 'messages' has no assistant turn to learn from (or pass "
                       "--assistant_only_loss false to learn the whole conversation)")


def other_tokenizer(tmp_path):
    """The tiny model with one token added to its tokenizer: a teacher the student cannot be distilled from."""
    from verl_kit.models import load_tokenizer, resolve_model_path

    teacher = tmp_path / "teacher"
    shutil.copytree(resolve_model_path("tiny-llama"), teacher)
    tok = load_tokenizer(str(teacher))
    tok.add_tokens(["zqxj"])
    tok.save_pretrained(str(teacher))
    return str(teacher), (f"error: --teacher_model_name_or_path {teacher}: the teacher's tokenizer is not the "
                          "student's: the vocabularies differ")


def unwritable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    return str(blocker / "sub"), f"error: --output_dir {blocker / 'sub'}: not writable"


# (recipe, flag, value or a function of tmp_path -> (value, the expected last line), the expected start of it)
ERRORS = [
    ("dpo.py", "--beta_typo", "0.2", "error: unknown flag(s) --beta_typo"),
    ("dpo.py", "--model_name_or_path", "/nonexistent/model",
     "error: --model_name_or_path /nonexistent/model: no such directory"),
    ("dpo.py", "--model_name_or_path", "nobody/no-such-model", "error: --model_name_or_path nobody/no-such-model: "
                                                               "not found"),
    ("dpo.py", "--dataset_name", "/nonexistent/data.jsonl", "error: --dataset_name /nonexistent/data.jsonl: no such "
                                                            "file"),
    ("dpo.py", "--dataset_name", bad_prefs, None),  # the reward model's loader too (verl_kit.data.preference_examples)
    ("reward_model.py", "--dataset_name", bad_margin, None),
    ("sft.py", "--dataset_name", bad_chat, None),
    ("dpo.py", "--output_dir", unwritable, None),
    ("grpo.py", "--num_generations", "1", "error: --num_generations 1: GRPO compares responses within a group"),
    ("ppo.py", "--reward_fn", "verl_kit.rewards:nope", "error: --reward_fn 'verl_kit.rewards:nope'"),
    ("distill.py", "--teacher_model_name_or_path", other_tokenizer, None),
]


@pytest.mark.parametrize("recipe, flag, value, expected", ERRORS,
                         ids=[f"{r.removesuffix('.py')}{f}-{v if isinstance(v, str) else v.__name__}"
                              for r, f, v, _ in ERRORS])
def test_user_errors_are_one_line(recipe, flag, value, expected, tmp_path):
    if callable(value):
        value, expected = value(tmp_path)
    args = ["--output_dir", str(tmp_path / "o"), "--max_steps", "1", flag, value]
    p = run(recipe_cmd(recipe, args), timeout=120, check=False)
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(expected), p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    if flag == "--output_dir":
        assert (tmp_path / "file").read_text() == "x"  # nothing written through the blocking file
