"""verl-kit: a small kit for LLM post-training (DPO, KTO, PPO) on DeepSpeed ZeRO-3, accelerate and Ray."""

__version__ = "0.1.0"
