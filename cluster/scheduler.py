"""The scheduler: every request's lifecycle, admission against KV blocks and SSM slots, step plans."""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass

from tokenizers import Tokenizer

from metrale.cluster.block_manager import BlockManager, SlotAllocator
from metrale.cluster.detokenizer import IncrementalDetokenizer
from metrale.cluster.draft_policy import DraftPolicy
from metrale.cluster.params import RequestError, SamplingParams
from metrale.cluster.plan import AHEAD, SeqWork, StepPlan, StepResult, WorkerCapacity
from metrale.cluster.sequence import Sequence, Status, TokenLogprob
from metrale.drafting.grammar import grammar_compiler
from metrale.drafting.stats import SpecStats
from metrale.workers.sampler import SamplingSpec

log = logging.getLogger(__name__)

# Sequence ids are unique in the process, so a request can move between a replica's schedulers.
_SEQ_IDS = itertools.count()
# Decode steps a plan runs in a row by default for a request read only at its end, on a CPU
# worker: its caller sees no token sooner either way, and the serving path exchanges a plan
# every 4 tokens (serving overhead at concurrency 32: 0.85 median against 0.77-0.81 with 1).
UNSTREAMED_DECODE_STEPS = 4


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512   # rows per step: decode tokens plus prefill chunks
    max_model_len: int | None = None    # defaults to the model's context (and the cache's size)
    prefix_caching: bool = True         # only used for models without linear-attention layers
    num_drafts: int = 0                 # drafts per speculative round (0: no speculation)
    adaptive_drafts: bool = True        # num_drafts is the most; each round's k is measured best
    steps_in_flight: int | None = None  # per worker; None: 2 (1 on a GPU not planning ahead)
    plan_ahead: bool = True             # plan a decode step, or a chain of greedy rounds,
                                        # before the last one's result
    decode_steps: int | None = None     # without drafts, decode steps a plan runs in a row;
                                        # None: UNSTREAMED_DECODE_STEPS for requests not
                                        # streamed on a worker without CUDA graphs, else 1
    prefill_gather: float = 1.0         # on a graph worker, the longest a prompt waits for
                                        # company, in prefill steps' times (`_prefill_due`)


