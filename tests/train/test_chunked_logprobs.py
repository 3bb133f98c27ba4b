"""verl_kit.train.lm_head: log-probs and entropy through the LM head in tiles equal those of the whole logits, by hand
and on the tiny model (untied, tied, LoRA, packed with a shared group prompt), in values and gradients, whatever the
tiling: token tiles that split a sequence, tiles of one token, vocabulary chunks of one column; in bf16 within its
rounding."""

import pytest
import torch
import trl.kernels.chunked_logprob as trl_kernel

from verl_kit.train.lm_head import CHUNK_SIZE, chunkable, chunked_logprobs, full_logprobs, head_logprobs

TOL = 1e-5  # relative, fp32


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: relative to the tensor's scale, so entries near 0 do not blow it up."""
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def test_chunked_logprobs_by_hand(monkeypatch):
    """hidden [[1, 0], [0, 2]], weight rows [1, 0], [0, 1], [1, 1], no bias, temperature 2: logits z = h W^T / 2 are
    token 0: [0.5, 0, 0.5], token 1: [0, 1, 1]. logsumexp: log(2 e^0.5 + 1) = log 4.297443 = 1.458020 and
    log(1 + 2e) = log 6.436564 = 1.861995. Targets 2 and 0: log p = 0.5 - 1.458020 = -0.958020 and -1.861995.
    Entropy = logsumexp - sum p z: token 0: p = [e^.5, 1, e^.5] / 4.297443 = [0.383652, 0.232697, 0.383652],
    sum p z = 0.5 * 2 * 0.383652 = 0.383652, H = 1.074368; token 1: sum p z = 2e / 6.436564 = 0.844638,
    H = 1.017357. d(sum log p) / d hidden row 0 = (onehot(2) - p) W / 2 = [-0.383652, -0.232697, 0.616348] W / 2
    = [0.232697, 0.383652] / 2 = [0.116348, 0.191826]. Tiles of one token and one vocabulary column give the same."""
    h = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    for tokens, chunk in ((4096, CHUNK_SIZE), (1, 1)):
        monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", tokens)
        h.grad = None
        lp, ent = chunked_logprobs(h, w, None, torch.tensor([2, 0]), temperature=2.0, chunk_size=chunk)
        torch.testing.assert_close(lp, torch.tensor([-0.958020, -1.861995]), atol=2e-6, rtol=0)
        torch.testing.assert_close(ent, torch.tensor([1.074368, 1.017357]), atol=2e-6, rtol=0)
        lp.sum().backward()
        torch.testing.assert_close(h.grad[0], torch.tensor([0.116348, 0.191826]), atol=2e-6, rtol=0)


