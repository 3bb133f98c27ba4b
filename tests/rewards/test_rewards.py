"""Rewards: a reward model with its own tokenizer and chat template (re-tokenization across deliberately different
vocabularies), reward functions loaded from a module or a file, weighted sums, errors that name the function and
the sample, dataset columns passed to reward functions (TRL's convention), the math-verify rewards, and DAPO's soft
overlong punishment (and TRL's own function)."""

import math
import time
from dataclasses import replace

import pytest
import torch
from helpers import build_reward_model

from verl_kit.errors import UserError
from verl_kit.rewards import (
    RewardModel,
    Rewards,
    boxed_format,
    call_reward_fn,
    kind_words,
    load_reward_fn,
    load_reward_model,
    math_answer,
    reward_columns,
    weighted_sum,
)
from verl_kit.rewards.functions import get_soft_overlong_punishment, soft_overlong_punishment


def score(rewards: Rewards, prompts, completions, truncated, columns=None) -> torch.Tensor:
    """The weighted total (B,) of every source's scores, as Rewards.of_rollout forms it (without a Rollout)."""
    return rewards.total(rewards.sources(prompts, completions, columns), truncated)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return build_reward_model(str(tmp_path_factory.mktemp("rm")))


def _load(path):
    return load_reward_model(path, lambda load: load().eval(), "cpu", max_length=256, batch_size=2)


def test_reward_model_retokenizes_with_its_own_template(reward_model_dir, tokenizer):
    """The policy's completion text is rendered with the reward model's chat template and tokenized with the reward
    tokenizer; the policy tokenizer would give other ids for the same text (the vocabularies differ). The score of
    each sample equals a forward pass of the reward model on exactly that text, alone and unpadded, so batching
    (by sorted length, 2 per batch here: the longest and the shortest sample land in different batches) and
    right-padding inside score() do not change it, nor the order of the scores."""
    rm = _load(reward_model_dir)
    prompts = [[{"role": "user", "content": "Describe the sea."}], "plain prompt: ", "mid: "]
    completions = ["The sea is calm and kind.", "zebra", "a calm reply"]
    texts = rm.texts(prompts, completions)
    assert texts[:2] == ["[USER] Describe the sea.\n[ASSISTANT] The sea is calm and kind.\n", "plain prompt: zebra"]
    policy_ids = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    rm_ids = rm.tokenizer(texts[0], add_special_tokens=False)["input_ids"]
    assert policy_ids != rm_ids
    assert rm.tokenizer.decode(rm_ids) == texts[0]
    scores = rm.score(prompts, completions)
    assert scores.shape == (3,)
    with torch.no_grad():
        for text, score in zip(texts, scores):
            ids = torch.tensor([rm.tokenizer(text, add_special_tokens=False)["input_ids"]])
            torch.testing.assert_close(rm.model(input_ids=ids).logits[0, 0], score, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scores[0], scores[1])


def test_kind_words_and_weighted_sum():
    """'lovely, warm day' has 3 words, 2 of them kind: 2/3; 'dull' 0; empty 0 (no division by zero).
    weighted_sum([a, b], [1, 0.5]) = a + 0.5 b: [2/3 + 0.5, 0 + 1.0, 0 + 0]."""
    a = call_reward_fn("kind", kind_words, ["p"] * 3, ["Lovely, warm day.", "dull", ""])
    torch.testing.assert_close(a, torch.tensor([2 / 3, 0.0, 0.0]))
    b = torch.tensor([1.0, 2.0, 0.0])
    torch.testing.assert_close(weighted_sum([a, b], [1.0, 0.5]), torch.tensor([2 / 3 + 0.5, 1.0, 0.0]))


def test_load_reward_fn_from_module_and_file(tmp_path):
    assert load_reward_fn("verl_kit.rewards:kind_words") is kind_words
    f = tmp_path / "my_reward.py"
    f.write_text("def length(prompts, completions):\n    return [float(len(c)) for c in completions]\n")
    fn = load_reward_fn(f"{f}:length")
    torch.testing.assert_close(call_reward_fn("length", fn, ["a", "b"], ["xy", ""]), torch.tensor([2.0, 0.0]))
    for spec, says in [("no_colon", "expected module:function"), (f"{tmp_path}/missing.py:f", "no such file"),
                       ("verl_kit.nope:f", "cannot import"), (f"{f}:nope", "no function 'nope'")]:
        with pytest.raises(UserError, match=says):
            load_reward_fn(spec)


