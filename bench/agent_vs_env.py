"""The cost of `--agent`: GRPO step time with the task written as an OpenAI-SDK agent (its requests served through the
run's loopback endpoint: HTTP, JSON, the chat template applied per request) against the same task as an environment
class (`--environment_factory`, the episode loop in the trainer), measured in the same run. Target: the agent path
within 1.15x of the environment path's step time (ratio = environment / agent >= 0.87).

    python bench/agent_vs_env.py                 # ~10 minutes on 2 CPU cores (+2 to teach the model, once)
    python bench/agent_vs_env.py --steps 2

The task is bench/episodes_vs_trl.py's: the bench model taught to call `look()` (cached), one tool describing the
next room, the reward the rooms seen, at most 2 rounds of tool calls, 8 prompts x 4 episodes per step, episodes of
at most 256 tokens, HF generate, one process, one compute thread. `explore` below is that environment as an agent:
it offers the environment's tool schema, runs `look` itself on the calls the replies make, and returns the rooms seen;
its third reply's calls are not run, as the environment's third round is not.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recipe loads this file by path, for `explore`
from episodes_vs_trl import EPISODE, GENERATIONS, PROMPTS, ROUNDS, Explore, tool_bench_args  # noqa: E402


async def explore(client, row: dict) -> float:
    """The Explore environment as an agent on the OpenAI SDK."""
    from transformers.utils import get_json_schema

    env, messages = Explore(), list(row["prompt"])
    env.reset()
    for turn in range(ROUNDS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=[get_json_schema(Explore.look)])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or turn == ROUNDS:
            break
        for call in message.tool_calls:
            result = env.look() if call.function.name == "look" else str({"error": "no such tool"})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return env.get_reward()


def main(argv=None):
    import harness as h  # here: the recipe imports this file for `explore`, without bench/ on its path

    args = tool_bench_args(h, __doc__, argv)
    out = h.RESULTS / "agent_vs_env"
    here = Path(__file__).resolve()
    flags = ["--prompts_per_step", str(PROMPTS), "--num_generations", str(GENERATIONS), "--beta", "0.04",
             "--max_tool_calling_iterations", str(ROUNDS), "--reward_fn", "none", "--max_prompt_length", "320",
             "--max_length", "640", "--packing_length", "1280"]
    env_flags = ["--environment_factory", f"{here.parent / 'episodes_vs_trl.py'}:Explore"]
    agent_flags = ["--agent", f"{here}:explore"]
    results, lines = {"args": vars(args)}, []
    from verl_kit.models import TINY_PREFS

    h.compare_workloads(args, {"tool": TINY_PREFS}, results, lines, "agent_vs_env", "the environment path",
                        lambda t, path: h.run_online(args, out, t, "grpo.py",
                                                     flags + agent_flags + ["--dataset_name", path], length=EPISODE),
                        lambda t, path: h.run_online(args, out, t, "grpo.py",
                                                     flags + env_flags + ["--dataset_name", path], length=EPISODE))
    got = results["tool"]
    for side, name in (("ours", "agent"), ("trl", "environment")):
        m = got[side]["metrics"]
        mean = lambda k: sum(r[k] for r in m) / len(m)  # noqa: B023 - used at once
        lines.append(f"  {name}: {mean('response_length/mean'):.1f} sampled tokens and "
                     f"{mean('tools/call_frequency'):.2f} tool calls per episode, reward {mean('reward/mean'):.2f}, "
                     f"generation {mean('timing_s/gen'):.1f}s/step")
    h.save_results("agent_vs_env", results)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
