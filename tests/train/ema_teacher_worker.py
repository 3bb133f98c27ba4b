"""Run by tests/train/test_ema_teacher.py, alone or under `accelerate launch`: a student (Trainable) and its EMA
teacher (train.EmaTeacher, rate 0.25, every 2nd optimizer step) over 3 optimizer steps of a fixed loss; records the
whole (gathered) weights of the initial model, of the student after steps 2 and 3 and of the teacher after each step,
and checks the teacher's per-process state round-trips (state_dict, a perturbation, load_state_dict)."""

import sys

import torch

from verl_kit.config import TrainConfig
from verl_kit.models import load_causal_lm
from verl_kit.train import EmaTeacher, Trainable, destroy, make_accelerator


def whole(accelerator, model) -> dict:
    """Every parameter's whole tensor, on every process (gathered under ZeRO-3)."""
    from accelerate.utils import extract_model_from_parallel

    named = dict(extract_model_from_parallel(model).named_parameters())
    with accelerator.sharding.full_params(model, list(named.values())) as full:
        return {n: full(p).detach().float().cpu().clone() for n, p in named.items()}


def main(model_path: str, out: str) -> None:
    cfg = TrainConfig(output_dir=out + ".d", per_device_train_batch_size=2, max_grad_norm=1e9,
                      gradient_checkpointing=False)
    accelerator = make_accelerator(cfg)
    world, rank, device = accelerator.num_processes, accelerator.process_index, accelerator.device
    student = Trainable(accelerator, load_causal_lm(model_path), cfg, learning_rate=1e-2, total_steps=3)
    ema = EmaTeacher(accelerator, student, lambda: load_causal_lm(model_path), rate=0.25, sync_steps=2)
    record = {"initial": whole(accelerator, ema.model)}
    ids = torch.arange(4, 36).view(4, 8)[rank::world].to(device)  # the same 4 rows in all, split over processes
    for step in (1, 2, 3):
        for _ in student.accumulate([0]):
            student.backward(student.model(input_ids=ids, labels=ids).loss / world)
        student.step()
        ema.after_step()
        record[f"teacher{step}"] = whole(accelerator, ema.model)
        if step > 1:
            record[f"student{step}"] = whole(accelerator, student.model)
    state = ema.state_dict()
    with torch.no_grad():
        for p in ema.model.parameters():
            accelerator.sharding.local(p).add_(1.0)
    ema.load_state_dict(state)
    record["reloaded"] = whole(accelerator, ema.model)
    record["steps"] = ema.steps
    if rank == 0:
        torch.save(record, out)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