def test_reward_fn_errors_name_function_and_sample():
    prompts, completions = ["p0", "p1", "p2"], ["ok", "boom here", "ok"]

    def raises(prompts, completions):
        return [1 / 0 if "boom" in c else 1.0 for c in completions]

    with pytest.raises(UserError, match=r"reward function raises raised ZeroDivisionError.*sample 1 \(prompt 'p1'"):
        call_reward_fn("raises", raises, prompts, completions)
    with pytest.raises(UserError, match=r"reward function nan returned nan for sample 2 \(prompt 'p2'"):
        call_reward_fn("nan", lambda p, c: [0.0, 1.0, math.nan], prompts, completions)
    with pytest.raises(UserError, match=r"reward function short returned 2 values for 3 samples"):
        call_reward_fn("short", lambda p, c: [0.0, 1.0], prompts, completions)
    with pytest.raises(UserError, match=r"reward function text returned 'x' for sample 0"):
        call_reward_fn("text", lambda p, c: ["x", 1.0, 1.0], prompts, completions)


def test_reward_model_is_frozen_and_deterministic(reward_model_dir):
    """Placed by engine.frozen (a plain module here, no DeepSpeed): no gradients, eval mode, same scores."""
    from verl_kit.train import Accelerator, frozen

    accelerator = Accelerator(cpu=True)
    rm = load_reward_model(reward_model_dir, lambda load: frozen(accelerator, load), "cpu", 256, 2)
    assert isinstance(rm, RewardModel)
    assert not any(p.requires_grad for p in rm.model.parameters()) and not rm.model.training
    s1 = rm.score(["a"] * 3, ["x", "yy", "zzz"])
    s2 = rm.score(["a"] * 3, ["x", "yy", "zzz"])
    assert torch.equal(s1, s2)


USER_REWARD = """
def reward(prompts, completions, answer, **kwargs):
    assert set(kwargs) <= {"level", "completion_ids"}, kwargs
    return [float(c.strip().endswith(str(a))) for c, a in zip(completions, answer)]
"""


def test_reward_file_reads_the_answer_column_beside_a_two_argument_fn(tmp_path):
    """A user file `reward(prompts, completions, answer, **kwargs)` gets the `answer` column (one value per
    completion: each prompt row repeated for its 2 generations, as reward_columns builds it) and the other columns as
    **kwargs; kind_words(prompts, completions) beside it gets the two lists only (its scores: 1, 0, 0, 1). Sum with
    weights 1 and 0.5, plus the missing-EOS penalty -1 for the truncated last response."""
    f = tmp_path / "my_reward.py"
    f.write_text(USER_REWARD)
    rewards = Rewards(f"{f}:reward,verl_kit.rewards:kind_words", None, "1,0.5", missing_eos_penalty=-1.0)
    rows = [{"prompt": "1+1?", "answer": 2, "level": "easy"}] * 2 + [{"prompt": "2+3?", "answer": 5,
                                                                        "level": "hard"}] * 2
    columns = reward_columns(rows)
    assert columns == {"answer": [2, 2, 5, 5], "level": ["easy", "easy", "hard", "hard"]}
    prompts = [r["prompt"] for r in rows]
    completions = ["kind 2", "3", "it is 5", "lovely 4"]
    scores = score(rewards, prompts, completions, torch.tensor([False, False, False, True]), columns)
    torch.testing.assert_close(scores, torch.tensor([1 + 0.5, 0.0, 1.0, 0 + 0.5 - 1.0]))
    with pytest.raises(UserError, match=r"^reward function .*my_reward.py:reward needs column 'answer', which the data "
                                        r"does not have \(columns: 'level'\)$"):
        score(rewards, prompts, completions, torch.zeros(4, dtype=torch.bool), {"level": columns["level"]})
    torch.testing.assert_close(score(Rewards("verl_kit.rewards:kind_words", None, None), prompts, completions,
                                     torch.zeros(4, dtype=torch.bool)), torch.tensor([1.0, 0.0, 0.0, 1.0]))


