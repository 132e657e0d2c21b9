"""`python -m deploy.torchrun TORCHRUN_ARGS`: torchrun (torch.distributed.run, same arguments) with FleetRL's
error boundary (deploy/errors.py).

Plain torchrun shows a failed rank as the rank's traceback, every line prefixed `[rankN]:`, once per rank,
then its own ChildFailedError traceback and table: 60-200 lines for one wrong config field. Here each rank
leaves its one line in a temporary folder (FLEETRL_ERROR_DIR) and this process prints each distinct line once,
then exits 2 when a rank made a user mistake (then only those lines: the other ranks' errors follow from it),
else 1. A rank that died without a word (killed by a
signal: the OOM killer, SIGKILL) is named with its exit code. A stop signal exits 128 + its number, as a shell
reports it.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from deploy.errors import ERROR_DIR, USER_ERROR, collect


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv if argv is not None else sys.argv[1:])
    # torchrun's per-failure log lines repeat what the ranks say, without saying it better. Each of its modules
    # sets its own logger's level, so the parent's level would not reach them.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, set here without its banner
    with tempfile.TemporaryDirectory(prefix="fleetrl-errors-") as folder:
        os.environ[ERROR_DIR] = folder  # the ranks inherit it
        try:
            run(args)
            return 0
        except SignalException as e:
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            lines, any_user = collect(Path(folder))
            for line in lines:
                print(line, file=sys.stderr)
            if lines:
                return USER_ERROR if any_user else 1
            for rank, failure in sorted(e.failures.items()):
                how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
                print(f"fleetrl learner: rank {rank} died ({how}) without an error; see its log in RUN_DIR/logs", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
