"""verl-kit: a small kit for LLM post-training: the DPO, KTO, PPO and GRPO recipes in recipes/ share it. DeepSpeed
ZeRO-3 through accelerate, exact packing, vLLM rollouts with weight sync, Ray multi-node launches."""

__version__ = "0.1.0"
