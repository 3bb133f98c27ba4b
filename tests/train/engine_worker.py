"""Run by tests/train/test_engine.py, alone or under `accelerate launch`: three optimizer steps of engine.Trainable on
fixed data (8 sequences per step over all processes, micro-batches of 2), recording per step the loss, the grad norm
that step() returns, the learning rate, and a fingerprint of the full (gathered) weights after every backward and
step."""

import json
import sys

import torch

from verl_kit.config import TrainConfig
from verl_kit.models import load_causal_lm
from verl_kit.train import Tally, Trainable, destroy, make_accelerator


def fingerprint(policy: Trainable) -> float:
    """Sum of every full parameter (gathered by the run's sharding; collective under ZeRO-3 and FSDP2)."""
    params = list(policy.model.parameters())
    with policy.sharding.full_params(policy.model, params) as full:
        return sum(float(full(p.detach()).double().sum()) for p in params)


def main(model_path: str, out: str) -> None:
    cfg = TrainConfig(output_dir=out + ".d", per_device_train_batch_size=2, max_grad_norm=0.5,
                      gradient_checkpointing=False)
    accelerator = make_accelerator(cfg)
    world, rank = accelerator.num_processes, accelerator.process_index
    policy = Trainable(accelerator, load_causal_lm(model_path), cfg, learning_rate=1e-2, total_steps=3)
    data = torch.randint(5, 500, (3, 8, 12), generator=torch.Generator().manual_seed(0))
    rows, updated_in_backward = [], False
    for step in range(3):
        mine = data[step][rank::world]
        chunks = [mine[i:i + 2] for i in range(0, len(mine), 2)]
        before, tally = fingerprint(policy), Tally()
        for ids in policy.accumulate(chunks):
            loss = policy.model(input_ids=ids.to(accelerator.device), labels=ids.to(accelerator.device)).loss
            policy.backward(loss * len(ids) / 8 * world)  # mean over the step's 8 sequences (equal lengths)
            tally.add(loss=loss.detach() * len(ids) / 8)
            updated_in_backward |= fingerprint(policy) != before
        grad_norm = policy.step()
        rows.append({"loss": tally.reduce()["loss"], "grad_norm": grad_norm, "lr": policy.learning_rate,
                     "changed": fingerprint(policy) != before})
    if accelerator.is_main_process:
        with open(out, "w") as f:
            json.dump({"world": world, "steps": rows, "updated_in_backward": updated_in_backward}, f)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
