"""Entropy controls (algos.entropy, train.EntropyTerms; TRL 1.16's --entropy_coef, --use_adaptive_entropy,
--top_entropy_quantile): the controller and the token selection worked by hand, the selection equal to TRL's own
GRPOTrainer.get_high_entropy_mask, and in GRPO: the adaptive coefficient's path, no bonus in the first step, and a
resume that applies the same coefficients (slow)."""

import math
from types import SimpleNamespace

import pytest
import torch

from verl_kit.algos import EntropyControl
from verl_kit.config import EntropyConfig
from verl_kit.errors import UserError
from verl_kit.train import EntropyTerms, global_quantile


def test_adaptive_coefficient_by_hand():
    """c = 0.01, delta 0.005, target 0.5, bounds [0, 0.02]. Before any measurement no bonus (last entropy inf).
    Step entropies 0.4, 0.3, 0.7, 0.9, 0.95: c 0.015 (0.4 <= 0.5: +), 0.02 (capped at max), 0.015 (0.7 > 0.5: -),
    0.01, 0.005; the bonus applied in the next step is c while the last entropy is <= 0.5, else 0. A fixed c is always
    applied and never moves."""
    ctl = EntropyControl(0.01, adaptive=True, coef_min=0.0, coef_max=0.02, delta=0.005, target=0.5)
    assert ctl.enabled and ctl.coefficient() == 0.0
    applied, coefs = [], []
    for h in (0.4, 0.3, 0.7, 0.9, 0.95):
        ctl.update(h)
        coefs.append(ctl.coef)
        applied.append(ctl.coefficient())
    assert coefs == pytest.approx([0.015, 0.02, 0.015, 0.01, 0.005])
    assert applied == pytest.approx([0.015, 0.02, 0.0, 0.0, 0.0])
    again = EntropyControl(0.01, adaptive=True, coef_min=0.0, coef_max=0.02, delta=0.005, target=0.5)
    again.load_state_dict(ctl.state_dict())
    assert again.coef == ctl.coef and again.last_entropy == 0.95
    fixed = EntropyControl(0.1)
    fixed.update(0.0)
    assert fixed.coefficient() == 0.1 and fixed.coef == 0.1 and not EntropyControl(0.0).enabled


def test_terms_by_hand():
    """Entropies (0.1, 0.5, 0.9, 0.3), the last token not kept, c = 0.1.
    rho 1: every kept token acts; the bonus is -c * H / 3 (3 kept tokens in the step): (-1/300, -5/300, -9/300, 0),
    and no mask. rho 0.5: the 0.5 quantile of the kept (0.1, 0.5, 0.9) is 0.5, so tokens 1 and 2 act (mask 0 1 1 0);
    2 acting tokens in this one micro-batch: the bonus is -c * H / 2 on them: (0, -0.025, -0.045, 0). rho 0: only the
    highest (0.9). The adaptive window: the acting tokens' entropy sum and count, reduced at end()."""
    h = torch.tensor([0.1, 0.5, 0.9, 0.3], requires_grad=True)
    kept = torch.tensor([True, True, True, False])
    accelerator = SimpleNamespace(register_for_checkpointing=lambda obj: None)
    ent = EntropyTerms(EntropyConfig(entropy_coef=0.1), accelerator)
    ent.start()
    acting, bonus = ent.terms(h, kept, n_tokens=3, n_chunks=1)
    assert acting is None and torch.allclose(bonus, torch.tensor([-1, -5, -9, 0]) / 300)
    bonus.sum().backward()
    assert torch.allclose(h.grad, torch.tensor([-1 / 30, -1 / 30, -1 / 30, 0]))
    assert ent.end() == {"entropy_coef": 0.1}

    ent = EntropyTerms(EntropyConfig(entropy_coef=0.1, top_entropy_quantile=0.5), accelerator)
    ent.start()
    acting, bonus = ent.terms(h, kept, n_tokens=3, n_chunks=1)
    assert acting.tolist() == [0, 1, 1, 0] and torch.allclose(bonus, torch.tensor([0, -0.025, -0.045, 0]))
    ent = EntropyTerms(EntropyConfig(top_entropy_quantile=0.0), accelerator)
    ent.start()
    acting, bonus = ent.terms(h, kept, n_tokens=3, n_chunks=1)
    assert acting.tolist() == [0, 0, 1, 0] and bonus is None and ent.end() == {}

    registered = []
    ent = EntropyTerms(EntropyConfig(entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=0.6,
                                     entropy_coef_delta=0.01),
                       SimpleNamespace(register_for_checkpointing=registered.append))
    assert registered == [ent.control]
    ent.start()
    _, bonus = ent.terms(h, kept, n_tokens=3, n_chunks=2)
    assert torch.equal(bonus, torch.zeros(4))  # no measurement yet: no bonus
    ent.terms(h, torch.tensor([False, False, True, False]), n_tokens=3, n_chunks=2)
    # the step's acting tokens: (0.1 + 0.5 + 0.9) and 0.9, mean 0.6 (float32 values: just below) <= 0.6: c + 0.01
    assert ent.end() == {"entropy_coef": pytest.approx(0.02)} and ent.control.coefficient() == pytest.approx(0.02)


