"""What a Slurm job that starts again does with its run directory: fleet.sbatch's questions, answered here.

    python -m deploy.restart resume RUN_DIR JOB_ID   exit 0: resume from the checkpoint printed; 1: start afresh (why on stderr)
    python -m deploy.restart newest RUN_DIR          the newest complete checkpoint, or an empty line

Slurm starts a requeued job (scontrol requeue, preemption with PreemptMode=REQUEUE, the job's own requeue before
its time limit) with the arguments of its first start: a CONFIG, which on its own would start a new run and set
the old one aside. The job resumes instead when RUN_DIR is its own run (RUN_DIR/.slurm-job names this job: a
run directory that holds another job's run is not taken over) and holds a complete checkpoint. `newest` lets the
job tell, before it requeues itself, whether this start checkpointed anything new: a time limit shorter than
cluster.time_limit_grace_s would otherwise requeue it forever without progress. Exit 2: a usage or file error.
"""

from __future__ import annotations

import sys
from pathlib import Path

JOB_FILE = ".slurm-job"  # in RUN_DIR: the id of the Slurm job whose run it holds (fleet.sbatch writes it)


def resume_from(run_dir: Path, job_id: str, newest: Path | None) -> tuple[Path | None, str]:
    """The checkpoint a restarted job `job_id` resumes from, or None and why it starts afresh. No I/O but the
    job file's read."""
    owner_file = run_dir / JOB_FILE
    owner = owner_file.read_text().strip() if owner_file.is_file() else ""
    if owner != job_id:
        return None, f"{run_dir} holds job {owner or 'unknown'}'s run, not job {job_id}'s: the run starts afresh"
    if newest is None:
        return None, f"no complete checkpoint in {run_dir / 'checkpoints'}: the run starts again from step 0"
    return newest, ""


def main(argv: list[str]) -> int:
    usage = "usage: python -m deploy.restart resume RUN_DIR JOB_ID | newest RUN_DIR"
    if not (argv[:1] == ["resume"] and len(argv) == 3 or argv[:1] == ["newest"] and len(argv) == 2):
        print(usage, file=sys.stderr)
        return 2
    from learner.run_layout import latest_checkpoint
    from protocol.logs import setup_logging

    setup_logging("restart")  # its lines go to stderr: fleet.sbatch reads the answer from stdout

    run_dir = Path(argv[1])
    try:
        newest = latest_checkpoint(run_dir)
        if argv[0] == "newest":
            print(newest or "")
            return 0
        found, why = resume_from(run_dir, argv[2], newest)
    except OSError as e:
        print(f"deploy.restart: {run_dir}: {e}", file=sys.stderr)
        return 2
    if found is None:
        print(why, file=sys.stderr)
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
