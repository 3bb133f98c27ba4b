"""What a long run survives (docs/long-runs.md): a preemption signal saves at the next step boundary on every rank and
exits, and the run resumes from that checkpoint bit-identically; a second signal ends it at once; a fresh run refuses
another run's --output_dir; a resume from an older checkpoint sets the newer ones aside; checkpoints are synced before
the rename, a full disk stops the run in one line with the earlier checkpoints intact, weights holding NaN are never
saved, `auto` falls back past a checkpoint that does not load; final/ is replaced by rename-aside; a torn last line of
metrics.jsonl is dropped on resume and the rewrite is atomic. The fast tests drive verl_kit.train on a small
prepared model in this process; the slow ones run recipes/sft.py."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    REPO,
    assert_resume_bit_identical,
    env,
    launch_cmd,
    launch_script,
    metrics,
    recipe_cmd,
    run,
    run_until,
)

from verl_kit.config import TrainConfig
from verl_kit.errors import UserError
from verl_kit.train import (
    Accelerator,
    Checkpoints,
    StopSignal,
    check_output_dir,
    list_checkpoints,
    model_flags,
    run_fingerprint,
    save_checkpoint,
)


@pytest.fixture(autouse=True)
def _default_signals():
    yield
    StopSignal().disarm()  # Checkpoints.resume() arms SIGTERM/SIGUSR1 in this process


def _trainer(seed: int = 0):
    """A fresh Accelerator with a Linear and its AdamW prepared by its sharding (accelerate's save_state/load_state
    for real)."""
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.sharding.prepare(model, optimizer)
    return accelerator, model, optimizer


def _resume(accelerator, cfg) -> tuple[Checkpoints, int]:
    ckpt = Checkpoints(accelerator, cfg, {})
    return ckpt, ckpt.resume()


def _step(model, optimizer):
    model(torch.ones(2, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _save(ckpt, cfg, step, keep=0):
    """Checkpoint `step` of `ckpt`'s run into `cfg`'s output_dir (cfg's flags, not the run's)."""
    return save_checkpoint(ckpt.accelerator, cfg.output_dir, step, keep, model_flags(cfg), ckpt.run_id, None,
                           run_fingerprint(cfg, {}))


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig(output_dir=str(out), **kw)


# ---- 1. preemption -------------------------------------------------------------------------------------------------

def test_second_signal_ends_the_process_at_once():
    """The first SIGTERM is noted (the run saves at the next step boundary); the second ends the process at once,
    with the signal's default action, while it is busy."""
    code = ("import importlib.util, os, signal, sys, time\n"  # the module alone: the handler needs nothing of the kit
            "spec = importlib.util.spec_from_file_location('preemption', sys.argv[1])\n"
            "module = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(module)\n"
            "STOP = module.StopSignal()\n"
            "STOP.arm()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(0.2)\n"
            "print('noted', STOP.received, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n"
            "print('still alive', flush=True)\n")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code, str(REPO / "verl_kit" / "train" / "preemption.py")], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["noted", str(int(signal.SIGTERM))], (p.stdout, p.stderr[-2000:])
    assert p.returncode == -signal.SIGTERM and time.time() - t0 < 25, p.returncode
    assert "SIGTERM received: saving a checkpoint at the end of this step" in p.stderr