def test_selection_equals_trls_get_high_entropy_mask():
    """TRL 1.16's GRPOTrainer.get_high_entropy_mask (run on a real one-process Accelerator) and the kit's selection
    (global_quantile of the kept tokens' entropies, then >=) pick the same tokens, for rho 0, 0.2, 0.5, 0.9 on random
    entropies with padding."""
    from accelerate import Accelerator
    from trl import GRPOTrainer

    from verl_kit.algos import high_entropy_mask

    g = torch.Generator().manual_seed(0)
    entropies = torch.rand(6, 9, generator=g) * 5
    mask = torch.rand(6, 9, generator=g) > 0.3
    trl_self = SimpleNamespace(accelerator=Accelerator(cpu=True))
    for rho in (0.0, 0.2, 0.5, 0.9):
        theirs = GRPOTrainer.get_high_entropy_mask(trl_self, entropies, mask.int(), 1 - rho)
        ours = torch.zeros_like(mask)
        ours[mask] = high_entropy_mask(entropies[mask], global_quantile(entropies[mask], 1 - rho))
        assert torch.equal(theirs, ours), rho
    assert math.isnan(global_quantile(torch.zeros(0), 0.5))


@pytest.mark.parametrize("argv, message", [
    (dict(top_entropy_quantile=1.5), "--top_entropy_quantile 1.5: must be in [0, 1]"),
    (dict(entropy_target=1.0), "--entropy_target: only with --use_adaptive_entropy"),
    (dict(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1), "need min <= max"),
])
def test_flag_errors(argv, message):
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EntropyConfig(**argv)


@pytest.mark.slow
def test_grpo_adaptive_entropy_follows_its_rule_and_resumes_bit_identical(tmp_path):
    """GRPO on the tiny model, 4 steps, --use_adaptive_entropy --entropy_coef 0.01 --entropy_coef_delta 0.01
    --entropy_target 100 (its ~6.4 nats are always below): the logged coefficient rises by delta each step (0.02,
    0.03, 0.04, 0.05). Step 1 applies no bonus (no measurement yet), so its gradient norm equals the run without the
    flags; step 2 applies 0.02 and differs. SIGKILLed once checkpoint-2 is complete and resumed with `auto`: the final
    weights and the metrics of steps 3-4 equal the uninterrupted run's (the coefficient is in the checkpoint)."""
    from helpers import assert_resume_bit_identical, metrics, recipe_cmd, run

    common = ["--max_steps", "4", "--prompts_per_step", "8", "--logging_steps", "1", "--dataset_test_split", "none",
              "--save_steps", "2"]
    adaptive = ["--use_adaptive_entropy", "--entropy_coef", "0.01", "--entropy_coef_delta", "0.01",
                "--entropy_target", "100"]

    def cmd(out, *extra):
        return recipe_cmd("grpo.py", ["--output_dir", str(out), *common, *adaptive, *extra])

    a, b, plain = tmp_path / "a", tmp_path / "b", tmp_path / "plain"
    assert_resume_bit_identical(cmd, a, b, 2, compare_steps=(3, 4))
    rows = [r for r in metrics(a) if "grad_norm" in r]
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.02, 0.03, 0.04, 0.05])
    assert all(r["actor/entropy"] < 100 for r in rows)
    run(recipe_cmd("grpo.py", ["--output_dir", str(plain), *common, "--max_steps", "2"]))
    base = [r for r in metrics(plain) if "grad_norm" in r]
    assert rows[0]["grad_norm"] == base[0]["grad_norm"] and rows[1]["grad_norm"] != base[1]["grad_norm"]
