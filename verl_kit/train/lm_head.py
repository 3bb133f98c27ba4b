"""Per-token log-probs and entropy through the LM head in tiles, never the (tokens x vocabulary) logits.

chunked_logprobs(...)   the maths: hidden (M, H) and the head's weight (V, H) -> log p(target) (M,) and entropy (M,),
                        logits built one [4096 tokens x chunk_size columns] tile at a time and folded into an online
                        logsumexp; the backward recomputes each tile (TRL 1.16's ChunkedLogProbFunction: Triton on
                        GPU, torch ops elsewhere)
head_logprobs(...)      a causal LM's log-probs and entropy at chosen positions, computed inside the LM head module's
                        own forward, so DeepSpeed ZeRO-3's module hooks gather its weight once per forward and once per
                        backward, as for any layer
head_divergence(...)    distillation's generalized JSD between a student and a teacher the same way, with both
                        models' logits in tiles (TRL's ChunkedDivergenceFunction), and the log-probs of both
token_logprobs(...)     a TokenBatch's scored-token log-probs (SFT's), the same way
sequence_logprobs(...)  their sum per sequence (DPO/KTO's, and scoring's)

What it saves: at a 151,936-token vocabulary one fp32 copy of the logits of 32 x 300 response tokens is 5.8 GB, and
log-softmax, softmax and their gradients make several; here the logits alive at once are one tile (4096 x 4096 fp32
= 64 MB, a few temporaries of that size on the torch path), whatever the vocabulary and the token count.
"""

from __future__ import annotations

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn
from trl.kernels import ChunkedLogProbFunction

from verl_kit.algos.distill import generalized_jsd
from verl_kit.algos.policy import entropy_from_logits
from verl_kit.data.packing import TokenBatch, logprobs_from_logits

# Vocabulary columns per tile (TRL tiles tokens by 4096): a tile is 4096 x 4096 fp32 = 64 MB, and the torch path
# holds about six temporaries of that size. Chosen by memory: on CPU one forward + backward of 2048 tokens x 49,152
# columns x 576 (SmolLM2's head) took the same time at 2048 to 32768 columns and as the whole logits (39-59 s, within
# the noise of 2 shared cores); TRL's own default, 32768, is tuned for its Triton kernel on GPU.
CHUNK_SIZE = 4096

# Config fields whose model post-processes the LM head's output (softcapping, scaling): there the head's output
# cannot be replaced by log-probs, and head_logprobs falls back to full logits.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     temperature: float = 1.0, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """With z = (hidden @ weight.T + bias) / temperature, the logits never held whole:
        logprobs = z[target] - logsumexp(z)         (M,) fp32
        entropy  = logsumexp(z) - sum_v softmax(z)_v z_v     (M,) fp32
    hidden (M, H), weight (V, H), bias (V,) or None, targets (M,) long. Gradients reach hidden, weight and bias
    (accumulated in fp32); an entropy used only for logging costs no backward work."""
    logprobs, entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
                                                         None, 1.0, ("entropy",))
    return logprobs, entropy


def full_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from whole logits (M, V), already divided by the temperature: for a loss that needs the whole
    distribution (distillation's JSD), a model whose head output is post-processed, and as the reference the chunked
    path is tested against."""
    return logprobs_from_logits(logits, targets), entropy_from_logits(logits)


def chunkable(model) -> bool:
    """Whether head_logprobs can run in tiles: a plain linear output layer whose output the model uses as is (not a
    LoRA-adapted head, no softcapping or logit scaling)."""
    inner = extract_model_from_parallel(model)
    config = inner.config.get_text_config()
    return (type(inner.get_output_embeddings()) is nn.Linear
            and all(getattr(config, name, None) is None for name in _LOGIT_TRANSFORMS))


