"""Shared test helpers: run recipes as subprocesses, launch them under accelerate inside a loopback-only network
namespace, read their metrics and exported weights; a recipe's config classes, JSON-lines data, and a reward model
over another vocabulary, for the tests of several folders. Importable as `helpers` from every folder under tests/ (no
`__init__.py` there: pytest puts tests/, conftest's folder, on sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACCELERATE = str(BIN / "accelerate")


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", GLOO_SOCKET_IFNAME="lo", VERL_KIT_NO_BAR="1",
             TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def isolated(cmd: list[str]) -> list[str]:
    """Run `cmd` in a fresh loopback-only network namespace when we can (root), so gloo and accelerate can only
    reach 127.0.0.1. Otherwise run it as is."""
    if os.geteuid() == 0 and shutil.which("unshare") and shutil.which("ip"):
        quoted = " ".join(f"'{c}'" for c in cmd)
        return ["unshare", "-n", "bash", "-c", f"ip link set lo up && exec {quoted}"]
    return cmd


def recipe_args(recipe: str) -> dict[str, type]:
    """The recipe's ARGS (role -> config class), read from the recipe file as it is (recipes/ is not a package)."""
    import runpy

    return runpy.run_path(str(REPO / "recipes" / recipe), run_name="recipe_under_test")["ARGS"]


def recipe_cmd(recipe: str, args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "recipes" / recipe), *args]


def launch_cmd(config: str, nproc: int, recipe: str, args: list[str], extra: list[str] = (),
               isolate: bool = True) -> list[str]:
    return launch_script(config, nproc, str(REPO / "recipes" / recipe), args, extra, isolate)


def launch_script(config: str, nproc: int, script: str, args: list[str], extra: list[str] = (),
                  isolate: bool = True) -> list[str]:
    """`accelerate launch` of any script under one of accelerate_configs/, in a loopback-only namespace (isolate=False:
    in this process's network, to reach a server the test session started on 127.0.0.1)."""
    where = ["--main_process_port", "29533"] if isolate else ["--main_process_ip", "127.0.0.1",
                                                              "--main_process_port", "29541"]
    cmd = [ACCELERATE, "launch", "--config_file", str(REPO / "accelerate_configs" / config), "--num_processes",
           str(nproc), *where, *extra, script, *args]
    return isolated(cmd) if isolate else cmd


def trl_fsdp2_config(out_dir) -> str:
    """TRL's own accelerate_configs/fsdp2.yaml as a user brings it (fsdp_cpu_ram_efficient_loading true: transformers
    loads the weights on rank 0 only), mixed precision off so that it compares with fp32 runs."""
    import trl

    text = (Path(trl.__file__).parent / "accelerate_configs" / "fsdp2.yaml").read_text()
    assert "fsdp_cpu_ram_efficient_loading: true" in text and "mixed_precision: bf16" in text, text
    path = Path(out_dir) / "trl_fsdp2.yaml"
    path.write_text(text.replace("mixed_precision: bf16", 'mixed_precision: "no"'))
    return str(path)


def run(cmd: list[str], timeout: float = 300, check: bool = True, **env_extra) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, cwd=REPO, env=env(OMP_NUM_THREADS=1, **env_extra), capture_output=True, text=True,
                       timeout=timeout, start_new_session=True)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}: {' '.join(cmd)}\n--- stderr tail ---\n{p.stderr[-4000:]}")
    return p