class Scheduler:
    def __init__(self, config: SchedulerConfig, capacity: WorkerCapacity, tokenizer: Tokenizer):
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        self.config, self.capacity, self.tokenizer = config, capacity, tokenizer
        # An SSM state cannot be rebuilt from shared KV blocks, so hybrid models cache no prefixes;
        # nor can an MTP or DFlash drafter's state, built from every row of the target.
        self.blocks = BlockManager(capacity.num_blocks, capacity.block_size,
                                   config.prefix_caching and not capacity.hybrid
                                   and capacity.prefix_sharing)
        self.slots = SlotAllocator(capacity.num_slots)
        self.num_drafts = self._draft_limit(config.num_drafts, capacity)
        self.drafts = DraftPolicy(self.num_drafts, config.adaptive_drafts)
        limit = min(capacity.max_model_len, capacity.num_blocks * capacity.block_size)
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_request: dict[str, list[Sequence]] = {}
        # sequence id -> plans holding it whose results are pending (two: one planned ahead)
        self.in_flight: dict[int, int] = {}
        # Plain decoding needs no verdict to plan the next step: the worker fills in the token
        # it sampled the step before (AHEAD), so a worker holding two plans runs whole batches.
        # Nor does a chain of greedy rounds: the next goes on from the last on the device.
        self.plans_ahead = config.plan_ahead and (not self.num_drafts or capacity.chains_ahead)
        # sequence id -> per plan in flight: its steps or rounds, and the rows of each (1 + k)
        self.flying_steps: dict[int, list[tuple[int, int]]] = {}
        self.chained: set[int] = set()   # the sequences of the last plan, when it was a chain
        self.updated_at = 0.0            # the clock at the end of the last update
        self.num_preemptions = 0
        self._grammar_compiler = None
        self.stats = SpecStats()
        self.clock = time.perf_counter
        # On a graph worker: the worker's seconds for its recent prefill steps, and since when
        # prompts have waited for one while others decode (`_prefill_due`).
        self.prefill_times: deque[float] = deque(maxlen=16)
        self.deferred_since: float | None = None
        # Seat-seconds that free seats have stood empty while prompts waited for them, since
        # deferred_since; the seats empty at the last look, and when that was.
        self.idle_seat_s, self.idle_seats, self.idle_at = 0.0, 0, 0.0

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    streamed: bool = True) -> list[Sequence]:
        """Validates and queues a request (n sequences); raises RequestError naming the problem.
        A request not `streamed` is read only when it ends (see `decode_steps`)."""
        if request_id in self.by_request:
            raise RequestError(f"request_id {request_id!r} is already in use")
        if not prompt_ids:
            raise RequestError("prompt must contain at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(f"prompt is {len(prompt_ids)} tokens; the model's context "
                               f"(max_model_len) is {self.max_model_len}")
        bad = [t for t in prompt_ids if not 0 <= t < self.capacity.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:3]} are outside the vocabulary "
                               f"(size {self.capacity.vocab_size})")
        if params.grammar is not None:
            self._grammars().compile(params.grammar)   # an invalid schema fails here, alone
        base_seed = params.seed if params.seed is not None else random.getrandbits(62)
        seqs = [Sequence(next(_SEQ_IDS), request_id, i, list(prompt_ids), params,
                         base_seed + i, IncrementalDetokenizer(self.tokenizer), streamed=streamed)
                for i in range(params.n)]
        self.by_request[request_id] = seqs
        self.waiting.extend(seqs)
        return seqs

    def abort(self, request_id: str) -> None:
        for seq in self.by_request.pop(request_id, []):
            if not seq.finished:
                self._finish(seq, "abort")

    def evacuate(self) -> list[tuple[str, list[Sequence]]]:
        """Forgets every request (its worker died, and the caches with it), returning each with
        its sequences reset to recompute prompt + output wherever they are adopted next."""
        requests = list(self.by_request.items())
        for _, seqs in requests:
            for seq in seqs:
                if not seq.finished:
                    self._release(seq)
                    seq.status, seq.num_computed = Status.WAITING, 0
                    seq.num_preemptions += 1
        self.by_request.clear()
        self.waiting.clear()
        self.in_flight.clear()
        self.flying_steps.clear()
        self.chained = set()
        return requests

    def adopt(self, request_id: str, seqs: list[Sequence]) -> None:
        """Queues another scheduler's evacuated request, ahead of requests not yet started."""
        self.by_request[request_id] = seqs
        self.waiting.extendleft(reversed([s for s in seqs if not s.finished]))

    def pop_finished(self, request_id: str) -> list[Sequence] | None:
        """The request's sequences once all are finished (then forgotten), else None."""
        seqs = self.by_request.get(request_id)
        if seqs is None or not all(s.finished for s in seqs):
            return None
        return self.by_request.pop(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def share(self, steps_in_flight: int) -> int | None:
        """Sequences per plan when `steps_in_flight` plans alternate on the worker: an equal part
        of the sequences it runs or will; None (no limit) when the plans follow each other over
        the same sequences, planned ahead."""
        if steps_in_flight == 1 or self.plans_ahead:
            return None
        active = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-active // steps_in_flight))

    # -- one step ---------------------------------------------------------------------------

    def schedule(self, max_seqs: int | None = None) -> StepPlan:
        """The next step for sequences not in flight (at most `max_seqs` of them); they are in
        flight until `update` takes the plan's result. A worker replaying CUDA graphs runs a step
        with a prefill chunk in it eagerly, at many times a decode round's cost, so there
        prefills get steps of their own, taken first; when none can run without preempting,
        the step is planned as usual (decode rounds, and prefills that make room). While others
        decode, prompts arriving one by one are gathered into one such step (`_prefill_due`)."""
        planned_at = self.clock()
        if not self.capacity.graphs:
            return StepPlan(self._plan(max_seqs, prefill_only=False), planned_at)
        due = self._prefill_due(planned_at)
        if due and (plan := self._plan(max_seqs, prefill_only=True)):
            self.deferred_since = None
            return StepPlan(plan, planned_at, prefill=True)
        return StepPlan(self._plan(max_seqs, prefill_only=False, admit=due), planned_at)

    def _prefill_due(self, now: float) -> bool:
        """Whether a graph worker's next step should be a prefill step. A prefill step costs
        about the same for one prompt as for many (host time: eager launches), so while other
        sequences decode, waiting prompts wait on, and prompts arriving (or seats freeing)
        meanwhile join them, until one measured prefill step's time has passed since they began
        to wait (or since the last prefill step, when a queue never empties). A prompt that
        finds a free seat thus at most doubles its time to first token, and under a full queue
        prefill steps come at most once per that time, each admitting every prompt that can
        start by then. A prompt in mid-prefill, nothing to decode, or a full step's rows
        waiting make it due at once. A prefill step's cost is the least of the recent ones:
        what a step costs however few rows it has (what gathering saves), without a step that
        compiled kernels.

        With `prefill_gather` g > 1 the wait may run on to g such times, for throughput: a
        prefill step stalls every running sequence for its time, while waiting leaves only the
        free seats empty. The step is then due once the seat-seconds left empty meanwhile reach
        the running sequences times the step's time (a lone prompt beside many running waits
        the longest; seats freeing in numbers end the wait sooner)."""
        if not self.waiting:
            self.deferred_since = None
            return any(s.num_pending > 1 for s in self.running)
        if (not self.prefill_times or any(s.num_pending > 1 for s in self.running)
                or not any(s.num_pending == 1 for s in self.running) or self._a_step_waits()):
            return True
        if self.deferred_since is None:
            self.deferred_since, self.idle_seat_s, self.idle_seats = now, 0.0, 0
        self.idle_seat_s += self.idle_seats * (now - self.idle_at)
        self.idle_seats, self.idle_at = min(self._free_seats(), len(self.waiting)), now
        waited, step = now - self.deferred_since, min(self.prefill_times)
        return waited >= step and (waited >= self.config.prefill_gather * step
                                   or self.idle_seat_s >= len(self.running) * step)

    def _free_seats(self) -> int:
        return max(min(self.config.max_num_seqs - len(self.running), self.slots.num_free), 0)

    def _a_step_waits(self) -> bool:
        """Whether the prompts that could start now (one per free seat) fill a step's rows."""
        rows = 0
        for seq in itertools.islice(self.waiting, self._free_seats()):
            rows += seq.num_tokens
            if rows >= self.config.max_num_batched_tokens:
                return True
        return False

    def _plan(self, max_seqs: int | None, prefill_only: bool, admit: bool = True) -> list[SeqWork]:
        """The step's work. With `prefill_only`, only prompt chunks and admissions, none of which
        preempts: a chunk without room waits (empty work then changes nothing). Without `admit`,
        waiting requests stay waiting."""
        budget = self.config.max_num_batched_tokens
        room = max_seqs or self.config.max_num_seqs
        chosen: list[tuple[Sequence, int, int]] = []     # (sequence, rows, drafts)
        decode_steps: dict[int, int] = {}                # sequence id -> steps in a row
        idle = [s for s in self.running if s.seq_id not in self.in_flight][:room]
        if prefill_only:
            idle = [s for s in idle if s.num_pending > 1]
        elif self.num_drafts and self.plans_ahead and idle and self.in_flight:
            return []   # they join the sequences in flight in one plan once those are back
        decoding = sum(s.decoding for s in idle)
        k_round = self.drafts.choose(decoding) if decoding and self.num_drafts else 0
        for seq in idle:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:   # preempted earlier in this loop
                continue
            pending = seq.num_pending
            n = min(pending, budget)
            k = self._drafts_for(seq, k_round, budget - 1) if seq.decoding else 0
            steps = self._decode_steps(seq, 0) if pending == 1 and not k else 1
            end = seq.num_computed + n + k + steps - 1   # tokens in the caches after the plan
            fits = self.blocks.can_append(seq.block_table, end)
            while not fits and not prefill_only:
                # the latest sequence not in flight: a step may still write a flying one's blocks
                victim = next(s for s in reversed(self.running) if s.seq_id not in self.in_flight)
                self._preempt(victim)
                if victim is seq:
                    break
                fits = self.blocks.can_append(seq.block_table, end)
            if not fits:
                continue
            self.blocks.append(seq.block_table, end)
            chosen.append((seq, n, k))
            decode_steps[seq.seq_id] = steps
            budget -= n + k
        while admit and len(chosen) < room and (start := self._admissible(budget)):
            tokens, cached, n = start
            seq = self.waiting.popleft()
            seq.num_computed = self.blocks.allocate(
                seq.block_table, tokens, len(cached) * self.capacity.block_size + n, cached)
            seq.slot = self.slots.allocate()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chosen.append((seq, n, 0))
            budget -= n
        if not self.capacity.ragged_drafts:   # one k for the whole round: the smallest
            k_min = min((k for _, n, k in chosen if k), default=0)
            chosen = [(seq, n, min(k, k_min)) for seq, n, k in chosen]
        pad = self._pad_depth(chosen)
        rounds = self._chain_rounds(chosen, pad)
        work = [self._work(seq, n, k, pad.get(seq.seq_id, 0),
                           rounds or decode_steps.get(seq.seq_id, 1)) for seq, n, k in chosen]
        if self.num_drafts and work:   # a chain planned ahead goes on from a chain's sequences
            self.chained = {w.seq_id for w in work} if rounds else set()
        if self.plans_ahead and not prefill_only:
            if not self.num_drafts:
                work += self._ahead(min(room - len(work), budget), rounds)
            elif not work:
                work = self._ahead_chain(room, budget)
        for w in work[:len(chosen)]:
            self.in_flight[w.seq_id] = 1
            self.flying_steps[w.seq_id] = [(w.steps, max(w.num_drafts, w.pad_to) + 1)]
        return work

    @staticmethod
    def _read_each_token(seq: Sequence) -> bool:
        """Whether the host must see each of the sequence's tokens before the next is computed:
        a grammar or constraint masks it, and logprobs are read for it. Such a sequence runs
        one step, or one round, per plan."""
        p = seq.params
        return p.grammar is not None or p.constraint is not None or p.logprobs is not None

    def _decode_steps(self, seq: Sequence, flying: int) -> int:
        """Decode steps in a row for a plan of the sequence after `flying` tokens in flight:
        `decode_steps` where nothing needs a verdict, a mask or logprobs between them, within
        what it may still emit."""
        p = self.config.decode_steps
        if p is None:
            p = 1 if seq.streamed or self.capacity.graphs else UNSTREAMED_DECODE_STEPS
        if p == 1 or self.num_drafts or self._read_each_token(seq):
            return 1
        return max(1, min(p, self._tokens_left(seq) - flying))

    def _admissible(self, budget: int) -> tuple[list[int], list[int], int] | None:
        """When the first waiting request can start now with at most `budget` rows: its tokens,
        the blocks of them already in the prefix cache and the rows of its first chunk (the
        prefix hashed once for the test and the allocation); else None."""
        if (not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs
                or self.slots.num_free == 0):
            return None
        tokens = self.waiting[0].tokens
        cached = self.blocks.cached_prefix(tokens)
        num_cached = len(cached) * self.capacity.block_size
        n = min(len(tokens) - num_cached, budget)
        if not self.blocks.can_allocate(tokens, num_cached + n, cached):
            return None
        return tokens, cached, n

    def _ahead(self, room: int, rounds: int = 0) -> list[SeqWork]:
        """Decode steps for sequences whose one step in flight samples their next token: the
        row is that token (AHEAD), which the worker fills in from the step before, since it runs
        plans in order. A sequence whose token in flight ends it by length is not planned; one
        that the token ends otherwise (EOS, a stop) wastes the row, whose output is dropped.
        Never preempts: a sequence without a free block for the row waits for its result. On
        a worker that chains plain decode steps, greedy ones are a chain of as many steps each
        (the plan's `rounds`, when its other sequences chain, else `_ahead_rounds`)."""
        picked = []
        for seq in self.running:
            if len(picked) == room:
                break
            if self.in_flight.get(seq.seq_id) != 1 or seq.num_pending != 1:
                continue
            flying = self.flying_steps[seq.seq_id][0][0]   # tokens its step in flight samples
            if (seq.params.grammar is None and seq.params.constraint is None
                    and self._tokens_left(seq) > flying):
                picked.append((seq, flying))
        chain = self._ahead_rounds(picked, rounds)
        work = []
        for seq, flying in picked:
            steps = chain or self._decode_steps(seq, flying)
            end = seq.num_tokens + flying - 1 + steps
            if not self.blocks.can_append(seq.block_table, end):
                continue
            self.blocks.append(seq.block_table, end)
            self.in_flight[seq.seq_id] = 2
            self.flying_steps[seq.seq_id].append((steps, 1))
            work.append(SeqWork(seq.seq_id, [AHEAD], seq.num_tokens + flying - 1,
                                list(seq.block_table), seq.slot,
                                self._sampling(seq, len(seq.output_ids) + flying),
                                prompt_len=len(seq.prompt_ids), steps=steps))
        return work

    def _ahead_rounds(self, picked: list[tuple[Sequence, int]], rounds: int) -> int:
        """Steps in a row for every sequence planned ahead (`picked`: each with the tokens its
        plan in flight samples) on a worker that chains plain decoding, or 0: all greedy and
        read at their end of a chain, `rounds` steps when the plan chains its others (else
        up to what the sequences may still emit), within the context of each."""
        most = self.capacity.chain_rounds
        if (self.num_drafts or most < 2 or not picked or any(
                not self._sampling(seq, 0).greedy or self._read_each_token(seq)
                for seq, _ in picked)):
            return 0
        rounds = rounds or min(most, max(self._tokens_left(seq) - flying for seq, flying in picked))
        rounds = min([rounds] + [self.max_model_len - seq.num_tokens - flying + 1
                                 for seq, flying in picked])
        return rounds if rounds >= 2 else 0

    def _ahead_chain(self, room: int, budget: int) -> list[SeqWork]:
        """With drafts, on a worker that runs chains ahead (`WorkerCapacity.chains_ahead`): the
        next chain of greedy rounds for the sequences of the chain in flight, planned before its
        result when every running sequence is in it (none waits to join a plan). The worker
        runs it on from where that chain leaves them on the device (`Worker._launch_chain`), so
        their pending tokens and cached lengths (AHEAD; `context_len` is where they stood
        before that chain) are its. Each sequence's blocks are taken for the most both chains
        may write (every draft accepted); never preempts. A sequence that the chain in flight
        ends for certain by its length (a round emits one token at least) is left out; one it
        ends otherwise wastes its rounds, whose output `update` drops. The rounds are those
        the sequence furthest from its end is expected to need after the chain in flight
        (`_expected_tokens`; 2 at least, up to `chain_rounds`); where every one is expected to
        end in it, none is planned (one that does not is planned after its result)."""
        running = self.running
        if (not running or len(running) > room or any(
                self.in_flight.get(s.seq_id) != 1 or s.seq_id not in self.chained
                for s in running)):
            return []
        k = min([self.drafts.choose(len(running))]
                + [self.capacity.slot_capacity[s.slot] for s in running])
        picked = []   # (sequence, its cached length at the most after the chain in flight)
        need = 0      # rounds the sequence furthest from its end is expected to need then
        for seq in running:
            rounds, rows = self.flying_steps[seq.seq_id][0]
            left = self._tokens_left(seq)
            if left > rounds:
                picked.append((seq, seq.num_computed + rounds * rows))
                left -= rounds * self._expected_tokens(seq, rows - 1)
                need = max(need, math.ceil(left / self._expected_tokens(seq, k)))
        if not picked or need < 1 or len(picked) * (k + 1) > budget:
            return []
        rounds = min(self.capacity.chain_rounds, max(2, need),
                     min((self.max_model_len - most) // (k + 1) for _, most in picked))
        if rounds < 2:
            return []
        work = []
        for seq, most in picked:
            if not self.blocks.can_append(seq.block_table, most + rounds * (k + 1)):
                continue
            self.blocks.append(seq.block_table, most + rounds * (k + 1))
            self.in_flight[seq.seq_id] = 2
            self.flying_steps[seq.seq_id].append((rounds, k + 1))
            work.append(SeqWork(seq.seq_id, [AHEAD], seq.num_computed, list(seq.block_table),
                                seq.slot, self._sampling(seq, len(seq.output_ids)),
                                prompt_len=len(seq.prompt_ids), num_drafts=k, steps=rounds))
        self.chained = {w.seq_id for w in work}
        return work

    def _expected_tokens(self, seq: Sequence, k: int) -> float:
        """Tokens a round of k drafts is expected to emit for the sequence: its own mean
        acceptance length so far (at most k + 1), else the draft policy's (all sequences')."""
        own = seq.spec.mean_acceptance_length
        return min(own, k + 1) if own else self.drafts.expected_tokens(k)

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Commits a step's outcome; returns the sequences that produced tokens."""
        self.forget(plan)
        by_id = {s.seq_id: s for s in self.running}
        outcomes = {o.seq_id: o for o in result.outcomes}
        touched, kept = [], {}   # drafts a verify carried -> what each kept verify accepted
        for w in plan.work:
            seq = by_id.get(w.seq_id)
            if seq is None:                    # aborted while the step ran
                continue
            outcome = outcomes.get(w.seq_id)
            accepted = outcome.accepted if outcome else 0
            # planned ahead, it began where the plan before (updated already) left it
            start = seq.num_computed if w.tokens[0] == AHEAD else w.context_len
            seq.num_computed = start + max(len(w.tokens), w.steps) + accepted
            if outcome is None:
                self._publish(seq)
                continue
            taken = self._append_tokens(seq, outcome.tokens)
            drafts, accepted = outcome.verifies(taken)   # what the sequence kept
            seq.spec.record(drafts, *accepted)
            kept.setdefault(drafts, []).extend(accepted)
            if seq.params.logprobs is not None and outcome.logprobs:
                seq.logprobs.extend(TokenLogprob(token, lp.logprob, list(lp.top)) for token, lp
                                    in zip(outcome.tokens[:taken], outcome.logprobs))
            if not seq.finished:   # (one that ended published in _finish)
                self._publish(seq)
            touched.append(seq)
        for drafts, accepted in kept.items():
            self.stats.record(drafts, *accepted)
        self._measure(plan, result, outcomes)
        self.updated_at = self.clock()
        return touched

    def forget(self, plan: StepPlan) -> None:
        """The plan's sequences are no longer in flight (its result is in, or will never come)."""
        for w in plan.work:
            left = self.in_flight.pop(w.seq_id, 0) - 1
            if left > 0:
                self.in_flight[w.seq_id] = left
            steps = self.flying_steps.get(w.seq_id)
            if steps:
                steps.pop(0)
                if not steps:
                    del self.flying_steps[w.seq_id]

    # -- internals --------------------------------------------------------------------------

    def _grammars(self):
        if self._grammar_compiler is None:
            self._grammar_compiler = grammar_compiler(self.tokenizer, self.capacity.vocab_size,
                                                      self.capacity.eos_token_ids)
        return self._grammar_compiler

    def _publish(self, seq: Sequence) -> None:
        """Offers the sequence's newly full, computed blocks to the prefix cache, once the
        update has appended the step's tokens: a step's accepted drafts (and a plan's steps or
        rounds in a row) are computed before they are appended, and a block offered short
        would break the hash chain of the blocks after it. Tokens cut by a stop were computed
        but are not the sequence's, so only blocks of tokens it holds are offered."""
        bs = self.capacity.block_size
        full = min(seq.num_computed, seq.num_tokens) // bs
        if full > seq.published:
            seq.published_hash = self.blocks.register(
                seq.block_table, seq.published, seq.tokens_between(seq.published * bs, full * bs),
                seq.published_hash)
            seq.published = full

    def _pad_depth(self, chosen: list[tuple[Sequence, int, int]]) -> dict[int, int]:
        """With a padding worker, a round of decoding sequences only: each sequence given fewer
        drafts than the round's deepest (tokens left, or none) verifies filler up to that depth
        where its slot, its context and free blocks allow it, so every chunk has one length and
        the round replays a CUDA graph. Never preempts for it."""
        depth = max((k for _, _, k in chosen), default=0)
        if (not self.capacity.pad_drafts or not depth
                or any(n != 1 or not seq.decoding for seq, n, _ in chosen)):
            return {}
        pad = {}
        for seq, _, k in chosen:
            if k < depth and (self.capacity.slot_capacity[seq.slot] >= depth
                              and seq.num_tokens + depth <= self.max_model_len
                              and self.blocks.can_append(seq.block_table,
                                                         seq.num_computed + 1 + depth)):
                self.blocks.append(seq.block_table, seq.num_computed + 1 + depth)
                pad[seq.seq_id] = depth
        return pad

    def _chain_rounds(self, chosen: list[tuple[Sequence, int, int]], pad: dict[int, int]) -> int:
        """Rounds the plan chains on the device (0: one round, as usual), on a worker that
        chains (`WorkerCapacity.chain_rounds`): a round of greedy decoding sequences only, every
        one verifying the same depth k, proposes, verifies and accepts again on the device
        without the host reading its verdicts, so its next round's host work (planning,
        proposing, layout, verdicts, update) is not paid. Depth 0 (the draft policy chose no
        drafts) chains too: plain decode steps that feed the drafter as verifies do, so k = 0
        costs what plain decoding does, where one step a plan would pay the host each token
        (a speculative engine plans no step ahead). The rounds stop at the context and at what
        the sequences may still emit, counted in rounds at the draft policy's expected tokens a
        round, rounded up: a round run after every sequence has ended costs a whole round for
        nothing, while a chain cut short costs one more plan, whose rounds are counted again.
        Each sequence's blocks are taken for every row the rounds may write, or none are."""
        most, depth = self.capacity.chain_rounds, max((k for _, _, k in chosen), default=0)
        if most < 2 or not chosen:
            return 0
        for seq, n, k in chosen:
            if (n != 1 or not seq.decoding or max(k, pad.get(seq.seq_id, 0)) != depth
                    or not self._sampling(seq, 0).greedy or self._read_each_token(seq)):
                return 0
        left = max(self._tokens_left(seq) for seq, _, _ in chosen)   # expected_tokens(0) = 1
        rounds = min(most, math.ceil(left / self.drafts.expected_tokens(depth)),
                     min((self.max_model_len - seq.num_computed) // (depth + 1)
                         for seq, _, _ in chosen))
        if rounds < 2:
            return 0
        ends = [(seq, seq.num_computed + rounds * (depth + 1)) for seq, _, _ in chosen]
        more = sum(max(0, self.blocks.blocks_for(end) - len(seq.block_table)) for seq, end in ends)
        if more > self.blocks.num_free:
            return 0
        for seq, end in ends:
            self.blocks.append(seq.block_table, end)
        return rounds

    def _work(self, seq: Sequence, n: int, k: int, pad_to: int = 0, steps: int = 1) -> SeqWork:
        start = seq.num_computed
        samples = start + n == seq.num_tokens
        p = seq.params
        spec = self._sampling(seq, len(seq.output_ids)) if samples else None
        return SeqWork(seq.seq_id, seq.tokens_between(start, start + n), start,
                       list(seq.block_table), seq.slot, spec, prompt_len=len(seq.prompt_ids),
                       num_drafts=k, pad_to=pad_to,
                       next_token=None if samples else seq.tokens_between(start + n, start + n + 1)[0],
                       grammar=p.grammar, constraint=p.constraint, steps=steps)

    @staticmethod
    def _sampling(seq: Sequence, draw: int) -> SamplingSpec:
        """How the worker samples the sequence's output token number `draw`."""
        p = seq.params
        return SamplingSpec(p.temperature, p.top_p, p.top_k, p.min_p, seq.seed, draw, p.logprobs)

    def _drafts_for(self, seq: Sequence, k: int, room: int) -> int:
        """The round's k for one sequence: never more than its slot's verify capacity, the
        step's remaining token budget, or what max_tokens and the context can still take."""
        if not k:
            return 0
        return max(0, min(k, self.capacity.slot_capacity[seq.slot], room,
                          self._tokens_left(seq) - 1))

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens the sequence may still emit, by max_tokens and by the context length."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens)

    def _measure(self, plan: StepPlan, result: StepResult, outcomes: dict) -> None:
        """Keeps the cost of a graph worker's prefill steps (see `_prefill_due`). Feeds the
        draft policy a step's acceptance, and its time when every sequence of it
        decoded (a prefill chunk's rows would be charged to the drafts). Both count the drafts
        asked for: one the proposer did not make gains no token, like a rejected one. The time
        runs from planning to the end of this update, so it holds the host's work per step and
        per token (planning, transport, detokenising, stop checks) beside the worker's. A plan
        made ahead was planned while the one before ran: its time runs from that one's
        update. A chain not planned ahead that has one planned ahead of it (the first after a
        prefill on a graph worker: the device waited while the host laid it out and uploaded
        its sequences) is not timed: that wait is paid once for its sequences whatever their
        k, and counted per round it makes that k look far dearer than chains planned ahead
        measure it (deploy/results/HISTORY.md, "The first chain is no longer timed")."""
        if plan.prefill:   # the worker's time: a plan may have waited behind another there
            self.prefill_times.append(result.propose_s + result.forward_s)
        if not self.num_drafts:
            return
        done = [(w, outcomes[w.seq_id]) for w in plan.work if w.seq_id in outcomes]
        verifies = []
        for w, o in done:
            drafts, accepted = o.verifies() if o.rounds else (w.num_drafts, [o.accepted])
            verifies += [(drafts, a) for a in accepted]
        self.drafts.record_acceptance(verifies)
        # (update forgot this plan: a sequence still in flight is in the chain planned ahead)
        refill = (all(w.steps > 1 and w.tokens[0] != AHEAD for w in plan.work)
                  and any(w.seq_id in self.in_flight for w in plan.work))
        if plan.work and not refill and all(w.decodes and w.sample for w in plan.work):
            span = self.clock() - max(plan.planned_at, self.updated_at) if plan.planned_at else 0.0
            rounds = max((len(o.rounds) for _, o in done if o.rounds), default=1)   # a chain's
            self.drafts.record_cost(len(plan.work), sum(w.num_drafts for w in plan.work),
                                    result.propose_s / rounds,
                                    max(result.forward_s, span - result.propose_s) / rounds)

    @staticmethod
    def _draft_limit(requested: int, capacity: WorkerCapacity) -> int:
        if requested and not capacity.has_proposer:
            raise ValueError(f"num_drafts={requested} needs a speculative method; the worker has none")
        deepest = max(capacity.slot_capacity, default=0)
        if requested > deepest:
            log.warning("num_drafts=%d exceeds every slot's verify capacity; using %d",
                        requested, deepest)
            return deepest
        return requested

    def _append_tokens(self, seq: Sequence, tokens: list[int]) -> int:
        """A step's tokens for the sequence, up to the first that ends it (a stop token, a stop
        string, the length); returns how many it took. Their text is decoded once for all of
        them, unless stop strings must be looked for after each token. A sequence that is not
        streamed and has no stop strings is decoded once, when it ends (the detokenizer then
        takes all its tokens in one step)."""
        if seq.finished:
            return 0
        p = seq.params
        if p.stop and len(tokens) > 1:
            taken = 0
            for token in tokens:
                if seq.finished:
                    break
                taken += self._append_tokens(seq, [token])
            return taken
        left = self._tokens_left(seq)
        tokens = tokens[:max(left, 1)]
        stops = p.stop_token_ids if p.ignore_eos else p.stop_token_ids + self.capacity.eos_token_ids
        end = min((tokens.index(t) for t in stops if t in tokens), default=None)
        if end is not None:   # the stop token's text is not part of the completion
            seq.output_ids.extend(tokens[:end + 1])
            seq.text += seq.detokenizer.step(seq.output_ids[:-1], final=True)
            self._finish(seq, "stop")
            return end + 1
        seq.output_ids.extend(tokens)
        at_length = left - len(tokens) <= 0
        if seq.streamed or p.stop or at_length:   # else no one reads the text before the end
            seq.text += seq.detokenizer.step(seq.output_ids, final=at_length)
        if p.stop and self._cut_at_stop_string(seq):
            self._finish(seq, "stop")
        elif at_length:
            self._finish(seq, "length")
        return len(tokens)

    def _cut_at_stop_string(self, seq: Sequence) -> bool:
        hits = [i for i in (seq.text.find(s) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.text = seq.text[:min(hits)]
        return bool(hits)

    def _preempt(self, seq: Sequence) -> None:
        """Frees the sequence's blocks and slot; it recomputes prompt + output when readmitted."""
        log.info("preempting sequence %d (%d tokens)", seq.seq_id, seq.num_tokens)
        self._release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self._publish(seq)   # its last step's full blocks, before they are freed
        self._release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free_table(seq.block_table)
        seq.published, seq.published_hash = 0, b""
        if seq.slot >= 0:
            self.slots.release(seq.slot)
        seq.slot = -1
