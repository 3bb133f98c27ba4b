"""The sandboxed code reward (verl_kit.rewards.code): HumanEval's canonical solutions pass their own tests through
it and wrong ones do not; a hostile program costs a zero reward and nothing else: the trainer and the machine are
unharmed and nothing stays behind. The full sandbox needs root (namespaces, a uid of its own), as in CI."""

import json
import os
import socket
import time

import psutil
import pytest

from verl_kit.rewards import code_tests
from verl_kit.rewards.code import UID_BASE, UID_SPAN, Limits, isolation, program_of, run_sandboxed

ROOT = os.geteuid() == 0
QUICK = Limits(wall_s=3, cpu_s=2, memory_mib=512, file_mib=4, processes=16)


def _sandbox_processes() -> list:
    return [p for p in psutil.process_iter(["uids"]) if UID_BASE <= p.info["uids"].real < UID_BASE + UID_SPAN]


@pytest.fixture(scope="module")
def humaneval(tmp_path_factory):
    from verl_kit.data.tasks import write_humaneval

    out = tmp_path_factory.mktemp("humaneval")
    write_humaneval(str(out))
    return [json.loads(line) for name in ("train", "test") for line in open(out / f"{name}.jsonl")]


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(humaneval):
    """Every fourth of HumanEval's 164 problems (all 164 pass when run: measured), each with its canonical solution
    (1.0, as HumanEval's own harness scores them) and with the solution of another problem (0.0); a chat prompt takes
    the completion's ```python block, after the imports of the code the prompt showed."""
    rows = humaneval[::4]
    good = code_tests([r["prompt"] for r in rows], [r["canonical_solution"] for r in rows],
                      [r["test"] for r in rows], [r["entry_point"] for r in rows])
    assert good == [1.0] * len(rows), [r["task_id"] for r, g in zip(rows, good) if g != 1.0]
    wrong = code_tests([r["prompt"] for r in rows[:10]], [r["canonical_solution"] for r in rows[1:11]],
                       [r["test"] for r in rows[:10]], [r["entry_point"] for r in rows[:10]])
    assert sum(wrong) == 0, wrong
    shown = "```python\nfrom typing import List\n\ndef add(a: List[int]):\n```"
    chat = [{"role": "user", "content": "Complete it.\n" + shown}]
    reply = "Here it is:\n```python\ndef add(a: List[int]):\n    return sum(a)\n```\nDone."  # the import dropped
    test = "def check(f):\n    assert f([2, 3]) == 5\n"
    assert program_of(chat, reply, test, "add").startswith("from typing import List\ndef add(a: List[int]):\n")
    assert code_tests([chat, chat], [reply, reply.replace("sum(a)", "max(a)")], [test, test], ["add", "add"]) == [1, 0]


HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "infinite loop": "while True:\n    pass\n",
    "10 GB allocation": "x = bytearray(10 * 2**30)\n",
    "huge file": "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)\n",
    "writes outside its folder": (
        "import os\nfor path in ({escape!r}, '/dev/shm/{nonce}', '/var/tmp/{nonce}', {repo_file!r}, "
        "os.path.expanduser('~') + '/{nonce}'):\n    try:\n        open(path, 'w').write('x')\n    except OSError:\n"
        "        pass\nraise SystemExit(1)\n"),
    "reads the parent's environment": (
        "import os\nseen = open(f'/proc/{{os.getppid()}}/environ', 'rb').read() + str(os.environ).encode()\n"
        "raise SystemExit(0 if b'{secret}' in seen else 1)\n"),
    "a socket": (
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')\n"),
    "kills its parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "a child left running": (
        "import os, subprocess, sys\nif os.fork() == 0:\n    os.setsid()\n    subprocess.Popen(['sleep', '600'])\n"
        "    os._exit(0)\nraise SystemExit(1)\n"),
}


@pytest.mark.skipif(not ROOT, reason="the full sandbox needs root (namespaces, a uid of its own)")
def test_hostile_programs_cost_a_zero_reward_and_nothing_else(tmp_path, monkeypatch):
    """Each hostile program fails (a zero reward) within the deadline; afterwards the trainer is alive, the listening
    socket got no connection, nothing was written outside the sandbox (/tmp, /dev/shm, /var/tmp, the repository, root's
    home), the secret in the trainer's environment was not read, and no process of a sandbox uid is left."""
    nonce = f"verl-kit-escape-{os.getpid()}-{time.time_ns()}"
    secret = f"s3cret-{time.time_ns()}"
    monkeypatch.setenv("VERL_KIT_TEST_SECRET", secret)
    escape, repo_file = f"/tmp/{nonce}", os.path.join(os.path.dirname(os.path.dirname(__file__)), nonce)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    outcomes = {}
    for name, source in HOSTILE.items():
        t0 = time.monotonic()
        program = source.format(escape=escape, nonce=nonce, repo_file=repo_file, secret=secret, port=port)
        outcomes[name] = run_sandboxed(program, QUICK)
        assert time.monotonic() - t0 < QUICK.wall_s + 10, name
    assert not any(o.passed for o in outcomes.values()), outcomes
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing connected
    for path in (escape, f"/dev/shm/{nonce}", f"/var/tmp/{nonce}", repo_file, os.path.expanduser(f"~/{nonce}")):
        assert not os.path.exists(path), path
    assert "MemoryError" in outcomes["10 GB allocation"].reason, outcomes["10 GB allocation"]
    assert "File too large" in outcomes["huge file"].reason, outcomes["huge file"]
    assert "PermissionError" in outcomes["kills its parent"].reason, outcomes["kills its parent"]
    deadline = time.monotonic() + 5
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _sandbox_processes(), [(p.pid, p.name()) for p in _sandbox_processes()]
    print({k: v.reason for k, v in outcomes.items()}, isolation())


@pytest.mark.slow
def test_grpo_runs_with_the_code_reward(tmp_path):
    """`--reward_fn verl_kit.rewards:code_tests` in recipes/grpo.py: the dataset's `test` and `entry_point` columns
    reach it, every sample is scored (the random tiny model's programs fail: 0.0) with no reward
    error, and the run says what sandbox it has."""
    from helpers import metrics, recipe_cmd, run, write_jsonl

    rows = [{"prompt": f"def {name}(a, b):\n", "test": f"def check(f):\n    assert f(6, 3) == {value}\n",
             "entry_point": name} for name, value in (("add", 9), ("sub", 3), ("mul", 18), ("div", 2))]
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", rows)
    out = tmp_path / "run"
    p = run(recipe_cmd("grpo.py", ["--config", "recipes/configs/grpo_tiny.yaml", "--dataset_name", str(data),
                                   "--dataset_test_split", "none", "--reward_fn", "verl_kit.rewards:code_tests",
                                   "--max_steps", "1", "--prompts_per_step", "4", "--num_generations", "2",
                                   "--max_completion_length", "16", "--output_dir", str(out), "--logging_steps", "1"]),
            timeout=300)
    steps = [r for r in metrics(out) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1] and all(r["reward/errors"] == 0 for r in steps), steps
    assert all(r["rewards/code_tests/mean"] == 0.0 for r in steps), steps
    assert f"code_tests sandbox: {isolation()}" in p.stderr, p.stderr[-2000:]
