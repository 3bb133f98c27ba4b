"""verl_kit.train.actor_critic: the packed, block-masked forward over rollout responses (pack_responses,
actor_logits) puts each response token's log-prob where a plain per-sequence forward puts it."""

import torch

from verl_kit.data import logprobs_from_logits


def test_packed_response_logprobs_match_plain_forward(tiny_model_path):
    """The packed, block-masked forward with ResponseIndex scattering puts each response token's log-prob at
    (row, position) exactly where a plain per-sequence forward puts it; rows 2 and 3 share their prompt (laid out
    once, layout's shared_prefix)."""
    from verl_kit.models import load_causal_lm
    from verl_kit.train import actor_logits, pack_responses

    model = load_causal_lm(tiny_model_path).eval()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [10, 11, 12, 13]]
    response = torch.tensor([[20, 21, 22, 0], [30, 31, 0, 0], [40, 41, 42, 43], [50, 51, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    out = torch.zeros(4, 4)
    with torch.no_grad():
        batch, ix = pack_responses(prompts, response, mask, [2, 0, 3, 1], 0, True, 64, True)
        assert batch.num_tokens == 3 + 3 + 2 + 2 + 4 + 4 + 2 + 1  # row 3 continues row 2's first 3 prompt tokens
        heads = []  # the LM head runs on the 11 positions that predict response tokens only
        hook = model.lm_head.register_forward_hook(lambda _, args, out: heads.append(tuple(out.shape[:-1])))
        out[ix.row, ix.pos] = logprobs_from_logits(actor_logits(model, batch, ix, 0.7), ix.targets)
        hook.remove()
        assert heads == [(1, 11)] == [(1, len(ix.targets))]
        for b in range(4):
            n = int(mask[b].sum())
            seq = torch.tensor(prompts[b] + response[b, :n].tolist())[None]
            logits = model(seq).logits[0, len(prompts[b]) - 1:-1] / 0.7
            torch.testing.assert_close(out[b, :n], logits.log_softmax(-1).gather(-1, seq[0, len(prompts[b]):, None])
                                       .squeeze(-1), atol=1e-5, rtol=1e-5)
            assert (out[b, n:] == 0).all()
