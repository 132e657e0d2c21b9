"""The baseline bench.learner_gpu compares FleetRL's learner with: one PPO update as a plain PyTorch loop.

What a user would write with transformers alone: right-padded rows, the model's SDPA attention,
full logits -> float32 log-softmax -> the clipped PPO surrogate over completion tokens, averaged
over the update's completion tokens (as FleetRL's token-level loss), gradient clipping, AdamW.
"""

from __future__ import annotations

import numpy as np
import torch

from learner.train.batch import Sample


def padded_rows(samples: list[Sample], device: torch.device) -> dict[str, torch.Tensor]:
    """ids and mask [B, L]; behaviour logprobs, loss mask [B, L - 1] aligned with the logit that predicts each token."""
    length = max(len(s.tokens) for s in samples)
    ids = np.zeros((len(samples), length), np.int64)
    mask = np.zeros((len(samples), length), np.int64)
    behaviour = np.zeros((len(samples), length - 1), np.float32)
    scored = np.zeros((len(samples), length - 1), np.float32)
    for b, s in enumerate(samples):
        n = len(s.tokens)
        ids[b, :n], mask[b, :n] = s.tokens, 1
        # The logit at position t predicts token t + 1: completion tokens P..n-1 are scored at P-1..n-2.
        behaviour[b, s.prompt_len - 1 : n - 1] = s.behaviour_logprobs
        scored[b, s.prompt_len - 1 : n - 1] = 1.0
    adv = np.array([[s.advantage] for s in samples], np.float32)
    arrays = dict(ids=ids, mask=mask, behaviour=behaviour, scored=scored, adv=adv)
    return {k: torch.from_numpy(v).to(device, non_blocking=True) for k, v in arrays.items()}


def ppo_loss(model: torch.nn.Module, rows: dict[str, torch.Tensor], total_tokens: int, clip: tuple[float, float]) -> torch.Tensor:
    logits = model(input_ids=rows["ids"], attention_mask=rows["mask"], use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, rows["ids"][:, 1:, None]).squeeze(2)
    ratio = torch.exp(logp - rows["behaviour"])
    adv = rows["adv"]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - clip[0], 1 + clip[1]) * adv)
    return -(surr * rows["scored"]).sum() / total_tokens


class PlainLoop:
    def __init__(self, model: torch.nn.Module, *, lr: float, grad_clip: float, clip: tuple[float, float], rows: int, checkpointing: bool):
        self.model, self.grad_clip, self.clip, self.rows = model, grad_clip, clip, rows
        device = next(model.parameters()).device
        self.device = device
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
        if device.type == "cuda":
            # As FleetRL does (learner/train/attention/varlen.py): with cuDNN's SDPA a new padded length costs a plan
            # build of ~3 ms per call, which would slow this baseline and flatter the FleetRL / plain ratio.
            torch.backends.cuda.enable_cudnn_sdp(False)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        model.train()
        # The fused kernel is CUDA-only here; the CPU smoke run takes the default implementation.
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0, fused=device.type == "cuda")

    def update(self, samples: list[Sample]) -> float:
        """One optimizer step over `samples`, `rows` padded rows per forward/backward; returns the loss."""
        total_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
        loss_sum = torch.zeros((), device=self.device)
        for i in range(0, len(samples), self.rows):
            loss = ppo_loss(self.model, padded_rows(samples[i : i + self.rows], self.device), total_tokens, self.clip)
            loss.backward()
            loss_sum += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss_sum)
