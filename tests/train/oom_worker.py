"""Run by tests/train/test_out_of_memory.py: a recipe (argv[2], its flags after it) whose first optimizer step starts
under RLIMIT_DATA = this process's data size at that moment plus argv[1] GiB, so that a step of known size runs out
of memory for real (torch's CPU allocator raises and the process goes on), whatever this install's own size is. The
limit is set when the recipe first asks for a step's micro-batches (train.out_of_memory.attempts, wrapped here; the
recipe itself runs as `python recipes/<name>.py` runs it)."""

import resource
import runpy
import sys

# imported by the first forward pass (accelerate looks for its engine): before the limit, as a long run has imported
# it before any step that can run out
import deepspeed  # noqa: F401

import verl_kit.train.out_of_memory as oom


def data_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmData:")) * 1024


def limited(margin_gib: float):
    real = oom.attempts

    def attempts(*args, **kwargs):
        if resource.getrlimit(resource.RLIMIT_DATA)[0] == resource.RLIM_INFINITY:
            limit = data_size() + int(margin_gib * 2 ** 30)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
        return real(*args, **kwargs)
    return attempts


if __name__ == "__main__":
    margin, recipe, sys.argv = float(sys.argv[1]), sys.argv[2], sys.argv[2:]
    oom.attempts = limited(margin)
    runpy.run_path(recipe, run_name="__main__")
