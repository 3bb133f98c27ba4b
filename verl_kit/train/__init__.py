"""Training mechanics: the one optimizer-step path (Trainable), frozen scorers, the run's Accelerator and its
Sharding (the one answer to "ZeRO-3, FSDP2 or DDP?"), collective helpers,
sharded scoring, packed forward passes over rollout responses, checkpoints, resume, the run's --output_dir and
preemption."""

from verl_kit.train.accelerator import make_accelerator
from verl_kit.train.actor_critic import (
    CriticModel,
    OffPolicyCorrection,
    ResponseIndex,
    ResponsePacker,
    actor_logits,
    critic_values,
    pack_responses,
)
from verl_kit.train.checkpoint import (
    MODEL_FLAGS,
    Checkpoints,
    PerRank,
    check_run,
    export_final,
    load_checkpoint,
    model_flags,
    nonfinite_weights,
    refuse_nonfinite,
    resolve_resume,
    run_changes,
    run_fingerprint,
    save_checkpoint,
)
from verl_kit.train.distributed import (
    Tally,
    Update,
    all_gather,
    all_reduce_max,
    derived_seed,
    destroy,
    global_quantile,
    micro_batches,
    minibatches,
    reduce_metrics,
    shard,
    step_indices,
    step_seed,
    steps_indices,
    unshard,
    updates,
)
from verl_kit.train.entropy import EntropyTerms
from verl_kit.train.lm_head import (
    CHUNK_SIZE,
    chunkable,
    chunked_logprobs,
    full_logprobs,
    head_divergence,
    head_logprobs,
    sequence_logprobs,
    token_logprobs,
)
from verl_kit.train.memory_plan import MemoryPlan
from verl_kit.train.memory_plan import plan as plan_memory
from verl_kit.train.output_dir import STATE_FILE, check_output_dir, list_checkpoints
from verl_kit.train.preemption import StopSignal
from verl_kit.train.scoring import Sequences, completion_sequences, make_batch, score_items, score_subset
from verl_kit.train.sharding import FSDP2, Accelerator, DeepSpeed, Sharding
from verl_kit.train.trainable import EmaTeacher, Trainable, frozen, load_teacher, self_teacher
