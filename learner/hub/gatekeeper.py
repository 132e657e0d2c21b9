"""The hub's gatekeeper: a ZAP handler that admits only the listed CURVE client keys.

    client --CURVE handshake--> [hub ROUTER] --ZAP request (client key)--> gatekeeper thread: listed? 200 : 400
    every message the hub reads --> Gatekeeper.admits(frame): is its connection's key still listed?

The ZAP handler runs in its own thread (pyzmq's ThreadAuthenticator), so a storm of
handshakes never queues behind the hub's event loop. The allow-list is the folder
`auth.authorized`, re-read when its modification time changes: `fleetrl keys --out DIR
--client NAME` admits a new node to a running learner within a second. Removing a key
refuses its next handshake, and `admits` drops every message of a connection opened
with it before: a revoked actor goes silent and is declared dead after hub.actor_timeout_s.
`admits` also names the key (its file's stem), so the hub can tie an actor id to the key
that registered it.
"""

from __future__ import annotations

import logging
from collections import Counter

import zmq
from zmq.auth.thread import ThreadAuthenticator

from protocol.auth import ServerKeys, load_allow_list
from protocol.logs import Throttle, get_logger
from protocol.transport import ZAP_DOMAIN


class Gatekeeper:
    def __init__(self, ctx: zmq.Context, keys: ServerKeys):
        self.folder = keys.authorized
        self.log = get_logger()
        # Each key is written by one thread only (ZAP thread: admitted/refused; hub thread: revoked).
        self.counts: Counter[str] = Counter()
        self._allowed: dict[bytes, str] = {}  # Z85 public key -> name; replaced whole on reload
        self._mtime_ns: int | None = None
        self._admitted_log = Throttle(1.0)
        self._refused_log = Throttle(1.0)
        self._revoked_log = Throttle(1.0)
        self.reload()
        if not self._allowed:
            self.log.warning(
                "auth.no_authorized_keys",
                folder=str(self.folder),
                hint="no client can connect until a key is added (fleetrl keys --out DIR --client NAME)",
            )
        # Bound to `ctx` (ZAP is per context) before the hub's socket binds: with ZAP_ENFORCE_DOMAIN a
        # handshake that finds no handler is refused, never waved through.
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("fleetrl.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self)

    def stop(self) -> None:
        self._auth.stop()

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP thread: one CURVE handshake, `key` in Z85. The client already proved it holds the secret."""
        name = self._allowed.get(key)
        self.counts["auth_admitted" if name is not None else "auth_refused"] += 1
        if name is not None:
            if (suppressed := self._admitted_log.ready()) is not None:
                self.log.info("auth.admitted", key=name, suppressed=suppressed)
        elif (suppressed := self._refused_log.ready()) is not None:
            self.log.warning("auth.refused", key=key.decode(errors="replace"), suppressed=suppressed)
        return name is not None

    def admits(self, frame: zmq.Frame) -> str | None:
        """Hub thread, per message: the name of the still-listed key its connection authenticated with, or None."""
        try:
            user = frame.get("User-Id")  # set from the ZAP reply: the client's Z85 public key
        except zmq.ZMQError:  # no such property: the connection never passed ZAP
            user = None
        name = self._allowed.get(user.encode()) if isinstance(user, str) else None
        if name is not None:
            return name
        self.counts["auth_revoked"] += 1
        if (suppressed := self._revoked_log.ready()) is not None:
            self.log.warning("auth.message_dropped", key=user, why="key no longer authorized", suppressed=suppressed)
        return None

    def reload(self) -> None:
        """Re-read the allow-list if the folder changed (a file added or removed). Keeps the old list on error."""
        try:
            mtime = self.folder.stat().st_mtime_ns
        except OSError as e:
            self.log.error("auth.allow_list_unreadable", folder=str(self.folder), error=str(e), kept=len(self._allowed))
            return
        if mtime == self._mtime_ns:
            return
        keys, problems = load_allow_list(self.folder)
        for problem in problems:
            self.log.error("auth.bad_key_file", problem=problem)
        added = sorted(set(keys.values()) - set(self._allowed.values()))
        removed = sorted(set(self._allowed.values()) - set(keys.values()))
        if self._mtime_ns is not None and (added or removed):
            self.log.info("auth.allow_list_changed", added=added, removed=removed, keys=len(keys))
        self._allowed, self._mtime_ns = keys, mtime