@pytest.mark.parametrize("tokens,chunk", [(4096, CHUNK_SIZE), (5, 64), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_full_values_and_gradients(monkeypatch, tokens, chunk, bias):
    """37 tokens, hidden 16, vocabulary 101, temperature 0.7: log-probs, entropy and the gradients of
    sum(a * logp + b * entropy) (random a, b) in hidden, weight and bias equal autograd through the whole logits.
    Tiles of 5 tokens split the 37 unevenly, chunks of 64 columns split the vocabulary unevenly."""
    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", tokens)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(37, 16, generator=g), torch.randn(101, 16, generator=g)
    b = torch.randn(101, generator=g) if bias else None
    targets = torch.randint(0, 101, (37,), generator=g)
    a, c = torch.randn(37, generator=g), torch.randn(37, generator=g)
    inputs = [h, w] + ([b] if bias else [])
    results = []
    for chunked in (True, False):
        leaves = [x.clone().requires_grad_() for x in inputs]
        hh, ww, bb = leaves[0], leaves[1], leaves[2] if bias else None
        if chunked:
            lp, ent = chunked_logprobs(hh, ww, bb, targets, 0.7, chunk)
        else:
            lp, ent = full_logprobs(torch.nn.functional.linear(hh, ww, bb) / 0.7, targets)
        (a * lp + c * ent).sum().backward()
        results.append([lp.detach(), ent.detach()] + [x.grad for x in leaves])
    for got, want in zip(*results):
        assert rel_err(got, want) < TOL


def test_bf16_equals_the_whole_bf16_logits():
    """bf16 hidden states and head (--bf16): the tiles' log-probs, entropy and gradients equal those through the
    whole bf16 logits (the path before lm_head.py, which cast the logits to fp32 before the softmax) within bf16's
    rounding, and both stay as close to the fp32 values as each other. 300 tokens, hidden 64, vocabulary 5,000."""
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(300, 64, generator=g), torch.randn(5000, 64, generator=g) * 0.1
    targets, a = torch.randint(0, 5000, (300,), generator=g), torch.randn(300, generator=g)
    fp32 = full_logprobs(h @ w.T, targets)
    results = []
    for chunked in (True, False):
        hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        lp, ent = (chunked_logprobs(hb, wb, None, targets, 1.0, 1024) if chunked else
                   full_logprobs((hb @ wb.T).float(), targets))
        (a * lp).sum().backward()
        results.append((lp.detach(), ent.detach(), hb.grad.float(), wb.grad.float()))
        assert lp.dtype == ent.dtype == torch.float32
        for got, want in zip((lp, ent), fp32):  # bf16 inputs: 8 bits of mantissa, logits of size ~3
            assert float((got.detach() - want).abs().max()) < 0.02
    for got, want in zip(*results):
        assert rel_err(got, want) < 1e-2


def _model(path, lora=False):
    from verl_kit.models import load_causal_lm, with_lora

    model = load_causal_lm(path)
    if lora:
        from verl_kit.config import TrainConfig

        cfg = TrainConfig(output_dir="unused", use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0)
        torch.manual_seed(0)  # the adapter's A is drawn at random: the same for both paths
        model = with_lora(model, cfg)
        with torch.no_grad():  # a fresh adapter's B is 0: move it so its gradient path is not trivial
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return model.train()


def _rollout():
    """Four responses; rows 2 and 3 share their prompt (a GRPO group: laid out once, layout's shared_prefix)."""
    g = torch.Generator().manual_seed(3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [10, 11, 12, 13]]
    response = torch.randint(5, 600, (4, 9), generator=g)
    lengths = torch.tensor([9, 4, 7, 5])
    mask = torch.arange(9)[None] < lengths[:, None]
    return prompts, response, mask


@pytest.mark.parametrize("case", ["untied", "tied", "lora", "padded"])
@pytest.mark.parametrize("tokens,chunk", [(4096, CHUNK_SIZE), (4, 100), (1, 1)])
def test_head_logprobs_equal_full_logits_on_the_tiny_model(case, tokens, chunk, monkeypatch, tiny_model_path,
                                                           tiny_tied_path):
    """The tiny model (vocabulary 654), its tied variant (the head is the embedding, as in SmolLM2) and a LoRA
    adapter on it: head_logprobs' log-probs, entropy and every trainable parameter's gradient of
    sum(a * logp + b * entropy) equal those of the whole-logits path (train.actor_logits), packed with a shared
    group prompt (or padded), at temperature 0.7, with token tiles of 4 (splitting every response) and of 1 and
    vocabulary chunks of 100 (uneven) and of 1."""
    from verl_kit.algos import entropy_from_logits
    from verl_kit.data import logprobs_from_logits
    from verl_kit.train import actor_logits, pack_responses

    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", tokens)
    prompts, response, mask = _rollout()
    batch, ix = pack_responses(prompts, response, mask, [2, 0, 3, 1], 0, case != "padded", 64, True)
    assert case == "padded" or batch.input_ids.shape[0] == 1  # one packed row, rows 2 and 3 sharing the prompt
    g = torch.Generator().manual_seed(4)
    a, c = torch.randn(len(ix.targets), generator=g), torch.randn(len(ix.targets), generator=g)
    results = []
    for chunked in (True, False):
        model = _model(tiny_tied_path if case == "tied" else tiny_model_path, lora=case == "lora")
        assert chunkable(model)
        if chunked:
            lp, ent = head_logprobs(model, batch.inputs(), ix.scored, ix.targets, 0.7, chunk)
        else:
            logits = actor_logits(model, batch, ix, 0.7)
            lp, ent = logprobs_from_logits(logits, ix.targets), entropy_from_logits(logits)
        (a * lp + c * ent).sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((lp.detach(), ent.detach(), grads))
    (lp, ent, grads), (lp0, ent0, grads0) = results
    assert rel_err(lp, lp0) < TOL and rel_err(ent, ent0) < TOL
    assert grads.keys() == grads0.keys() and len(grads) > 0
    if case != "lora":
        assert "lm_head.weight" in grads or case == "tied"
    errs = {n: rel_err(grads[n], grads0[n]) for n in grads}
    assert max(errs.values()) < TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize("packing", [True, False])
def test_sequence_logprobs_equal_full_logits(packing, monkeypatch, tiny_model_path):
    """SFT/DPO/KTO's per-sequence sums of completion log-probs (6 prompt + chosen/rejected pairs, packed into rows of
    48 or padded), and the gradients of sum(a * logps) in every parameter, equal the sums of the whole logits'
    log-probs, with token tiles of 5 and vocabulary chunks of 100."""
    from verl_kit.data import layout, logprobs_from_logits
    from verl_kit.train import sequence_logprobs

    def full_sequence_logprobs(model, batch):
        scored = batch.scored
        logps = logprobs_from_logits(model(**batch.inputs()).logits[:, :-1][scored], batch.input_ids[:, 1:][scored])
        return torch.zeros(batch.num_seqs).index_add(0, batch.seq_ids[:, 1:][scored], logps)

    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", 5)
    g = torch.Generator().manual_seed(0)
    seqs, masks = [], []
    for _ in range(6):
        prompt = torch.randint(5, 600, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(2):
            comp = torch.randint(5, 600, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
            seqs.append(prompt + comp)
            masks.append([False] * len(prompt) + [True] * len(comp))
    batch = layout(seqs, masks, pad_id=0, packing=packing, packing_length=48)
    a = torch.randn(len(seqs), generator=g)
    results = []
    for chunked in (True, False):
        model = _model(tiny_model_path)
        logps = (sequence_logprobs(model, batch, chunk_size=100) if chunked
                 else full_sequence_logprobs(model, batch))
        (a * logps).sum().backward()
        results.append((logps.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (logps, grads), (logps0, grads0) = results
    assert rel_err(logps, logps0) < TOL
    assert max(rel_err(grads[n], grads0[n]) for n in grads0) < TOL


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_head_divergence_equals_generalized_jsd(beta, monkeypatch, tiny_model_path, tiny_tied_path):
    """Distillation's scores through both heads in tiles (token tiles of 4: every response split) equal the
    whole-logits path: the student's log-probs, entropy, algos.generalized_jsd from the teacher (forward KL, JSD,
    reverse KL) and the teacher's log-probs, and the student's gradients of sum(a * jsd + b * entropy); packed, with a
    shared group prompt; the student a LoRA adapter on the tiny model, the teacher the tied tiny model."""
    import trl.kernels.chunked_divergence as trl_divergence

    from verl_kit.algos import generalized_jsd
    from verl_kit.train import actor_logits, head_divergence, pack_responses

    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", 4)
    monkeypatch.setattr(trl_divergence, "TOKEN_CHUNK_SIZE", 4)
    prompts, response, mask = _rollout()
    batch, ix = pack_responses(prompts, response, mask, [2, 0, 3, 1], 0, True, 64, True)
    teacher = _model(tiny_tied_path).eval()
    g = torch.Generator().manual_seed(5)
    a, c = torch.randn(len(ix.targets), generator=g), torch.randn(len(ix.targets), generator=g)
    results = []
    for chunked in (True, False):
        student = _model(tiny_model_path, lora=True)
        if chunked:
            lp, ent, jsd, t_lp = head_divergence(student, teacher, batch.inputs(), ix.scored, ix.targets, 0.7, beta,
                                                 chunk_size=100)
        else:
            logits = actor_logits(student, batch, ix, 0.7)
            with torch.no_grad():
                t_logits = actor_logits(teacher, batch, ix, 0.7)
            lp, ent = full_logprobs(logits, ix.targets)
            jsd, t_lp = generalized_jsd(logits, t_logits, beta), full_logprobs(t_logits, ix.targets)[0]
        (a * jsd + c * ent).sum().backward()
        grads = {n: p.grad for n, p in student.named_parameters() if p.requires_grad}
        results.append(([lp.detach(), ent.detach(), jsd.detach(), t_lp], grads))
    (values, grads), (values0, grads0) = results
    assert all(rel_err(x, y) < TOL for x, y in zip(values, values0)), [rel_err(x, y) for x, y in zip(values, values0)]
    assert max(rel_err(grads[n], grads0[n]) for n in grads0) < TOL


@pytest.mark.parametrize("lora", [False, True])
def test_divergence_with_a_teacher_reading_other_prompts(lora, monkeypatch, tiny_model_path, tiny_tied_path):
    """Self-distillation's teacher reads a privileged context before the same responses: ResponsePacker.divergence
    with a teacher rollout (other prompts, so another packed layout: rows 2 and 3 no longer share theirs) gives each
    response token the student's log-prob, its JSD from the teacher and the teacher's log-prob that one row at a time
    through the whole logits gives; tiled (a plain student) and through the whole-logits path (a LoRA student)."""
    import dataclasses

    import trl.kernels.chunked_divergence as trl_divergence

    from verl_kit.algos import generalized_jsd
    from verl_kit.config import TrainConfig
    from verl_kit.rollout.types import Rollout
    from verl_kit.train import ResponsePacker

    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", 4)
    monkeypatch.setattr(trl_divergence, "TOKEN_CHUNK_SIZE", 4)
    prompts, response, mask = _rollout()
    ro = Rollout(prompts, response, mask, torch.zeros(response.shape), torch.zeros(4, dtype=torch.bool))
    theirs = dataclasses.replace(ro, prompt_ids=[[40 + i] * (i + 2) + p for i, p in enumerate(prompts)])
    student, teacher = _model(tiny_model_path, lora=lora), _model(tiny_tied_path).eval()
    packer = ResponsePacker(TrainConfig(output_dir="unused", packing_length=64), 0, student, 0.7)
    lp, ent, jsd, t_lp, ix = packer.divergence(student, teacher, ro, [2, 0, 3, 1], "cpu", 0.5, theirs)
    assert len(ix.targets) == int(mask.sum())
    for k, (row, pos) in enumerate(zip(ix.row.tolist(), ix.pos.tolist())):
        s_ids, t_ids = prompts[row] + response[row].tolist(), theirs.prompt_ids[row] + response[row].tolist()
        with torch.no_grad():
            s_logits = student(input_ids=torch.tensor([s_ids])).logits[0, len(prompts[row]) - 1 + pos] / 0.7
            t_logits = teacher(input_ids=torch.tensor([t_ids])).logits[0, len(theirs.prompt_ids[row]) - 1 + pos] / 0.7
        target = response[row, pos]
        want = (s_logits.log_softmax(-1)[target], generalized_jsd(s_logits[None], t_logits[None], 0.5)[0],
                t_logits.log_softmax(-1)[target])
        got = (lp[k], jsd[k], t_lp[k])
        assert all(abs(float(x - y)) < 1e-4 for x, y in zip(got, want)), (row, pos, got, want)
