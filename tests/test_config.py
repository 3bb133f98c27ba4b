"""Config parsing: yaml + CLI (CLI wins), HF/TRL flag names, and one-line errors for every mistake."""


import pytest

from verl_kit.config import TrainConfig, parse_args
from verl_kit.errors import UserError


def test_defaults_and_cli():
    cfg = parse_args(TrainConfig, ["--learning_rate", "1e-3", "--packing", "false", "--max_steps", "7"])
    assert cfg.learning_rate == 1e-3 and cfg.packing is False and cfg.max_steps == 7
    assert cfg.model_name_or_path == "tiny-llama"


def test_yaml_then_cli_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.002\nper_device_train_batch_size: 3\ndataset_test_split: none\n")
    cfg = parse_args(TrainConfig, ["--config", str(path), "--per_device_train_batch_size", "5"])
    assert cfg.learning_rate == 0.002  # from yaml
    assert cfg.per_device_train_batch_size == 5  # CLI wins
    assert cfg.dataset_test_split is None


@pytest.mark.parametrize("argv, expected", [
    (["--learning_rat", "1e-3"], "unknown flag.* --learning_rat "),
    (["--lerning_rate", "1e-3"], "unknown flag.* --lerning_rate "),
    (["--learning_rate", "fast"], "--learning_rate.*invalid float value: 'fast'"),
    (["--report_to", "wandb,mlfow"], "--report_to: 'wandb,mlfow': expected none, all, or a comma-separated list of "
                                     "aim, clearml, comet_ml, dvclive, mlflow, swanlab, tensorboard, trackio, wandb"),
    (["--report_to", "all,wandb"], "--report_to: 'all,wandb': expected none, all"),
    (["--per_device_train_batch_size", "0"], "--per_device_train_batch_size: must be >= 1"),
    (["--max_prompt_length", "600", "--max_length", "512"], "--max_prompt_length"),
    (["--bf16", "maybe"], "--bf16"),
])
def test_cli_errors_name_the_flag(argv, expected):
    with pytest.raises(UserError, match=expected):
        parse_args(TrainConfig, argv)


def test_report_to_names_every_accelerate_tracker_and_refuses_a_missing_one():
    """--report_to takes accelerate's trackers under TRL's names; one that is not installed stops the run in one line
    (accelerate alone drops it silently); `all` is every installed one."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    from verl_kit.config import TRACKERS
    from verl_kit.train.accelerator import trackers

    assert sorted(TRACKERS) == sorted(LOGGER_TYPE_TO_CLASS)
    installed = sorted(str(t.value) for t in get_available_trackers())
    assert sorted(trackers(parse_args(TrainConfig, ["--report_to", "all"]))) == installed
    assert trackers(parse_args(TrainConfig, ["--report_to", "none"])) == []
    missing = next(t for t in TRACKERS if t not in installed)
    with pytest.raises(UserError, match=f"--report_to tensorboard,{missing}: {missing} not installed .*installed: "):
        trackers(parse_args(TrainConfig, ["--report_to", f"tensorboard,{missing}"]))


def test_yaml_errors_name_the_key(tmp_path):
    bad_key = tmp_path / "k.yaml"
    bad_key.write_text("learning_rate: 0.1\nlerning_rate: 0.2\n")
    with pytest.raises(UserError, match="unknown key.*lerning_rate"):
        parse_args(TrainConfig, ["--config", str(bad_key)])
    bad_type = tmp_path / "t.yaml"
    bad_type.write_text("learning_rate: fast\n")
    with pytest.raises(UserError, match="--learning_rate.*invalid float value: 'fast'"):
        parse_args(TrainConfig, ["--config", str(bad_type)])
    with pytest.raises(UserError, match="--config: no such file"):
        parse_args(TrainConfig, ["--config", str(tmp_path / "missing.yaml")])


def test_recipes_are_not_importable(monkeypatch):
    from helpers import REPO

    monkeypatch.syspath_prepend(str(REPO))
    with pytest.raises(ImportError, match="not a package"):
        import recipes  # noqa: F401


def test_kit_functions_take_the_role_they_read(tmp_path):
    """TrainConfig is the union of TRL-style roles (ModelConfig, DataConfig, BatchConfig, OptimConfig, OutputConfig):
    every flag in exactly one, and a kit function that takes a role runs on that role alone (load_splits a DataConfig,
    micro_batches a BatchConfig, check_output_dir an OutputConfig, Trainable an OptimConfig). Each role checks
    itself."""
    import dataclasses

    import torch

    from verl_kit import config, data, train
    from verl_kit.errors import UserError

    roles = (config.ModelConfig, config.DataConfig, config.BatchConfig, config.OptimConfig, config.OutputConfig)
    names = [f.name for r in roles for f in dataclasses.fields(r)]
    assert len(set(names)) == len(names) and set(names) == {f.name for f in dataclasses.fields(config.TrainConfig)}
    train_split, test_split = data.load_splits(config.DataConfig())
    assert len(train_split) > 0 and len(test_split) > 0
    assert train.micro_batches(config.BatchConfig(per_device_train_batch_size=2), list("abcde"), [1] * 5) == [
        ["a", "b"], ["c", "d"], ["e"]]
    train.check_output_dir(config.OutputConfig(output_dir=str(tmp_path / "out")))
    t = train.Trainable(train.Accelerator(cpu=True), torch.nn.Linear(2, 1), config.OptimConfig(max_grad_norm=0.5),
                        learning_rate=0.1, total_steps=10)
    assert t.learning_rate == 0.1 and t.max_grad_norm == 0.5 and t.sharding.name == "none"
    with pytest.raises(UserError, match="--max_prompt_length"):
        config.DataConfig(max_prompt_length=600)
    with pytest.raises(UserError, match="--lora_r is a LoRA flag"):
        config.ModelConfig(lora_r=8)
