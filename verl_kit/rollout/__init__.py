"""Prompts -> Rollout: the backend Protocol and its types, HF generate, a colocated vLLM engine, a vLLM server and its
client, the weight sync and its probe; the episode contract (EpisodeRunner) and its runners (single-turn, environments
and tools, agents) with their one chat renderer; synchronous or asynchronous (one-step-off) rollouts, held-out
evaluation. The weight sync's internals are imported from their modules: rollout.weight_sync (the trainer's side),
rollout.transport (the wire format and same-host slots), rollout.worker_extension (what vLLM loads), rollout.synced
(what the two vLLM backends share)."""

from verl_kit.rollout.agents import AgentEpisodes
from verl_kit.rollout.backends import make_backend, rollout_dtype, start_servers
from verl_kit.rollout.chat import ChatRenderer, check_prefix_property
from verl_kit.rollout.episodes import Episodes, SingleTurn, make_episodes
from verl_kit.rollout.hf import HFGenerateBackend
from verl_kit.rollout.probe import Probe, default_probe_threshold, max_abs_diff, trainer_logprobs
from verl_kit.rollout.prompts import evaluate, rollout_metrics, sample_rows
from verl_kit.rollout.rollouts import InFlightRollouts, Rollouts, dynamic_sampling, make_rollouts, sampling_params
from verl_kit.rollout.tools import call_tool, describe_tools, parse_tool_calls, tool_schema
from verl_kit.rollout.types import (
    EpisodeRunner,
    Prompts,
    Rollout,
    RolloutBackend,
    SamplingParams,
    Scores,
    concat_rollouts,
    select_rows,
)
from verl_kit.rollout.vllm_client import VLLMServer
from verl_kit.rollout.vllm_engine import VLLMColocated
from verl_kit.rollout.vllm_server import ServerProcess
