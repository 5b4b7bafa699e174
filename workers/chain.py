"""Greedy n-gram, MTP or DFlash rounds chained on the device: a chain of `max_rounds` rounds is
one CUDA graph replay, a shorter one a replay a round.

A chained round drafts (n-gram: from each sequence's history, `ngram_drafts_on_device`; MTP
and DFlash: their drafter's `round_drafts`, from each slot's stash or context window; none in a
round of depth 0, a plain decode step that still feeds the drafter), lays out
its verify rows, runs the target, counts the accepted drafts, commits a hybrid's SSM states,
feeds a drafter the committed rows (`round_commit`: MTP's K/V and stash, DFlash's context
window) and appends the round's tokens to the history, all inside one graph over static
buffers; a second graph holds `max_rounds` such rounds in a row. The host fills the buffers
once per chain, replays the graphs (on an H100, 8 replays of a round's graph and their copies
took 128-280 us of host time, one replay of 8 rounds 6-83 us, in two runs of
scripts/chainlaunch.py) and reads every round's tokens with one sync at the end
(`Worker._execute_chain`). A chain planned before
the last one's result goes on from the buffers that one leaves (`ChainRunner.resume`), so the
host fills nothing per sequence and launches it while the last one runs (`Worker._launch_chain`).
"""

from __future__ import annotations

import numpy as np
import torch

from metrale.drafting.ngram import ngram_drafts_on_device
from metrale.workers.batch import RowsLayout, to_device
from metrale.workers.cuda_graphs import GraphRunner
from metrale.workers.models import kernels


def padded_histories(histories: list[list[int]], width: int) -> np.ndarray:
    """The sequences' token histories as rows of `width` columns, zeros after each."""
    rows = np.zeros((len(histories), width), dtype=np.int64)
    for row, history in zip(rows, histories):
        row[:len(history)] = history
    return rows


def padded_rows(histories: list[list[int]]) -> tuple[np.ndarray, list[int]]:
    """The histories as rows as wide as the longest, zeros after each, and their lengths: what
    a chain that starts from the host takes (`ChainRunner.launch`)."""
    lengths = list(map(len, histories))
    return padded_histories(histories, max(lengths)), lengths


class SlotHistories:
    """Each slot's committed tokens: a list per slot, as the host's proposers read them, and,
    when `mirrored` (n-gram chains, which start from whole histories), the same tokens in one
    int64 array. A chain that starts from the host then copies its rows out of the array
    instead of converting every token from a Python int (32 histories of 257 tokens took
    190-260 us that way on a CPU, in the speculative engine's first step, before its first
    replay). A long extension (a prompt) is written to the array at once, in its prefill step;
    a chain's few tokens when rows are next asked for. Lists only grow until `reset`."""
    WRITE_THROUGH = 32   # tokens

    def __init__(self, slots: int, mirrored: bool):
        self.lists: list[list[int]] = [[] for _ in range(slots)]
        self.array = np.zeros((slots, 256 if mirrored else 0), dtype=np.int64)
        self.written = [0] * slots   # leading tokens of each list that are in the array
        self.mirrored = mirrored

    def __getitem__(self, slot: int) -> list[int]:
        return self.lists[slot]

    def reset(self, slot: int) -> None:
        self.lists[slot], self.written[slot] = [], 0

    def extend(self, slot: int, tokens: list[int]) -> None:
        self.lists[slot].extend(tokens)
        if self.mirrored and len(tokens) >= self.WRITE_THROUGH:
            self._write(slot)

    def rows(self, slots: list[int]) -> tuple[np.ndarray, list[int]]:
        """The slots' histories as rows as wide as the longest, zeros after each, and their
        lengths."""
        if not self.mirrored:
            return padded_rows([self.lists[s] for s in slots])
        lengths = [len(self.lists[s]) for s in slots]
        width = max(lengths)
        for s in slots:
            self._write(s)
        rows = self.array[slots, :width]   # (a copy)
        rows[np.arange(width) >= np.array(lengths)[:, None]] = 0
        return rows, lengths

    def _write(self, slot: int) -> None:
        history, done = self.lists[slot], self.written[slot]
        if done == len(history):
            return
        if len(history) > self.array.shape[1]:
            wider = np.zeros((len(self.array), max(2 * self.array.shape[1], len(history))),
                             dtype=np.int64)
            wider[:, :self.array.shape[1]] = self.array
            self.array = wider
        self.array[slot, done:len(history)] = history[done:]
        self.written[slot] = len(history)


