"""Run by tests/train/test_nonfinite_steps.py, alone or under `accelerate launch`: four optimizer steps of
train.Trainable on the tiny model and fixed data, where step 2's loss is NaN on the last process only and step 3's
loss is +inf with finite gradients (a constant added), recording per step the grad norm that step() returns, whether
the full (gathered) weights changed and are finite, the skips counted and the learning rate."""

import json
import math
import sys

import torch

from verl_kit.config import TrainConfig
from verl_kit.models import load_causal_lm
from verl_kit.train import Trainable, destroy, make_accelerator


def weights(policy: Trainable) -> tuple[float, bool]:
    """(sum of every full parameter, all finite); gathered by the run's sharding (collective under ZeRO-3, FSDP2)."""
    params = list(policy.model.parameters())
    with policy.sharding.full_params(policy.model, params) as full:
        ps = [full(p.detach()).double() for p in params]
        return sum(float(p.sum()) for p in ps), all(bool(torch.isfinite(p).all()) for p in ps)


def main(model_path: str, out: str) -> None:
    cfg = TrainConfig(output_dir=out + ".d", per_device_train_batch_size=2, gradient_checkpointing=False)
    accelerator = make_accelerator(cfg)
    world, rank = accelerator.num_processes, accelerator.process_index
    policy = Trainable(accelerator, load_causal_lm(model_path), cfg, learning_rate=1e-2, total_steps=4)
    data = torch.randint(5, 500, (4, 4, 12), generator=torch.Generator().manual_seed(0))
    rows = []
    for step in range(4):
        before, _ = weights(policy)
        for ids in policy.accumulate([data[step][rank::world]]):
            loss = policy.model(input_ids=ids.to(accelerator.device), labels=ids.to(accelerator.device)).loss
            if step == 1 and rank == world - 1:
                loss = loss * math.nan  # one process's loss only: every process must skip
            if step == 2:
                loss = loss + math.inf  # non-finite, yet its gradients are finite
            policy.backward(loss)
        grad_norm = policy.step()
        after, finite = weights(policy)
        rows.append({"grad_norm": grad_norm, "changed": after != before, "finite": finite,
                     "skips": policy.nonfinite_skips, "lr": policy.learning_rate})
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"world": world, "steps": rows}, f)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
