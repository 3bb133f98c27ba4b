"""Multi-turn GRPO step time: `recipes/grpo.py --environment_factory` against TRL 1.16's GRPOTrainer with
`environment_factory=`, the same environment class, measured in the same run.

    python bench/episodes_vs_trl.py                 # ~12 minutes on 2 CPU cores (+2 to teach the model, once)
    python bench/episodes_vs_trl.py --steps 2

The environment (`Explore`, below): one tool, `look()`, that describes the next room in a fixed sentence; the
reward is the number of rooms seen. Episodes are capped at 2 rounds of tool calls (`max_tool_calling_iterations`
on both sides), so a well-formed episode is: call, result, call, result, call (the third call is not run).

Why the bench model is first taught to call the tool: TRL's environments have no `respond` (a turn without a tool
call ends the episode), and a random-init model never writes a well-formed `<tool_call>`, so both sides would run
one-turn episodes only. The bench model (harness.build_model) is fine-tuned for a few steps, once and cached, to
write `<tool_call>{"name": "look", "arguments": {}}</tool_call>` after every assistant header; sampled at
temperature 1 about 9 calls in 10 come out whole, so the episodes are really multi-turn on both sides, with each
side's own tool-call parser and tool loop. The rest are malformed calls, which the sides treat differently: ours
answers `{'error': ...}` and the episode goes on (a failed call), TRL's parse_response falls back to plain text and
the episode ends, so ours' episodes run about 10% longer. The tokens per step are measured and printed for both.

Why a chat template is set: TRL refuses the bench model's (the embedded tiny model's) template at start
("The provided chat template does not support tool calling": trl/trainer/grpo_trainer.py, the supports_tool_calling
check in GRPOTrainer.__init__; the template prints `message['content']` only, so a tool call disappears), and it
reads tool calls only with a response parser, which it sets for known templates only (add_response_schema raises
"Unrecognized chat template" otherwise). Both sides therefore get TOOL_TEMPLATE, a Qwen-2.5-style template in the
tiny tokenizer's own special tokens (tool schemas in the system message, `<tool_call>` blocks, tool results as user
turns in `<tool_response>`; without tools it renders exactly like the embedded template), and TRL gets
RESPONSE_TEMPLATE (transformers' response parser: Qwen3's, with the tiny end token) on the tokenizer. Our kit sees
a template with tool support and takes the native tool path (it reads `<tool_call>` blocks itself).

The same on both sides otherwise: 8 embedded-task prompts x 4 episodes per step, episodes of at most 256 tokens
(sampled plus tool results, TRL's meaning), HF generate (TRL without vLLM), temperature 1, beta 0.04 (a frozen
reference), one optimizer step per rollout of one micro-batch, the environment's reward only, fp32, one process,
one compute thread. Step time and ratio (TRL / ours): harness.compare_workloads, as in bench/grpo_vs_trl.py.
Our side's layout knob: `--packing_length 1280`, so that a group's prompt and its 4 episodes fit one packed row and
the prompt goes through the model once (docs/recipes.md); TRL pads each episode with its own copy of the prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROMPTS, GENERATIONS, EPISODE, ROUNDS = 8, 4, 256, 2
CALL = '<tool_call>{"name": "look", "arguments": {}}</tool_call>'
# Qwen-2.5's tool layout in the tiny tokenizer's special tokens (<|system|>, <|user|>, <|assistant|>, <|end|>).
TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{- '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{- '\n</tools>\nCall a tool as <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|end|>' }}"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}<|end|>{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|user|><tool_response>\n' + message['content'] + '\n</tool_response><|end|>' }}"
    "{%- elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{- (f['arguments'] | tojson) + '}</tool_call>' }}"
    "{%- endfor %}<|end|>"
    "{%- else %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# transformers' response parser (what TRL reads tool calls with): trl.chat_template_utils.qwen3_template's fields.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
    "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                              "content": "json", "transform": {"type": "function", "function": "{content}"}},
               "content": {"close_pattern": r"<\|end\|>\s*", "content": "text"}}}


class Explore:
    """A deterministic walk through rooms: `look` describes the next one; the reward counts the rooms seen."""

    def reset(self, **row) -> None:
        self.rooms = 0

    def look(self) -> str:
        """Look at the next room."""
        self.rooms += 1
        return f"Room {self.rooms}: the river, the old bridge and the quiet park."

    def get_reward(self) -> float:
        return float(self.rooms)


def build_tool_model(h, max_steps: int = 200, target: float = 0.003) -> str:
    """The bench model with TOOL_TEMPLATE, fine-tuned (once, cached) to answer every assistant header with CALL:
    AdamW on well-formed episodes of embedded-task prompts, one per step, the loss on the calls only, until the mean
    loss of the last 10 steps is under `target` per token (a 46-token call then comes out whole ~90% of the time)."""
    out = h.RESULTS / "cache" / "tiny-llama-20m-tools"
    if (out / "config.json").is_file():
        return str(out)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_kit.data import load_split
    from verl_kit.models import TINY_PREFS

    base = h.build_model()
    tok = AutoTokenizer.from_pretrained(base)
    tok.chat_template = TOOL_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    env = Explore()
    call = tok(CALL + tok.eos_token, add_special_tokens=False)["input_ids"]
    rows = []
    for row in load_split(TINY_PREFS, "train").select(range(max_steps)):
        env.reset()
        ids = tok.apply_chat_template(row["prompt"], tools=[env.look], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        labels = [-100] * len(ids)
        for turn in range(ROUNDS + 1):
            ids, labels = ids + call, labels + call
            if turn < ROUNDS:
                result = tok(f"<|user|><tool_response>\n{env.look()}\n</tool_response><|end|><|assistant|>",
                             add_special_tokens=False)["input_ids"]
                ids, labels = ids + result, labels + [-100] * len(result)
        rows.append((torch.tensor([ids]), torch.tensor([labels])))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / max_steps)
    losses = []
    for step, (ids, labels) in enumerate(rows):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        decay.step()
        opt.zero_grad()
        losses.append(loss.item())
        if (step + 1) % 10 == 0:
            print(f"tool model: step {step + 1} loss {sum(losses[-10:]) / 10:.4f}", flush=True)
            if sum(losses[-10:]) / 10 < target:
                break
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.response_template = RESPONSE_TEMPLATE  # saved in tokenizer_config.json; our kit does not read it
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


def tool_bench_args(h, doc: str, argv=None) -> argparse.Namespace:
    """The flags of a bench on the tool-calling bench model (this one, bench/agent_vs_env.py), the model built."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=1, help="steps skipped per run")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    args.model, args.skip = build_tool_model(h), []
    return args


