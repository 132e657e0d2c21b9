"""Learner restart: what a checkpoint holds beyond the weights, and how `fleetrl learner --resume RUN_DIR` continues.

    RUN_DIR/checkpoints/step-N/            one folder, complete once renamed (learner/checkpoint.py)
        config.json, model.safetensors, tokenizer files    Hugging Face weights (rank 0, from the weight snapshot)
        state/policy/...                   DeepSpeed engine state: every rank's ZeRO shard of the optimizer, the
                                           LR scheduler, the step count (engine.save_checkpoint: collective)
        state/critic/...                   the critic's engine (algo.advantage = gae)
        state/learner.json                 rank 0: version, updates, ledger, hub counters, max_staleness,
                                           quarantined actor ids, row N

Saving is collective: rank 0 decides before an update that it ends with a checkpoint and says so in
the share's header (Share.save_step), so every rank calls save_checkpoint after the same update and
in the same place among the collectives (after the weight snapshot). DeepSpeed's save opens and closes
with a barrier, so when rank 0 renames the folder every rank's files are in it. The rename makes it
complete: resume takes the newest step-N with state/learner.json; an interrupted write left only a
.tmp-step-N-part folder, which is removed at the next start.

Resume, on every rank: load the engines (weights, optimizer, scheduler); under ZeRO-3 join the
start-of-run weight snapshot. Rank 0 also restores the hub (ledger, counters, version) before any
actor can register, cuts metrics.jsonl back to rows 1..N (rows of updates after the checkpoint are
retrained), and re-sends the restored weights to every actor that registers (WeightSender.start):
no actor generates until it serves them.

Limits: the learner ranks and ZeRO stage must be those of the checkpoint (DeepSpeed shards the
optimizer per rank). With several ranks a write error inside DeepSpeed's save stops the learner
group (rank 0 raises instead of skipping that checkpoint): the other ranks would otherwise wait at
DeepSpeed's closing barrier. The run resumes from the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from learner.record.metrics import read_rows
from learner.run_layout import LEARNER_FILE, STATE_DIR, latest_checkpoint
from learner.train.distributed import Topology
from protocol.config import ConfigError
from protocol.logs import get_logger

if TYPE_CHECKING:
    from learner.train.trainer import Trainer

FORMAT = 1  # bump when LearnerState changes incompatibly


@dataclass(kw_only=True, slots=True)
class LearnerState:
    """Rank 0's part of a checkpoint (JSON)."""

    format: int = FORMAT
    updates: int  # rollout batches trained: the checkpoint is step-<updates>
    version: int  # policy version = optimizer steps taken
    steps_per_update: int  # S = mini_batches x ppo_epochs
    world: int  # learner ranks that wrote the DeepSpeed shards
    zero_stage: int
    hub: dict[str, Any]  # Hub.export_state(): ledger, counters, max_staleness, quarantined ids
    row: dict[str, Any] = field(default_factory=dict)  # metrics row of update N, in case the crash beat its write


def save_engines(trainer: Trainer, folder: Path) -> None:
    """Collective: every rank writes its DeepSpeed state (its ZeRO shard) for the policy, and the critic if any."""
    trainer.engine.save_checkpoint(str(folder), tag="policy", save_latest=False)
    if trainer.critic is not None:
        trainer.critic.save_checkpoint(str(folder), tag="critic", save_latest=False)


def load_engines(trainer: Trainer, folder: Path) -> None:
    """Collective: weights, optimizer moments, LR scheduler and step count, as saved."""
    for name, engine in (("policy", trainer.engine), ("critic", trainer.critic)):
        if engine is None:
            continue
        path, _ = engine.load_checkpoint(str(folder), tag=name, load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise ValueError(f"--resume: no {name} state in {folder}")


def write_learner_state(folder: Path, state: LearnerState) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LEARNER_FILE).write_text(json.dumps(asdict(state)) + "\n")


def read_learner_state(checkpoint: Path) -> LearnerState:
    data = json.loads((checkpoint / STATE_DIR / LEARNER_FILE).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"--resume: {checkpoint} has learner state format {data.get('format')}, this code reads {FORMAT}")
    return LearnerState(**data)