def draft_round(history: torch.Tensor, used: torch.Tensor, depth: int, min_n: int,
                max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A round's drafts [S, depth] and its rows' ids [S, depth + 1] (the pending token, the
    history's last, then the drafts)."""
    pending = history.gather(1, used[:, None] - 1)
    if not depth:   # a plain decode step
        return pending[:, :0], pending
    drafts = ngram_drafts_on_device(history, used, depth, min_n, max_n)
    return drafts, torch.cat([pending, drafts], 1)


def greedy_counts(drafts: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """Drafts each sequence accepted: those before the first that is not the argmax of the row
    before it (best [S, depth + 1])."""
    return (drafts == best[:, :drafts.shape[1]]).long().cumprod(1).sum(1)


def advance(history: torch.Tensor, used: torch.Tensor, context: torch.Tensor,
            best: torch.Tensor, accepted: torch.Tensor) -> None:
    """Appends a round's tokens (the argmaxes of the accepted drafts' rows and the next) to each
    history, in place. Columns past the accepted ones are written over by the next round's."""
    history.scatter_(1, used[:, None] + torch.arange(best.shape[1], device=best.device), best)
    used.add_(accepted + 1)
    context.add_(accepted + 1)


def round_inputs(history: torch.Tensor, used: torch.Tensor, context: torch.Tensor,
                 drafts: torch.Tensor, tables: torch.Tensor, block_size: int, ids: torch.Tensor,
                 positions: torch.Tensor, kv_index: torch.Tensor, context_in: torch.Tensor) -> None:
    """A chained round's step inputs, written into the step's buffers: each sequence's pending
    token (its history's last) then its drafts [S, k], at positions context.. (KV indices
    through the block tables), and the cached lengths. With `kernels.CHAIN` on a GPU, one
    launch (`kernels.round_inputs`, whose reference this is)."""
    if kernels.chain_kernels(history.device):
        return kernels.round_inputs(history, used, context, drafts, tables, block_size, ids,
                                    positions, kv_index, context_in)
    row_ids = torch.cat([history.gather(1, used[:, None] - 1), drafts], 1)
    at = context[:, None] + torch.arange(row_ids.shape[1], device=history.device)
    kv = tables.gather(1, at // block_size).long() * block_size + at % block_size
    ids.copy_(row_ids.view(-1))
    positions.copy_(at.view(-1))
    kv_index.copy_(kv.view(-1))
    context_in.copy_(context)


def land(history: torch.Tensor, used: torch.Tensor, context: torch.Tensor, best: torch.Tensor,
         accepted: torch.Tensor, landing: torch.Tensor) -> None:
    """`advance`, and the round's argmaxes then its accepted count into each landing row; one
    launch with `kernels.CHAIN` on a GPU (`kernels.round_advance`)."""
    if kernels.chain_kernels(history.device):
        return kernels.round_advance(history, used, context, best, accepted, landing)
    advance(history, used, context, best, accepted)
    length = best.shape[1]
    landing[:, :length].copy_(best)
    landing[:, length].copy_(accepted)


class ChainRunner:
    """The chain's static buffers, shared by its graphs (two per batch bucket and rows per
    sequence, one round and `max_rounds` rounds, captured at start or on first use): each
    sequence's tokens (`history`, the first `used` of a row valid), its cached length
    (`context`), and per round of a graph its argmaxes and accepted count per sequence
    (`landing`, [max_rounds, bucket, length + 1]). With a `drafter` (the
    MTP or DFlash proposer's graphs) the rounds draft with it, and the history need only hold
    each sequence's pending token at the start; `seen` holds the rows each sequence's DFlash
    window has taken."""

    def __init__(self, graphs: GraphRunner, min_n: int, max_n: int, max_len: int,
                 max_rounds: int, drafter=None):
        self.graphs, self.min_n, self.max_n, self.drafter = graphs, min_n, max_n, drafter
        device = graphs.tables.device
        seqs = graphs.buckets[-1]
        self.width = max_len + max_rounds * graphs.max_rows   # what the rounds may append
        self.history = torch.zeros(seqs, self.width, dtype=torch.long, device=device)
        self.used = torch.ones(seqs, dtype=torch.long, device=device)
        self.context = torch.zeros(seqs, dtype=torch.long, device=device)
        self.seen = torch.zeros(seqs, dtype=torch.long, device=device)
        self.max_rounds = max(max_rounds, 1)
        self.landing = torch.zeros(self.max_rounds, seqs, graphs.max_rows + 1, dtype=torch.long,
                                   device=device)
        # per (bucket, rows, verify): the graph of one round, the graph of max_rounds rounds in
        # a row (None when that is 1), and the functions captured in them, which hold tensors
        # they read (freed, their memory would be handed out again)
        self.graphs_by_shape: dict[tuple[int, int, bool], tuple] = {}

    @torch.inference_mode()
    def run(self, layout: RowsLayout, histories: tuple[np.ndarray, list[int]], rounds: int,
            seen: list[int] | None = None) -> list:
        """Runs `rounds` chained rounds (`launch`) and reads them: per round and sequence its
        argmaxes, then its accepted count (host lists, read with one sync)."""
        return self.launch(layout, rounds, histories, seen).tolist()

    @torch.inference_mode()
    def launch(self, layout: RowsLayout, rounds: int,
               histories: tuple[np.ndarray, list[int]] | None = None,
               seen: list[int] | None = None, rows: list[int] | None = None) -> torch.Tensor:
        """Launches `rounds` chained rounds of the layout's sequences (one length: the pending
        token's row and the drafts'; its ids and cached lengths are not read) without waiting
        for them. Either `histories` are the sequences' token histories, pending token last,
        as zero-padded rows and their lengths (`padded_rows`, `SlotHistories.rows`; and their DFlash windows
        have taken `seen` rows), or the sequences go on from where
        the chain launched last leaves them on the device, `rows` their rows in it (`resume`).
        Returns per round and sequence its argmaxes, then its accepted count, on the device."""
        n, length, verify = len(layout.seqs), layout.uniform_length, layout.seqs[0].verify
        bucket = self.graphs.bucket(n)
        key = (bucket, length, verify)
        if key not in self.graphs_by_shape:   # (its capture runs over padding: keep the rows)
            kept = [state.clone() for state in self._state()] if rows is not None else ()
            self._capture(*key)
            for state, was in zip(self._state(), kept):
                state.copy_(was)
        self.graphs.prepare(layout)       # slots, block tables, row starts; padding sequences
        if rows is not None:
            self.resume(rows, bucket)
        else:
            self._reset(bucket)
            padded, lengths = histories
            to_device(padded, self.history.device, out=self.history[:n, :padded.shape[1]])
            sizes = to_device([lengths, [s.context_len for s in layout.seqs], seen or [0] * n],
                              self.history.device)
            self.used[:n].copy_(sizes[0])
            self.context[:n].copy_(sizes[1])
            self.seen[:n].copy_(sizes[2])
        one, many = self.graphs_by_shape[key][:2]
        landed = torch.empty(rounds, n, length + 1, dtype=torch.long, device=self.history.device)
        r = 0
        while r < rounds:   # max_rounds at a time where they fit: one launch, not one a round
            graph, take = (many, self.max_rounds) if many and rounds - r >= self.max_rounds \
                else (one, 1)
            graph.replay()
            landed[r:r + take].copy_(self.landing[:take, :n, :length + 1])
            r += take
        return landed

    def resume(self, rows: list[int], bucket: int) -> None:
        """The sequences of the chain launched last that go on, in their new order (`rows`:
        each one's row in that chain), keep their tokens, cached lengths and windows there;
        the bucket's rows after them become padding. In stream order, after that chain."""
        n = len(rows)
        if rows != list(range(n)):
            index = to_device(rows, self.history.device)
            for state in self._state():
                state[:n] = state.index_select(0, index)
        self._reset(bucket, n)

    def _state(self) -> tuple[torch.Tensor, ...]:
        """What a sequence's row holds from one round to the next."""
        return self.history, self.used, self.context, self.seen

    def capture_all(self, lengths: list[int], verify: bool) -> None:
        """Captures every bucket's round for each row count (k + 1 for k drafts), so no chain
        waits for a capture: the draft policy moves k, and the batch shrinks, within a run."""
        for length in lengths:
            for bucket in reversed(self.graphs.buckets):
                if (bucket, length, verify) not in self.graphs_by_shape:
                    self._capture(bucket, length, verify)

    def _capture(self, bucket: int, length: int, verify: bool) -> None:
        around = self._round(bucket, length, verify)   # kept: the graphs read its tensors

        def graph_of(rounds: int):
            self._reset(bucket)   # the capture runs the rounds once, over padding only
            return self.graphs.capture_around(bucket, length, verify, *around, rounds)
        one = graph_of(1)
        many = graph_of(self.max_rounds) if self.max_rounds > 1 else None
        self.graphs_by_shape[(bucket, length, verify)] = (one, many, around)

    def _reset(self, bucket: int, start: int = 0) -> None:
        """Rows start.. of the bucket as padding: one token, nothing cached (padding rows
        write the block and slot kept for them, which `prepare` gives them)."""
        self.history[start:bucket].zero_()
        self.used[start:bucket] = 1
        self.context[start:bucket] = 0
        self.seen[start:bucket] = 0

    def _round(self, bucket: int, length: int, verify: bool):
        """The work on each side of the target's step in a round's graph (see
        GraphRunner.capture_around)."""
        depth, graphs, bs = length - 1, self.graphs, self.graphs.block_size
        history, used, context = self.history[:bucket], self.used[:bucket], self.context[:bucket]
        seen, drafter = self.seen[:bucket], self.drafter
        tables = graphs.tables[:bucket]
        counts = torch.full((bucket,), depth, dtype=torch.long, device=history.device)
        step = {}
        # n-gram rounds on a GPU pair their kernels up (kernels.ROUND_FUSED): the lookup with the
        # rows' inputs, the verdicts with the land
        paired = drafter is None and kernels.round_fused(history.device)

        def before(views):
            ids_in, positions_in, kv_in, slots_in, _, _, context_in, _ = views
            step.update(ids=ids_in, slots=slots_in)
            if not depth:   # a plain decode step
                drafts = history[:, :0]
            elif paired:   # the lookup writes the rows too
                step["drafts"] = kernels.ngram_round_inputs(
                    history, used, context, depth, self.min_n, self.max_n, tables, bs, ids_in,
                    positions_in, kv_in, context_in)
                return
            elif drafter is None:
                drafts = ngram_drafts_on_device(history, used, depth, self.min_n, self.max_n)
            else:
                pending = history.gather(1, used[:, None] - 1)[:, 0]
                drafts = drafter.round_drafts(slots_in, pending, context, seen, tables, depth)
            round_inputs(history, used, context, drafts.contiguous(), tables, bs, ids_in,
                         positions_in, kv_in, context_in)
            step["drafts"] = drafts

        def after(logits, hidden, captured, r):
            best = kernels.argmax_rows(logits)
            landing = self.landing[r, :bucket]
            if verify:   # paired: the verdicts' kernel lands the round too
                accepted = graphs.ssm.commit_greedy_captured(
                    step["ids"], best, counts, step["slots"], length,
                    (history, used, context, landing) if paired else None)
                if paired:
                    return
            else:
                accepted = greedy_counts(step["drafts"], best.view(bucket, length))
            if drafter is not None:   # the committed rows: pending token, accepted drafts
                drafter.round_commit(best, context, accepted + 1, seen, step["slots"], tables,
                                     hidden, captured, length)
            land(history, used, context, best.view(bucket, length), accepted, landing)
        return before, after
