"""What one learner GPU holds while it trains a micro-batch, beside the model states: an estimate for `fleetrl plan`.

Counted per decoder layer and token, in the training dtype (b bytes), what autograd keeps for
backward with flash/varlen attention (no [tokens, tokens] score matrix):
    the two RMSNorms' inputs and outputs (4 h), q (h) and k, v (2 kv), the attention output (h),
    the MLP's gate, up, activation and product (4 I):  layer = (6 h + 2 kv + 4 I) b
- without checkpointing: every layer's, tokens x layers x layer;
- with gradient checkpointing: each layer's input (tokens x layers x h b), plus one layer's
  activations recomputed in backward and its gradients (2 x tokens x layer).
Plus the scored hidden states and the final norm (3 tokens x h b), the logits of one chunk of
tokens in float32 with their softmax and gradient (learner/train/scoring.py: chunk x V x (12 + b); with top-p, the
sorted copy and its softmax and cumulative sum, 12 more; with top-k, 5 more),
the float32 sum of the lm_head's gradient (V x h x 4), and under ZeRO-3 the parameters it
keeps gathered at once (DeepSpeed's stage3_max_live_parameters, 1e9 by default).

The architecture comes from model.path's config.json, or from model.arch (a config.json of
the same architecture, for planning before the weights are at hand: configs/models/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ZERO3_LIVE_PARAMS = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters


@dataclass(frozen=True, slots=True)
class Arch:
    """The shape of a decoder-only transformer, as its Hugging Face config.json gives it."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, c: dict) -> Arch:
        heads = c["num_attention_heads"]
        return cls(
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            intermediate=c["intermediate_size"],
            heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            vocab=c["vocab_size"],
        )


def config_json(model_path: str, arch_path: str) -> Path | None:
    """The config.json describing the model: model.path's when it is there, else model.arch's."""
    if model_path and (Path(model_path) / "config.json").is_file():
        return Path(model_path) / "config.json"
    if arch_path:
        return Path(arch_path)
    return None


def read_arch(path: Path) -> Arch:
    return Arch.from_config(json.loads(path.read_text()))


@dataclass(kw_only=True, slots=True)
class Activations:
    """Bytes of one micro-batch's training working set on one GPU, by part."""

    tokens: int  # positions in the micro-batch on this GPU
    layers: float
    head: float  # scored hidden states, one chunk of logits, the lm_head gradient sum
    gathered: float  # ZeRO-3's gathered parameters

    @property
    def total(self) -> float:
        return self.layers + self.head + self.gathered


def activation_bytes(
    arch: Arch,
    tokens: int,
    dtype_bytes: int,
    checkpointing: bool,
    chunk: int,
    zero_stage: int,
    num_params: int,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Activations:
    b, h = dtype_bytes, arch.hidden
    layer = (6 * h + 2 * arch.kv_heads * arch.head_dim + 4 * arch.intermediate) * b
    if checkpointing:
        layers = tokens * arch.layers * h * b + 2 * tokens * layer
    else:
        layers = tokens * arch.layers * layer
    per_logit = 12 + b + (12 if top_p < 1 else 0) + (5 if top_k > 0 else 0)  # top-k: its kept mask and masked copy
    head = 3 * tokens * h * b + min(chunk, tokens) * arch.vocab * per_logit + arch.vocab * h * 4
    gathered = min(ZERO3_LIVE_PARAMS, num_params) * b if zero_stage == 3 else 0.0
    return Activations(tokens=tokens, layers=float(layers), head=float(head), gathered=float(gathered))
