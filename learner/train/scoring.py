"""The completion tokens' logprobs (and entropy) from the model's last hidden states, a chunk of tokens at a time.

A full `[tokens, vocab]` float32 logit tensor is what runs a long-generation learner out of
memory: 64k tokens x 152k vocabulary is 40 GB, and autograd keeps it (and its softmax) for
backward. So the policy's lm_head is swapped for a `ScoringHead`, which holds the SAME weight
Parameter (its name, its tying to the input embeddings and DeepSpeed's partitioning are
unchanged). Inside `scoring(...)` the head picks the hidden states of the scored positions
and runs `ChunkedLogprobs`: logits of `chunk` tokens at a time in float32, reduced at once to
a logprob and an entropy per token. Backward recomputes each chunk's logits from the saved
hidden states and weight; nothing of size vocab survives a chunk.

It is the lm_head module itself that scores (not code after the model's forward) because
ZeRO-3 gathers a module's parameters only around that module's own forward and backward.
The head returns one `[T, 2]` tensor (logprob, entropy), so ZeRO-3's backward hook on the
module's output sees every gradient that reaches the weight. Outside `scoring(...)` the head
is a plain linear layer.

Top-k / top-p (rollout.top_k, rollout.top_p): the actor's vLLM samples from, and reports the
logprobs of, softmax(z) renormalised over the kept tokens (vllm/v1/sample/ops/topk_topp_sampler.py,
apply_top_k_top_p_pytorch: top-k keeps z >= the k-th largest z; then top-p, on the softmax of what
top-k kept, sorted ascending, drops each token whose cumulative probability is <= 1 - top_p, the
largest always kept; z = logits / temperature, so the kept set depends on the temperature). The
learner scores the same distribution: each chunk finds each token's threshold (the smallest kept z)
the same way, and the logprob is z[target] - logsumexp over the kept set. Only the [T] thresholds are
saved; backward recomputes the mask from them. The mask is piecewise constant in z, so the masked
logits get zero gradient and the kept ones the softmax over the kept set. The target is always
counted as kept: the engine sampled it, so under the engine's weights it is kept anyway, and under
moved weights (a stale sample, or a later PPO step) a target that fell out of the set scores as the
smallest member instead of -inf (a ratio of exactly 0 and a NaN gradient). Ties at the threshold keep
every tied token, where vLLM's sort keeps an arbitrary subset of them.
Unverified on GPUs: where Triton is installed (CUDA) vLLM masks with apply_top_k_top_p_triton instead, which
finds the top-p pivot by bisection and keeps exactly k tokens under ties (ties are common in bf16 logits), so
the boundary token can differ and `logprob_mismatch` would show it. The CPU build has no Triton: the engine
test (tests/integration/test_sampling.py) proves the match there only. The shipped recipes sample with both off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


class ChunkedLogprobs(torch.autograd.Function):
    """hidden [T, H], weight [V, H], targets [T] -> [T, 2]: log softmax(h W^T / t)[target] and the entropy, of the
    distribution after top-k / top-p (top_k = 0 and top_p = 1: none)."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        entropy: bool,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        acc = _acc_dtype(weight)
        out = torch.zeros(hidden.shape[0], 2, dtype=acc, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)
        masked = _masks(top_k, top_p, weight.shape[0])
        floor = torch.empty(hidden.shape[0] if masked else 0, dtype=acc, device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            z = _logits(hidden[a : a + chunk], weight, temperature)
            t = targets[a : a + chunk, None]
            if masked:
                floor[a : a + chunk] = threshold(z, top_k, top_p)
                kept = _kept(z, floor[a : a + chunk], t)
                zk = z.masked_fill(~kept, float("-inf"))
            else:
                zk = z
            lse[a : a + chunk] = zk.logsumexp(-1)
            out[a : a + chunk, 0] = z.gather(1, t).squeeze(1) - lse[a : a + chunk]
            if entropy:  # H = lse - sum(p z); p is 0 off the kept set, z is finite there
                out[a : a + chunk, 1] = lse[a : a + chunk] - (torch.softmax(zk, -1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, out, floor)
        ctx.temperature, ctx.chunk, ctx.entropy, ctx.masked = temperature, chunk, entropy, masked
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        hidden, weight, targets, lse, out, floor = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        # summed over chunks in float32: a bfloat16 sum would round the running total at every chunk
        grad_w = torch.zeros(weight.shape, dtype=_acc_dtype(weight), device=weight.device) if want_w else None
        for a in range(0, hidden.shape[0], chunk):
            h, g = hidden[a : a + chunk], grad[a : a + chunk]
            z = _logits(h, weight, t)
            p = torch.exp(z - lse[a : a + chunk, None])
            if ctx.masked:  # off the kept set p = 0: no gradient, in the logprob or the entropy
                p = p.masked_fill(~_kept(z, floor[a : a + chunk], targets[a : a + chunk, None]), 0.0)
            # d logp / dz = onehot(target) - p;  d H / dz = -p (log p + H)
            gz = p * -g[:, :1]
            gz.scatter_add_(1, targets[a : a + chunk, None], g[:, :1])
            if ctx.entropy:
                gz -= g[:, 1:] * p * (z - lse[a : a + chunk, None] + out[a : a + chunk, 1:])
            gz = (gz / t).to(weight.dtype)
            if grad_h is not None:
                grad_h[a : a + chunk] = gz @ weight
            if grad_w is not None:
                grad_w += gz.t() @ h  # the matmul in the weights' dtype (tensor cores), summed in float32
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None, None


def _masks(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether top-k / top-p removes anything (vLLM: top_k 0 or >= the vocabulary, and top_p 1, are off)."""
    return 0 < top_k < vocab or top_p < 1.0


def threshold(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[N, V] logits (after temperature) -> [N]: the smallest z vLLM's top-k then top-p keeps in each row.

    The same steps as vLLM's apply_top_k_top_p_pytorch, in the same order and dtype, so the boundary token
    agrees: top-k alone is one topk; top-p sorts ascending, softmaxes what top-k kept, and drops the prefix
    whose cumulative probability is <= 1 - top_p (never the largest)."""
    vocab = z.shape[-1]
    k = top_k if 0 < top_k < vocab else 0
    if top_p >= 1.0:
        assert k, "threshold() called with nothing to mask"
        return z.topk(k, dim=-1).values[:, -1]
    zs = z.sort(dim=-1).values  # ascending
    dropped = torch.zeros(zs.shape, dtype=torch.bool, device=z.device)
    if k:
        dropped |= zs < zs[:, vocab - k, None]
    cum = zs.masked_fill(dropped, float("-inf")).softmax(-1).cumsum(-1)
    dropped |= cum <= 1 - top_p
    dropped[:, -1] = False
    # The dropped positions are a prefix of the ascending order: the first kept one is the threshold.
    return zs.gather(1, dropped.sum(-1, keepdim=True)).squeeze(1)


def _kept(z: torch.Tensor, floor: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: z at or above its row's threshold, and always the target (see the module docstring)."""
    return (z >= floor[:, None]).scatter_(1, targets, True)


def _acc_dtype(weight: torch.Tensor) -> torch.dtype:
    """float32 at least (float64 stays float64: exact gradient checks)."""
    return torch.promote_types(weight.dtype, torch.float32)


def _logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """One chunk's logits in float32, from the matmul in the weights' dtype (as the engine computes them)."""
    return (h @ weight.t()).to(_acc_dtype(weight)) / temperature


@dataclass(kw_only=True, slots=True)
class Scoring:
    rows: torch.Tensor  # int64 [T]: row of each scored position
    cols: torch.Tensor  # int64 [T]: its column (the logit there predicts the token)
    targets: torch.Tensor  # int64 [T]
    temperature: float
    chunk: int  # tokens per chunk of the vocabulary projection
    entropy: bool  # also compute the entropy (else column 1 is 0)
    top_k: int = 0  # the sampler's top-k (0 = off): score the distribution the actor sampled from
    top_p: float = 1.0  # the sampler's top-p (1 = off)


class ScoringHead(nn.Linear):
    """The lm_head: a linear layer, or, inside `scoring(...)`, `[T, 2]` (logprob, entropy) of the scored tokens."""

    scoring: Scoring | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        s = self.scoring
        if s is None:
            return super().forward(hidden)
        picked = hidden[s.rows, s.cols]  # [T, H]
        return ChunkedLogprobs.apply(picked, self.weight, s.targets, s.temperature, s.chunk, s.entropy, s.top_k, s.top_p)


def install_scoring_head(model: nn.Module) -> ScoringHead:
    """Swap the model's lm_head for a ScoringHead over the same weight Parameter (before deepspeed.initialize)."""
    old = model.get_output_embeddings()  # type: ignore[operator]
    if isinstance(old, ScoringHead):
        return old
    if not isinstance(old, nn.Linear) or old.bias is not None:
        raise ValueError(f"scoring needs a bias-free nn.Linear lm_head, got {type(old).__name__}")
    head = ScoringHead(old.in_features, old.out_features, bias=False, device="meta")
    head.weight = old.weight  # the same Parameter: a tied embedding stays tied
    model.set_output_embeddings(head)  # type: ignore[operator]
    return head


@contextlib.contextmanager
def scoring(
    head: ScoringHead,
    rows: torch.Tensor,
    cols: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    entropy: bool,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Iterator[None]:
    """Inside: a forward of the model returns `[T, 2]` as its "logits". Only the head is armed, and it is not
    re-run by activation checkpointing (that recomputes decoder layers), so the block may end after the forward."""
    head.scoring = Scoring(
        rows=rows, cols=cols, targets=targets, temperature=temperature, chunk=chunk, entropy=entropy, top_k=top_k, top_p=top_p
    )
    try:
        yield
    finally:
        head.scoring = None


def score_tokens(
    model: nn.Module,
    head: ScoringHead,
    mb,
    temperature: float,
    chunk: int,
    entropy: bool,
    device: torch.device,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [T], entropies [T]) of a TokenBatch's completion tokens under `model` (whose lm_head is `head`),
    on `device`, of the distribution sampled with `temperature`, `top_k` and `top_p`; the entropies (of that same
    distribution) are 0 unless `entropy`."""
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in mb.model_kwargs().items()}
    with scoring(
        head, mb.score_rows.to(device), mb.score_cols.to(device), mb.targets.to(device), temperature, chunk, entropy, top_k, top_p
    ):
        # use_cache=False: with a KV cache transformers would not keep packed samples apart.
        out = model(**kwargs, use_cache=False).logits
    return out[:, 0], out[:, 1]
