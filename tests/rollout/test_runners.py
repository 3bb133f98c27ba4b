"""The episode contract (rollout.types.EpisodeRunner): every runner (single-turn; an environment that replies, with a
tool offered; an --agent on the OpenAI SDK whose second call rewrites its history, so an episode spans two rows) runs
through the same checks, on the real HF-generate backend of the tiny model (its EOS raised so that turns end) and
through rollout.Rollouts, the only caller: the batch holds params.n episodes of each asked prompt in order, each row
carries its prompt's index and dataset row, the masks and log-probs agree, and selecting, joining and checkpointing
the batch keep every field. The Rollout's fields are walked from their declared roles, so a field added later is
checked too."""

from dataclasses import fields

import pytest
import torch
from helpers import add, eos_biased_engine

from verl_kit.rollout import AgentEpisodes, Episodes, Prompts, Rollouts, SamplingParams, SingleTurn
from verl_kit.rollout.types import EPISODE, ROW, TOKEN, EpisodeRunner, Rollout, concat_rollouts, select_rows

ROWS = [{"prompt": [{"role": "user", "content": f"Add {i} and 3. Be brief."}], "answer": str(i + 3)}
        for i in range(4)]


def rewriting_agent(client, row):
    """Asks, then asks again from a rewritten history: two rows of one episode (rollout.agents' per-call shape)."""
    first = client.chat.completions.create(model="any", messages=row["prompt"], max_tokens=6)
    text = first.choices[0].message.content or ""
    client.chat.completions.create(model="any", messages=[{"role": "user", "content": "In short: " + text}],
                                   max_tokens=6)
    return 1.0


class OneReply:
    """An environment that answers the first turn once ("Once more.") and scores 0.5: every episode gets inserted
    tokens (the tiny model's turns end in EOS)."""

    def reset(self, **row):
        self.replied = False

    def respond(self, text):
        if not self.replied:
            self.replied = True
            return "Once more."
        return None

    def get_reward(self):
        return 0.5


def runners(engine, tokenizer):
    return {"single_turn": SingleTurn(engine),
            "tools": Episodes(engine, tokenizer, "tiny-llama", OneReply, tools=[add], max_prompt_length=512,
                              max_completion_length=32),
            "agent": AgentEpisodes(engine, tokenizer, "tiny-llama", rewriting_agent, max_prompt_length=512,
                                   max_completion_length=32)}


@pytest.fixture(scope="module")
def batches(tiny_model_path, tokenizer):
    """Each runner's batch of prompts [2, 0] (2 episodes each), generated through Rollouts."""
    engine = eos_biased_engine(tiny_model_path, tokenizer)
    ids = [tokenizer.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False)
           for r in ROWS]
    split = Prompts(ROWS, ids)
    out = {}
    for name, runner in runners(engine, tokenizer).items():
        assert isinstance(runner, EpisodeRunner), name
        rollouts = Rollouts(runner, split, lambda step, k: ([2, 0], SamplingParams(max_new_tokens=8, n=2, seed=3)),
                            total_steps=1)
        out[name] = rollouts.get(0)[0]
        rollouts.close()
    return out


@pytest.mark.parametrize("name", ["single_turn", "tools", "agent"])
def test_every_runner_keeps_the_contract(batches, name):
    ro = batches[name]
    B = len(ro.prompt_ids)
    episodes = ro.row_episode().tolist()
    assert episodes == sorted(episodes) and len(ro.first_rows()) == 4  # 2 prompts x n=2, in order, rows consecutive
    assert [ro.prompt_index[i] for i in ro.first_rows()] == [2, 2, 0, 0]
    assert ro.rows == [ROWS[i] for i in ro.prompt_index]  # the batch carries each row's dataset row
    for f in fields(Rollout):  # every field None or one value per row, whatever its role
        value = getattr(ro, f.name)
        if value is not None and f.metadata["role"] in (TOKEN, ROW, EPISODE):
            assert len(value) == B, f.name
            if f.metadata["role"] == TOKEN:
                assert value.shape == ro.response_ids.shape, f.name
            if f.metadata["role"] == EPISODE:  # the same on every row of an episode
                assert all(value[i] == value[ro.first_rows()[e]] or value[i] != value[i]  # NaN
                           for i, e in enumerate(episodes)), f.name
    assert (ro.sampling_logprobs[~ro.response_mask] == 0).all() and (ro.sampling_logprobs[ro.response_mask] <= 0).all()
    if ro.env_mask is not None:  # sampled and inserted tokens never overlap
        assert not (ro.env_mask & ro.response_mask).any()
        assert all("env_tokens" in e and "reward_source" in e for e in ro.episodes)
        assert torch.equal(ro.per_row(ro.per_episode(ro.env_reward)), ro.env_reward)
    if name == "tools":
        assert ro.env_mask.any(-1).all() and (ro.env_reward == 0.5).all()  # every episode got its reply
    if name == "agent":
        assert B == 8 and ro.episode == [0, 0, 1, 1, 2, 2, 3, 3]  # the rewritten call: a second row per episode


@pytest.mark.parametrize("name", ["single_turn", "tools", "agent"])
def test_select_concat_and_checkpoint_keep_every_field(batches, name):
    """Selecting the rows of episodes [3, 1] and joining them back with the rest, or a state_dict round trip, gives
    the same values field by field (TOKEN fields compared up to the width they were padded to)."""
    ro = batches[name]
    back = Rollout.from_state_dict(ro.state_dict())
    tail, head = select_rows(ro, ro.episode_rows([2, 3])), select_rows(ro, ro.episode_rows([0, 1]))
    joined = concat_rollouts([head, tail])
    for f in fields(Rollout):
        a, b, c = getattr(ro, f.name), getattr(back, f.name), getattr(joined, f.name)
        if isinstance(a, torch.Tensor) and f.metadata["role"] == TOKEN:  # joined: padded to its longest row
            w = c.shape[1]
            assert torch.equal(a, b) and torch.equal(a[:, :w], c) and (a[:, w:] == f.metadata["pad"]).all(), f.name
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b) and torch.equal(a, c), f.name
        else:
            assert a == b == c, f.name
    one = select_rows(ro, ro.episode_rows([1])).episode  # one episode, renumbered from 0
    assert one == ([0, 0] if name == "agent" else None)