@pytest.mark.slow
def test_sigterm_saves_then_resume_is_bit_identical(tmp_path):
    """SFT gets SIGTERM mid-run: it saves at the next step boundary and exits 143 with one line naming the
    checkpoint; resumed with `auto` (after a crash-torn last line of metrics.jsonl and a stale temporary checkpoint
    are left in its directory) it ends with the uninterrupted run's weights bit for bit and one clean metrics
    history. A fresh run into that directory is then refused in one line. On the committed code SIGTERM ended the
    run with no checkpoint past the periodic one and rc -15, the torn line stopped the resume with a
    JSONDecodeError, and the fresh run went ahead."""
    args = ["--max_steps", "20", "--save_steps", "2", "--logging_steps", "1", "--dataset_test_split", "none",
            "--per_device_train_batch_size", "4"]
    cmd = lambda out, *extra: recipe_cmd("sft.py", ["--output_dir", str(out), *args, *extra])
    stopped = {}

    def terminate(p):
        os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        last = err.strip().splitlines()[-1]
        m = re.fullmatch(r"stopped by SIGTERM after step (\d+): saved (\S+); continue with "
                         r"--resume_from_checkpoint auto", last)
        assert p.returncode == 128 + signal.SIGTERM and m, (p.returncode, err[-3000:])
        stopped["step"], stopped["path"] = int(m.group(1)), m.group(2)

    def crash_leftovers(b):
        assert 2 < stopped["step"] < 20 and (b / f"checkpoint-{stopped['step']}" / "trainer_state.json").is_file()
        assert list_checkpoints(str(b))[-1][0] == stopped["step"]
        with open(b / "metrics.jsonl", "a") as f:
            f.write('{"step": 99, "lo')  # a row cut short by a crash
        (b / ".tmp-checkpoint-99").mkdir()

    a, b = tmp_path / "full", tmp_path / "stopped"
    assert_resume_bit_identical(cmd, a, b, 2, kill=terminate, before_resume=crash_leftovers, compare_steps=(10, 20))
    assert not (b / ".tmp-checkpoint-99").exists()
    p = run(cmd(b), check=False)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and last.startswith(f"error: --output_dir {b} holds another run's work ("), last
    assert last.endswith("continue that run with --resume_from_checkpoint auto, replace it with "
                         "--overwrite_output_dir, or choose another --output_dir"), last


def _worker(launcher: subprocess.Popen, rank: int):
    """The training process of `rank` under an accelerate launch."""
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "sft.py" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no rank {rank} worker under {launcher.pid}")


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_with_one_checkpoint(tmp_path):
    """ZeRO-3 x2: SIGUSR1 to rank 1 alone. Both ranks learn it at the step boundary's collective and write one
    complete checkpoint together (both ranks' optimizer partitions); rank 0 prints the one line. On the committed code
    rank 1 died of SIGUSR1 and the launch failed with no checkpoint past the periodic one."""
    out = tmp_path / "z3"
    args = ["--output_dir", str(out), "--max_steps", "12", "--save_steps", "2", "--logging_steps", "1",
            "--dataset_test_split", "none", "--per_device_train_batch_size", "2"]
    seen = {}

    def signal_rank_1(p):
        _worker(p, 1).send_signal(signal.SIGUSR1)
        _, seen["err"] = p.communicate(timeout=180)

    run_until(launch_cmd("zero3.yaml", 2, "sft.py", args),
              lambda: (out / "checkpoint-2" / "trainer_state.json").is_file(), timeout=300, kill=signal_rank_1)
    lines = [x for x in seen["err"].splitlines() if x.startswith("stopped by SIGUSR1 after step ")]
    assert len(lines) == 1, seen["err"][-4000:]
    step = int(lines[0].split()[5].rstrip(":"))
    saved = out / f"checkpoint-{step}"
    assert step > 2 and (saved / "trainer_state.json").is_file() and not (out / "final").exists()
    partitions = sorted(p.name for p in saved.rglob("*optim_states.pt"))
    assert len(partitions) == 2, partitions  # rank 0's and rank 1's


# ---- 2. non-finite weights are never saved -------------------------------------------------------------------------

def test_nonfinite_weights_are_not_saved(tmp_path):
    """A NaN in a trainable weight: save_checkpoint refuses in one line naming the last good checkpoint, and writes
    nothing (no checkpoint, no temporary). On the committed code the NaN weights were saved as checkpoint-2."""
    cfg = _cfg(tmp_path / "out")
    accelerator, model, optimizer = _trainer()
    ckpt, _ = _resume(accelerator, cfg)
    _save(ckpt, cfg, 1)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(UserError) as e:
        _save(ckpt, cfg, 2)
    assert str(e.value) == (f"checkpoint-2 not written: the trainable weights hold NaN or inf after step 2; the last "
                            f"checkpoint is {cfg.output_dir}/checkpoint-1 (docs/long-runs.md, Bad values)")
    assert sorted(os.listdir(cfg.output_dir)) == ["checkpoint-1"]


