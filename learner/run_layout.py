"""Where a run directory keeps its checkpoints, and which one a resume takes. No torch: the deploy scripts
(deploy/restart.py, run by fleet.sbatch at every start) ask this without paying torch's import.

    RUN_DIR/checkpoints/step-N/              complete once renamed (learner/checkpoint.py)
        state/learner.json                   rank 0's training state (learner/resume.py): a checkpoint without it
                                             holds weights only, and a run cannot continue from it
"""

from __future__ import annotations

from pathlib import Path

from protocol.logs import get_logger

STATE_DIR = "state"
LEARNER_FILE = "learner.json"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint with training state: step-N (renamed, so complete) holding state/learner.json."""
    folder = Path(run_dir) / "checkpoints"
    steps = sorted((int(p.name[5:]), p) for p in folder.glob("step-*") if p.name[5:].isdigit()) if folder.is_dir() else []
    for _, path in reversed(steps):
        if (path / STATE_DIR / LEARNER_FILE).is_file():
            return path
        get_logger().warning("resume.checkpoint_without_state", path=str(path))  # weights only: cannot continue from it
    return None
