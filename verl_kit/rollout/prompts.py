"""Rollouts in, metrics out: held-out evaluation through any rollout backend, the rollout metrics of a step and
readable sample rows (the prompt splits themselves: data.prompts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from verl_kit.algos.evaluation import pass_at_k
from verl_kit.data.datasets import SOURCE, source_metrics
from verl_kit.metrics import progress
from verl_kit.rollout.types import Prompts, Rollout, SamplingParams, Scores, select_rows
from verl_kit.train.distributed import Tally, reduce_metrics, shard


def rollout_metrics(ro: Rollout, scored: Scores, step_seconds: float, environments: tuple[str, ...] = (),
                    data_sources: list[str] = ()) -> dict:
    """reward/*, response_length/* and perf/tokens_per_s of a step's rollouts on all processes (collective); for
    multi-turn episodes also TRL's tools/call_frequency (tool calls per episode) and tools/failure_frequency (failed
    calls per call), episode/turns (assistant turns per episode) and episode/env_token_share (the response tokens the
    environment inserted), and per environment of the multi-environment form (`environments`, the same names on every
    process: Rollouts.environments) env/<name>/*. response_length counts the sampled tokens. Each reward source's own
    scores (`scored.sources`) as TRL's rewards/<name>/mean and rewards/<name>/std. The reward statistics are per
    episode, the lengths per training sample (an --agent's episode may hold several). With `data_sources` (the split's
    data_source names, Prompts.sources): data/source_share/<name> and data/source_reward/<name> per episode."""
    lengths, scores = ro.response_mask.sum(-1), scored.total
    episode_scores = ro.per_episode(scores).tolist() if data_sources else None
    sources = {"score": scores, **{f"rewards/{k}": v for k, v in scored.sources.items()}}
    sources = {k: ro.per_episode(v) for k, v in sources.items()}
    t = reduce_metrics({"n": len(ro.first_rows()), "rows": len(lengths), **{k: v.sum() for k, v in sources.items()},
                        **{f"{k}_sq": (v.double() ** 2).sum() for k, v in sources.items()},
                        "tokens": lengths.sum(), "truncated": ro.truncated.sum(),
                        "prompt_tokens": sum(len(p) for p in ro.prompt_ids)}, {"max_length": lengths.max()})
    n, rows = t["n"], t["rows"]
    mean = {k: t[k] / n for k in sources}
    std = {k: max(t[f"{k}_sq"] / n - mean[k] ** 2, 0.0) ** 0.5 for k in sources}
    return {"reward/mean": mean["score"], "reward/std": std["score"],
            **{f"{k}/{stat}": v[k] for k in sources if k != "score" for stat, v in (("mean", mean), ("std", std))},
            "response_length/mean": t["tokens"] / rows, "response_length/max": t["max_length"],
            "response_length/clip_ratio": t["truncated"] / rows,
            "perf/tokens_per_s": (t["tokens"] + t["prompt_tokens"]) / step_seconds,
            **episode_metrics(ro, scores, environments),
            **(source_metrics([ro.rows[i].get(SOURCE) for i in ro.first_rows()], data_sources, episode_scores)
               if data_sources else {})}


def episode_metrics(ro: Rollout, scores: torch.Tensor, environments: tuple[str, ...] = ()) -> dict:
    """tools/*, episode/* of a multi-turn batch over all processes (collective; episode/env_errors: the episodes whose
    environment's respond or get_reward raised, per episode), and for each of `environments`
    env/<name>/reward_mean (the total reward of its episodes), env/<name>/share (of the episodes),
    env/<name>/tool_call_frequency, env/<name>/tool_failure_frequency and env/<name>/turns; {} for single-turn
    rollouts."""
    if ro.episodes is None:
        return {}
    sums = {"env_tokens": ro.env_mask.sum(), "all_tokens": ro.sequence_mask.sum(), "samples": len(ro.prompt_ids)}
    first = ro.first_rows()  # an agent's episode of several rows (per-call samples) counts once
    ro, scores = select_rows(ro, first), scores[first]
    names = [e["environment"] for e in ro.episodes]
    groups = {"": [True] * len(names), **{f"env/{name}/": [e == name for e in names] for name in environments}}
    for g, member in groups.items():
        eps = [e for e, m in zip(ro.episodes, member) if m]
        sums.update({f"{g}n": len(eps), f"{g}score": scores[torch.tensor(member, dtype=torch.bool)].sum(),
                     **{f"{g}{k}": sum(e[k] for e in eps) for k in ("tool_calls", "tool_failures", "turns")}})
    sums["env_errors"] = sum(e.get("env_errors", 0) for e in ro.episodes)
    t = reduce_metrics(sums)
    out = {"episode/env_token_share": t["env_tokens"] / max(t["all_tokens"], 1),
           "episode/env_errors": t["env_errors"] / max(t["n"], 1), "episode/samples": t["samples"] / max(t["n"], 1)}
    for g in groups:
        n, calls = max(t[f"{g}n"], 1), t[f"{g}tool_calls"]
        call, failure, turns = ("tools/call_frequency", "tools/failure_frequency", "episode/turns") if not g else \
            (f"{g}tool_call_frequency", f"{g}tool_failure_frequency", f"{g}turns")
        out.update({call: calls / n, failure: t[f"{g}tool_failures"] / max(calls, 1), turns: t[f"{g}turns"] / n})
        if g:
            out.update({f"{g}reward_mean": t[f"{g}score"] / n, f"{g}share": t[f"{g}n"] / max(t["n"], 1)})
    return out


@torch.no_grad()
def evaluate(accelerator, generate: Callable[[list[int], SamplingParams], Rollout], split: Prompts,
             params: SamplingParams, score, batch_size: int, pass_threshold: float = 1.0, extra=None,
             environments: tuple[str, ...] = ()) -> dict:
    """Mean score of the responses to the held-out `split` (`score(rollout) -> Scores`, no KL term), the
    prompts sharded over processes, `batch_size` per call of `generate(prompt indices, params)` (Rollouts.evaluate's:
    the run's backend, or its episodes). Every process makes the same calls (ZeRO-3
    lockstep). The torch RNG is forked, so a run samples the same training rollouts with or without evaluation. With
    `params.seed`, every response gets its own seed (the seed plus its prompt's position). With `params.n` > 1
    responses per prompt, also eval/pass@k for k = 1, 2, 4, ... <= n: the mean over prompts of the unbiased pass@k
    (algos.pass_at_k), a response passing when its score is >= `pass_threshold`. Multi-turn episodes add
    eval/tools/call_frequency, eval/tools/failure_frequency and eval/episode/env_errors (environment errors per
    episode), as the training metrics, and the multi-environment
    form eval/env/<name>/reward_mean for each of `environments`. `extra(rollout) ->
    {name: (B,)}` (optional): more per-response values, each reported as its mean over the responses, eval/<name>."""
    world, rank, n = accelerator.num_processes, accelerator.process_index, len(split.ids)
    mine = shard(n, rank, world)
    tally = Tally()
    ks = [2 ** j for j in range(params.n.bit_length()) if params.n > 1]  # 1, 2, 4, ... <= n
    starts = range(0, len(mine), batch_size)
    with torch.random.fork_rng():
        for i in progress(starts, "eval", len(starts), accelerator.is_main_process):
            idx = mine[i:i + batch_size]
            first = (rank + world * i) * params.n  # this batch's first response, over all processes
            ro = generate(idx, replace(params, seed=params.sample_seed(first)))
            ro = select_rows(ro, ro.last_rows())  # an agent's episode of several rows: its final call
            scored = score(ro)
            scores = scored.total.view(len(idx), params.n)
            real = torch.tensor([rank + world * (i + k) < n for k in range(len(idx))])  # not shard()'s wrap-around
            tally.add(responses=float(real.sum()) * params.n, score=scores[real],
                      tokens=ro.response_mask.view(len(idx), params.n, -1)[real],
                      **{f"extra/rewards/{k}/mean": v.view(len(idx), params.n)[real]
                         for k, v in scored.sources.items()})
            if ro.episodes is not None:  # multi-turn: tool calls (and failed ones), failed episodes
                calls = torch.tensor([[e["tool_calls"], e["tool_failures"], e.get("env_errors", 0)]
                                      for e in ro.episodes], dtype=torch.float64)
                calls = calls.view(len(idx), params.n, 3)[real]
                tally.add(tool_calls=calls[..., 0], tool_failures=calls[..., 1], env_errors=calls[..., 2])
            for name in environments:  # the multi-environment form: each environment's own held-out reward
                member = torch.tensor([e["environment"] == name for e in ro.episodes]).view(len(idx), params.n)
                member &= real[:, None]
                tally.add(**{f"env/{name}/n": member, f"env/{name}/score": scores[member]})
            for name, values in (extra(ro) if extra else {}).items():
                tally.add(**{f"extra/{name}": values.view(len(idx), params.n)[real]})
            if params.n > 1:
                passed = (scores[real] >= pass_threshold).sum(-1)
                tally.add(prompts=float(real.sum()), **{f"pass@{k}": pass_at_k(passed, params.n, k) for k in ks})
    t = tally.reduce()
    return {"eval/reward_mean": t["score"] / t["responses"], "eval/response_length": t["tokens"] / t["responses"],
            **{f"eval/pass@{k}": t[f"pass@{k}"] / t["prompts"] for k in ks},
            **({"eval/tools/call_frequency": t["tool_calls"] / t["responses"],
                "eval/tools/failure_frequency": t["tool_failures"] / max(t["tool_calls"], 1),
                "eval/episode/env_errors": t["env_errors"] / t["responses"]} if "tool_calls" in t else {}),
            **{f"eval/env/{name}/reward_mean": t[f"env/{name}/score"] / max(t[f"env/{name}/n"], 1)
               for name in environments},
            **{f"eval/{k[len('extra/'):]}": v / t["responses"] for k, v in t.items() if k.startswith("extra/")}}


def sample_rows(step: int, ro: Rollout, scores: torch.Tensor, tokenizer, k: int = 4,
                extra: list[dict] | None = None) -> list[dict]:
    """k of a step's responses, spread over its prompts, as readable rows for samples.jsonl: step, prompt (as in the
    dataset), completion (decoded), reward, the dataset row's other columns as `reference`, and `extra[i]`'s fields
    (one dict per response, optional)."""
    out, rows = [], ro.rows
    for i in range(0, len(rows), max(1, len(rows) // k))[:k]:
        # a multi-turn episode: the whole of it (environment tokens too) and its messages
        text = tokenizer.decode(ro.response_ids[i][ro.sequence_mask[i]], skip_special_tokens=True)
        out.append({"step": step, "prompt": rows[i]["prompt"], "completion": text, "reward": float(scores[i]),
                    "reference": {c: v for c, v in rows[i].items() if c != "prompt"}, **(extra[i] if extra else {})})
        if ro.episodes is not None:
            out[-1]["messages"] = ro.episodes[i]["messages"]
    return out