def test_nonfinite_weights_are_not_published(tmp_path, tiny_model_path):
    """Nothing non-finite is published (issue 55, item 2): the final export of a model with a NaN in a trainable
    weight stops in one line naming the step and the last checkpoint, and an earlier final/ stays as it was. On main
    64ad734 the NaN weights were written to final/."""
    from verl_kit.models import load_causal_lm, load_tokenizer
    from verl_kit.train import export_final

    cfg = _cfg(tmp_path / "out")
    accelerator = Accelerator(cpu=True)
    model = load_causal_lm(tiny_model_path)
    model, _ = accelerator.sharding.prepare(model, torch.optim.AdamW(model.parameters()))
    ckpt, _ = _resume(accelerator, cfg)
    _save(ckpt, cfg, 3)
    tokenizer = load_tokenizer(tiny_model_path)
    assert export_final(accelerator, model, tokenizer, cfg.output_dir, 3) == f"{cfg.output_dir}/final"
    before = (tmp_path / "out" / "final" / "model.safetensors").read_bytes()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(UserError) as e:
        export_final(accelerator, model, tokenizer, cfg.output_dir, 4)
    assert str(e.value) == (f"final/ not written: the trainable weights hold NaN or inf after step 4; the last "
                            f"checkpoint is {cfg.output_dir}/checkpoint-3 (docs/long-runs.md, Bad values)")
    assert (tmp_path / "out" / "final" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(cfg.output_dir)) == ["checkpoint-3", "final"]


@pytest.mark.slow
def test_zero3_partition_tails_are_not_the_weights(tmp_path, tiny_model_path):
    """Under ZeRO-3 the partitions are of equal size, so the last ones run past a parameter's end (PPO's critic: a
    1-element value-head bias, rank 1's partition of it all tail); DeepSpeed allocates that tail and never writes it.
    `Sharding.local` holds the parameter's elements only (the ranks' pieces add up to each parameter), and NaN in
    every tail leaves the non-finite check at 0. Before, the check read the tails: a healthy PPO run under ZeRO-3 x2
    refused its final export once in a suite's run (test_ppo_lora_episodes_zero3_equals_one_process)."""
    out = str(tmp_path / "record.pt")
    run(launch_script("zero3.yaml", 2, str(REPO / "tests" / "train" / "zero3_padding_worker.py"),
                      [tiny_model_path, out]), timeout=300)
    ranks = torch.load(out)
    assert sum(r["tails"] for r in ranks) > 0  # there were tails to poison
    for name, (_, whole) in ranks[0]["held"].items():
        assert sum(r["held"][name][0] for r in ranks) == whole, name
    assert [r["nonfinite"] for r in ranks] == [0, 0]


# ---- 3. a checkpoint belongs to its run ----------------------------------------------------------------------------

