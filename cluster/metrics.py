"""A replica's Prometheus metrics, through Ray's metrics API: queues, KV, slots, speculation."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge

from metrale.cluster.engine import LaneLoad
from metrale.drafting.stats import SpecStats


class ReplicaMetrics:
    """Sampled from the engine's state on a timer, so the step loop itself pays nothing."""

    def __init__(self, replica: str):
        self.replica = replica
        worker = ("replica", "worker")
        self.running = Gauge("metrale_requests_running", "Sequences holding a slot", worker)
        self.waiting = Gauge("metrale_requests_waiting", "Sequences queued for admission", worker)
        self.kv_usage = Gauge("metrale_kv_cache_usage", "Fraction of KV blocks in use", worker)
        self.slot_usage = Gauge("metrale_slot_usage",
                                "Fraction of sequence slots (SSM state, verify pool) in use",
                                worker)
        self.preemptions = Counter("metrale_preemptions_total", "Sequences preempted", worker)
        self.draft_length = Gauge("metrale_draft_length", "Drafts per sequence the draft policy "
                                  "chose for the latest round", worker)
        self.proposed = Counter("metrale_drafts_proposed_total", "Draft tokens verified",
                                ("replica",))
        self.accepted = Counter("metrale_drafts_accepted_total", "Draft tokens accepted",
                                ("replica",))
        self.acceptance = Gauge("metrale_acceptance_length",
                                "Tokens emitted per speculative round (accepted drafts + 1), "
                                "over the last interval", ("replica",))
        self._last_preemptions: list[int] = []
        self._last = SpecStats()

    def report(self, loads: list[LaneLoad], spec: SpecStats) -> None:
        if not self._last_preemptions:
            self._last_preemptions = [0] * len(loads)
        for rank, load in enumerate(loads):
            tags = {"replica": self.replica, "worker": str(rank)}
            self.running.set(load.running, tags)
            self.waiting.set(load.waiting, tags)
            self.kv_usage.set(load.kv_usage, tags)
            self.slot_usage.set(load.slot_usage, tags)
            self.draft_length.set(load.draft_length, tags)
            if load.preemptions > self._last_preemptions[rank]:
                self.preemptions.inc(load.preemptions - self._last_preemptions[rank], tags)
            self._last_preemptions[rank] = load.preemptions
        tags = {"replica": self.replica}
        rounds = spec.rounds - self._last.rounds
        proposed = spec.drafts_proposed - self._last.drafts_proposed
        accepted = spec.drafts_accepted - self._last.drafts_accepted
        if proposed:
            self.proposed.inc(proposed, tags)
        if accepted:
            self.accepted.inc(accepted, tags)
        if rounds:
            self.acceptance.set((accepted + rounds) / rounds, tags)
        self._last = SpecStats(spec.rounds, spec.drafts_proposed, spec.drafts_accepted)
