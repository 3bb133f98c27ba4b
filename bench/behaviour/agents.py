"""An --agent for the tiny model whose episodes give both training shapes of verl_kit.rollout.agents (see
tests/rollout/test_agents.py's `scripted` and AGENT_FILE): call 1 answers the prompt; call 2 sends the reply back with
a user turn (extends call 1 token for token: the merged shape, one sequence); call 3 asks from a rewritten history
(does not extend the earlier calls: a per-call sample, a second training row of the same episode). Returns None so
--reward_fn scores the episode. No shared state between episodes: the result does not depend on their order."""


async def agent(client, row):
    messages = list(row["prompt"])
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again 1"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    text = second.choices[0].message.content or ""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Sum up: " + text}])
    return None