def test_output_dir_belongs_to_its_run(tmp_path):
    """A fresh run refuses a directory holding checkpoints or final/ (make_accelerator calls check_output_dir before
    anything loads); --overwrite_output_dir deletes them at the start; a resume from an older checkpoint moves the
    newer ones to superseded/ (never deleted, never resumed by `auto`); rotation deletes only this run's
    checkpoints. On the committed code there was no check, `auto` went back to checkpoint-3 and rotation deleted
    the other run's checkpoint."""
    out = tmp_path / "out"
    cfg = _cfg(out, save_total_limit=2)
    check_output_dir(cfg)  # an empty or missing directory is fine
    accelerator, model, optimizer = _trainer()
    ckpt, start = _resume(accelerator, cfg)
    assert start == 0
    for step in (1, 2, 3):
        _step(model, optimizer)
        _save(ckpt, cfg, step, keep=0)
    with pytest.raises(UserError, match=r"holds another run's work \(checkpoint-1, checkpoint-2, checkpoint-3\)"):
        check_output_dir(cfg)
    check_output_dir(_cfg(out, resume_from_checkpoint="auto"))
    check_output_dir(_cfg(out, overwrite_output_dir=True))
    with pytest.raises(UserError, match="--overwrite_output_dir starts afresh and --resume_from_checkpoint"):
        _cfg(out, overwrite_output_dir=True, resume_from_checkpoint="auto")

    # Resume from checkpoint-1: 2 and 3 are set aside, `auto` then finds 1.
    accelerator, model, optimizer = _trainer(seed=1)
    older = _cfg(out, resume_from_checkpoint=str(out / "checkpoint-1"), save_total_limit=2)
    ckpt, start = _resume(accelerator, older)
    assert start == 1
    assert [s for s, _ in list_checkpoints(str(out))] == [1]
    assert sorted(os.listdir(out / "superseded")) == ["checkpoint-2", "checkpoint-3"]
    run_id = json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["run_id"]

    # Another run's checkpoint beside this run's is never rotated away.
    foreign = out / "checkpoint-0"
    shutil.copytree(out / "checkpoint-1", foreign)
    state = json.loads((foreign / "trainer_state.json").read_text())
    (foreign / "trainer_state.json").write_text(json.dumps({**state, "step": 0, "run_id": "another-run"}))
    for step in (2, 3, 4):
        _step(model, optimizer)
        _save(ckpt, older, step, keep=2)
    assert [s for s, _ in list_checkpoints(str(out))] == [0, 3, 4]
    assert json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["run_id"] == run_id  # kept on resume

    # --overwrite_output_dir: a fresh start that deletes the earlier run's checkpoints, final/ and superseded/.
    (out / "final").mkdir()
    accelerator, model, optimizer = _trainer()
    ckpt, start = _resume(accelerator, _cfg(out, overwrite_output_dir=True))
    assert start == 0
    assert sorted(os.listdir(out)) == []


# ---- 4. durable, recoverable checkpoints ---------------------------------------------------------------------------

