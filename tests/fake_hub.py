"""A hub stand-in for driving learner/weights/sync.py's WeightSender without sockets: the members and their
registered devices are given, the WeightSyncs it would send are recorded, and an eviction fails the test."""

from __future__ import annotations


class RecordingHub:
    def __init__(self, devices: dict[str, list[str]]):
        self.members, self.sent = devices, []  # actor id -> device identities (one per engine worker)

    def live_actors(self):
        return sorted(self.members)

    def devices(self, ids):
        return [self.members[a] for a in ids]

    def send_weight_sync(self, members, make):
        self.sent.extend(make(a) for a in members)

    def add_membership_listener(self, fn):
        pass

    def evict(self, actor_id, why):
        raise AssertionError(f"{actor_id} evicted: {why}")
