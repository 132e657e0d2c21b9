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

from deploy.errors import ERROR_DIR, USER_ERROR, launcher_lines


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
            # Stopped from outside (a stop, or srun ending the step because a rank on another node failed): what
            # the ranks here hit before it, such as a peer gone from a collective, is still said once.
            for line in launcher_lines(Path(folder), {})[0]:
                print(line, file=sys.stderr)
            return 128 + int(e.sigval)
        except ChildFailedError as e:
            died = {r: f"signal {f.signal_name()}" if f.exitcode < 0 else f"exit code {f.exitcode}" for r, f in e.failures.items()}
            lines, any_user = launcher_lines(Path(folder), died)
            for line in lines:
                print(line, file=sys.stderr)
            return USER_ERROR if any_user else 1


if __name__ == "__main__":
    sys.exit(main())