def test_checkpoint_is_synced_before_the_rename_and_rotated_after(tmp_path, monkeypatch):
    """Every file of the checkpoint and its directory are fsynced before the temporary is renamed to
    checkpoint-<step>, the output directory after it, and older checkpoints are deleted only then (renamed aside
    first: durable.remove_dir); a stale
    `.tmp-checkpoint-*` from an interrupted save is swept when the run starts. On the committed code nothing was
    synced and the temporary stayed."""
    cfg = _cfg(tmp_path / "out")
    os.makedirs(tmp_path / "out" / ".tmp-checkpoint-7" / "junk")
    accelerator, model, optimizer = _trainer()
    ckpt, _ = _resume(accelerator, cfg)
    assert not (tmp_path / "out" / ".tmp-checkpoint-7").exists()
    _save(ckpt, cfg, 1)

    events = []
    real_fsync, real_rename, real_rmtree = os.fsync, os.rename, shutil.rmtree

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_rename(src, dst)

    def rmtree(path, *args, **kwargs):
        events.append(("rmtree", str(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    _step(model, optimizer)
    _save(ckpt, cfg, 2, keep=1)
    tmp, final = f"{cfg.output_dir}/.tmp-checkpoint-2", f"{cfg.output_dir}/checkpoint-2"
    at = events.index(("rename", tmp, final))
    synced = {e[1] for e in events[:at] if e[0] == "fsync"}
    written = {os.path.join(tmp, n) for n in os.listdir(final)}
    assert written <= synced and tmp in synced, (written - synced, tmp)
    assert ("fsync", cfg.output_dir) in events[at:]
    gone = f"{cfg.output_dir}/.deleted-checkpoint-1"  # pruned whole or not at all: renamed aside, then deleted
    aside = events.index(("rename", f"{cfg.output_dir}/checkpoint-1", gone))
    assert aside > at and ("rmtree", gone) in events[aside:]
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [2]


def test_full_disk_stops_in_one_line_and_keeps_the_checkpoints(tmp_path, monkeypatch):
    """A save whose write fails with ENOSPC: one UserError line saying so, the temporary removed, checkpoint-1
    intact. On the committed code the OSError escaped as a traceback and left .tmp-checkpoint-2 behind. (A real full
    file system: test_full_disk_in_a_real_run.)"""
    cfg = _cfg(tmp_path / "out")
    accelerator, model, optimizer = _trainer()
    ckpt, _ = _resume(accelerator, cfg)
    _save(ckpt, cfg, 1)
    before = {p: p.read_bytes() for p in (tmp_path / "out" / "checkpoint-1").iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full)  # accelerate writes the optimizer state with torch.save
    with pytest.raises(UserError) as e:
        _save(ckpt, cfg, 2)
    assert str(e.value) == (f"--output_dir {cfg.output_dir}: writing checkpoint-2 failed (No space left on device); "
                            "the run stops and the checkpoints on disk are intact (checkpoint-1): free space, then "
                            "continue with --resume_from_checkpoint auto")
    assert sorted(os.listdir(cfg.output_dir)) == ["checkpoint-1"]
    assert {p: p.read_bytes() for p in (tmp_path / "out" / "checkpoint-1").iterdir()} == before


def _can_mount() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/mnt"],
                          capture_output=True).returncode == 0


# a checkpoint of the SFT recipe's tiny model is ~8 MiB in one process and across two ranks alike (the model once,
# AdamW's moments split in partitions or shards)
@pytest.mark.slow
@pytest.mark.skipif(not _can_mount(), reason="needs root to mount a small tmpfs in a private mount namespace")
@pytest.mark.parametrize("launch, size_mib, failing, kept", [
    ("zero3.yaml", 20, 6, "checkpoint-2, checkpoint-4"),  # no room for checkpoint-6: refused before a byte is written
    ("fsdp2.yaml", 6, 2, "none"),                          # the disk fills during the first save, inside DCP's
])
def test_full_disk_in_a_real_run(tmp_path, launch, size_mib, failing, kept):
    """SFT on two ranks (each writes its own partition or shard) into a small tmpfs. ZeRO-3, 20 MiB: checkpoint-2 and
    -4 fit, checkpoint-6 does not, and every rank's room check stops it before anything is written. FSDP2, 6 MiB: the
    disk fills during the first save, inside torch.distributed.checkpoint, whose CheckpointException (a BaseException
    holding each rank's error) escaped the save on the committed code: a traceback on each rank and the staging
    directory left behind. Now every rank stops with one line, exit 2, the earlier checkpoints complete and the latest
    still latest, no temporary left. (One process, a simulated ENOSPC: test_full_disk_stops_in_one_line_and_keeps_the
    _checkpoints; ZeRO-3 filling during its save and FSDP2 refused by the room check behave the same: run by hand.)"""
    mnt = tmp_path / "small"
    mnt.mkdir()
    args = ["--output_dir", str(mnt / "run"), "--max_steps", str(failing), "--save_steps", "2",
            "--dataset_test_split", "none"]
    argv = " ".join(launch_cmd(launch, 2, "sft.py", args, isolate=False))
    script = (f"mount -t tmpfs -o size={size_mib}m tmpfs {mnt} && {{ {argv}; echo \"rc=$?\"; "
              f"ls -a {mnt}/run; ls {mnt}/run/checkpoint-* 2>/dev/null; }}")
    p = subprocess.run(["unshare", "-m", "-n", "bash", "-c", "ip link set lo up && " + script], cwd=REPO,
                       env=env(OMP_NUM_THREADS=1), capture_output=True, text=True, timeout=300)
    assert re.search(r"rc=[1-9]", p.stdout), (p.stdout, p.stderr[-3000:])
    assert re.search(
        rf"error: --output_dir {mnt}/run: writing checkpoint-{failing} failed \(.*\); the run stops and the "
        rf"checkpoints on disk are intact \({kept}\): free space, then continue with --resume_from_checkpoint auto",
        p.stderr), (p.stdout, p.stderr[-3000:])
    # each rank says it in one line (the two may land on one line of the shared stderr), none with a traceback
    assert p.stderr.count(f"error: --output_dir {mnt}/run: writing checkpoint-{failing} failed") == 2, p.stderr[-3000:]
    assert "[rank0]: Traceback" not in p.stderr and "[rank1]: Traceback" not in p.stderr, p.stderr[-3000:]
    assert f".tmp-checkpoint-{failing}" not in p.stdout, p.stdout
    assert p.stdout.count("trainer_state.json") == (0 if kept == "none" else 2), p.stdout


SAVE_FAILS_ON_ONE_RANK = r"""
import sys, torch
from verl_kit.config import TrainConfig
from verl_kit.errors import UserError
from verl_kit.train import Accelerator, Checkpoints, list_checkpoints, model_flags, run_fingerprint, save_checkpoint


class RankState:  # what a rank saves of its own (an async run's batches generated ahead)
    def __init__(self, broken):
        self.broken = broken

    def state_dict(self):
        if self.broken:
            raise ValueError("this rank's state cannot be saved")
        return {"ok": 1}

    def load_state_dict(self, state):
        pass


accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model, optimizer = accelerator.sharding.prepare(model, optimizer)
cfg = TrainConfig(output_dir=sys.argv[1])
ckpt = Checkpoints(accelerator, cfg, {})
ckpt.resume()
rank = accelerator.process_index
for step in (1, 2):
    try:
        save_checkpoint(accelerator, cfg.output_dir, step, 0, model_flags(cfg), ckpt.run_id,
                        RankState(step == 2 and rank == 1), run_fingerprint(cfg, {}))
    except UserError as e:
        print(f"rank {rank}: {e}; latest: {list_checkpoints(cfg.output_dir)[-1][0]}", flush=True)
        sys.exit(2)
"""


@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_stops_every_rank(tmp_path):
    """FSDP2 x2: checkpoint-2's save raises inside one rank only (a bug: its own state cannot be saved). No rank is
    left waiting in a collective: the failing rank raises its error (its traceback), the other stops in one line
    ("on another process"); the staging directory is removed and checkpoint-1 stays the latest, complete. On the
    committed code the failing rank raised and the other waited in the next collective until its timeout."""
    script = tmp_path / "save.py"
    script.write_text(SAVE_FAILS_ON_ONE_RANK)
    out = tmp_path / "out"
    p = subprocess.run(launch_script("fsdp2.yaml", 2, str(script), [str(out)]), cwd=REPO, env=env(OMP_NUM_THREADS=1),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0 and "ValueError: this rank's state cannot be saved" in p.stderr, p.stderr[-3000:]
    assert re.search(rf"rank 0: --output_dir {out}: writing checkpoint-2 failed \(on another process\); the run "
                     r"stops and the checkpoints on disk are intact \(checkpoint-1\).*; latest: 1$", p.stdout, re.M), \
        (p.stdout, p.stderr[-3000:])
    assert sorted(os.listdir(out)) == ["checkpoint-1"] and (out / "checkpoint-1" / "trainer_state.json").is_file()


def test_auto_falls_back_past_a_checkpoint_that_does_not_load(tmp_path, caplog):
    """checkpoint-2's model.safetensors is cut short (a crash of the storage, not of the save): `auto` warns, loads
    checkpoint-1 (its weights, exactly) and sets checkpoint-2 aside. On the committed code resume raised from
    safetensors."""
    cfg = _cfg(tmp_path / "out", resume_from_checkpoint="auto")
    accelerator, model, optimizer = _trainer()
    ckpt, _ = _resume(accelerator, _cfg(tmp_path / "out"))
    _step(model, optimizer)
    _save(ckpt, cfg, 1)
    at_1 = model.weight.detach().clone()
    _step(model, optimizer)
    _save(ckpt, cfg, 2)
    shard = tmp_path / "out" / "checkpoint-2" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    accelerator, model, optimizer = _trainer(seed=5)
    with caplog.at_level("WARNING"):
        ckpt, start = _resume(accelerator, cfg)
        assert start == 1
    assert torch.equal(model.weight.detach(), at_1)
    assert f"--resume_from_checkpoint auto: {cfg.output_dir}/checkpoint-2 does not load (" in caplog.text
    assert [s for s, _ in list_checkpoints(cfg.output_dir)] == [1]
    assert (tmp_path / "out" / "superseded" / "checkpoint-2").is_dir()


def test_final_is_replaced_by_rename_aside(tmp_path, tiny_model_path, monkeypatch):
    """export_hf writes final.tmp, then renames the old final/ aside before renaming the new one in: when that
    rename fails (a crash there) the old final/ is back whole, and a full disk while writing is one line with the old
    final/ intact. On the committed code final/ was deleted before the rename, so the same failure left none, and
    the full disk escaped as a traceback."""
    from verl_kit.models import export_hf, load_causal_lm, load_tokenizer

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(load_causal_lm(tiny_model_path))
    state_dict = accelerator.sharding.full_state_dict(model)
    tokenizer = load_tokenizer(tiny_model_path)
    final = tmp_path / "final"
    final.mkdir()
    (final / "earlier.txt").write_text("the earlier export")
    real_rename = os.rename

    def failing_rename(src, dst):
        if str(src).endswith("final.tmp"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(UserError, match=r"final: writing the final model failed \(Input/output error\)"):
        export_hf(accelerator, model, state_dict, tokenizer, str(final))
    assert sorted(os.listdir(tmp_path)) == ["final"] and (final / "earlier.txt").is_file()

    monkeypatch.setattr(os, "rename", real_rename)
    monkeypatch.setattr(type(tokenizer), "save_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))))
    with pytest.raises(UserError, match=r"writing the final model failed \(No space left on device\)"):
        export_hf(accelerator, model, state_dict, tokenizer, str(final))
    assert sorted(os.listdir(tmp_path)) == ["final"] and (final / "earlier.txt").is_file()

    monkeypatch.undo()
    export_hf(accelerator, model, state_dict, tokenizer, str(final))
    assert sorted(os.listdir(tmp_path)) == ["final"] and (final / "model.safetensors").is_file()
    assert not (final / "earlier.txt").exists()


# ---- 5. resume reads what a crash left -----------------------------------------------------------------------------

class _Main:
    """What MetricsLogger needs of an accelerator: the main process, no trackers."""
    is_main_process, log_with = True, None


def test_torn_metrics_line_is_dropped_and_the_rewrite_is_atomic(tmp_path, monkeypatch, caplog):
    """metrics.jsonl ends in a line cut short by a crash: on resume at step 2 the rows through step 2 are kept, the
    torn line dropped with a warning naming file and line; samples.jsonl alike. When the rewrite itself fails midway
    (a full disk), the file is as it was. On the committed code the torn line raised JSONDecodeError and the rewrite
    truncated the file in place first."""
    from verl_kit.metrics import MetricsLogger

    rows = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(4)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 4, "lo')
    (tmp_path / "samples.jsonl").write_text('{"step": 1, "prompt": "a"}\n{"step": 3, "pro')
    with caplog.at_level("WARNING"):
        MetricsLogger(_Main(), str(tmp_path), total_steps=10, start_step=2)
    assert metrics(tmp_path) == rows[:3]
    assert (tmp_path / "samples.jsonl").read_text() == '{"step": 1, "prompt": "a"}\n'
    assert f"{tmp_path}/metrics.jsonl: line 5 is not JSON (cut short by a crash?): dropped" in caplog.text

    import builtins

    real_open = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, _):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        writelines = write

    def open_full(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return Full(f) if "w" in mode else f

    (tmp_path / "metrics.jsonl").write_text(text)
    monkeypatch.setattr(builtins, "open", open_full)
    with pytest.raises(OSError):
        MetricsLogger(_Main(), str(tmp_path), total_steps=10, start_step=1)
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == text

    # a full disk while a row is appended (issue 55, item 3): one line, the file as it was (on main 64ad734 a
    # traceback)
    log = MetricsLogger(_Main(), str(tmp_path), total_steps=10, start_step=4)
    kept = (tmp_path / "metrics.jsonl").read_text()
    monkeypatch.setattr(builtins, "open", lambda path, mode="r", *a, **k: (
        Full(real_open(path, mode, *a, **k)) if "a" in mode else real_open(path, mode, *a, **k)))
    with pytest.raises(UserError, match=r"metrics\.jsonl: appending failed \(No space left on device\); the run stops "
                                        r"and the checkpoints on disk are intact"):
        log.log(5, {"loss": 0.5})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == kept