def test_each_reward_source_is_logged(tmp_path, tokenizer):
    """The same two functions scoring a Rollout (decoded with the policy's tokenizer) with an environment reward:
    the step's score is the weighted sum plus get_reward(), and each source's own scores reach the metrics as TRL's
    rewards/<function name>/mean and /std (the environment's as rewards/environment/*), kept row for row through
    dynamic sampling's concat and select."""
    from verl_kit.rollout import Rollout
    from verl_kit.rollout.prompts import rollout_metrics
    from verl_kit.rollout.types import Scores

    f = tmp_path / "my_reward.py"
    f.write_text(USER_REWARD)
    rewards = Rewards(f"{f}:reward,verl_kit.rewards:kind_words", None, "1,0.5", missing_eos_penalty=-1.0,
                      tokenizer=tokenizer)
    rows = [{"prompt": "1+1?", "answer": 2}] * 2 + [{"prompt": "2+3?", "answer": 5}] * 2
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in ("kind 2", "3", "it is 5", "lovely 4")]
    R = max(map(len, ids))
    response = torch.tensor([x + [tokenizer.pad_token_id] * (R - len(x)) for x in ids])
    mask = torch.tensor([[j < len(x) for j in range(R)] for x in ids])
    ro = Rollout([[1, 2]] * 4, response, mask, torch.zeros(response.shape), torch.tensor([False, False, False, True]),
                 env_reward=torch.tensor([0.0, 1.0, 0.0, 2.0]))
    scored = rewards.of_rollout(replace(ro, rows=rows))
    torch.testing.assert_close(scored.total, torch.tensor([1 + 0.5, 0 + 1.0, 1.0, 0.5 - 1.0 + 2.0]))
    m = rollout_metrics(ro, scored, 1.0)
    assert m["reward/mean"] == pytest.approx(1.25)
    assert (m["rewards/reward/mean"], m["rewards/reward/std"]) == pytest.approx((0.5, 0.5))  # 1, 0, 1, 0
    assert (m["rewards/kind_words/mean"], m["rewards/kind_words/std"]) == pytest.approx((0.5, 0.5))  # unweighted
    assert (m["rewards/environment/mean"], m["rewards/environment/std"]) == pytest.approx((0.75, 0.8291562))
    kept = Scores.concat([scored, scored]).select([7, 0])
    assert kept.total.tolist() == [1.5, 1.5]
    assert {k: v.tolist() for k, v in kept.sources.items()} == {"reward": [0.0, 1.0], "kind_words": [1.0, 1.0],
                                                                "environment": [2.0, 0.0]}


def test_calling_conventions_follow_the_signature():
    """TRL style (names `completions`): all by keyword, prompts only if named or **kwargs; positional otherwise, with
    the columns it names (or all for **kwargs); completion_ids offered alike."""
    seen = {}

    def trl_style(completions, solution, **kwargs):
        seen["trl"] = sorted(kwargs)
        return [float(c == s) for c, s in zip(completions, solution)]

    def only_completions(completions):
        return [1.0] * len(completions)

    def positional(p, c, **kw):
        seen["pos"] = sorted(kw)
        return [0.0] * len(c)

    cols = {"solution": ["a", "b"], "extra": [1, 2]}
    torch.testing.assert_close(call_reward_fn("t", trl_style, ["p", "q"], ["a", "x"], cols, [[1], [2]]),
                               torch.tensor([1.0, 0.0]))
    assert seen["trl"] == ["completion_ids", "extra", "prompts"]
    torch.testing.assert_close(call_reward_fn("o", only_completions, ["p"], ["a"], {"extra": [1]}), torch.tensor([1.0]))
    call_reward_fn("pos", positional, ["p", "q"], ["a", "b"], cols)
    assert seen["pos"] == ["extra", "solution"]
    for bad, says in [({"completions": ["a"]}, r"reward column 'completions': the name is taken"),
                      ({"answer": [1, 2]}, r"reward column 'answer' has 2 values for 1 completions")]:
        with pytest.raises(UserError, match=says):
            call_reward_fn("o", only_completions, ["p"], ["a"], bad)


def test_trl_completion_ids_reward_runs_unchanged():
    """TRL's own soft overlong punishment (trl.rewards, `completion_ids, **kwargs`: no `completions` parameter) is
    called by keyword like any TRL reward. L_max 8, cache 4: lengths 3, 5, 7, 9 -> 0 (<= 4), (4 - 5) / 4 = -0.25,
    (4 - 7) / 4 = -0.75, -1 (> 8)."""
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in (3, 5, 7, 9)]
    got = call_reward_fn("overlong", get_soft_overlong_punishment(8, 4), ["p"] * 4, ["c"] * 4, {}, ids)
    torch.testing.assert_close(got, torch.tensor([0.0, -0.25, -0.75, -1.0]))


