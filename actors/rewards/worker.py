"""One reward worker process: `python -m actors.rewards.worker FD SPEC`, started by actors/rewards/pool.py.

It loads the reward named SPEC, says ("ready", pid) or ("load_error", why) on the connection FD, then
answers each RewardContext it receives with an Outcome, one at a time. A plain subprocess, not a
multiprocessing child: multiprocessing's spawn would import the actor's own main module (vLLM, torch) into
every worker, and fork would copy an actor that runs threads.

It exits when the actor closes the connection, or when its parent changes (the actor died and the worker
was re-parented): it must not outlive the actor. On Linux the kernel also kills it when the actor dies, in the
middle of a call too (actors/lifeline.py). SIGINT is ignored: a Ctrl-C reaches the whole process
group, and the actor stops its workers itself.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

from actors import lifeline
from actors.rewards.base import load_reward, score_one
from protocol.logs import first_line

PARENT_CHECK_S = 1.0  # how often an idle worker checks that the actor is still its parent


def main(argv: list[str]) -> int:
    lifeline.attach()  # dies with the actor even inside a reward call that never returns
    fd, spec = int(argv[0]), argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    conn = Connection(fd)
    try:
        reward = load_reward(spec)
    except Exception as e:  # the user's module failed to import or has the wrong form: report it, then exit
        conn.send(("load_error", first_line(e)))
        return 1
    conn.send(("ready", os.getpid()))
    while True:
        if not conn.poll(PARENT_CHECK_S):
            if os.getppid() != parent:
                return 0
            continue
        try:
            ctx = conn.recv()
        except EOFError:  # the actor closed its end: it is stopping
            return 0
        conn.send(score_one(reward, ctx))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