def main(argv=None):
    import harness as h  # here, not at the top: the recipe imports this file for Explore, without bench/ on its path

    args = tool_bench_args(h, __doc__, argv)
    out = h.RESULTS / "episodes_vs_trl"
    flags = ["--prompts_per_step", str(PROMPTS), "--num_generations", str(GENERATIONS), "--beta", "0.04",
             "--environment_factory", f"{Path(__file__).resolve()}:Explore", "--max_tool_calling_iterations",
             str(ROUNDS), "--reward_fn", "none", "--max_prompt_length", "320", "--max_length", "640",
             "--packing_length", "1280"]  # a group's 4 episodes (<= 4 x 257) after its ~130-token prompt, in one row
    results, lines = {"args": vars(args)}, []
    from verl_kit.models import TINY_PREFS

    h.compare_workloads(args, {"tool": TINY_PREFS}, results, lines, "episodes_vs_trl", "TRL 1.16 GRPOTrainer",
                        lambda t, path: h.run_online(args, out, t, "grpo.py", flags + ["--dataset_name", path],
                                                     length=EPISODE),
                        lambda t, path: h.run_online_peer(args, out, t, "episodes_vs_trl.py", "trl-episodes-worker",
                                                          ["--data", path]))
    got = results["tool"]
    ours = [{"sampled": r["response_length/mean"] * PROMPTS * GENERATIONS,
             "episode": r["response_length/mean"] * PROMPTS * GENERATIONS / (1 - r["episode/env_token_share"]),
             "calls": r["tools/call_frequency"], "turns": r["episode/turns"], "gen_s": r["timing_s/gen"]}
            for r in got["ours"]["metrics"]]
    trl = got["trl"]["episodes"][args.warmup:]
    mean = lambda xs, k: sum(x[k] for x in xs) / max(len(xs), 1)
    results["tokens_per_step"] = {side: {k: mean(xs, k) for k in xs[0]} for side, xs in (("ours", ours), ("trl", trl))}
    for side, t in results["tokens_per_step"].items():
        lines.append(f"  {side}: {t['sampled']:.0f} sampled + {t['episode'] - t['sampled']:.0f} tool-result tokens "
                     f"per step, {t['calls']:.2f} tool calls and {t['turns']:.2f} turns per episode, "
                     f"generation {t['gen_s']:.1f}s/step")
    h.save_results("episodes_vs_trl", results)
    print("\n".join(lines))


def trl_episodes_worker(argv):
    import harness as h

    a = h.trl_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verl_kit.data import load_split

    episodes = []

    class Counting(GRPOTrainer):  # the episode tokens of every step: sampled (tool_mask 1) and tool results
        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            completion_ids, tool_mask, completions = out[1], out[2], out[3]
            count = lambda role: sum(1 for c in completions for m in c if m["role"] == role) / len(prompts)
            episodes.append({"sampled": sum(sum(m) for m in tool_mask), "episode": sum(map(len, completion_ids)),
                             "calls": count("tool"), "turns": count("assistant"),
                             "gen_s": time.perf_counter() - t0})
            return out

    ds = load_split(a.data, "train").select_columns(["prompt"])
    config = GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=PROMPTS * GENERATIONS,
        num_generations=GENERATIONS, max_completion_length=EPISODE, max_tool_calling_iterations=ROUNDS,
        gradient_accumulation_steps=1, num_iterations=1, beta=0.04, learning_rate=1e-5, lr_scheduler_type="constant",
        temperature=1.0, top_p=1.0, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=42, dataloader_num_workers=0)
    clock = h.step_clock()
    trainer = Counting(model=AutoModelForCausalLM.from_pretrained(a.model, dtype="float32"), reward_funcs=None,
                       args=config, train_dataset=ds, processing_class=AutoTokenizer.from_pretrained(a.model),
                       callbacks=[clock], environment_factory=Explore)
    trainer.train()
    clock.save(f"{a.out}/steps.json", episodes=episodes)
    print(json.dumps(episodes))


if __name__ == "__main__":
    trl_episodes_worker(sys.argv[2:]) if sys.argv[1:2] == ["trl-episodes-worker"] else main()