def head_logprobs(model, inputs: dict, scored: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropy (M,), (M,) fp32 of `targets` (M,) predicted at the positions `scored` (R, L-1) of the
    rows `inputs` (TokenBatch.inputs(): input_ids (R, L), ...), at `temperature`. The LM head's forward is swapped,
    for this call only, for one that selects the scored positions and runs chunked_logprobs on them: inside the head
    module, so ZeRO-3 gathers its weight for the forward and again for the backward exactly as it does for the plain
    head."""
    device = inputs["input_ids"].device
    scored, targets = scored.to(device), targets.to(device)
    if not chunkable(model):
        logits = scored_logits(model, inputs, scored)
        return full_logprobs(logits / temperature, targets)
    head = extract_model_from_parallel(model).get_output_embeddings()
    return _through_head(model, inputs, lambda hidden: chunked_logprobs(
        hidden[:, :-1][scored], head.weight, head.bias, targets, temperature, chunk_size))


def head_divergence(student, teacher, inputs: dict, scored: torch.Tensor, targets: torch.Tensor, temperature: float,
                    beta: float, chunk_size: int = CHUNK_SIZE, teacher_inputs: tuple | None = None
                    ) -> tuple[torch.Tensor, ...]:
    """Distillation's scores at the positions `scored`: the student's log-probs, entropy and its generalized JSD
    from the teacher (algos.generalized_jsd's maths, beta the same; TRL 1.16's ChunkedDivergenceFunction), and the
    teacher's log-probs, each (M,) fp32; gradients reach the student only. The teacher runs first, its head swapped
    for one that keeps the scored hidden states (M, H_t); then the student's head folds both models' tiles.
    `teacher_inputs`: (inputs, scored, order) where the teacher reads other sequences (a privileged context before
    the same responses): its scored positions, taken in `order`, are the student's."""
    # imported here: this module of TRL imports transformers' integrations, which print a line on stdout at import
    # under WANDB_MODE=offline
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    device = inputs["input_ids"].device
    scored, targets = scored.to(device), targets.to(device)
    t_inputs, t_scored, order = teacher_inputs or (inputs, scored, None)
    t_scored = t_scored.to(device)
    in_order = (lambda t: t) if order is None else (lambda t: t[order.to(device)])
    if not (chunkable(student) and chunkable(teacher)):
        with torch.no_grad():
            t_logits = in_order(scored_logits(teacher, t_inputs, t_scored)) / temperature
        logits = scored_logits(student, inputs, scored) / temperature
        return (*full_logprobs(logits, targets), generalized_jsd(logits, t_logits, beta),
                logprobs_from_logits(t_logits, targets))
    s_head = extract_model_from_parallel(student).get_output_embeddings()
    t_head = extract_model_from_parallel(teacher).get_output_embeddings()

    def teacher_forward(hidden):  # (R, L, H_t) -> the scored hidden states (M, H_t), log-probs (M,)
        h = in_order(hidden[:, :-1][t_scored])
        return h, chunked_logprobs(h, t_head.weight, t_head.bias, targets, temperature, chunk_size)[0]

    def student_forward(hidden):  # (R, L, H_s) -> log-probs, entropy, divergence (M,)
        h = hidden[:, :-1][scored]
        logprobs, entropy = chunked_logprobs(h, s_head.weight, s_head.bias, targets, temperature, chunk_size)
        divergence, _ = ChunkedDivergenceFunction.apply(h, s_head.weight, s_head.bias, t_hidden, t_head.weight,
                                                        t_head.bias, beta, temperature)
        return logprobs, entropy, divergence

    with torch.no_grad():
        t_hidden, t_logprobs = _through_head(teacher, t_inputs, teacher_forward)
    return (*_through_head(student, inputs, student_forward), t_logprobs)


def _through_head(model, inputs: dict, forward) -> tuple[torch.Tensor, ...]:
    """Run `model` with its LM head's forward replaced by `forward` (an instance attribute, so nn.Module.__call__
    and every hook on the head run around it) and return what it returned, which the model passes on as `logits`."""
    head = extract_model_from_parallel(model).get_output_embeddings()
    head.forward = forward
    try:
        return model(**inputs).logits
    finally:
        del head.forward


def scored_logits(model, inputs: dict, scored: torch.Tensor) -> torch.Tensor:
    """The whole logits (M, V) fp32 of the positions `scored` (R, L-1) only: a hook on the LM head selects them
    first. The path of a loss that needs every probability, or of a head that cannot run in tiles (chunkable)."""
    head = extract_model_from_parallel(model).get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _, args: (args[0][:, :-1][scored][None], *args[1:]))
    try:
        return model(**inputs).logits[0].float()
    finally:
        hook.remove()


def token_logprobs(model, batch: TokenBatch, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (M,) fp32 at temperature 1 of a TokenBatch's (packed or padded) M scored tokens, each predicted from
    the previous position of its sequence, and the sequence each belongs to (M,): through head_logprobs, in tiles."""
    scored = batch.scored
    logps, _ = head_logprobs(model, batch.inputs(), scored, batch.input_ids[:, 1:][scored], 1.0, chunk_size)
    return logps, batch.seq_ids[:, 1:][scored].to(logps.device)


def sequence_logprobs(model, batch: TokenBatch, chunk_size: int = CHUNK_SIZE) -> torch.Tensor:
    """Sum of the scored tokens' log-probs per sequence (N,) fp32 of a TokenBatch (SFT/DPO/KTO's and scoring's)."""
    logps, index = token_logprobs(model, batch, chunk_size)
    return torch.zeros(batch.num_seqs, dtype=logps.dtype, device=logps.device).index_add(0, index, logps)