def run_until(cmd: list[str], done, timeout: float = 300, kill=None, **env_extra) -> None:
    """Start `cmd`, wait until `done()` is true, then SIGKILL its whole process group (a crash, not a shutdown), or
    call `kill(proc)` to kill it some other way (what is left of the group is SIGKILLed after)."""
    p = subprocess.Popen(cmd, cwd=REPO, env=env(OMP_NUM_THREADS=1, **env_extra), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while not done():
            if p.poll() is not None:
                raise AssertionError(f"exited early ({p.returncode}): {p.stderr.read()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError("timed out waiting for the condition")
            time.sleep(0.02)
        if kill is not None:
            kill(p)
    finally:
        if p.poll() is None or kill is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


# ---- a trainer SIGKILLed alone leaves nothing behind (verl_kit.launch.processes.OrphanGuard) -----------------------

ORPHAN_BOUND_S = 10.0


def alive(procs) -> list:
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def mappers(paths: set[str]) -> dict[int, set[str]]:
    """pid -> which of `paths` it maps, over every process of this host we may read."""
    import psutil

    found = {}
    for p in psutil.process_iter():
        try:
            with open(f"/proc/{p.pid}/maps") as f:
                hit = {line.split(maxsplit=5)[5].strip().removesuffix(" (deleted)") for line in f
                       if len(line.split(maxsplit=5)) == 6} & paths
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if hit:
            found[p.pid] = hit
    return found


def sigkill_alone_leaves_nothing(trainer: subprocess.Popen) -> float:
    """SIGKILL the training process alone (an OOM kill, `kill -9 PID`: its process group and every process it started
    live on, no atexit or finalizer runs), then assert that within ORPHAN_BOUND_S no process it had under it (by
    parent chain, collected just before the kill: a colocated engine's core and worker) remains, nothing maps the
    run's weight-sync slots, and the slots and vLLM's own shared-memory queues are removed. -> seconds until the last
    process was gone."""
    os.kill(trainer.pid, signal.SIGSTOP)  # frozen while we look (importing the kit takes seconds): no step goes on
    import psutil

    from verl_kit.rollout import transport

    tree = psutil.Process(trainer.pid).children(recursive=True)
    slots = {os.path.join(transport.shm_dir(), n) for n in os.listdir(transport.shm_dir())
             if n.startswith(f"{trainer.pid}-")}
    engine_maps = set().union(*mappers(slots).values())
    assert len(tree) >= 2 and slots and engine_maps, (tree, slots, engine_maps)  # the engine core, its worker
    queues = set()  # vLLM's own shared memory (its message queues), unlinked by multiprocessing's resource tracker
    for p in alive(tree):
        with open(f"/proc/{p.pid}/maps") as f:
            queues |= {line.split(maxsplit=5)[5].strip().removesuffix(" (deleted)") for line in f
                       if "/dev/shm/psm_" in line}
    os.kill(trainer.pid, signal.SIGKILL)  # the trainer only: its group lives on
    t0 = time.time()
    trainer.wait()
    try:
        while alive(tree) and time.time() - t0 < ORPHAN_BOUND_S:
            time.sleep(0.05)
        took = time.time() - t0
        left = [(p.pid, p.name()) for p in alive(tree)]
        print(f"SIGKILL of the trainer -> last of its {len(tree)} processes gone: {took:.2f}s; left: {left}")
        assert not left, f"left behind {took:.0f}s after the trainer's SIGKILL: {left}"
        assert not mappers(slots), mappers(slots)
        assert not [s for s in slots if os.path.exists(s)]
        assert queues and not [q for q in queues if os.path.exists(q)], queues
        return took
    finally:
        for p in alive(tree):  # what the guard did not stop
            p.kill()


def run_driver(source: str, *args: str, timeout: float = 300, wrap=None, **env_extra) -> dict:
    """Run the Python `source` as a script (a file: vLLM's engine wants a `__main__` guard) in a fresh interpreter
    from the repo, in its own session, with `args`; `wrap(cmd)` gives the command to run instead (e.g. `isolated`).
    It must exit 0 and print a line `RESULT <json>`: the JSON of the last one is returned."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="verl-kit-driver-") as d:
        script = Path(d) / "driver.py"
        script.write_text(source)
        cmd = [sys.executable, str(script), *args]
        p = subprocess.run(wrap(cmd) if wrap else cmd, cwd=REPO, env=env(**env_extra), capture_output=True, text=True,
                           timeout=timeout, start_new_session=True)
    assert p.returncode == 0, f"driver exit {p.returncode}\n--- stderr tail ---\n{p.stderr[-4000:]}"
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"no RESULT line\n--- stdout tail ---\n{p.stdout[-2000:]}\n--- stderr tail ---\n{p.stderr[-2000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def metrics(output_dir) -> list[dict]:
    with open(Path(output_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_weights(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(path) / "model.safetensors"))


# ---- one home for the SIGKILL -> `--resume_from_checkpoint auto` -> bit-identical scenario -------------------------

def _wall_clock(key: str) -> bool:
    """Metrics that depend on the clock or the machine, not on the run's numbers (the memory plan counts the process's
    resident size and the machine's free memory)."""
    return key == "elapsed_s" or key.startswith(("timing_s/", "perf/", "sync/sec", "sync/bytes_", "memory/"))


def numbers(output_dir, ignore: tuple[str, ...] = ()) -> dict[int, dict]:
    """metrics.jsonl by step (rows of one step merged), without the wall-clock metrics and `ignore`."""
    out: dict[int, dict] = {}
    for r in metrics(output_dir):
        out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if not _wall_clock(k) and k not in ignore})
    return out


