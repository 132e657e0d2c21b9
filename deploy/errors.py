"""The command line's error boundary: what a failed command shows, and where its traceback goes.

- A user mistake (ConfigError: the config, the model folder, the data, the reward, an address) prints one line,
  `fleetrl: config error: FIELD: what is wrong; what to do`, and exits 2. Its traceback goes to the process's log
  file (RUN_DIR/logs/...jsonl), never to the screen.
- Anything else is a bug or a failure of the machine: its traceback goes to the log file and to the screen, and the
  command exits 1.
- A learner rank whose collective lost a peer (the peer was killed, crashed, or its node went away) is neither: its
  cause is the peer's, which that rank's own line or exit code names. One line, `rank N: lost a peer rank in a
  collective (...)`, the traceback to the log file only.

Learner ranks under torchrun: every rank has the same config, so a mistake in it fails every rank at once.
`fleetrl learner` starts torchrun through deploy/torchrun.py, which sets FLEETRL_ERROR_DIR: each failed rank
writes its one line there and prints nothing, and the launcher prints each distinct line once. Without it (a
torchrun started by hand) rank 0 prints user mistakes and the other ranks keep them to their log files.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from protocol.config import ConfigError
from protocol.logs import first_line, log_exception

USER_ERROR = 2  # exit code of a user mistake, as argparse's
ERROR_DIR = "FLEETRL_ERROR_DIR"  # set by deploy/torchrun.py: where ranks leave their one-line errors
_OURS = [Path(__file__).resolve().parents[1] / pkg for pkg in ("actors", "learner", "protocol", "deploy")]


class UsageError(ConfigError):
    """A command-line mistake (a missing argument, a malformed --learner): `fleetrl COMMAND: ...`, exit 2."""


def report(command: str, error: Exception, log_file: Path | None) -> int:
    """Show `error` as this module's docstring says; returns the exit code."""
    user = isinstance(error, ConfigError)
    rank = int(os.environ.get("RANK", "0"))
    lost_peer = not user and "RANK" in os.environ and peer_gone(error)
    if log_file is not None:
        try:
            log_exception(log_file, "fleetrl.error", error, command=command, rank=rank)
        except OSError:  # an unwritable run directory must not hide the error itself
            log_file = None
    if isinstance(error, UsageError):
        line = f"fleetrl {command}: {error}"
    elif user:
        line = f"fleetrl: config error: {error}"
        if log_file is not None and _from_user_code(error.__cause__):
            line += f" (traceback in {log_file})"  # the user's own code raised it (a reward module): where matters
    else:
        where = f"; traceback in {log_file}" if log_file is not None else ""
        what = f"lost a peer rank in a collective ({first_line(error)})" if lost_peer else first_line(error)
        line = f"fleetrl {command}: {'rank ' + str(rank) + ': ' if 'RANK' in os.environ else ''}{what}{where}"
    error_dir = os.environ.get(ERROR_DIR)
    if error_dir:
        Path(error_dir, f"rank{rank}.json").write_text(json.dumps({"line": line, "user": user}))
    if not user and (log_file is None or (rank == 0 and not lost_peer)):
        traceback.print_exception(error, file=sys.stderr)
    if not error_dir and (rank == 0 or not user):
        print(line, file=sys.stderr, flush=True)
    return USER_ERROR if user else 1


def _from_user_code(cause: BaseException | None) -> bool:
    """Whether `cause` was raised in code that is neither FleetRL's nor installed (a reward module of the user's)."""
    if cause is None:
        return False
    installed = [Path(p).resolve() for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}]
    for frame in traceback.extract_tb(cause.__traceback__):
        if frame.filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
            continue
        path = Path(frame.filename).resolve()
        if not any(path.is_relative_to(root) for root in _OURS + installed):
            return True
    return False


# What a collective raises on a rank whose peer went away: gloo's TCP pair, and NCCL once the peer's process is gone.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")


def peer_gone(error: BaseException) -> bool:
    """Whether `error` is a collective that lost a peer rank, or a collective that failed while handling one (a
    rank's stop runs one more). torch.distributed raises RuntimeError or its subclasses: the chain is followed
    through those only, so that a bug raised while handling a lost peer (a KeyError) is still shown as a bug, and
    a BrokenPipeError of this process's own files is not one."""
    seen: set[int] = set()
    e: BaseException | None = error
    while isinstance(e, RuntimeError) and id(e) not in seen:
        seen.add(id(e))
        if any(s in str(e) for s in _PEER_GONE):
            return True
        e = e.__cause__ or e.__context__
    return False


def collect(error_dir: Path) -> tuple[list[str], bool, set[int]]:
    """The distinct lines the ranks left in `error_dir` (by rank), whether there was a user mistake among them, and
    which ranks left one."""
    found, ranks = [], set()
    for path in sorted(error_dir.glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank"))):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a rank killed while writing: its exit code still says it failed
            continue
        ranks.add(int(path.stem.removeprefix("rank")))
    # A user mistake on one rank is the cause; what the others then hit (a peer gone from a collective) follows
    # from it and stays in their log files.
    user = [f for f in found if f["user"]]
    lines = list(dict.fromkeys(f["line"] for f in user or found))
    return lines, bool(user), ranks


def launcher_lines(error_dir: Path, died: dict[int, str]) -> tuple[list[str], bool]:
    """What the learner's launcher (deploy/torchrun.py) prints for a failed run, and whether a user mistake was
    among the causes. `died`: the failed ranks it saw, each with how it ended ("exit code 1", "signal SIGKILL").
    A rank that died without a line of its own comes first: it is the cause of what the others then report (a peer
    gone from a collective). Under a user mistake only the mistake is shown."""
    lines, user, spoke = collect(error_dir)
    if user:
        return lines, True
    # Once a rank has failed, torchrun stops the others with SIGTERM: those that die of it (still starting, say)
    # are not a cause when another rank said what went wrong.
    silent = [
        f"fleetrl learner: rank {rank} died ({how}) without an error; see its log in RUN_DIR/logs"
        for rank, how in sorted(died.items())
        if rank not in spoke and not (lines and how == "signal SIGTERM")
    ]
    return silent + lines, False
