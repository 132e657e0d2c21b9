"""The critic for PPO with GAE: a Hugging Face transformer backbone plus a scalar value head.

A folder written by `save_pretrained` is the backbone's own Hugging Face folder (config.json +
model.safetensors, loadable by `AutoModel`) plus `value_head.safetensors`. `from_pretrained` on a
policy folder (a causal LM, no value head) takes its transformer body and starts a fresh head:
the usual init of a PPO critic from the policy's weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

HEAD_FILE = "value_head.safetensors"


class Critic(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        # float32 head whatever the backbone's dtype: values feed squared errors and GAE sums.
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        # Small weights and a zero bias: the first values are near 0, so the first advantages are
        # about the raw returns instead of noise from a random projection of large hidden states.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> Critic:
        """Load a critic folder, or a policy folder (its transformer body, with a fresh value head)."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(str(path), dtype=dtype)
        critic = cls(backbone, backbone.config.hidden_size)
        head = Path(path) / HEAD_FILE
        if head.exists():
            critic.value_head.load_state_dict(load_file(str(head)))
        return critic

    def save_pretrained(self, path: str | Path) -> None:
        path = Path(path)
        self.backbone.save_pretrained(path)  # type: ignore[operator]
        save_file({k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}, str(path / HEAD_FILE))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention_kwargs,
    ) -> torch.Tensor:
        """Values [B, L] in float32: values[b, t] is the value of the state after reading tokens 0..t,
        i.e. before token t + 1. GAE's V of completion token j (prompt length P) is at position
        P - 1 + j, the position whose logit scores it: `values[mb.score_rows, mb.score_cols]`.

        Packed rows (several sequences in one row): pass position_ids restarting at 0 for each
        sequence and no attention_mask; transformers then masks attention to each sequence's block.
        `attention_kwargs` carry a packed or sequence-parallel layout's boundaries (learner/train/layout.py).
        """
        # use_cache=False: with a KV cache transformers skips the packed-sequence detection, and a
        # packed row would silently attend across its sequences.
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **attention_kwargs
        ).last_hidden_state
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
