"""`fleetrl status`: a live view of a running learner and its actors (rich), fetched over the hub socket.

    fleetrl status --learner tcp://HOST:PORT [--interval 2] [--once]

Each refresh is one StatusRequest / StatusReply (protocol/messages.py). `--once` prints one
snapshot and exits (0, or 1 when the learner does not answer or refuses the handshake: the line names
the key flag to fix); the live view keeps retrying through a learner restart and says that it is waiting.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from deploy.ctl import NoReply, request
from protocol import messages as m
from protocol.auth import ClientKeys

BAR_WIDTH = 40


def fetch(addr: str, timeout_s: float = 5.0, keys: ClientKeys | None = None) -> m.StatusReply:
    reply = request(addr, m.StatusRequest(), timeout_s, keys)
    if isinstance(reply, m.Error):
        raise ValueError(f"the hub rejected the status request: {reply.detail}")
    assert isinstance(reply, m.StatusReply), f"unexpected reply {type(reply).__name__}"
    return reply


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{seconds:.1f}s"


def render(r: m.StatusReply, addr: str) -> RenderableType:
    state = "training" if r.training else "waiting for rollouts"
    head = Text.assemble(
        ("FleetRL learner ", "bold"),
        addr,
        f"   up {_age(r.uptime_s)}\n",
        "version ",
        (str(r.policy_version), "bold"),
        f" ({r.updates} updates, S = {r.steps_per_update})   ",
        "k = ",
        (str(r.max_staleness), "bold"),
        f"   {state}\n",
        f"last update {r.step_s:.3f} s   ",
        (
            f"last weight sync {_age(r.sync_age_s)} ago: held the learner {r.sync_s:.3f} s, broadcast {r.broadcast_s:.3f} s"
            if r.syncs
            else "no weight sync yet"
        ),
        "\n",
        f"ledger: pending {r.pending}  granted {r.granted}  received {r.received}  trained {r.trained}   "
        f"buffered {r.buffered}   dropped stale {r.dropped_stale} (requeued)",
    )
    actors = Table(title=f"actors ({len(r.actor_ids)})", title_justify="left")
    for name, justify in (
        ("actor", "left"),
        ("version", "right"),
        ("behind", "right"),
        ("samples/s", "right"),
        ("groups", "right"),
        ("leases", "right"),
        ("heartbeat", "right"),
    ):
        actors.add_column(name, justify=justify)  # type: ignore[arg-type]
    for i, actor_id in enumerate(r.actor_ids):
        served = int(r.actor_served_version[i])
        age = float(r.actor_heartbeat_age_s[i])
        actors.add_row(
            actor_id,
            str(served),
            str(r.policy_version - served),
            f"{float(r.actor_samples_per_s[i]):.1f}",
            str(int(r.actor_groups[i])),
            str(int(r.actor_leases[i])),
            Text(f"{age:.1f}s ago", style="red" if age > 10 else ""),
        )
    taken = int(r.staleness_counts.sum())
    hist = Table(title=f"staleness (u + S - 1) - v of the last {taken} groups trained (k = {r.max_staleness})", title_justify="left")
    hist.add_column("staleness", justify="right")
    hist.add_column("groups", justify="right")
    hist.add_column("", justify="left")
    peak = max(1, int(r.staleness_counts.max())) if taken else 1
    for s, count in enumerate(r.staleness_counts.tolist()):
        hist.add_row(str(s), str(count), Text("#" * round(BAR_WIDTH * count / peak), style="red" if s > r.max_staleness else "green"))
    return Group(head, actors, hist)


def _console() -> Console:
    # Not a terminal (a pipe, a test): wide enough that no column is cut.
    return Console() if sys.stdout.isatty() else Console(width=160, no_color=True)


def run_status(addr: str, once: bool, interval_s: float, timeout_s: float, keys: ClientKeys | None = None) -> int:
    console = _console()
    if once:
        try:
            console.print(render(fetch(addr, timeout_s, keys), addr))
        except (NoReply, ValueError, m.ProtocolError) as e:
            print(f"fleetrl status: {e}", file=sys.stderr)
            return 1
        return 0

    def view() -> RenderableType:
        try:
            return render(fetch(addr, timeout_s, keys), addr)
        except (NoReply, ValueError, m.ProtocolError) as e:
            return Text(f"{e}; retrying every {interval_s:g} s", style="yellow")

    try:
        if not console.is_terminal:  # a pipe or a file: one snapshot after another
            while True:
                console.rule(time.strftime("%H:%M:%S"))
                console.print(view())
                time.sleep(interval_s)
        with Live(Text(f"asking {addr} ..."), console=console, auto_refresh=False) as live:
            while True:
                live.update(view(), refresh=True)
                time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0