def assert_resume_bit_identical(cmd, a, b, checkpoint: int, *, run_a: bool = True, weights: str = "model.safetensors",
                                compare_steps=(), ignore: tuple[str, ...] = (), before_resume=None,
                                kill=None, timeout: float = 300, **env_extra) -> None:
    """`cmd(output_dir, *extra)` -> argv of one training run. Run A (already run when run_a is False) goes straight to
    the end; run B is SIGKILLed (its whole process group, a crash) once checkpoint-`checkpoint` is complete, must not
    have finished (or killed by `kill(proc)`, as run_until), and is resumed with `--resume_from_checkpoint auto`
    (after `before_resume(b)`, if given). Then:
    B's final `weights` equal A's bit for bit; metrics.jsonl of B reads as one run (rows in step order, no step logged
    twice with the same metrics, the same last step as A); and every metric of `compare_steps` but the wall-clock ones
    and `ignore` equals A's."""
    import torch
    from safetensors.torch import load_file

    a, b = Path(a), Path(b)
    if run_a:
        run(cmd(a), timeout=timeout, **env_extra)
    run_until(cmd(b), lambda: (b / f"checkpoint-{checkpoint}" / "trainer_state.json").is_file(), timeout=timeout,
              kill=kill, **env_extra)
    assert not (b / "final").exists(), "the run finished before it was killed"
    if before_resume is not None:
        before_resume(b)
    run(cmd(b, "--resume_from_checkpoint", "auto"), timeout=timeout, **env_extra)

    wa, wb = load_file(str(a / "final" / weights)), load_file(str(b / "final" / weights))
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, different
    rows = metrics(b)
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps), steps
    kinds = [(r["step"], tuple(sorted(k for k in r if not _wall_clock(k)))) for r in rows]
    assert len(kinds) == len(set(kinds)), kinds  # no step logged twice
    assert steps[-1] == metrics(a)[-1]["step"], (steps, metrics(a)[-1])
    na, nb = numbers(a, ignore), numbers(b, ignore)
    for step in compare_steps:
        assert na[step] == nb[step], (step, na[step], nb[step])


def assert_adapter_export(final: Path, classifier: bool = False):
    """final/ = the adapter (peft loads it onto the base), final/merged = a full model with the same outputs."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "model.safetensors").exists()
    auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    base_path = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    kwargs = {"num_labels": 1} if classifier else {}
    adapted = PeftModel.from_pretrained(auto.from_pretrained(base_path, dtype=torch.float32, **kwargs), str(final))
    merged = auto.from_pretrained(str(final / "merged"), dtype=torch.float32)
    base = auto.from_pretrained(base_path, dtype=torch.float32, **kwargs)
    ids = torch.randint(3, 200, (1, 20))
    with torch.no_grad():
        out = [m.eval()(input_ids=ids).logits for m in (adapted, merged, base)]
    assert torch.allclose(out[0], out[1], atol=1e-4), float((out[0] - out[1]).abs().max())
    assert float((out[1] - out[2]).abs().max()) > 1e-6  # the adapter was trained (and exported)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


RM_TEMPLATE = "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"


def build_reward_model(out: str) -> str:
    """A tiny LlamaForSequenceClassification over a *different* tokenizer: a 300-token BPE trained on other text,
    other special tokens and another chat template than the policy's. Written to `out`; returns it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["[USER] [ASSISTANT] the cat sat on the mat", "kind words and warm replies", "zebra quartz jukebox"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                        chat_template=RM_TEMPLATE)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=1,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


