"""Dataset mixtures (`datasets:` in a recipe config, TRL 1.16's DatasetMixtureConfig form; data.load_mixture): the
mixed rows equal TRL's own get_dataset's, each row names its dataset (data_source), the held-out split is the same
every run, bad entries are one line, a changed mixture refuses a resume, and a run logs each source's share of every
step (data/source_share/*, exactly the share of the step's prompts) and, online, its reward."""

from __future__ import annotations

import pytest
import yaml
from helpers import metrics, recipe_cmd, run, write_jsonl

from verl_kit.config import DataConfig, parse
from verl_kit.data import load_splits, train_fingerprint
from verl_kit.errors import UserError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _files(tmp_path):
    (tmp_path / "a").mkdir(exist_ok=True)
    (tmp_path / "b").mkdir(exist_ok=True)
    a = write_jsonl(tmp_path / "a" / "train.jsonl", [{"prompt": f"a{i} ", "answer": str(i), "x": 1} for i in range(10)])
    b = write_jsonl(tmp_path / "b" / "train.jsonl", [{"prompt": f"b{i} ", "answer": str(i), "y": 2} for i in range(30)])
    return a, b


def _cfg(tmp_path, entries, **extra) -> DataConfig:
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"datasets": entries, **extra}))
    return parse(["--config", str(path)], d=DataConfig).d


def test_mixture_rows_are_trls(tmp_path):
    """TRL's rule over 10 and 30 rows: fractions 1:3 give w = 1/4, 3/4 and N = min(10 / 0.25, 30 / 0.75) = 40, all 10
    of a and all 30 of b; 1:1 gives N = 20, the first 10 of each. The rows (without
    data_source) equal trl.scripts.utils.get_dataset's on the same entries (json builder, data_files), in order; the
    data_source names the dataset by its last two path parts (both files are train.jsonl). Without fractions, the
    whole datasets in order. test_split_size splits the same held-out rows off every time."""
    from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig, get_dataset

    a, b = _files(tmp_path)
    for fractions, sizes in (((1, 3), (10, 30)), ((1, 1), (10, 10)), ((None, None), (10, 30))):
        entries = [{"path": p, "columns": ["prompt", "answer"], **({"fraction": f} if f else {})}
                   for p, f in zip((a, b), fractions)]
        train, test = load_splits(_cfg(tmp_path, entries))
        trl = get_dataset(DatasetMixtureConfig(datasets=[
            DatasetConfig(path="json", data_files=p, columns=["prompt", "answer"], fraction=f)
            for p, f in zip((a, b), fractions)]))["train"]
        assert test is None and train.remove_columns("data_source").to_list() == trl.to_list(), fractions
        assert train["data_source"] == ["a/train"] * sizes[0] + ["b/train"] * sizes[1]
    cfg = _cfg(tmp_path, [{"path": a, "columns": ["prompt"]}, {"path": b, "columns": ["prompt"]}], test_split_size=8)
    (train, test), (_, test2) = load_splits(cfg), load_splits(cfg)
    assert len(test) == 8 and len(train) == 32 and test.to_list() == test2.to_list()
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    assert train_fingerprint(cfg) == train_fingerprint(_cfg(tmp_path, [{"path": a, "columns": ["prompt"]},
                                                                       {"path": b, "columns": ["prompt"]}],
                                                            test_split_size=8))
    assert train_fingerprint(cfg) != train_fingerprint(_cfg(tmp_path, [{"path": a, "columns": ["prompt"]}],
                                                            test_split_size=8))


