"""Chunked logprobs (learner/train/scoring.py): the same numbers and gradients as full logits, without a [T, V] tensor;
and gradient checkpointing really recomputes the layers, with the packed kwargs, to the same gradients."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from learner.train.attention.hf import VARLEN
from learner.train.batch import token_logprobs
from learner.train.engines import checkpoint_layers
from learner.train.packing import pack_samples
from learner.train.scoring import ChunkedLogprobs, ScoringHead, install_scoring_head, score_tokens
from tests.unit.test_packing import make_samples


def reference(hidden, weight, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.t()) / temperature, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 4, 11, 100])
@pytest.mark.parametrize("entropy", [False, True])
def test_chunked_matches_full_logits_and_gradcheck(chunk, entropy):
    torch.manual_seed(chunk)
    hidden = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (11,))
    out = ChunkedLogprobs.apply(hidden, weight, targets, 0.7, chunk, entropy)
    logp, ent = reference(hidden, weight, targets, 0.7)
    torch.testing.assert_close(out[:, 0], logp, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 1], ent if entropy else torch.zeros_like(ent), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda h, w: ChunkedLogprobs.apply(h, w, targets, 0.7, chunk, entropy), (hidden, weight))


def test_bfloat16_gradients_close_to_float32():
    """In the training dtype the weight gradient is summed over chunks in float32: close to the fp32 result."""
    torch.manual_seed(0)
    h32, w32 = torch.randn(300, 64), torch.randn(500, 64) * 0.1
    targets = torch.randint(0, 500, (300,))
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        h = h32.to(dtype).detach().clone().requires_grad_()
        w = w32.to(dtype).detach().clone().requires_grad_()
        out = ChunkedLogprobs.apply(h, w, targets, 1.0, 16, True)
        (out[:, 0].sum() + 0.1 * out[:, 1].sum()).backward()
        grads[dtype] = (h.grad.float(), w.grad.float())
    for g16, g32 in zip(grads[torch.bfloat16], grads[torch.float32], strict=True):
        assert (g16 - g32).norm() / g32.norm() < 2e-2


class LargestTensor(TorchDispatchMode):
    """The most elements any op produced while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocab_tensor_exists():
    """Forward and backward never hold more than a chunk of logits: the claim the memory plan relies on."""
    hidden = torch.randn(400, 8, requires_grad=True)
    weight = torch.randn(1000, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (400,))
    with LargestTensor() as seen:
        ChunkedLogprobs.apply(hidden, weight, targets, 1.0, 50, True).sum().backward()
    assert 50 * 1000 <= seen.largest < 400 * 1000, seen.largest  # one chunk's logits, not all tokens'
    with LargestTensor() as full:
        sum(reference(hidden, weight, targets, 1.0)).sum().backward()
    assert full.largest >= 400 * 1000  # the control: full logits do make one


def tiny(tie: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


@pytest.mark.parametrize("tie", [False, True])
def test_scoring_head_keeps_the_model(tie):
    """The swapped head is the same Parameter under the same name (weight sync and checkpoints see no change), a
    tied embedding stays tied, and outside scoring the model returns ordinary logits."""
    model = tiny(tie)
    names = [n for n, _ in model.named_parameters()]
    weight = model.lm_head.weight
    ids = torch.randint(0, 40, (2, 7))
    before = model(input_ids=ids).logits
    head = install_scoring_head(model)
    assert isinstance(model.lm_head, ScoringHead) and head.weight is weight
    assert [n for n, _ in model.named_parameters()] == names
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    assert install_scoring_head(model) is head  # idempotent


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_score_tokens_matches_full_logits_in_a_packed_model(entropy_coef):
    model = tiny(tie=True)
    model.set_attn_implementation(VARLEN)
    packed = pack_samples(make_samples(), version=3)
    ref = token_logprobs(model(**packed.model_kwargs()).logits, packed, 0.7)
    (ref.sum()).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    head = install_scoring_head(model)
    logp, ent = score_tokens(model, head, packed, 0.7, chunk=4, entropy=entropy_coef > 0, device=torch.device("cpu"))
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    (logp.sum() + entropy_coef * ent.sum()).backward()
    if entropy_coef == 0:
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6)
    else:
        assert (ent > 0).all()


def test_gradient_checkpointing_recomputes_with_packed_kwargs():
    """Each decoder layer runs twice per training step (forward, then again in backward), sees the packed
    boundaries both times, and the gradients equal those without checkpointing."""
    packed = pack_samples(make_samples(), version=3)
    grads, calls = {}, {}
    for ckpt in (False, True):
        model = tiny(tie=False)
        model.set_attn_implementation(VARLEN)
        head = install_scoring_head(model)
        if ckpt:
            checkpoint_layers(model)
        model.train()
        seen: list[bool] = []
        model.model.layers[0].self_attn.register_forward_pre_hook(
            lambda mod, args, kwargs, seen=seen: seen.append(kwargs.get("cu_seq_lens_q") is not None), with_kwargs=True
        )
        logp, _ = score_tokens(model, head, packed, 1.0, chunk=8, entropy=False, device=torch.device("cpu"))
        logp.sum().backward()
        calls[ckpt], grads[ckpt] = seen, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert calls[False] == [True] and calls[True] == [True, True]
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-5, atol=1e-7)