class Scripted:
    """A RolloutBackend test double that 'samples' scripted texts, one per call, and records the prompts it was asked
    (the component under test is the episode loop and what follows it, not an engine)."""

    per_sample_seeds = False

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    def generate(self, prompts, params):
        import torch

        from verl_kit.rollout import Rollout

        self.prompts.append([list(p) for p in prompts])
        ids = self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = torch.tensor([ids] * len(prompts))
        return Rollout(prompts, ids, torch.ones_like(ids, dtype=torch.bool), torch.full(ids.shape, -0.5),
                       torch.zeros(len(prompts), dtype=torch.bool))

    def keep_prefixes(self):
        import contextlib

        return contextlib.nullcontext()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def qwen3_tokenizer(tiny_model_path: str, out_dir) -> str:
    """The tiny tokenizer with Qwen3's chat tokens (<|im_start|>/<|im_end|> special, <|im_end|> its EOS; <think>,
    <tool_call>, <tool_response> and their closers plain added tokens, as in Qwen3's tokenizer) and TRL 1.16's copy
    of Qwen3's chat template, saved to `out_dir`: a thinking model's template without the hub."""
    from trl.chat_template_utils import qwen3_chat_template

    from verl_kit.models import load_tokenizer

    tok = load_tokenizer(tiny_model_path)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = qwen3_chat_template
    tok.save_pretrained(out_dir)
    return str(out_dir)


def prompt_groups(groups) -> tuple[list[list[int]], list[list[bool]], list[int]]:
    """Sequences that share their prompts, as GRPO groups do: for each (prompt length, completion lengths) of
    `groups`, one random prompt (seed 0, ids 5-599) followed by each random completion. Returns the sequences, their
    loss masks (completion tokens) and each sequence's shareable prefix (layout's shared_prefix: prompt length - 1)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, 600, (n,), generator=g).tolist()  # noqa: E731
    seqs, masks, shared = [], [], []
    for n, completions in groups:
        prompt = rand(n)
        for k in completions:
            seqs.append(prompt + rand(k))
            masks.append([False] * n + [True] * k)
            shared.append(n - 1)
    return seqs, masks, shared


def eos_biased_engine(model_path: str, tokenizer, bias: float = 5.0):
    """The real HF-generate backend on `model_path` with the EOS logit raised by `bias` (a bias on the copy's output
    layer), so that the random tiny model's turns end and episodes get to their next turn."""
    import torch

    from verl_kit.models import load_causal_lm
    from verl_kit.rollout import HFGenerateBackend

    engine = HFGenerateBackend(load_causal_lm(model_path).eval(), tokenizer, "cpu", torch.float32)
    head = engine.model.lm_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    biased.weight.data.copy_(head.weight.data)
    biased.bias.data.zero_()
    biased.bias.data[tokenizer.eos_token_id] = bias
    engine.model.lm_head = biased
    return engine


@contextlib.contextmanager
def reward_server(model_dir: str, cache_dir, *args: str):
    """`python -m verl_kit.rewards.serve --model model_dir` as a user starts it (no key of their own: it writes a
    fresh one to a 0600 file under `cache_dir`, VERL_KIT_CACHE, and prints the file): yields (url, key, process);
    stopped at the end. Fails with the server's output if it is not healthy within 120 s."""
    import re

    import requests

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "verl_kit.rewards.serve", "--model", model_dir, "--port", str(port),
                             *args], cwd=REPO, env=env(VERL_KIT_CACHE=str(cache_dir)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        printed = ""
        while not (found := re.search(r"VERL_KIT_REWARD_KEY=\$\(cat (\S+)\)", printed)):
            line = proc.stdout.readline()
            assert line, f"the reward server ended before printing its key:\n{printed}"
            printed += line
        path = found.group(1)
        assert os.stat(path).st_mode & 0o777 == 0o600, oct(os.stat(path).st_mode)
        key, url = open(path).read().strip(), f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            try:
                if requests.get(url + "/health", headers={"Authorization": f"Bearer {key}"}, timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            time.sleep(0.2)
        yield url, key, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
