"""How long the run is, in updates, optimizer steps, samples and passes over the prompt set.

train.total_steps updates (rollout batches), or total_episodes / rollout batch when train.total_episodes > 0
(whole). Over N training prompts: N / prompts_per_step updates per epoch, updates x prompts_per_step / N epochs,
epochs x samples_per_prompt samples per prompt. N comes from the prompt set when it is at hand (addition: 100;
data.path: its rows minus the validation split), else from data.num_prompts.

FleetRL's epochs run back to back (learner/hub/core/ledger.py opens the next when the queue runs dry), so a rollout
batch may span two and none is partial. The sources iterate a dataloader per epoch instead, whose last batch holds
N mod prompts_per_step prompts: Open-Reasoner-Zero trains it (torch DataLoader, drop_last False: ceil(N / B)
batches per epoch); verl (drop_last=True) and open-instruct (ShufflingIterator: an epoch is N - N mod B prompts)
drop it (floor(N / B)). The plan counts both, so a source's "E epochs" reads as updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from learner.plan.layout import BatchLayout, need
from protocol.config import Config


@dataclass(frozen=True, kw_only=True, slots=True)
class LrPlan:
    """The policy's learning rate over the run (learner/train/lr_schedule.py; the critic's scales with algo.critic_lr)."""

    peak: float  # train.lr
    warmup_steps: int  # optimizer steps
    first: float  # the first optimizer step's: peak / warmup_steps (the peak without warmup)
    schedule: str  # train.lr_schedule
    final: float  # where the decay ends, after the last step: peak x train.min_lr_ratio (constant: the peak)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunLength:
    source: str  # train.total_steps | train.total_episodes
    updates: int  # rollout batches trained in the run
    optimizer_steps: int  # updates x S: the final policy version
    lr: LrPlan  # the learning rate over those steps
    episodes: int  # samples trained over the run
    num_prompts: int | None  # training prompts (None: unknown)
    prompts_source: str
    updates_per_epoch: float | None  # N / prompts_per_step: FleetRL's epochs run back to back
    last_batch: int | None  # prompts in a per-epoch dataloader's last batch, N mod prompts_per_step (0: none partial)
    batches_kept: int | None  # a per-epoch dataloader's batches, the partial last one trained: ceil(N / B) (ORZ)
    batches_dropped: int | None  # the same with the partial one dropped: floor(N / B) (verl, open-instruct)
    epochs: float | None  # passes over the prompt set, as FleetRL trains them
    max_epochs: int  # data.epochs: the ledger opens no more, so a run longer than that runs out of prompts
    samples_per_prompt: float | None  # samples drawn per prompt over the run


def run_length(cfg: Config, batch: BatchLayout, num_prompts: int | None) -> RunLength:
    """`num_prompts`: the training prompt count when the caller has loaded the set, else found by `prompt_count`."""
    t, rollout = cfg.train, batch.rollout_batch
    if t.total_episodes > 0:
        batch_text = f"{t.prompts_per_step} prompts x {batch.samples_per_prompt} samples = {rollout} samples per rollout batch"
        need(
            t.total_episodes % rollout == 0,
            "train.total_episodes",
            f"{t.total_episodes} samples / ({batch_text}) = {t.total_episodes / rollout:.2f} rollout batches is not whole",
        )
        updates, source = t.total_episodes // rollout, "train.total_episodes"
    else:
        updates, source = t.total_steps, "train.total_steps"
    optimizer_steps = updates * batch.steps_per_update
    need(
        t.lr_schedule == "constant" or t.warmup_steps < optimizer_steps,
        "train.warmup_steps",
        f"{t.warmup_steps} >= the run's {optimizer_steps} optimizer steps: train.lr_schedule = {t.lr_schedule} would never decay",
    )
    n, prompts_source = (num_prompts, "the loaded prompt set") if num_prompts is not None else prompt_count(cfg)
    epochs = updates * t.prompts_per_step / n if n else None
    return RunLength(
        source=source,
        updates=updates,
        optimizer_steps=optimizer_steps,
        lr=LrPlan(
            peak=t.lr,
            warmup_steps=t.warmup_steps,
            first=t.lr / max(1, t.warmup_steps),
            schedule=t.lr_schedule,
            final=t.lr if t.lr_schedule == "constant" else t.lr * t.min_lr_ratio,
        ),
        episodes=updates * rollout,
        num_prompts=n,
        prompts_source=prompts_source,
        updates_per_epoch=n / t.prompts_per_step if n else None,
        last_batch=n % t.prompts_per_step if n else None,
        batches_kept=-(-n // t.prompts_per_step) if n else None,
        batches_dropped=n // t.prompts_per_step if n else None,
        epochs=epochs,
        max_epochs=cfg.data.epochs,
        samples_per_prompt=epochs * batch.samples_per_prompt if epochs is not None else None,
    )


def held_out(rows: int, val_fraction: float) -> int:
    """Prompts data.val_fraction holds out: at least one when nonzero, as the data split does (by rows here)."""
    return 0 if val_fraction == 0 else max(1, round(val_fraction * rows))


def prompt_count(cfg: Config) -> tuple[int | None, str]:
    """Training prompts and where the number comes from: the set when at hand, else data.num_prompts."""
    from learner.data.prompts import addition_items
    from learner.data.sources import count_rows

    d = cfg.data
    if d.task == "addition":
        rows, source = len(addition_items(digits=d.digits)), "data.task = addition"
    elif Path(d.path).exists():  # a file or a folder; a hub id is not here
        rows, source = count_rows(Path(d.path)), f"rows of {d.path}"
    elif d.num_prompts > 0:
        rows, source = d.num_prompts, f"data.num_prompts ({d.path} is not here)"
    else:
        return None, f"unknown: {d.path} is not here and data.num_prompts = 0"
    held = held_out(rows, d.val_fraction)
    return rows - held, source + (f", minus {held} held out by data.val_fraction {d.val_fraction}" if held else "")
