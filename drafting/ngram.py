"""The n-gram (prompt lookup) proposer: drafts what followed the last n tokens earlier on."""

from __future__ import annotations

from metrale.drafting.proposer import CommittedRows, Proposal, ProposeRequest


def ngram_drafts(history: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest matching suffix."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + num_drafts]
    return []


class NgramProposer:
    method = "ngram"
    capture_layers: tuple[int, ...] = ()
    fixed_drafts = None
    keeps_row_state = False
    max_batch = 1 << 30

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def from_worker(cls, ngram_min=1, ngram_max=4, **_):
        return cls(ngram_min, ngram_max)

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        out = []
        for req in requests:
            drafts = ngram_drafts(req.history, req.num_drafts, self.min_n, self.max_n)
            kept: list[int] = []
            for token in drafts:   # a grammar cuts the lookup at its first disallowed token
                mask = req.allowed(kept) if req.allowed else None
                if mask is not None and not bool(mask[token]):
                    break
                kept.append(token)
            out.append(Proposal(kept, [0.0] * len(kept)))
        return out

    def commit(self, rows: list[CommittedRows]) -> None:
        """The worker keeps every sequence's tokens; there is nothing else to update."""
