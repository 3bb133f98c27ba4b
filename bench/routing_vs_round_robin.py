"""Routing over two vLLM servers: the kit's group-affine routing (rollout.router.route: a prompt that extends one
routed since the last sync goes where that one went) against round-robin, on a multi-turn workload, measured with
vLLM's own prefix-cache counters (/metrics) and the wall time of the turns.

    python bench/routing_vs_round_robin.py        # 16 prompts of 512 tokens x 4 samples, 3 turns of 128, 2 rounds each
    python bench/routing_vs_round_robin.py --prompt_tokens 128 --new_tokens 32 --feedback_tokens 8 --prompts 32

Two kit servers of the bench model (fp32, loopback, one core each) behind one VLLMServers. A round: every server's
prefix cache reset, then turn 1 (each prompt with --samples samples), then --turns - 1 more turns in which every
sample's conversation is extended by its response and a fixed feedback of --feedback_tokens tokens and continued (one
sample each), as an environment's episodes are, asked in a shuffled order each turn (episodes progress at different
paces; the same shuffles for both). Affine: the router as the kit runs it. Round-robin: each request to the next server
in turn (one counter for the run), a group's samples still together. Rounds alternate the two. Per round: the
prefix-cache hit rate over both servers (vllm:prefix_cache_hits / vllm:prefix_cache_queries, in tokens, turns 2 on) and
the seconds of turns 2 on.

Summary line: `routing_affine ratio=<round-robin seconds / affine seconds> ...` with both hit rates.
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
import time

import harness as h


def prefix_counters(servers) -> tuple[float, float]:
    """(hits, queries) of vLLM's prefix cache, summed over the servers' /metrics."""
    import requests

    hits = queries = 0.0
    for s in servers:
        text = requests.get(s.url + "/metrics", headers=s._headers, timeout=30).text
        for name, value in re.findall(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\} ([0-9.e+]+)$", text,
                                      re.M):
            if name.endswith("hits_total"):
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


def one_round(backend, prompts, args, feedback) -> dict:
    import requests

    from verl_kit.rollout import SamplingParams

    for s in backend.servers:
        requests.post(s.url + "/reset_prefix_cache", headers=s._headers, timeout=30).raise_for_status()
    backend.homes.forget()
    ro = backend.generate(prompts, SamplingParams(n=args.samples, max_new_tokens=args.new_tokens, temperature=1.0,
                                                  ignore_eos=True))
    convs = [p + ro.response_ids[i][ro.response_mask[i]].tolist() for i, p in
             enumerate(ro.prompt_ids)]
    hits0, queries0 = prefix_counters(backend.servers)
    t0 = time.perf_counter()
    for turn in range(args.turns - 1):
        # in the order the episodes ask (they progress at different paces): the same shuffles for both policies
        convs = [c + feedback for c in convs]
        random.Random(turn).shuffle(convs)
        ro = backend.generate(convs, SamplingParams(n=1, max_new_tokens=args.new_tokens, temperature=1.0,
                                                    ignore_eos=True))
        convs = [c + ro.response_ids[i][ro.response_mask[i]].tolist() for i, c in enumerate(convs)]
    seconds = time.perf_counter() - t0
    hits, queries = prefix_counters(backend.servers)
    return {"seconds": seconds, "hit_rate": (hits - hits0) / max(queries - queries0, 1)}


def round_robin():
    """A `route` that hands each prompt to the next server in turn (one counter for the whole run), ignoring
    affinity and load."""
    counter = itertools.count()

    def route(prompts, n, alive, load, homes):
        servers = [alive[next(counter) % len(alive)] for _ in prompts]
        for s in servers:
            load[s] += n
        return servers

    return route


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--prompt_tokens", type=int, default=512)
    ap.add_argument("--feedback_tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from verl_kit.models import load_tokenizer
    from verl_kit.rollout import ServerProcess, VLLMServer, router
    from verl_kit.rollout.router import VLLMServers

    path = h.build_model()
    tok = load_tokenizer(path)
    rng = random.Random(0)
    pool = h.word_pool(tok)
    prompts = []
    for _ in range(args.prompts):
        ids = []
        while len(ids) < args.prompt_tokens:
            ids += tok(" " + rng.choice(pool)[0], add_special_tokens=False)["input_ids"]
        prompts.append(ids[:args.prompt_tokens])
    feedback = tok(" " + " ".join(rng.choice(pool)[0] for _ in range(args.feedback_tokens)),
                   add_special_tokens=False)["input_ids"][:args.feedback_tokens]
    env = h.bench_env()
    servers = [ServerProcess(path, dtype="float32", max_model_len=1024, wait=False,
                             extra=["--seed", str(i)]) for i in range(2)]
    try:
        for s in servers:
            s.wait_ready()
        backend = VLLMServers([VLLMServer(s.url, tok, request_timeout_s=600) for s in servers])
        affine = router.route
        results = {"affine": [], "round_robin": []}
        one_round(backend, prompts, args, feedback)  # warm-up
        for r in range(args.rounds):
            for kind in ("affine", "round_robin")[:: 1 if r % 2 == 0 else -1]:
                router.route = affine if kind == "affine" else round_robin()
                results[kind].append(one_round(backend, prompts, args, feedback))
                print(f"round {r + 1} {kind}: {results[kind][-1]}", flush=True)
    finally:
        for s in servers:
            s.stop()
    del env
    out = {k: {"seconds": h.median([x["seconds"] for x in v]), "hit_rate": h.median([x["hit_rate"] for x in v]),
               "rounds": v} for k, v in results.items()}
    out["workload"] = vars(args)
    print(f"results: {h.save_results('routing_vs_round_robin', out)}")
    a, rr = out["affine"], out["round_robin"]
    print(h.summary_line("routing_affine", rr["seconds"] / a["seconds"],
                         f"two vLLM servers, {args.prompts} prompts x {args.samples} samples, {args.turns} turns: "
                         f"prefix-cache hit rate {a['hit_rate']:.2f} vs {rr['hit_rate']:.2f} (round-robin), turns "
                         f"2-{args.turns} in {a['seconds']:.2f} s vs {rr['seconds']:.2f} s"))


if __name__ == "__main__":
    main()
