"""Timeouts that hold (verl_kit.deadline): a reward, tool or environment call past its timeout leaves nothing
running. On the main thread (where the recipes score and, with synchronous rollouts, run episodes) the call is
interrupted where it is; a reward function that blocks forever, an `async def` one that blocks its event loop, an
environment whose reset, respond or get_reward hangs, and 3,000 tool calls that hang each
cost their timeout and leave no thread behind, and math_answer stays on the main thread with its own SIGALRM limits.
Off the main thread (--async_rollout's rollout thread) a hanging call is abandoned on its thread, at most
MAX_ABANDONED at a time: the next one stops the run in one line."""

import asyncio
import threading
import time

import pytest

from verl_kit.errors import UserError
from verl_kit.rewards import CallLimits, call_reward_fn
from verl_kit.rollout.tools import call_tool

PROMPTS, COMPLETIONS = ["p0", "p1", "p2"], ["a", "b", "c"]


def blocks_forever(prompts, completions):
    threading.Event().wait()  # no timeout: only an interruption ends it


async def blocks_its_loop(prompts, completions):
    if completions[0] == "b":
        time.sleep(30)  # blocking call inside a coroutine: asyncio.wait_for cannot cancel it
    return [1.0]


def test_reward_that_blocks_forever_leaves_no_thread():
    """--reward_timeout_s 0.3 --reward_fallback -1: three calls of a function that never returns each give the batch
    the fallback after ~0.3 s, and no thread is left running (a thread waited for and abandoned would stay blocked
    for good, one per call). An async function that blocks its event loop ends at the loop's outer deadline."""
    limits = CallLimits(timeout_s=0.3, fallback=-1.0)
    threads = threading.active_count()
    t0 = time.monotonic()
    for _ in range(3):
        assert call_reward_fn("blocks", blocks_forever, PROMPTS, COMPLETIONS, limits=limits).tolist() == [-1.0] * 3
    assert time.monotonic() - t0 < 3 and limits.timeouts == 9
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]

    # an async function awaited per sample: the loop's outer deadline is 0.3 x (ceil(3 / 16) + 1) = 0.6 s; samples a
    # and c returned before b blocked, b and whatever had not returned count as timed out
    t0 = time.monotonic()
    out = call_reward_fn("loop", blocks_its_loop, PROMPTS, COMPLETIONS, limits=limits).tolist()
    assert time.monotonic() - t0 < 5 and out[1] == -1.0 and out[0] == 1.0
    assert threading.active_count() == threads


def test_a_timeout_keeps_math_answer_on_the_main_thread():
    """math-verify's own limits (3 s per parse and comparison) work by SIGALRM, on the main thread only: with a timeout
    the reward still runs there, and math_answer scores as without one."""
    from verl_kit.rewards import math_answer

    seen = []

    def where(prompts, completions):
        seen.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(completions)

    limits = CallLimits(timeout_s=5.0)
    call_reward_fn("where", where, PROMPTS, COMPLETIONS, limits=limits)
    assert seen == [True]
    scores = call_reward_fn("verl_kit.rewards:math_answer", math_answer, ["q", "q"], ["so 7", "so 8"],
                            {"answer": ["7", "7"]}, limits=limits)
    assert scores.tolist() == [1.0, 0.0]


def hang() -> str:
    """A tool that never returns."""
    threading.Event().wait()


def test_three_thousand_hanging_tool_calls_leave_no_thread():
    """Issue 39's measure: 3,000 calls of a tool that hangs, cut at 1 ms each, all come back as the model's error
    result and leave the thread count where it was (abandoned threads would number 3,000)."""
    threads, t0 = threading.active_count(), time.monotonic()
    for _ in range(3000):
        name, result, failed = call_tool({"hang": hang}, {"name": "hang", "arguments": {}}, 0.001)
        assert failed and "timed out after 0.001 s" in result
    assert threading.active_count() == threads
    print(f"3000 hanging tool calls: {time.monotonic() - t0:.1f} s")


def test_hanging_calls_off_the_main_thread_are_capped():
    """Off the main thread a call cannot be interrupted: each hanging one is abandoned on its daemon thread, and once
    MAX_ABANDONED are still running the next call stops the run with one line naming the tool, instead of threads
    piling up without end."""
    from verl_kit import deadline

    box, threads, release = {}, threading.active_count(), threading.Event()

    def stuck() -> str:
        """A tool that hangs until the test ends."""
        release.wait()

    def rollout_thread():
        try:
            for _ in range(3 * deadline.MAX_ABANDONED):
                call_tool({"stuck": stuck}, {"name": "stuck", "arguments": {}}, 0.01)
        except UserError as e:
            box["error"] = str(e)

    t = threading.Thread(target=rollout_thread)
    t.start()
    t.join(30)
    try:
        assert not t.is_alive()
        assert threading.active_count() - threads <= deadline.MAX_ABANDONED
        assert box["error"].startswith(f"{deadline.MAX_ABANDONED} calls cut at their timeout are still running (tool "
                                       "stuck): ") and "\n" not in box["error"]
    finally:
        release.set()  # the abandoned calls return: the cap is free again for the other tests
        deadline_s = time.monotonic() + 10
        while deadline.abandoned() and time.monotonic() < deadline_s:
            time.sleep(0.01)
    assert deadline.abandoned() == 0