@pytest.mark.parametrize("entries,extra,message", [
    ([{"path": "A", "fraction": 0.5}, {"path": "B"}], {}, "set `fraction` for every dataset of the mixture or for"),
    ([{"path": "A", "fraction": -1}], {}, "fractions must be positive numbers"),
    ([{"path": "A", "weight": 2}], {}, "datasets[0]: unknown key(s) weight"),
    ([{"split": "train"}], {}, "datasets[0]: `path` is required"),
    ([{"path": "A"}], {"test_split_size": 0}, "--test_split_size 0: a positive share or count"),
])
def test_bad_mixture_entries_are_one_line(tmp_path, entries, extra, message):
    with pytest.raises(UserError) as e:
        _cfg(tmp_path, entries, **extra)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_mixture_data_is_one_line(tmp_path):
    """A column an entry does not have, and datasets whose columns differ (a has x, b has y), name the entries."""
    a, b = _files(tmp_path)
    with pytest.raises(UserError, match=r"datasets\[1\] \(.*b/train.jsonl\): no column\(s\) z \(it has"):
        load_splits(_cfg(tmp_path, [{"path": a}, {"path": b, "columns": ["prompt", "z"]}]))
    with pytest.raises(UserError, match=r"datasets\[1\] .* has columns .*'y'.* but datasets\[0\] .* has .*'x'.*"
                                        "keep the same ones with `columns:`"):
        load_splits(_cfg(tmp_path, [{"path": a}, {"path": b}]))


def test_grpo_logs_each_sources_share_and_sft_refuses_a_changed_mixture(tmp_path):
    """GRPO (tiny, 2 steps) on a 3:1 mixture of the embedded arithmetic and calculator prompts logs
    data/source_share/<name> equal to the share of each dataset among the step's prompts (recomputed here from the
    seeded order, train.step_indices, over the mixture's train rows), and data/source_reward/<name> within [0, 1].
    SFT on a mixture logs the shares of its steps too, and its resume with another fraction is refused in one line
    naming the changed data."""
    from verl_kit.train import step_indices

    entries = [{"path": "verl_kit/assets/arith/train.jsonl", "columns": ["prompt", "answer"], "fraction": 0.75},
               {"path": "verl_kit/assets/calc/train.jsonl", "columns": ["prompt", "answer"], "fraction": 0.25}]
    config = tmp_path / "grpo.yaml"
    config.write_text(yaml.safe_dump({**yaml.safe_load(open("recipes/configs/grpo_tiny.yaml")), "datasets": entries,
                                      "test_split_size": 8}))
    out = tmp_path / "grpo"
    run(recipe_cmd("grpo.py", ["--config", str(config), "--output_dir", str(out), "--max_steps", "2",
                               "--logging_steps", "1"]))
    train, _ = load_splits(_cfg(tmp_path, entries, test_split_size=8))
    for row in [r for r in metrics(out) if "loss" in r or "reward/mean" in r]:
        idx = step_indices(len(train), row["step"] - 1, 16, 42, 0, 1)
        sources = [train[i]["data_source"] for i in idx]
        for name in ("arith/train", "calc/train"):
            assert row[f"data/source_share/{name}"] == sources.count(name) / len(idx), (row, name)
            assert 0 <= row.get(f"data/source_reward/{name}", 0) <= 1
        assert sources.count("calc/train") not in (0, len(idx))  # both sources sampled in each of the 2 steps

    sft = [{"path": "verl_kit/assets/tiny_sft/train.jsonl", "fraction": 0.5},
           {"path": "verl_kit/assets/tiny_sft/test.jsonl", "fraction": 0.5}]
    cmd = lambda entries, *extra: recipe_cmd("sft.py", [  # noqa: E731
        "--config", str(_write(tmp_path / "sft.yaml", entries)), "--output_dir", str(tmp_path / "sft"),
        "--max_steps", "2", "--save_steps", "1", "--logging_steps", "1", *extra])
    run(cmd(sft))
    shares = [r for r in metrics(tmp_path / "sft") if "loss" in r]
    assert all(r["data/source_share/train"] + r["data/source_share/test"] == 1 for r in shares)
    sft[0]["fraction"] = 0.25
    p = run(cmd(sft, "--resume_from_checkpoint", "auto", "--max_steps", "3"), check=False)
    assert p.returncode == 2 and "data" in p.stderr.strip().splitlines()[-1], p.stderr[-2000:]


def _write(path, entries):
    path.write_text(yaml.safe_dump({"datasets": entries, "test_split_size": 16}))
    return path