def test_per_sample_retry_slices_the_columns():
    """A batch failure is retried sample by sample with the columns sliced alike: sample 1's answer 0 divides by 0."""

    def ratio(prompts, completions, answer):
        assert len(answer) == len(completions)
        return [len(c) / a for c, a in zip(completions, answer)]

    with pytest.raises(UserError, match=r"^reward function ratio raised ZeroDivisionError: .* on sample 1 "
                                        r"\(prompt 'p1', completion 'yy'\); pass --reward_fallback"):
        call_reward_fn("ratio", ratio, ["p0", "p1", "p2"], ["x", "yy", "z"], {"answer": [1, 0, 2]})


@pytest.mark.parametrize("completion, reference, expected", [
    ("The answer is 42.", "42", 1.0),              # plain number at the end
    ("3 + 4 = 7", "7", 1.0),                       # right-hand side of the final equation
    ("First 3, then 5, finally 9", "7", 0.0),      # the last number (9) counts, not an earlier one
    ("The answer is 41.", "42", 0.0),              # wrong
    ("I have no idea.", "42", 0.0),                # no answer at all
    ("The answer is seven.", "7", 0.0),            # words are not parsed
    ("So \\boxed{\\frac{1}{2}}.", "1/2", 1.0),     # boxed LaTeX vs a plain fraction
    ("\\boxed{7} and then 3", "7", 1.0),           # a box wins over a later number
    ("It is 0.5", "\\frac{1}{2}", 1.0),            # numeric equality
    ("\\boxed{x^2}", "x^2", 1.0),                  # bare LaTeX reference (retried inside $...$)
    ("... so 72.", "48/2 = <<48/2=24>>24 clips\n#### 72", 1.0),  # GSM8K-style worked reference
])
def test_math_answer(completion, reference, expected):
    got = call_reward_fn("math_answer", math_answer, ["q"], [completion], {"answer": [reference]})
    assert got.tolist() == [expected]


def test_math_answer_reference_column_and_errors():
    """`solution` is used when there is no `answer`; neither is a one-line UserError naming function and columns;
    a reference with nothing to parse names the sample."""
    assert call_reward_fn("m", math_answer, ["q"] * 2, ["= 4", "5"], {"solution": ["4", "4"]}).tolist() == [1.0, 0.0]
    rewards = Rewards("verl_kit.rewards:math_answer", None, None)
    with pytest.raises(UserError, match=r"^reward function math_answer needs a reference column 'answer' or "
                                        r"'solution'; the data has 'level'$"):
        score(rewards, ["q"], ["4"], torch.zeros(1, dtype=torch.bool), {"level": ["easy"]})
    with pytest.raises(UserError, match=r"^reward function math_answer needs .*; the data has no other columns$"):
        score(rewards, ["q"], ["4"], torch.zeros(1, dtype=torch.bool))
    with pytest.raises(UserError, match=r"^reward function math_answer: the answer of sample 1 \('none'\) holds "):
        score(rewards, ["q"] * 2, ["4", "4"], torch.zeros(2, dtype=torch.bool), {"answer": ["4", "none"]})


def test_boxed_format():
    cases = {"So \\boxed{7}.": 1.0, "\\boxed{\\frac{1}{2}}": 1.0, "The answer is 7.": 0.0, "\\boxed{}": 0.0,
             "\\boxed{ }": 0.0, "\\boxed{7} or \\boxed{8}": 0.0, "\\boxed{\\frac{1}{2}": 0.0, "": 0.0}
    got = call_reward_fn("boxed_format", boxed_format, ["q"] * len(cases), list(cases), {"answer": ["7"] * len(cases)})
    assert got.tolist() == list(cases.values())


def test_reward_columns_rows_must_agree():
    assert reward_columns([]) == {}
    assert reward_columns([{"prompt": "p", "answer": 1}], exclude=("prompt", "answer")) == {}
    with pytest.raises(UserError, match=r"^reward columns: row 2 has columns \['answer', 'extra'\] but row 0 has "
                                        r"\['answer'\]; every row must have the same columns$"):
        reward_columns([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": 2},
                        {"prompt": "c", "answer": 3, "extra": 0}])


