"""Prompts -> Rollout: the backend Protocol and its types, HF generate, a colocated vLLM engine, a vLLM server and its
client, the weight sync and its probe, synchronous or asynchronous (one-step-off) rollouts, multi-turn episodes with
tools and environments, held-out evaluation."""

from verl_kit.rollout.backends import make_backend, rollout_dtype, start_server
from verl_kit.rollout.episodes import Episodes, check_prefix_property, make_episodes
from verl_kit.rollout.hf import HFGenerateBackend
from verl_kit.rollout.probe import Probe, default_probe_threshold, max_abs_diff, trainer_logprobs
from verl_kit.rollout.prompts import Prompts, evaluate, load_prompt_splits, load_prompts, rollout_metrics, sample_rows
from verl_kit.rollout.rollouts import Rollouts, dynamic_sampling, sampling_params, start_rollouts
from verl_kit.rollout.tools import call_tool, describe_tools, parse_tool_calls, tool_schema
from verl_kit.rollout.types import Rollout, RolloutBackend, SamplingParams, concat_rollouts, select_rows
from verl_kit.rollout.vllm_client import VLLMServer
from verl_kit.rollout.vllm_engine import SyncedBackend, VLLMColocated, to_rollout, vllm_sampling
from verl_kit.rollout.vllm_server import (
    LOOPBACK,
    ServerProcess,
    api_key,
    auth_headers,
    free_port,
    is_loopback_url,
    main,
    serve_command,
    serve_env,
)
from verl_kit.rollout.weight_sync import (
    SHM_PREFIX,
    WORKER_EXTENSION,
    SharedBuckets,
    WorkerExtension,
    buckets,
    decode,
    encode,
    engine_name,
    gathered_buckets,
    named_tensors,
    release_mappings,
    shm_dir,
    sweep_orphans,
    sync_weights,
)
