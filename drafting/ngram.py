"""The n-gram (prompt lookup) proposer: drafts what followed the last n tokens earlier on."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from metrale.drafting.proposer import CommittedRows, Proposal, ProposeRequest
from metrale.drafting.rejection import greedy_verdict
from metrale.workers.models import kernels


def ngram_drafts(history: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The tokens after the most recent earlier occurrence of the longest matching suffix: the
    definition, by a scan of the whole history. `SuffixIndex` answers the same in O(max_n)."""
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == suffix:
                return history[start + n:start + n + num_drafts]
    return []


def ngram_drafts_on_device(history: torch.Tensor, lengths: torch.Tensor, num_drafts: int,
                           min_n: int, max_n: int) -> torch.Tensor:
    """`ngram_drafts` for many sequences at once, never waiting for the host (a CUDA graph
    holds it): history [S, H] holds each sequence's tokens in its first lengths[i] (>= 1)
    columns. Returns [S, num_drafts]: the drafts, then the sequence's last token as filler
    where fewer follow the match (all filler without one). Greedy verdicts hold whatever the
    drafts are, so filler only costs a rejected row. With `kernels.CHAIN` on a GPU, one kernel
    (`kernels.ngram_lookup`); else `ngram_drafts_in_tensors`, its reference."""
    if kernels.chain_kernels(history.device):
        return kernels.ngram_lookup(history, lengths, num_drafts, min_n, max_n)
    return ngram_drafts_in_tensors(history, lengths, num_drafts, min_n, max_n)


def ngram_drafts_in_tensors(history: torch.Tensor, lengths: torch.Tensor, num_drafts: int,
                            min_n: int, max_n: int) -> torch.Tensor:
    """`ngram_drafts_on_device` in a few tensor ops over the whole width of the table.

    A match of n tokens ends at column e when history[e - k] equals the suffix's k-th token
    from the end for every k < n (built up one k at a time: elementwise ops over [S, H], with
    no scan over a short last dimension, which CUDA runs slowly). The longest n wins, then the
    latest e before the last token: the one (n, e) with the largest n * H + e."""
    width, device = history.shape[1], history.device
    last = lengths[:, None] - 1                                  # the newest token's column
    padded = F.pad(history, (max_n - 1, 0), value=-1)           # -1 matches no token
    ends = torch.arange(width, device=device)[None, :]
    earlier = ends < last
    agree = torch.ones_like(earlier)
    score = torch.full_like(history, -1)
    for n in range(1, max_n + 1):
        k = n - 1                     # history[e - k] against the suffix's token at last - k
        agree &= padded[:, max_n - 1 - k:max_n - 1 - k + width] == history.gather(
            1, (last - k).clamp(min=0))
        if n >= min_n:
            score = torch.where(agree & earlier & (last >= n), n * width + ends, score)
    score = score.amax(1)
    found = torch.where(score >= 0, score % width + 1, -1)      # where the drafts begin
    at = found[:, None] + torch.arange(num_drafts, device=device)
    real = (found[:, None] >= 0) & (at <= last)
    return torch.where(real, history.gather(1, at.clamp(0, width - 1)), history.gather(1, last))


class SuffixIndex:
    """One sequence's n-grams (min_n..max_n tokens) mapped to where each last began, among those
    followed by a token. Tokens are indexed as they arrive, so a lookup costs O(max_n) however
    long the history is (the scan costs O(history x max_n) per round and sequence).

    An n-gram's key is one int, its tokens newest first in 32 bits each above a leading 1 (so
    n-grams of different lengths differ), not a tuple. Ints are not tracked by the collector;
    tuples were, and as a slot's new index grew its old one's keys were freed, so the count
    that starts a collection (allocations less deallocations) stayed near zero while the new
    keys piled up in the youngest generation: some 44 000 after a prefill of 64 prompts of 256
    tokens, walked by the first decode step's collection (3-5 ms of that step on a CPU).
    Token ids are in [0, 2**32)."""

    def __init__(self, history: list[int], min_n: int, max_n: int):
        self.history, self.min_n, self.max_n = history, min_n, max_n
        self.last: dict[int, int] = {}
        self.indexed = 0   # tokens of history whose preceding n-grams are in `last`

    def extend(self) -> None:
        """Indexes the tokens that arrived since the last call."""
        h, last, min_n = self.history, self.last, self.min_n
        for end in range(self.indexed + 1, len(h)):   # n-grams ending at end - 1, followed by h[end]
            key = 1
            for n in range(1, min(self.max_n, end) + 1):
                key = key << 32 | h[end - n]
                if n >= min_n:
                    last[key] = end - n
        self.indexed = max(self.indexed, len(h) - 1)

    def drafts(self, num_drafts: int) -> list[int]:
        self.extend()
        h = self.history
        keys, key = [], 1
        for n in range(1, min(self.max_n, len(h) - 1) + 1):
            key = key << 32 | h[-n]
            keys.append(key)
        for n in range(len(keys), self.min_n - 1, -1):
            start = self.last.get(keys[n - 1])
            if start is not None:
                return h[start + n:start + n + num_drafts]
        return []


def lookup_rounds(prompt: list[int], output: list[int], k: int, min_n: int, max_n: int) -> int:
    """Rounds a greedy n-gram speculation of k drafts a round takes to emit `output` after its
    first token (the prefill's), when every round accepts what the lookup's drafts match: the
    rounds the text itself asks for, whatever a draft policy or an engine does. Each round's
    verdict is the engine's greedy one, the output standing in for the target's argmaxes."""
    history = list(prompt) + output[:1]
    index = SuffixIndex(history, min_n, max_n)
    at, rounds = min(1, len(output)), 0   # at: output tokens in the history
    while at < len(output):
        drafts = index.drafts(min(k, len(output) - at - 1))
        verdict = greedy_verdict(drafts, output[at:at + len(drafts) + 1])
        history.extend(verdict.tokens)
        at, rounds = at + len(verdict.tokens), rounds + 1
    return rounds


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
        self.index: dict[int, SuffixIndex] = {}   # slot -> its sequence's index

    @classmethod
    def from_worker(cls, ngram_min=1, ngram_max=4, **_):
        return cls(ngram_min, ngram_max)

    def _index_of(self, slot: int, history: list[int]) -> SuffixIndex:
        index = self.index.get(slot)
        # the worker starts a new history list for each sequence a slot takes
        if index is None or index.history is not history:
            index = self.index[slot] = SuffixIndex(history, self.min_n, self.max_n)
        return index

    def observe(self, slot: int, history: list[int]) -> None:
        """A prompt chunk joined the slot's history: the worker calls this while the device runs
        the chunk, so a prompt's n-grams (about 0.3 ms of host time per 256 tokens) are indexed
        in its prefill step rather than in the sequence's first round."""
        self._index_of(slot, history).extend()

    def propose(self, requests: list[ProposeRequest]) -> list[Proposal]:
        out = []
        for req in requests:
            index = self._index_of(req.slot, req.history)
            kept: list[int] = []
            for token in index.drafts(req.num_drafts):   # a grammar cuts at its first disallowed token
                mask = req.allowed(kept) if req.allowed else None
                if mask is not None and not bool(mask[token]):
                    break
                kept.append(token)
            out.append(Proposal(kept, [0.0] * len(kept)))
        return out

    def commit(self, rows: list[CommittedRows]) -> None:
        """The worker keeps every sequence's tokens; there is nothing else to update."""
