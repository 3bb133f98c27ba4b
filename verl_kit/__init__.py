"""verl-kit: a small kit for LLM post-training, shared by the recipes in recipes/ (SFT, reward model, DPO, KTO, PPO,
GRPO, on-policy distillation). Its subpackages follow the data path of a step:

    data      datasets in TRL's formats -> token ids, packing        (verl_kit.data)
    models    loading, LoRA, ZeRO-3 helpers, the tiny and real model (verl_kit.models)
    rollout   prompts -> Rollout: HF generate, vLLM, weight sync     (verl_kit.rollout)
    rewards   reward functions and reward models                     (verl_kit.rewards)
    algos     the maths: advantages, losses, reductions (torch only) (verl_kit.algos)
    train     the optimizer-step path, distributed helpers, resume   (verl_kit.train)
    launch    process supervision, Ray multi-node launches           (verl_kit.launch)

with config (recipe flags, by role), metrics (logging) and errors (one-line user errors) at the top. Lower layers never
import higher ones: algos imports only torch, data nothing of rollout or train, config nothing that pulls in vLLM.
"""

__version__ = "0.1.0"
