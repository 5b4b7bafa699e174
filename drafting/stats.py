"""Speculation statistics, kept per request by the scheduler and per worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0               # verifies that carried at least one draft
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    proposed_at: list[int] = field(default_factory=list)   # per draft position
    accepted_at: list[int] = field(default_factory=list)

    def record(self, proposed: int, *accepted: int) -> None:
        """Verifies of `proposed` drafts each, one per count in `accepted` (the drafts it
        accepted): a chain's rounds in one call, counted by how many drafts each accepted."""
        if proposed == 0 or not accepted:
            return
        n = len(accepted)
        self.rounds += n
        self.drafts_proposed += proposed * n
        self.drafts_accepted += sum(accepted)
        if len(self.proposed_at) < proposed:
            grow = [0] * (proposed - len(self.proposed_at))
            self.proposed_at += grow
            self.accepted_at += grow
        beyond = n   # verifies that accepted draft i: those that accepted more than i drafts
        for i in range(proposed):
            beyond -= accepted.count(i)
            self.proposed_at[i] += n
            self.accepted_at[i] += beyond

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.drafts_proposed += other.drafts_proposed
        self.drafts_accepted += other.drafts_accepted
        for i in range(len(other.proposed_at)):
            if i == len(self.proposed_at):
                self.proposed_at.append(0)
                self.accepted_at.append(0)
            self.proposed_at[i] += other.proposed_at[i]
            self.accepted_at[i] += other.accepted_at[i]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per speculative round: accepted drafts plus the bonus/replacement."""
        return (self.drafts_accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate_at(self) -> list[float]:
        return [a / p for a, p in zip(self.accepted_at, self.proposed_at)]

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafts_proposed": self.drafts_proposed,
                "drafts_accepted": self.drafts_accepted,
                "mean_acceptance_length": round(self.mean_acceptance_length, 4),
                "acceptance_rate_at": [round(r, 4) for r in self.acceptance_rate_at]}