@pytest.mark.parametrize("off_main", [False, True])
def test_a_call_that_returns_in_time_is_untouched(off_main):
    """A call within its timeout returns its value or raises its own exception, on either path."""
    from verl_kit import deadline

    def both():
        assert deadline.call_with_deadline(lambda: 7, 5.0, "x") == 7
        with pytest.raises(KeyError):
            deadline.call_with_deadline(lambda: {}["k"], 5.0, "x")
        return True

    if not off_main:
        assert both()
        return
    out = []
    t = threading.Thread(target=lambda: out.append(both()))
    t.start()
    t.join(10)
    assert out == [True]


def test_async_reward_without_blocking_still_times_out_per_call():
    """Cooperative awaits keep asyncio's per-call timeout (the outer deadline is not what cuts them)."""
    async def slow(prompts, completions):
        await asyncio.sleep(5 if completions[0] == "b" else 0)
        return [0.5]

    limits = CallLimits(timeout_s=0.2, fallback=0.0)
    assert call_reward_fn("slow", slow, PROMPTS, COMPLETIONS, limits=limits).tolist() == [0.5, 0.0, 0.5]
    assert limits.timeouts == 1


class Hangs:
    """An environment whose `hang` method (reset, respond or get_reward, from the dataset row) blocks forever."""

    def reset(self, hang=None, **row):
        self.hang = hang
        if hang == "reset":
            threading.Event().wait()

    def respond(self, text):
        if self.hang == "respond":
            threading.Event().wait()
        return None

    def get_reward(self):
        if self.hang == "get_reward":
            threading.Event().wait()
        return 1.0


def test_environment_calls_that_hang_end_their_episode(tokenizer, caplog):
    """--env_timeout_s 0.3 (issue 55, item 1): an environment whose reset, respond or get_reward never returns costs
    its episode, not the run: each ends at ~0.3 s as a counted failure (episode/env_errors, its score the fallback, a
    warning line per method), the episode beside it scores 1, no thread is left running, and the held-out evaluation
    counts them (eval/episode/env_errors). On main 64ad734 each of them hung the step for good."""
    from dataclasses import replace
    from types import SimpleNamespace

    from helpers import Scripted

    from verl_kit.rewards import Rewards
    from verl_kit.rollout import Episodes, Prompts, SamplingParams, Scores, evaluate

    rows = [{"prompt": "Say hi.", "hang": h} for h in ("reset", "respond", "get_reward", None)]
    eps = Episodes(Scripted(tokenizer, ["hi"] * 2), tokenizer, "tiny-llama", env_factory=Hangs,
                   max_prompt_length=64, env_timeout_s=0.3)
    threads, t0 = threading.active_count(), time.monotonic()
    with caplog.at_level("WARNING"):
        ro = eps.run(rows, [1, 2, 3, 4], SamplingParams())
    assert time.monotonic() - t0 < 5 and threading.active_count() == threads
    assert [e["env_errors"] for e in ro.episodes] == [1, 1, 1, 0]
    assert [e["failure"] for e in ro.episodes][:3] == [f"Hangs.{m} did not return within 0.3 s (--env_timeout_s)"
                                                       for m in ("reset", "respond", "get_reward")]
    assert ro.response_mask[0].sum() == 0 and ro.response_mask[1:].sum(-1).gt(0).all()  # reset's: no turn played
    rewards = Rewards("none", None, None, tokenizer=tokenizer, env_reward=True, limits=CallLimits(fallback=-1.0))
    scored = rewards.of_rollout(replace(ro, rows=rows))
    assert scored.total.tolist() == [-1.0, 1.0, -1.0, 1.0]  # respond's episode still asks get_reward
    assert sum("did not return within 0.3 s" in r.message for r in caplog.records) == 3
    eps.engine.texts += ["hi"] * 2
    split = Prompts(rows, [[0]] * 4)
    held_out = evaluate(SimpleNamespace(num_processes=1, process_index=0, is_main_process=False),
                        lambda idx, params: eps.generate(split, idx, params, "the held-out split"), split,
                        SamplingParams(), lambda ro: Scores(ro.env_reward.nan_to_num()), 4)
    assert held_out["eval/episode/env_errors"] == 0.75