def agree_on_checkpoint(topo: Topology, run_dir: Path) -> Path:
    """Collective: rank 0 picks the checkpoint, every rank loads that one (a shared run.dir is assumed)."""
    found = latest_checkpoint(run_dir) if topo.is_root else None
    step = torch.tensor([int(found.name[5:]) if found is not None else -1], dtype=torch.int64, device=topo.device)
    if topo.world > 1:
        dist.broadcast(step, src=0)
    if int(step.item()) < 0:
        raise ValueError(f"--resume {run_dir}: no complete checkpoint with training state in {Path(run_dir) / 'checkpoints'}")
    return Path(run_dir) / "checkpoints" / f"step-{int(step.item())}"


def check_compatible(state: LearnerState, topo: Topology, zero_stage: int, steps_per_update: int) -> None:
    if state.world != topo.world or state.zero_stage != zero_stage:
        raise ConfigError(
            f"cluster: the checkpoint was written by {state.world} learner rank(s) with ZeRO-{state.zero_stage}; "
            f"this learner has {topo.world} with ZeRO-{zero_stage}: resume with the same ones"
        )
    if state.steps_per_update != steps_per_update:
        raise ConfigError(
            f"train.mini_batches x train.ppo_epochs: {steps_per_update} optimizer steps per update, "
            f"the checkpoint's run took {state.steps_per_update}: resume with the same ones"
        )


def restore_metrics(run_dir: Path, state: LearnerState) -> int:
    """Cut metrics.jsonl back to the rows of updates 1..N (later ones are retrained); returns the rows kept.

    The file is rewritten atomically, a line at a time (a long run's rows do not fit in memory as dicts). A torn
    last line (SIGKILL mid-write) is dropped; of two rows of one update, the first is kept. Row N comes from the
    checkpoint when the crash came between the checkpoint and that row's write.
    """
    path = Path(run_dir) / "metrics.jsonl"
    first: dict[int, int] = {}  # update -> byte offset of its first row
    read = 0
    for offset, _, row in read_rows(path):
        read += 1
        step = row.get("step")
        if isinstance(step, int) and 1 <= step <= state.updates and step not in first:
            first[step] = offset
    row_n = state.row if state.updates not in first and state.row else None
    missing = [s for s in range(1, state.updates + 1) if s not in first and not (s == state.updates and row_n)]
    if missing:
        get_logger().warning("resume.metrics_rows_missing", steps=missing[:20], count=len(missing))
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("wb") as out:
        if first:
            with path.open("rb") as src:
                for step in sorted(first):
                    src.seek(first[step])
                    out.write(src.readline().rstrip(b"\n") + b"\n")
        if row_n:
            out.write((json.dumps(row_n) + "\n").encode())
    os.replace(tmp, path)
    kept = len(first) + bool(row_n)
    get_logger().info("resume.metrics", rows=read, kept=kept)
    return kept


def discard_newer(run_dir: Path, step: int) -> None:
    """Checkpoint folders after `step` belong to the abandoned future; best.json must not point at one."""
    folder = Path(run_dir) / "checkpoints"
    for path in folder.glob("step-*"):
        if path.name[5:].isdigit() and int(path.name[5:]) > step:
            trash = folder / f".trash-{path.name}-{os.getpid()}"
            path.rename(trash)
            shutil.rmtree(trash)
            get_logger().warning("resume.discarded_checkpoint", path=str(path))
    best = folder / "best.json"
    if best.exists() and json.loads(best.read_text()).get("step", 0) > step:
        best.unlink()


# What one run writes into run.dir and a later run must not mix with its own (logs/ and config.toml are the
# launcher's and the actors', shared by every start).
RUN_OUTPUTS = ("metrics.jsonl", "samples.jsonl", "reward_curve.png", "tensorboard", "checkpoints")


def set_aside_previous_run(run_dir: Path, stamp: str) -> Path | None:
    """A fresh start (no --resume) in a run.dir that holds another run's outputs: move them into
    run_dir/previous-`stamp`/, so that nothing is lost and nothing is mixed. Appended to, the old metrics.jsonl made
    the new run's curve and summary count both runs, and a later --resume could take the old run's checkpoint.
    Returns the folder, or None when there was nothing to move. Rank 0 only, before anything is written."""
    found = [run_dir / name for name in RUN_OUTPUTS if (run_dir / name).exists()]
    if not found:
        return None
    aside = run_dir / f"previous-{stamp}"
    aside.mkdir()
    for path in found:
        path.rename(aside / path.name)
    return aside
