"""verl_kit.train.checkpoint: the run fingerprint a resume checks (the training rows' hash and the maths flags), its
one-line refusal and --resume_ignore_changes. (A refused resume as a user meets it:
tests/recipes/test_all_recipes.py.)"""

import os
import shutil

import pytest
from helpers import recipe_args

from verl_kit.config import parse
from verl_kit.errors import UserError


def test_resume_changes_and_the_override(tmp_path):
    """run_fingerprint: the train split's rows hash (the same rows under another file name hash the same, an edited
    row does not) and the maths flags, not the free ones (--output_dir, --logging_steps). check_run refuses a change
    in one line, warns and goes on with --resume_ignore_changes, ignores a flag the checkpoint did not record (added
    to the kit since) and a checkpoint saved before fingerprints."""
    from verl_kit.data import TINY_SFT
    from verl_kit.train import check_run, run_fingerprint

    sft = recipe_args("sft.py")

    def fingerprint(argv):
        cfg = parse(argv, **sft)
        return run_fingerprint(cfg.train, cfg.resume_checked())

    for name in ("a.jsonl", "b.jsonl", "c.jsonl"):
        shutil.copy(f"{TINY_SFT}/train.jsonl", tmp_path / name)
    (tmp_path / "c.jsonl").write_text((tmp_path / "c.jsonl").read_text().replace("splendid", "fine", 1))
    fp = {n: fingerprint(["--dataset_name", str(tmp_path / f"{n}.jsonl")]) for n in "abc"}
    assert fp["a"]["data"] == fp["b"]["data"] != fp["c"]["data"]
    free = fingerprint(["--dataset_name", str(tmp_path / "a.jsonl"), "--output_dir", "x", "--logging_steps", "7"])
    assert check_run("ck", fp["a"], free, False) == []
    other = fingerprint(["--dataset_name", str(tmp_path / "c.jsonl"), "--seed", "1"])
    with pytest.raises(UserError) as e:
        check_run("ck", fp["a"], other, False)
    assert str(e.value).startswith(f"--resume_from_checkpoint ck: changed since the checkpoint: the training data "
                                   f"({tmp_path / 'a.jsonl'} train rows hash {fp['a']['data']} -> ")
    assert "; --seed 42 -> 1 (resume anyway with --resume_ignore_changes)" in str(e.value)
    assert len(check_run("ck", fp["a"], other, True)) == 2
    older = {**fp["a"], "flags": {k: v for k, v in fp["a"]["flags"].items() if k != "seed"}}
    assert check_run("ck", older, fingerprint(["--dataset_name", str(tmp_path / "a.jsonl"), "--seed", "1"]),
                     False) == []
    assert check_run("ck", None, other, False) == []


def test_resume_refuses_another_sharding():
    """The fingerprint records the sharding: a checkpoint written under ZeRO-3 or FSDP2 (files of their own) is refused
    under the other or without sharding, in one line; one process and DDP (accelerate's whole-model files), or two
    ZeRO stages, are not a change; a checkpoint saved before the sharding was recorded is not compared."""
    from verl_kit.train import run_changes, run_fingerprint

    cfg = parse([], **recipe_args("sft.py"))
    fp = {s: run_fingerprint(cfg.train, cfg.resume_checked(), s) for s in ("none", "ddp", "zero2", "zero3", "fsdp2")}
    assert run_changes(fp["zero3"], fp["fsdp2"]) == ["the sharding (zero3 -> fsdp2: the accelerate config; its model "
                                                     "and optimizer files do not load under the other)"]
    assert run_changes(fp["fsdp2"], fp["ddp"]) and run_changes(fp["none"], fp["fsdp2"])
    assert run_changes(fp["none"], fp["ddp"]) == run_changes(fp["zero2"], fp["zero3"]) == []
    older = {k: v for k, v in fp["zero3"].items() if k != "sharding"}
    assert run_changes(older, fp["fsdp2"]) == []


def test_resume_rules_are_declared_by_the_config_classes():
    """Whether a resume may change a flag is declared by its config class (config.RESUME, beside CHOICES), not in a
    list kept elsewhere: the checkpoint records exactly the "checked" flags (Args.resume_checked), the "model" ones
    are MODEL_FLAGS, a flag no class names is checked, and a rule for a field the class lacks is refused."""
    from dataclasses import dataclass, field
    from typing import ClassVar

    from verl_kit import config
    from verl_kit.train import MODEL_FLAGS, model_flags

    cfg = parse([], **recipe_args("grpo.py"))
    checked = cfg.resume_checked()
    assert {"learning_rate", "seed", "beta", "temperature", "num_generations", "reward_fn"} <= checked.keys()
    assert not {"output_dir", "logging_steps", "vllm_sync_timeout_s", "env_timeout_s", "reward_timeout_s",
                "packing", "model_name_or_path", "use_peft"} & checked.keys()
    assert MODEL_FLAGS == ("model_name_or_path", "use_peft", "lora_r", "lora_target_modules")
    assert model_flags(cfg.train) == {f: getattr(cfg.train, f) for f in MODEL_FLAGS}
    every = set(cfg.flags())
    free = {k for p in cfg.pieces.values() for k in config.flags_with_rule(p, "free")}
    assert every == set(checked) | free | set(MODEL_FLAGS) and not set(checked) & free

    @dataclass
    class Added(config.TrainConfig):  # a copied recipe's new flag: checked unless its class says otherwise
        my_knob: int = field(default=1, metadata={"help": "x"})

    assert config.resume_rules(Added)["my_knob"] == "checked" and config.resume_rules(Added)["output_dir"] == "free"

    @dataclass
    class Wrong(config.Config):
        RESUME: ClassVar[dict] = {"not_a_field": "free"}
        knob: int = field(default=1, metadata={"help": "x"})

    with pytest.raises(ValueError, match="Wrong.RESUME"):
        config.resume_rules(Wrong)


def test_a_kill_while_pruning_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    """Pruning an old checkpoint (--save_total_limit) is one rename, then the deletion: a kill during the deletion
    (here: the deletion raising after a first file is gone) leaves the checkpoint gone from the run's listing, never a
    checkpoint-N without its marker (a CI run's kill mid-prune left one behind that nothing removed), and the next
    prune sweeps the remains."""
    from verl_kit import durable
    from verl_kit.train import list_checkpoints

    for step in (5, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
        (tmp_path / f"checkpoint-{step}" / "model.bin").write_bytes(b"x" * 100)
    real = shutil.rmtree

    def killed(path, ignore_errors=False):
        if ".deleted-" in str(path) and os.path.isdir(path):
            os.unlink(os.path.join(path, "trainer_state.json"))
            raise KeyboardInterrupt  # the process dies here
        return real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(durable.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        durable.remove_dir(str(tmp_path / "checkpoint-5"))
    monkeypatch.setattr(durable.shutil, "rmtree", real)
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [10]
    assert sorted(os.listdir(tmp_path)) == [".deleted-checkpoint-5", "checkpoint-10"]
    durable.sweep_deleted(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-10"]
