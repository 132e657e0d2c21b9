"""The frozen reference policy for the KL penalty: a copy of the initial policy that never trains."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from learner.train.batch import TokenBatch
from learner.train.scoring import install_scoring_head, score_tokens


class ReferencePolicy:
    """Holds a causal LM in eval mode with requires_grad off and no optimizer (not an nn.Module on
    purpose: nothing walking the learner's modules, e.g. DeepSpeed or a weight sync, can pick it up)."""

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.head = install_scoring_head(self.model)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ReferencePolicy:
        """Load the reference from the policy's initial folder (works under ZeRO-3, unlike a deepcopy)."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype))

    @torch.no_grad()
    def logprobs(self, mb: TokenBatch, temperature: float, chunk: int = 1024, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        """Logprobs [T] of the micro-batch's completion tokens, after `temperature`, `top_k` and `top_p` like the
        policy's (the KL compares the same truncated distributions), on its device."""
        device = next(self.model.parameters()).device
        return score_tokens(self.model, self.head, mb, temperature, chunk, entropy=False, device=device, top_k=top_k, top_p=top_p)[0]
