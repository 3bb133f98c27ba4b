"""Rewards: reward functions (TRL's calling convention), a frozen reward model or a served one, an LLM judge, their
weighted sum, and training a reward model."""

from verl_kit.rewards.code import Limits, code_tests, run_sandboxed
from verl_kit.rewards.combined import RewardModel, Rewards, load_reward_model, make_rewards, weighted_sum
from verl_kit.rewards.functions import (
    MATH_TIMEOUT_S,
    RESERVED,
    CallLimits,
    SoftOverlongPunishment,
    boxed_format,
    call_reward_fn,
    final_number,
    get_soft_overlong_punishment,
    kind_reply,
    kind_words,
    last_number,
    load_reward_fn,
    math_answer,
    reward_columns,
    soft_overlong_punishment,
)
from verl_kit.rewards.remote import LLMJudge, RemoteRewardModel, RewardServerError, parse_score
from verl_kit.rewards.reward_model import (
    TokenRewardModel,
    last_token_index,
    load_reward_classifier,
    margins,
    score_rewards,
    sequence_rewards,
)
