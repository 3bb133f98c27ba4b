"""Pure maths, tensors in and out (imports only torch): advantages and KL estimators, preference losses (the DPO
family under TRL's loss_type names, KTO, Bradley-Terry), policy and value losses with their reductions, off-policy
importance weights, pass@k, the groups dynamic sampling keeps, on-policy distillation losses (reverse-KL advantages,
generalized JSD), entropy controls."""

from verl_kit.algos.advantages import (
    OUTCOME_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    gae,
    group_advantages,
    kl_estimate,
    masked_moments,
    masked_variance,
    outcome_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    token_rewards,
    truncation_penalty,
    whiten,
)
from verl_kit.algos.distill import generalized_jsd, reverse_kl_advantages
from verl_kit.algos.entropy import EntropyControl, high_entropy_mask
from verl_kit.algos.evaluation import pass_at_k
from verl_kit.algos.off_policy import MODES, check_args, importance_weights, mismatch_metrics, step_metrics
from verl_kit.algos.policy import (
    POLICY_LOSSES,
    PolicyLoss,
    Surrogate,
    cispo,
    clipped_surrogate,
    entropy_from_logits,
    sequence_log_ratio,
    value_loss,
)
from verl_kit.algos.preference import (
    DPO_LOSS_TYPES,
    F_DIVERGENCE_LOSS_TYPES,
    F_DIVERGENCES,
    REFERENCE_FREE_LOSS_TYPES,
    bradley_terry_loss,
    dpo_loss,
    dpo_loss_terms,
    f_divergence_score,
    implicit_rewards,
    kl_reference_point,
    kto_loss,
)
from verl_kit.algos.reduction import REDUCTIONS, global_mean_share, loss_weights
from verl_kit.algos.sampling import group_rows, informative_groups, select_groups
