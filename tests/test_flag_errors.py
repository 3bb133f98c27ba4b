"""Every flag mistake the config classes refuse, in one place: each case parses a recipe's ARGS as its main() does
(config.parse: each role's __post_init__, then the rules across roles) and expects one line naming the flag. How a
user meets them (exit code 2, one line on stderr, no traceback) is
tests/recipes/test_all_recipes.py::test_user_errors_are_one_line."""

import pytest
import torch
from helpers import recipe_args

from verl_kit.config import parse
from verl_kit.errors import UserError

CASES = [
    # DPO's loss flags (DPOConfig) and a training flag (OfflineConfig)
    ("dpo.py", ["--beta", "high"], "invalid float value: 'high'"),
    ("dpo.py", ["--loss_type", "hinge2"], "--loss_type: 'hinge2' is not one of sigmoid, hinge, ipo, robust, exo_pair,"),
    ("dpo.py", ["--loss_type", "sigmoid,sft2"], "--loss_type: 'sft2' is not one of sigmoid, hinge,"),
    ("dpo.py", ["--loss_type", "sigmoid,sft", "--loss_weights", "1"],
     "--loss_weights 1: 1 weight(s) for 2 loss type(s) (sigmoid,sft)"),
    ("dpo.py", ["--loss_weights", "one"], "--loss_weights 'one': expected comma-separated numbers"),
    ("dpo.py", ["--loss_type", "hinge", "--label_smoothing", "0.1"],
     "--label_smoothing 0.1: only sigmoid, robust, exo_pair and simpo use it, not hinge"),
    ("dpo.py", ["--loss_type", "robust", "--label_smoothing", "0.5"],
     "--label_smoothing 0.5: use [0, 1) (robust: [0, 0.5)"),
    ("dpo.py", ["--loss_type", "exo_pair"], "--label_smoothing 0.0: use [0, 1) (robust: [0, 0.5); exo_pair: (0, 1))"),
    ("dpo.py", ["--loss_type", "discopop", "--discopop_tau", "0"], "--discopop_tau 0.0: use > 0"),
    ("dpo.py", ["--loss_type", "sigmoid,apo_zero", "--f_divergence_type", "js_divergence"],
     "--f_divergence_type js_divergence applies to --loss_type sigmoid, sigmoid_norm, hinge, ipo, exo_pair, robust, "
     "discopop, sft, not sigmoid,apo_zero"),
    ("dpo.py", ["--f_divergence_type", "kl"], "--f_divergence_type: 'kl' is not one of reverse_kl, forward_kl,"),
    ("dpo.py", ["--eval_steps", "0"], "--eval_steps: must be >= 1, got 0"),
    # checkpoints (TrainConfig; docs/long-runs.md)
    ("sft.py", ["--save_interval_minutes", "-1"], "--save_interval_minutes: must be >= 0, got -1.0"),
    ("sft.py", ["--overwrite_output_dir", "--resume_from_checkpoint", "auto"],
     "--overwrite_output_dir starts afresh and --resume_from_checkpoint continues a run: pass one of them"),
    ("kto.py", ["--beta", "-1"], "--beta: must be > 0, got -1.0"),
    # LoRA flags mean something only with --use_peft (TrainConfig)
    ("dpo.py", ["--lora_r", "8"], "--lora_r is a LoRA flag: add --use_peft"),
    ("grpo.py", ["--lora_target_modules", "q_proj"], "--lora_target_modules is a LoRA flag"),
    ("dpo.py", ["--load_in_4bit"], "--load_in_4bit is a LoRA flag"),
    # rollouts (RolloutConfig, VLLMConfig) and the policy ratio (RatioConfig), across roles
    ("grpo.py", ["--async_rollout"], "--async_rollout needs --rollout vllm or vllm-server"),
    ("grpo.py", ["--rollout", "vllm", "--max_staleness", "-1"], "--max_staleness: must be >= 0, got -1"),
    ("grpo.py", ["--rollout", "vllm-server", "--partial_rollout"], "--partial_rollout continues the generation in "
     "flight across a weight sync: it needs --async_rollout"),
    ("ppo.py", ["--rollout", "vllm", "--async_rollout", "--partial_rollout"], "--partial_rollout needs --rollout "
     "vllm-server: a vLLM engine in each training process generates a batch in one blocking call"),
    ("grpo.py", ["--rollout", "vllm-server", "--async_rollout", "--partial_rollout", "--dynamic_sampling"],
     "--dynamic_sampling generates a step's further batches when the step asks for them"),
    ("grpo.py", ["--rollout", "vllm-server", "--vllm_server_url", "http://a:1,http://b:1", "--vllm_num_servers", "2"],
     "--vllm_num_servers 2 starts servers; --vllm_server_url names running ones: pass one of them"),
    ("grpo.py", ["--rollout", "vllm-server", "--vllm_server_url", "http://a:1,http://a:1/"], "a URL named twice"),
    ("grpo.py", ["--rollout", "vllm-server", "--vllm_server_url", "https://a:1", "--vllm_server_ca_file", "/no/ca.pem"],
     "--vllm_server_ca_file /no/ca.pem: no such file"),
    ("grpo.py", ["--rollout", "vllm-server", "--vllm_num_servers", "0"], "--vllm_num_servers: must be >= 1, got 0"),
    ("grpo.py", ["--rollout", "vllm", "--async_rollout", "--vllm_enable_sleep_mode"],
     "--async_rollout keeps the engine generating during the update: it cannot sleep"),
    ("ppo.py", ["--rollout", "vllm", "--top_p", "0.9"], "--vllm_importance_sampling_correction needs --top_p 1.0"),
    ("ppo.py", ["--rollout", "vllm", "--vllm_importance_sampling_mode", "sequence_truncate",
                "--vllm_importance_sampling_clip_max", "None"],
     "sequence_truncate' needs vllm_importance_sampling_clip_max"),
    ("ppo.py", ["--rollout", "vllm", "--vllm_importance_sampling_clip_min", "4"], "clip_min (4.0) must be less than"),
    ("ppo.py", ["--old_logprobs", "rollout", "--top_p", "0.9"], "--old_logprobs rollout needs --top_p 1.0"),
    ("grpo.py", ["--epsilon_high", "0.1"], "--epsilon_high 0.1 is below --cliprange 0.2"),
    ("grpo.py", ["--num_generations_eval", "0"], "--num_generations_eval: must be >= 1, got 0"),
    ("distill.py", ["--teacher_model_name_or_path", "tiny-llama", "--prompts_per_step", "0"],
     "--prompts_per_step: must be >= 1, got 0"),
    # a prompt of --max_prompt_length plus a full response must fit the vLLM engine's context (--max_length), else
    # HF generate and vLLM would return responses of different lengths
    ("ppo.py", ["--max_length", "64", "--max_prompt_length", "48", "--max_completion_length", "17"],
     "--max_prompt_length 48 + --max_completion_length 17 exceed --max_length 64"),
    # rewards (RewardConfig)
    ("grpo.py", ["--reward_timeout_s", "0"], "--reward_timeout_s 0.0: use > 0"),
    ("ppo.py", ["--reward_fallback", "nan"], "--reward_fallback nan: use a finite score"),
    ("ppo.py", ["--reward_max_concurrency", "0"], "--reward_max_concurrency: must be >= 1, got 0"),
    # the recipes' own knobs and their rules across roles
    ("grpo.py", ["--num_generations", "1"], "--num_generations 1: GRPO compares responses within a group"),
    ("grpo.py", ["--loss_type", "cispo"], "--loss_type cispo needs --epsilon_high >= 1"),
    ("grpo.py", ["--loss_type", "cispo", "--epsilon_high", "0.5"], "--loss_type cispo needs --epsilon_high >= 1"),
    ("grpo.py", ["--mask_truncated_completions", "--ignore_eos"], "--mask_truncated_completions with --ignore_eos"),
    ("grpo.py", ["--advantage_estimator", "reinforce"], "--advantage_estimator: 'reinforce' is not one of grpo, rloo"),
    ("grpo.py", ["--importance_sampling_level", "seq"],
     "--importance_sampling_level: 'seq' is not one of token, sequence"),
    ("grpo.py", ["--dynamic_sampling", "--max_num_gen_batches", "0"], "--max_num_gen_batches: must be >= 1, got 0"),
    ("ppo.py", ["--critic_init", "reward"], "--critic_init reward needs --reward_model_name_or_path"),
    ("distill.py", [], "give one of --teacher_model_name_or_path (a frozen model the student learns from) and "
                       "--teacher_model_kind base|live|ema (self-distillation)"),
    ("distill.py", ["--teacher_model_name_or_path", "tiny-llama", "--teacher_model_kind", "base"], "give one of"),
    ("distill.py", ["--teacher_model_kind", "teacher"], "--teacher_model_kind: 'teacher' is not one of"),
    ("distill.py", ["--teacher_model_kind", "live", "--teacher_prompt_template", "{prompt}"],
     "--teacher_prompt_template '{prompt}': must hold both {prompt} and {privileged_context}"),
    ("distill.py", ["--teacher_model_kind", "ema", "--teacher_update_rate", "0"],
     "--teacher_update_rate 0.0: must be in (0, 1]"),
    ("distill.py", ["--teacher_model_kind", "ema", "--use_peft"], "--teacher_model_kind ema with --use_peft: not "),
    ("distill.py", ["--teacher_model_name_or_path", "tiny-llama", "--beta", "2"],
     "--beta 2.0: the JSD interpolation coefficient must be in [0, 1]"),
    ("distill.py", ["--teacher_model_name_or_path", "tiny-llama", "--task_reward_coef", "0.5"],
     "--task_reward_coef 0.5 needs --loss_type reverse_kl, --num_generations >= 2"),
    # a recipe does not accept a flag it ignores: PPO clips (epsilon_high) but has no group estimator, GSPO level,
    # truncation masking or dynamic sampling; distillation has no environments
    *[("ppo.py", [flag, "x"], "unknown flag") for flag in ("--advantage_estimator", "--importance_sampling_level",
                                                           "--mask_truncated_completions", "--dynamic_sampling")],
    ("distill.py", ["--teacher_model_name_or_path", "tiny-llama", "--environment_factory", "x.py:X"], "unknown flag"),
]


@pytest.mark.parametrize("recipe, argv, expected", CASES,
                         ids=[f"{r.removesuffix('.py')}{''.join(a[:1])}-{i}" for i, (r, a, _) in enumerate(CASES)])
def test_flag_error(recipe, argv, expected):
    with pytest.raises(UserError) as e:
        parse(argv, **recipe_args(recipe))
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal")
def test_4bit_base_is_refused_on_cpu():
    with pytest.raises(UserError, match=r"^--load_in_4bit needs a GPU: bitsandbytes' CPU 4-bit kernel gives wrong"):
        parse(["--use_peft", "--load_in_4bit"], **recipe_args("dpo.py"))


def test_valid_flags_parse_by_role():
    """The same flags, each in its role's class: a valid online command line parses whole."""
    cfg = parse(["--epsilon_high", "0.28", "--max_length", "64", "--max_prompt_length", "48",
                 "--max_completion_length", "16", "--use_peft", "--lora_r", "8"], **recipe_args("ppo.py"))
    assert (cfg.ratio.epsilon_high, cfg.train.lora_r, cfg.rollout.max_completion_length) == (0.28, 8, 16)
    assert cfg.flags()["epsilon_high"] == 0.28 and "critic_init" in cfg.flags()
