"""Sample completions in the run directory: what the policy writes, read as text, as training goes.

Every log.samples_every_steps updates, the first log.samples_groups groups of the step's batch go to
RUN_DIR/samples.jsonl, one JSON object per group (one prompt and all its completions):

    {"step": 10, "policy_version": 10, "prompt_id": 3, "epoch": 0, "actor_id": "actor0",
     "prompt": "1+2=", "answer": "3",
     "completions": [{"text": "3<eos>", "reward": 1.0, "parts": {}, "finish_reason": "stop", "tokens": 2}, ...]}

The prompt is the rendered text the actor was granted (templates applied); completions are decoded with the
learner's tokenizer, special tokens kept, so an EOS or a chat turn marker shows where the model put it.
An episode (rollout.env) also lists its turns, the model's and the environment's told apart, and its counts:

    "turns": [{"role": "model", "text": "<calc>37+45</calc>"}, {"role": "env", "text": "<result>82</result>"},
              {"role": "model", "text": "82<eos>"}], "model_turns": 2, "tool_calls": 1
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol.messages import RolloutGroup


class SampleWriter:
    def __init__(self, run_dir: Path, every_steps: int, groups: int, tokenizer: Any, prompts: Any):
        self.path = run_dir / "samples.jsonl"
        self.every_steps, self.groups = every_steps, groups
        self.tokenizer, self.prompts = tokenizer, prompts  # prompts: the training PromptSet (indexed by prompt_id)

    def wants(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def write(self, step: int, version: int, groups: list[RolloutGroup]) -> int:
        """Append this step's samples when it is one of every `every_steps`; returns the groups written."""
        if not self.wants(step):
            return 0
        with self.path.open("a") as f:
            for g in groups[: self.groups]:
                f.write(json.dumps(self.record(step, version, g), ensure_ascii=False) + "\n")
        return min(len(groups), self.groups)

    def record(self, step: int, version: int, g: RolloutGroup) -> dict[str, Any]:
        prompt = self.prompts[g.prompt_id]
        k = len(g.reward_part_names)
        parts = g.reward_parts.reshape(len(g.lengths), k) if k else None
        completions, start = [], 0
        mask = g.loss_mask if len(g.loss_mask) else None
        for i, n in enumerate(g.lengths.tolist()):
            tokens = g.completion_tokens[start : start + n].tolist()
            record: dict[str, Any] = {
                "text": self.tokenizer.decode(tokens, skip_special_tokens=False),
                "reward": float(g.rewards[i]),
                "parts": {} if parts is None else {name: float(parts[i, j]) for j, name in enumerate(g.reward_part_names)},
                "finish_reason": g.finish_reasons[i],
                "tokens": n,
            }
            if len(g.turns):
                own = [1] * n if mask is None else mask[start : start + n].tolist()
                record.update(turns=self.turns(tokens, own), model_turns=int(g.turns[i]), tool_calls=int(g.tool_calls[i]))
            completions.append(record)
            start += n
        # policy_version: the learner's after the step; the completions come from version_min..version_max
        return {
            "step": step,
            "policy_version": version,
            "version_min": g.version_min,
            "version_max": g.version_max,
            "prompt_id": g.prompt_id,
            "epoch": g.epoch,
            "actor_id": g.actor_id,
            "prompt": prompt.text,
            "answer": prompt.answer,
            "completions": completions,
        }

    def turns(self, tokens: list[int], mask: list[int]) -> list[dict[str, str]]:
        """The episode's runs of model tokens (mask 1) and environment tokens (mask 0), decoded, in order."""
        out: list[dict[str, str]] = []
        run: list[int] = []
        for i, (t, m) in enumerate(zip(tokens, mask, strict=True)):
            run.append(t)
            if i + 1 == len(tokens) or mask[i + 1] != m:
                out.append({"role": "model" if m else "env", "text": self.tokenizer.decode(run, skip_special_tokens=False)})
                run = []
        return out
