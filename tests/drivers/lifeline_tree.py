"""Process trees for tests/integration/test_lifeline.py, made with the calls the actor uses (actors/lifeline.py), without vLLM.

lifeline_tree.py tree         a root with children: spawned (which spawns a grandchild), forked from the main
                              thread, forked from a thread that then ends. Prints one JSON line {role: pid} once
                              all are up, then sleeps.
lifeline_tree.py stop GRACE   a root whose main thread never acts on a stop request (stuck, as during vLLM's engine
                              start), with a child; prints "ready CHILD_PID", then on the deadline "overdue SIGNUM KILLED".
lifeline_tree.py clean GRACE  a root that stops cleanly half a second after a stop request (an actor closing its
                              engine): prints "ready PID", then "stopping SIGNUM" and exits 0.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from actors import lifeline  # noqa: E402

lifeline.attach()  # as deploy/cli.py does: a spawned child runs its parent's main module first


def sleeper(role: str, queue: mp.Queue) -> None:
    queue.put((role, os.getpid()))
    time.sleep(600)


def spawner(queue: mp.Queue) -> None:
    mp.get_context("spawn").Process(target=sleeper, args=("grandchild", queue)).start()
    sleeper("spawned", queue)


def tree() -> None:
    lifeline.root()
    queue = mp.get_context("spawn").Queue()
    mp.get_context("spawn").Process(target=spawner, args=(queue,)).start()
    mp.get_context("fork").Process(target=sleeper, args=("forked", queue)).start()
    thread = threading.Thread(target=lambda: mp.get_context("fork").Process(target=sleeper, args=("forked_in_thread", queue)).start())
    thread.start()
    thread.join()
    pids = dict(queue.get(timeout=60) for _ in range(4))
    print(json.dumps(pids), flush=True)
    time.sleep(600)


def stop(grace_s: float) -> None:
    lifeline.root()
    requested: list[int] = []
    lifeline.stop_on_signals(requested.append, grace_s, lambda signum, killed: print(f"overdue {signum} {killed}", flush=True))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"ready {child.pid}", flush=True)
    while True:  # stuck: never looks at `requested`
        time.sleep(0.01)


def clean(grace_s: float) -> None:
    lifeline.root()
    requested: list[int] = []
    lifeline.stop_on_signals(requested.append, grace_s, lambda signum, killed: print(f"overdue {signum} {killed}", flush=True))
    print(f"ready {os.getpid()}", flush=True)
    while not requested:
        time.sleep(0.01)
    print(f"stopping {requested[0]}", flush=True)
    time.sleep(0.5)  # the clean stop's own work
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "tree":
        tree()
    elif sys.argv[1] == "clean":
        clean(float(sys.argv[2]))
    else:
        stop(float(sys.argv[2]))
