"""Evaluation rounds, driven from the training thread: when one is due, run it through the hub, log its metrics.

The round itself, its grants and results, is hub state: learner/hub/core/evaluation.py.
"""

from __future__ import annotations

from collections.abc import Callable

from learner.data.prompts import PromptSet
from learner.hub.core.evaluation import EvalRound, Sampling
from learner.hub.server import Hub
from protocol.config import Config
from protocol.logs import get_logger


class Evaluator:
    """Learner side: decides when a round is due, runs it through the hub, returns its metrics."""

    def __init__(self, cfg: Config, sets: dict[str, PromptSet], hub: Hub):
        self.cfg, self.sets, self.hub = cfg, sets, hub
        self.sampling = Sampling.from_config(cfg)
        self.rounds = 0
        self.log = get_logger()

    def due(self, step: int, last: bool) -> bool:
        every = self.cfg.eval.every_steps
        return every > 0 and bool(self.sets) and (step % every == 0 or last)

    def run(
        self, version: int, step: int | None = None, last: bool = False, should_stop: Callable[[], bool] = lambda: False
    ) -> dict[str, float]:
        """After update `step` (default: `version`), evaluate `version`, the weights just sent to the actors, if due.

        Blocks until done or eval.timeout_s.
        """
        if not self.due(version if step is None else step, last):
            return {}
        self.rounds += 1
        rnd = EvalRound(
            self.rounds,
            version,
            self.sets,
            self.sampling,
            max_prompts=self.cfg.eval.max_prompts,
            lease_s=self.cfg.staleness.lease_s,
            seed=self.cfg.run.seed,
        )
        self.hub.start_eval(rnd)
        self.hub.wait_eval(self.cfg.eval.timeout_s, should_stop)
        out = rnd.metrics()
        fields = {k.removeprefix("eval/").replace("/", "_"): round(v, 4) for k, v in out.items() if k.startswith("eval/")}
        if rnd.done:
            self.log.info("eval.round_done", round=rnd.round_id, seconds=round(out["time/eval"], 2), **fields)
        else:
            self.log.warning(
                "eval.round_partial",
                round=rnd.round_id,
                answered=len(rnd.rewards),
                total=len(rnd.tasks),
                timeout_s=self.cfg.eval.timeout_s,
                **fields,
            )
        return out