def test_slow_or_failing_rewards_get_the_fallback_and_are_counted():
    """--reward_timeout_s 0.2 --reward_fallback -1: a plain function that sleeps 5 s past the timeout gives its whole
    batch call (3 samples) the fallback, counted as 3 timeouts, after ~0.2 s (its thread sleeps on, abandoned); one
    that raises on sample 1 gets the fallback there only (the retry sample by sample), counted as 1 error. An
    `async def` function is awaited per sample: sample 1 sleeps past the timeout, sample 2 raises, so [1, -1, -1]
    with one more timeout and one more error; with --reward_max_concurrency 2 at most 2 calls are ever in flight."""
    import asyncio

    from verl_kit.rewards import CallLimits

    prompts, completions = ["p0", "p1", "p2"], ["a", "b", "c"]
    limits = CallLimits(timeout_s=0.2, fallback=-1.0, max_concurrency=2)

    def sleepy(prompts, completions):
        time.sleep(5)
        return [1.0] * len(completions)

    t0 = time.monotonic()
    assert call_reward_fn("sleepy", sleepy, prompts, completions, limits=limits).tolist() == [-1.0, -1.0, -1.0]
    assert time.monotonic() - t0 < 2 and (limits.timeouts, limits.errors) == (3, 0)

    def raises(prompts, completions):
        return [1 / 0 if c == "b" else 0.5 for c in completions]

    assert call_reward_fn("raises", raises, prompts, completions, limits=limits).tolist() == [0.5, -1.0, 0.5]
    assert (limits.timeouts, limits.errors) == (3, 1)

    flight = {"now": 0, "max": 0}

    async def remote(prompts, completions):
        flight["now"] += 1
        flight["max"] = max(flight["max"], flight["now"])
        try:
            await asyncio.sleep(5 if completions[0] == "b" else 0.05)
            if completions[0] == "c":
                raise ConnectionError("verifier down")
            return [1.0]
        finally:
            flight["now"] -= 1

    assert call_reward_fn("remote", remote, prompts, completions, limits=limits).tolist() == [1.0, -1.0, -1.0]
    assert (limits.timeouts, limits.errors) == (4, 2) and flight == {"now": 0, "max": 2}


def test_slow_or_failing_rewards_without_fallback_stop_in_one_line():
    """No --reward_fallback: the run stops with one line naming the function and the sample (an async function's
    call is per sample; a plain function's timeout names its batch), and nothing is counted."""
    import asyncio

    from verl_kit.rewards import CallLimits

    prompts, completions = ["p0", "p1"], ["a", "b"]
    limits = CallLimits(timeout_s=0.2)

    async def remote(prompts, completions):
        await asyncio.sleep(5 if completions[0] == "b" else 0)
        return [1.0]

    def sleepy(prompts, completions):
        time.sleep(5)

    def raises(prompts, completions):
        raise KeyError("judge")

    for fn, says in ((remote, r"^reward function remote did not return within 0.2 s \(--reward_timeout_s\) on sample "
                               r"1 \(prompt 'p1', completion 'b'\); pass --reward_fallback <score>"),
                     (sleepy, r"^reward function sleepy did not return within 0.2 s .* on a batch of 2 samples"),
                     (raises, r"^reward function raises raised KeyError: 'judge' on sample 0 \(prompt 'p0'")):
        with pytest.raises(UserError, match=says) as e:
            call_reward_fn(fn.__name__, fn, prompts, completions, limits=limits)
        assert "\n" not in str(e.value)
    assert (limits.timeouts, limits.errors) == (0, 0)


def test_soft_overlong_punishment_by_hand_and_like_trl():
    """L_max = 10, L_cache = 4: lengths up to 6 score 0; 7 -> (6 - 7) / 4 = -0.25; 9 -> -0.75; 10 -> -1.0; 11 -> -1
    (past L_max). TRL's get_soft_overlong_punishment gives the same on the same ids. Called through the kit's reward
    convention (call_reward_fn, completion_ids by keyword). The ready-made function has TRL's command-line values."""
    from trl.rewards import get_soft_overlong_punishment as trl_factory

    ids = [[1] * n for n in (3, 6, 7, 9, 10, 11)]
    want = [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    fn = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    got = call_reward_fn("overlong", fn, ["p"] * 6, ["c"] * 6, {"answer": list(range(6))}, ids)
    assert got.tolist() == want
    assert trl_factory(10, 4)(ids) == want
    assert (soft_overlong_punishment.max_completion_len, soft_overlong_punishment.soft_punish_cache) == (1280, 256)
    with pytest.raises(UserError, match="soft_punish_cache 0"):
        get_soft_overlong_punishment(10, 0)
