"""Run by tests/train/test_long_runs.py under `accelerate launch` with ZeRO-3 x2: PPO's critic (a 1-element value-head
bias, so ZeRO-3's equal-sized partitions run past some parameters' ends) as a Trainable; the tail of every partition
past its parameter's end is filled with NaN, as the never-written memory DeepSpeed allocates there may hold; records
what `Sharding.local` says each process holds and what the non-finite check finds."""

import sys

import torch

from verl_kit.config import TrainConfig
from verl_kit.train import CriticModel, Trainable, destroy, make_accelerator
from verl_kit.train.checkpoint import nonfinite_weights


def main(model_path: str, out: str) -> None:
    cfg = TrainConfig(output_dir=out + ".d", per_device_train_batch_size=2, gradient_checkpointing=False)
    accelerator = make_accelerator(cfg)
    critic = Trainable(accelerator, CriticModel.from_pretrained(model_path, "policy", None, False), cfg,
                       learning_rate=1e-3, total_steps=1)
    held, tails, rank = {}, 0, torch.distributed.get_rank()
    with torch.no_grad():
        for name, p in critic.model.named_parameters():
            held[name] = (accelerator.sharding.local(p).numel(), p.ds_numel)
            part = p.ds_tensor.view(-1)
            tail = part[max(0, min(part.numel(), p.ds_numel - rank * part.numel())):]  # past the parameter's end
            tails += tail.numel()
            tail.fill_(float("nan"))
    record = {"held": held, "tails": tails, "nonfinite": nonfinite_weights(accelerator)}
    gathered = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, record)
    if accelerator.is_main_process:
        torch.save(gathered, out)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
