"""Warm start for the embedded demo: a short supervised run that gives the tiny model a starting policy.

A randomly initialised model never samples a correct sum, and RL from zero reward
learns nothing. So the demo first trains the model to convergence on the correct
answers with heavy label smoothing (0.45 by default): it learns the whole table
(the right answer is always the most likely) and the "digits, then <eos>" format,
but stays unsure, sampling the right sum about a quarter of the time at
temperature 1. RL must sharpen that policy: the rise in the demo's reward is
RL's doing, not this step's.

Tried and rejected, so nobody retries them: noisy labels never learn the table;
stopping clean training early gives a policy so close to its random init that one
Adam step at the demo's learning rate collapses the reward.

The tool demo (`warm_start_tools`, configs/demo_tools.toml) sums numbers of several digits, which the tiny model
cannot learn to add in its head in a warm start. Its examples answer directly (the right sum, rarely learned) or,
on demo.tool_share of them, call the calculator: `<calc>a+b</calc>`, the result as the environment writes it
(context, not trained), then the sum copied. The model starts out knowing both ways, mostly answering directly
and mostly wrong; RL must learn to call the tool. Measured before choosing (2 digits, 500 steps of 256
examples, smoothing 0.05, half with the tool): it called the tool on 55% of prompts, right 73% of those times,
and right 2% of the times it answered directly.
"""

from __future__ import annotations

from pathlib import Path

import torch

from learner.data.prompts import addition_items

TOOL_BATCH = 256  # examples per warm-start step of the tool demo, drawn afresh each step


def warm_start(model_dir: Path, steps: int, seed: int, smoothing: float, lr: float = 3e-3) -> dict[str, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    items = addition_items()
    eos = tokenizer.eos_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        rows, masks = [], []
        for prompt, answer in items:
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            t = tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos]
            rows.append(p + t)
            masks.append([0] * len(p) + [1] * len(t))
        width = max(map(len, rows))
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        loss_mask = torch.tensor([mk + [0] * (width - len(mk)) for mk in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none", label_smoothing=smoothing
        )
        loss = (nll * loss_mask[:, 1:].reshape(-1)).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return {"final_loss": loss.item()}


def warm_start_tools(
    model_dir: Path, steps: int, seed: int, smoothing: float, digits: int, tool_share: float, lr: float = 3e-3
) -> dict[str, float]:
    """The tool demo's warm start (see the module's doc): direct answers and calculator calls, the calls on
    `tool_share` of the examples; the result's tokens are context (loss 0), as the learner will treat them."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(f"fleetrl-tool-warmstart-{seed}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lo, hi = 10 ** (digits - 1), 10**digits - 1

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def example() -> tuple[list[int], list[int]]:
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        parts = [(encode(f"{a}+{b}="), 0)]
        if rng.random() < tool_share:
            parts += [(encode(f"<calc>{a}+{b}</calc>"), 1), (encode(f"<result>{a + b}</result>"), 0)]
        parts.append((encode(str(a + b)) + [eos], 1))
        return [t for ids, _ in parts for t in ids], [m for ids, m in parts for _ in ids]

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        rows = [example() for _ in range(TOOL_BATCH)]
        width = max(len(ids) for ids, _ in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
        loss_mask = torch.tensor([mk + [0] * (width - len(mk)) for _, mk in rows], dtype=torch.float32)
        attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none", label_smoothing=smoothing
        )
        loss = (nll * loss_mask[:, 1:].reshape(-1)).sum() / loss_mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return {"final_loss": loss.item()}
