"""A request's output stream: the deltas its client receives, cut so no sent text is taken back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from metrale.cluster.sequence import Sequence, TokenLogprob
from metrale.drafting.stats import SpecStats


@dataclass
class Delta:
    """What one completion of a request gained since its last delta."""
    request_id: str
    index: int                    # which of the request's n completions
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None   # stop | length | error, on the completion's last delta
    spec: SpecStats | None = None      # the completion's speculation statistics, on its last delta
    error: str | None = None
    error_type: str | None = None      # unavailable (retry later) or internal

    def extend(self, later: "Delta") -> "Delta":
        """This delta followed by a later one of the same completion, as one."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.finish_reason, self.spec = later.finish_reason, later.spec
        self.error, self.error_type = later.error, later.error_type
        return self


class OutputStream:
    """Turns a request's sequences into deltas for `sink`, one per sequence that moved."""

    def __init__(self, request_id: str, seqs: list[Sequence], sink: Callable[[Delta], None]):
        self.request_id, self.sink = request_id, sink
        n = len(seqs)
        self.sent_text, self.sent_tokens, self.sent_logprobs = [0] * n, [0] * n, [0] * n
        self.closed = [False] * n
        # A stop string cuts the text before its match, so the last len(stop) - 1 characters wait
        # until they can no longer start one.
        self.holdback = max((len(s) for s in seqs[0].params.stop), default=1) - 1

    @property
    def done(self) -> bool:
        return all(self.closed)

    def emit(self, seq: Sequence) -> None:
        i = seq.index
        end = len(seq.text) if seq.finished else max(self.sent_text[i],
                                                      len(seq.text) - self.holdback)
        delta = Delta(self.request_id, i, seq.text[self.sent_text[i]:end],
                      seq.output_ids[self.sent_tokens[i]:], seq.logprobs[self.sent_logprobs[i]:])
        self.sent_text[i], self.sent_tokens[i] = end, len(seq.output_ids)
        self.sent_logprobs[i] = len(seq.logprobs)
        if seq.finished:
            delta.finish_reason, delta.spec = seq.finish_reason, seq.spec
            self.closed[i] = True
        if delta.text or delta.token_ids or delta.finish_reason:
            self.sink(delta)

    def fail(self, message: str, kind: str) -> None:
        """Ends every open completion with an error of `kind` (unavailable or internal)."""
        for i, closed in enumerate(self.closed):
            if not closed:
                self.sink(Delta(self.request_id, i, finish_reason="error", error=message,
                                error_type=kind))
        self.closed = [True] * len(self.closed)
