"""Whether a Slurm job that starts again can resume its run: what fleet.sbatch asks when SLURM_RESTART_COUNT > 0.

    python -m deploy.restart RUN_DIR

Slurm starts a requeued job (scontrol requeue, preemption with PreemptMode=REQUEUE, the job's own requeue before
its time limit) with the arguments of its first start: a CONFIG, which on its own would start a new run and set
the old one aside. Exit 0 with the newest complete checkpoint on stdout: the job resumes from it (`--resume
RUN_DIR`). Exit 1 with one line on stderr: there is none yet (the job stopped before its first checkpoint), and
the job starts the run afresh.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m deploy.restart RUN_DIR", file=sys.stderr)
        return 2
    from learner.resume import latest_checkpoint  # torch: imported only when asked

    found = latest_checkpoint(Path(argv[0]))
    if found is None:
        print(f"no complete checkpoint in {Path(argv[0]) / 'checkpoints'}: the run starts again from step 0", file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
