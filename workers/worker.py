"""A worker: owns the device, the target model, its caches and the drafter, and runs step plans."""

from __future__ import annotations

import itertools
import logging
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from metrale.cluster.plan import (AHEAD, SeqOutcome, SeqWork, StepPlan, StepResult, TokenLogprobs,
                                  WorkerCapacity)
from metrale.drafting.grammar import grammar_compiler
from metrale.drafting.proposer import CommittedRows, ProposeRequest, build_proposer
from metrale.drafting.rejection import greedy_verdict, verify_drafts
from metrale.drafting.stats import SpecStats
from metrale.workers.batch import RowsLayout, SeqRows, to_device
from metrale.workers.chain import (ChainRunner, SlotHistories, advance, draft_round,
                                   greedy_counts, padded_histories, padded_rows)
from metrale.workers.cuda_graphs import GraphRunner
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models import kernels, load_model
from metrale.workers.models.decoder import fuse_projections
from metrale.workers.models.loader import load_tokenizer
from metrale.workers.models.parallel import SINGLE
from metrale.workers.parallel import TensorParallel
from metrale.workers.sampler import generator_for, logprobs_of, target_probs
from metrale.workers.ssm_pool import SSMSlotPool, verify_capacities

log = logging.getLogger(__name__)


@dataclass
class DeviceDrafts:
    """A proposer's greedy drafts left on the device: row i of `tokens` [n, >= k] holds the
    drafts of works[i], which takes its first num_drafts. One copy writes them into the step's
    input ids on the device, and the host reads them with the round's argmaxes, so proposing
    costs the host no wait for the drafter."""
    tokens: torch.Tensor
    works: list[SeqWork]

    def patch(self, work: list[SeqWork], layout: RowsLayout):
        """A function that writes the drafts into a step's input ids once they are on the
        device: each sequence's rows after its pending token."""
        k = self.works[0].num_drafts
        if (len(self.works) == len(work) and layout.uniform_length == k + 1
                and all(w.num_drafts == k and len(w.tokens) == 1 for w in self.works)):
            # each sequence's rows are its pending token and its k drafts: one strided copy
            n = len(work)
            return lambda ids: ids.view(n, k + 1)[:, 1:].copy_(self.tokens[:, :k])
        start = {w.seq_id: s.start + len(w.tokens) for w, s in zip(work, layout.seqs)}
        width = self.tokens.shape[1]
        index = to_device([[start[w.seq_id] + j for w in self.works for j in range(w.num_drafts)],
                           [i * width + j for i, w in enumerate(self.works)
                            for j in range(w.num_drafts)]], self.tokens.device)
        flat = self.tokens.reshape(-1)
        return lambda ids: ids.index_copy_(0, index[0], flat.index_select(0, index[1]))

    def read_into(self, drafts: dict[int, list[int]], best: torch.Tensor | None) -> list | None:
        """Reads `best` and the drafts with one host sync; the drafts replace their placeholders
        in `drafts`, `best` comes back as a list."""
        n = 0 if best is None else best.numel()
        flat = self.tokens.reshape(-1)
        values = (flat if best is None else torch.cat([best.reshape(-1), flat])).tolist()
        width = self.tokens.shape[1]
        for i, w in enumerate(self.works):
            drafts[w.seq_id] = values[n + i * width:n + i * width + w.num_drafts]
        return None if best is None else values[:n]


FLIGHTS = 4   # decode steps a worker keeps launched before it reads the oldest one's tokens
CHAIN_ROUNDS = 8   # greedy rounds a plan chains on a graph worker (Worker._execute_chain)
MAX_CHAIN_ROUNDS = 64   # the most a worker takes: a new request's prefill waits for the chain in
                        # flight (about 5 ms at B = 32 with 8), and pinned landing grows with it
LAYER_DRAFTERS = ("mtp", "dflash")   # proposers whose chained rounds draft with a captured layer


def _check_ahead(work: list[SeqWork], sampling) -> None:
    """Every row planned ahead (AHEAD) must be of a sequence in `sampling`, those the step
    before samples a token for."""
    missing = [w.seq_id for w in work if w.tokens[0] == AHEAD and w.seq_id not in sampling]
    if missing:
        raise RuntimeError(f"sequences {missing} were planned ahead, but the step before "
                           f"sampled no token for them")


class InFlight:
    """A step launched on the device whose tokens the host has not read yet (`Worker.launch`).
    `result()` reads them, and every step launched before, in the order launched; a step that
    ran to its end at launch holds its result already."""

    def __init__(self, worker: "Worker | None", work: list[SeqWork] = (), best=None, host=None,
                 done=None, start: float = 0.0, result: StepResult | None = None,
                 chain: tuple[int, int, bool] | None = None):
        # best: the argmaxes on the device; host: their pinned copy, valid once `done` has passed
        # (a chain's: ChainRunner.launch's rounds, and `chain` its rounds, length, and whether
        # it went on from the chain before on the device)
        self.worker, self.work, self.best, self.host = worker, work, best, host
        self.done, self.start, self.chain = done, start, chain
        self.rows = {w.seq_id: i for i, w in enumerate(work)}   # one row a sequence
        self._result = result

    @classmethod
    def finished(cls, result: StepResult) -> "InFlight":
        return cls(None, result=result)

    @property
    def read(self) -> bool:
        """Whether its result is on the host (result() returns without waiting)."""
        return self._result is not None

    def result(self) -> StepResult:
        if self._result is None:
            self.worker._read_flights(self)
        return self._result


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    device: str = "auto"                 # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                  # auto (from config.json) | float32 | bfloat16 | float16
    block_size: int = 16
    kv_cache_bytes: int = 256 << 20      # memory budget for the paged KV cache
    max_num_seqs: int = 64               # slots: one per running sequence
    speculative_method: str = "none"     # none | mtp | dflash | ngram | self
    drafter: str | None = None           # DFlash drafter directory
    max_drafts: int = 8                  # deepest verify a slot may need (pool depth - 1)
    verify_pool_bytes: int | None = None  # verify-pool budget; None: every slot gets max_drafts
    mtp_confidence_threshold: float | None = None
    self_spec_layers: int | None = None  # layers that draft for 'self' (default: half)
    dflash_window: int = 2048            # context rows a DFlash drafter keeps per sequence
    ngram_min: int = 1
    ngram_max: int = 4
    propose_batch_max: int = 64
    tensor_parallel_size: int = 1        # ranks (worker processes) one worker's model spans
    attention_backend: str = "auto"      # auto | torch | triton (auto: triton on CUDA)
    cuda_graphs: bool = True             # replay captured decode/verify steps on CUDA
    pad_drafts: bool | None = None       # verify every planned draft slot (None: with CUDA graphs)
    capture_at_start: bool = True        # capture every decode/verify graph when starting
    warmup_prefill_rows: int = 0         # on CUDA: one dummy prefill of this many rows at start
                                         # (the step budget), compiling its kernels before serving
    chain_rounds: int | None = None      # greedy n-gram, MTP or DFlash rounds (or, without a
                                         # proposer, plain decode steps) a plan may chain (None:
                                         # CHAIN_ROUNDS with CUDA graphs, else 0)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return torch.device(self.device)


def graphs_replay_on(device: torch.device) -> bool:
    """Whether captured graphs replay on the device: on CUDA only (tests stand a rerun of the
    step in for a replay on the CPU, under Triton's interpreter)."""
    return device.type == "cuda"


def attention_backend(requested: str, device: torch.device) -> str:
    """The kernels a worker runs: Triton on CUDA when it imports (or under Triton's CPU
    interpreter, for tests), else plain torch."""
    triton_runs = kernels.runs_on(device)
    if requested == "auto":
        return "triton" if triton_runs and device.type == "cuda" else "torch"
    if requested == "triton" and not triton_runs:
        raise ValueError("attention_backend='triton' needs Triton and a CUDA device")
    if requested not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, not {requested!r}")
    return requested


class Worker:
    """One rank of a worker: with `tp` of several ranks, each holds its share of the model's heads
    (and of their KV pages and SSM slots) and runs the same plans; drafters are whole on each."""

    def __init__(self, config: WorkerConfig, tp: TensorParallel = SINGLE):
        if tp.size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs a group of "
                             f"that many ranks (workers.group.WorkerGroup starts one)")
        self.config, self.tp = config, tp
        self.device = config.torch_device
        self.backend = attention_backend(config.attention_backend, self.device)
        self.model, mtp_tensors = load_model(Path(config.model), self.device, config.dtype, tp)
        cfg = self.model.config
        if self.backend == "triton" and tp.size == 1:
            fuse_projections(self.model.model.layers)
        # CUDA graphs pad batches with sequences that own one spare KV block and SSM slot
        self.use_graphs = (config.cuda_graphs and graphs_replay_on(self.device)
                           and self.backend == "triton" and tp.size == 1)
        spare = int(self.use_graphs)
        # A sequence given fewer drafts than planned verifies filler rows in their place, so the
        # round's chunks stay equal in length and its graph replays; verdicts read the real rows.
        self.pad_drafts = self.use_graphs if config.pad_drafts is None else config.pad_drafts
        self.kv = self._make_kv_cache()
        slots = config.max_num_seqs
        self.ssm = self._make_ssm_pool() if cfg.is_hybrid else None
        self.proposer = build_proposer(
            config.speculative_method, target=self.model, mtp_tensors=mtp_tensors, kv=self.kv,
            ssm=self.ssm, num_blocks=self.kv.num_blocks, block_size=config.block_size,
            num_slots=slots, drafter=config.drafter,
            mtp_confidence_threshold=config.mtp_confidence_threshold,
            self_spec_layers=config.self_spec_layers, dflash_window=config.dflash_window,
            ngram_min=config.ngram_min, ngram_max=config.ngram_max,
            propose_batch_max=config.propose_batch_max, cuda_graphs=self.use_graphs,
            backend=self.backend)
        capacity = tuple(self.ssm.capacity[:slots] if self.ssm else [config.max_drafts] * slots)
        p = self.proposer
        self.capacity = WorkerCapacity(
            num_blocks=self.kv.num_blocks - spare, block_size=config.block_size, num_slots=slots,
            max_model_len=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
            eos_token_ids=cfg.eos_token_ids, hybrid=cfg.is_hybrid,
            proposer=p.method if p else "none", slot_capacity=capacity if p else (0,) * slots,
            fixed_drafts=p.fixed_drafts if p else None,
            propose_batch_max=p.max_batch if p else 0, self_speculative=config.speculative_method == "self",
            prefix_sharing=not (p and p.keeps_row_state), on_gpu=self.device.type == "cuda",
            pad_drafts=bool(p) and self.pad_drafts, graphs=self.use_graphs,
            chain_rounds=self._chain_rounds())
        self.history = SlotHistories(slots, mirrored=bool(p) and p.method == "ngram")
        self.grammars: list[tuple | None] = [None] * slots          # (spec, constraint) per slot
        self._grammar_compiler = None
        self.prompt_len = [0] * slots
        self.stats = SpecStats()
        self._sampled: dict[int, int] = {}   # seq id -> the token its latest step sampled
        self._sampled_at: dict[int, int] = {}   # after a chain: seq id -> its cached length
        # seq id -> its row in the chain launched last, whose state the chain runner holds
        self._chain_rows: dict[int, int] = {}
        # seq id -> (cached length, last token) after the chain read last
        self._chain_end: dict[int, tuple[int, int]] = {}
        self._flying: deque[InFlight] = deque()   # launched, tokens not read yet, oldest first
        self._flights = threading.RLock()   # launches and reads may come from two threads
        # pinned landing rows for the argmaxes of steps in flight, used in turn
        self._landing = ([torch.empty(slots, dtype=torch.long,
                                      pin_memory=self.device.type == "cuda")
                          for _ in range(FLIGHTS)] if self.use_graphs else [])
        self._launches = 0
        self._chains_launched = 0
        self._read_at = 0.0   # when the host last read a flight's tokens
        self.graphs = GraphRunner(
            self.model, self.kv, self.ssm, slots, config.max_drafts + 1 if p else 1,
            -(-cfg.max_position_embeddings // config.block_size),
            p.capture_layers if p else (), pad_block=self.kv.num_blocks - 1,
            pad_slot=slots) if self.use_graphs else None
        if self.graphs is not None and config.capture_at_start:
            start = time.perf_counter()
            lengths = [1] + ([k + 1 for k in range(1, config.max_drafts + 1)] if p else [])
            self.graphs.capture_all(lengths, verify=cfg.is_hybrid)
            if p is not None and getattr(p, "graphs", None) is not None:   # MTP, DFlash
                p.graphs.capture_all(config.max_drafts)
            log.info("captured %d CUDA graphs in %.1fs", len(self.graphs.graphs),
                     time.perf_counter() - start)
        if self.graphs is not None and p is not None and self.ssm is not None:
            self.ssm.capture_commits(self.graphs.buckets, spare_slot=slots,    # tiny: always now
                                     max_length=config.max_drafts + 1)
        # after the commits: a chained round commits with their index
        # (a sequence holds at most what the context and the KV cache hold; a round's lookup
        # costs the history buffer's width, whatever the sequences' lengths)
        drafter = getattr(p, "graphs", None) if p is not None and p.method in LAYER_DRAFTERS \
            else None
        self.chain = ChainRunner(self.graphs, getattr(p, "min_n", 0), getattr(p, "max_n", 0),
                                 min(cfg.max_position_embeddings,
                                     self.kv.num_blocks * config.block_size),
                                 self.capacity.chain_rounds, drafter) \
            if self.graphs is not None and self.capacity.chain_rounds and (
                p is None or p.method == "ngram" or drafter is not None) else None
        # pinned landing for the rounds of the two chains launched last, used in turn
        self._chain_landing = [torch.empty(
            self.capacity.chain_rounds * (slots + 1) * (self.graphs.max_rows + 1),
            dtype=torch.long, pin_memory=self.device.type == "cuda") for _ in range(2)] \
            if self.chain is not None else []
        if self.chain is not None and config.capture_at_start:
            start = time.perf_counter()
            self.chain.capture_all([1], verify=False)   # the draft policy's k = 0, plain steps
            if p is not None:
                self.chain.capture_all([k + 1 for k in range(1, config.max_drafts + 1)],
                                       verify=cfg.is_hybrid)
            log.info("captured %d chained-round graphs in %.1fs",
                     len(self.chain.graphs_by_shape), time.perf_counter() - start)
        if config.warmup_prefill_rows and self.device.type == "cuda":
            start = time.perf_counter()
            rows = self.warm_up(config.warmup_prefill_rows)
            log.info("warmed up a prefill of %d rows in %.1fs", rows, time.perf_counter() - start)
        log.info("worker on %s: %s", self.device, self.memory_report())

    def _chain_rounds(self) -> int:
        """Rounds a plan may chain (`_execute_chain`): with an n-gram, MTP or DFlash proposer or
        none (plain greedy decode steps) on one rank only, by default CHAIN_ROUNDS where CUDA
        graphs replay (elsewhere every round waits for the host anyway; deploy/results/HISTORY.md,
        "Rounds chained on the device, measured" and "Plain decode steps chained"). Off the
        graph path a plan's rounds run one by one unless `chain_rounds` asks for chains."""
        rounds = self.config.chain_rounds
        method = self.proposer.method if self.proposer is not None else "none"
        if rounds is None:
            rounds = CHAIN_ROUNDS if self.use_graphs else 0
        if not 0 <= rounds <= MAX_CHAIN_ROUNDS:
            raise ValueError(f"chain_rounds must be 0 to {MAX_CHAIN_ROUNDS}, not {rounds}")
        return rounds if method in ("none", "ngram", *LAYER_DRAFTERS) and self.tp.size == 1 else 0

    def _make_kv_cache(self) -> PagedKVCache:
        cfg, c = self.model.config, self.config
        layers, kv_heads = len(cfg.full_attention_layers), self.tp.split(cfg.num_key_value_heads)
        per_block = PagedKVCache.bytes_per_block(layers, c.block_size, kv_heads, cfg.head_dim,
                                                 cfg.dtype)
        if layers:
            num_blocks = c.kv_cache_bytes // per_block
        else:   # no attention layers: blocks only count positions
            num_blocks = cfg.max_position_embeddings * c.max_num_seqs // c.block_size
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes={c.kv_cache_bytes} holds fewer than two KV blocks "
                             f"of {per_block} bytes")
        return PagedKVCache(layers, num_blocks, c.block_size, kv_heads, cfg.head_dim, cfg.dtype,
                            self.device)

    def _make_ssm_pool(self) -> SSMSlotPool:
        cfg, c = self.model.config, self.config
        split = self.tp.split   # this rank's heads and their conv channels
        dims = (len(cfg.linear_attention_layers), split(cfg.linear_conv_dim),
                cfg.linear_conv_kernel_dim, split(cfg.linear_num_value_heads),
                cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        capacities = None
        if c.speculative_method != "none":
            per_entry = SSMSlotPool.bytes_per_entry(*dims, cfg.dtype)
            budget = (c.max_num_seqs * (c.max_drafts + 1) if c.verify_pool_bytes is None
                      else c.verify_pool_bytes // per_entry)
            capacities = verify_capacities(c.max_num_seqs, c.max_drafts, budget)
        slots = c.max_num_seqs
        if self.use_graphs:   # the padding sequences' slot, as deep as any verify
            capacities, slots = (capacities or [0] * slots) + [c.max_drafts], slots + 1
        return SSMSlotPool(dims[0], slots, *dims[1:], cfg.dtype, self.device, capacities,
                           use_kernels=self.backend == "triton")

    def memory_report(self) -> dict:
        report = {"kv_cache_bytes": self.kv.k.nbytes * 2, "kv_blocks": self.kv.num_blocks,
                  "block_size": self.config.block_size, "slots": self.config.max_num_seqs}
        if self.ssm is not None:
            per_entry = self.ssm.slot_bytes   # one verify entry holds one slot's state
            report |= {"ssm_bytes_per_slot": per_entry,
                       "verify_pool_bytes": self.ssm.verify_bytes,
                       "verify_pool_bytes_per_slot": [(c + 1 if c else 0) * per_entry
                                                      for c in self.ssm.capacity],
                       "slot_capacity": list(self.ssm.capacity)}
        return report

    # -- one step: propose, verify, accept, commit ----------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Runs the plan to its end: its result (after those of steps still in flight)."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> InFlight:
        """Starts the plan's step. A decode step of greedy sequences that replays a CUDA graph
        returns without waiting for the device: its argmaxes stay there, and a step planned
        ahead of it takes its rows' tokens from them on the device, so the host plans, lays out
        and launches the next step while this one runs (one host sync a step, when its tokens
        are read). Any other step first reads the steps in flight, then runs to its end."""
        with self._flights:
            if not plan.prefill and self._flies(plan.work):   # (prefill steps are timed)
                self._chain_rows = {}
                return self._launch_decode(plan.work)
            if not plan.prefill and self._chain_flies(plan.work):
                return self._launch_chain(plan.work)
            self._chain_rows = {}
        self._read_flights()
        return InFlight.finished(self._execute(plan))

    def _flies(self, work: list[SeqWork]) -> bool:
        """Whether a step may run without a host sync: plain greedy decoding of every sequence
        on the graph path (no drafts, logprobs or masks, one rank, no proposer to feed)."""
        return (self.graphs is not None and self.proposer is None and self.tp.size == 1
                and bool(work) and all(
                    len(w.tokens) == 1 and w.num_drafts == 0 and w.steps == 1
                    and w.sample is not None
                    and w.sample.greedy and w.sample.logprobs is None and w.grammar is None
                    and w.constraint is None for w in work)
                and self.graphs.fits(len(work), 1, max(len(w.block_table) for w in work)))

    def _launch_decode(self, work: list[SeqWork]) -> InFlight:
        """Lays out, fills and replays a decode step; the rows planned ahead of a step still in
        flight get their tokens from its argmaxes on the device."""
        start = time.perf_counter()
        if self._flying and self._flying[-1].best is None:   # a chain's: read on the host
            self._read_flights()
        before = self._flying[-1] if self._flying else None
        patch = None
        if before is None:
            work = self._fill_ahead(work)
        else:
            _check_ahead(work, before.rows)
            ahead = [(i, w.seq_id) for i, w in enumerate(work) if w.tokens[0] == AHEAD]
            self._sampled, self._sampled_at = {}, {}
            if ahead:
                index = to_device([[i for i, _ in ahead], [before.rows[s] for _, s in ahead]],
                                  self.device)
                source = before.best

                def patch(ids):
                    ids.index_copy_(0, index[0], source.index_select(0, index[1]))
        layout = RowsLayout.of([([max(w.tokens[0], 0)], w.context_len, w.block_table, w.slot)
                                for w in work], self.config.block_size)
        fresh = [w for w in work if w.context_len == 0]   # one-token prompts
        for w in fresh:   # (no proposer: the history of a step in flight is not kept)
            self.history.reset(w.slot)
            self.prompt_len[w.slot] = w.prompt_len
        if fresh and self.ssm is not None:
            self.ssm.reset([w.slot for w in fresh])
        if len(self._flying) == FLIGHTS:   # its landing row is the oldest one's
            self._read_flights(self._flying[0])
        _, _, logits = self.graphs.run(layout, patch, keep_hidden=False)
        best = kernels.argmax_rows(logits)
        host = self._landing[self._launches % FLIGHTS][:len(work)]
        self._launches += 1
        host.copy_(best, non_blocking=True)   # a copy in stream order, read on the host later
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        flight = InFlight(self, work, best, host, done, start)
        self._flying.append(flight)
        return flight

    def _chain_flies(self, work: list[SeqWork]) -> bool:
        """Whether a plan is a chain of greedy rounds (n-gram, MTP, DFlash, or plain decode
        steps) that may run without a host sync (`_launch_chain`): on the graph path, within a
        graph's shape."""
        return (self.chain is not None and bool(work) and work[0].steps > 1 and self._chains(work)
                and self.graphs.fits(len(work), max(max(w.num_drafts, w.pad_to) for w in work) + 1,
                                     max(len(w.block_table) for w in work)))

    def _launch_chain(self, work: list[SeqWork]) -> InFlight:
        """Launches a chain's rounds (`_execute_chain`) and returns without waiting for them.
        A chain planned ahead (every row AHEAD) of sequences that the chain launched last
        holds goes on from where that one leaves them on the device: their pending tokens,
        histories and cached lengths stay there, so the host uploads none, need not read that
        chain first, and launches this one while it runs; an MTP or DFlash drafter's stash,
        K/V and window go on there too. Otherwise the rows planned ahead take their tokens and
        lengths from the steps before, read first, and a drafter catches up on the rows it
        holds (`before_chain`)."""
        start = time.perf_counter()
        rounds, depth = work[0].steps, max(max(w.num_drafts, w.pad_to) for w in work)
        length, verify = depth + 1, self.ssm is not None and depth > 0
        rows = [self._chain_rows.get(w.seq_id) for w in work]
        resumed = None not in rows and all(w.tokens[0] == AHEAD for w in work)
        if resumed:
            self._sampled, self._sampled_at = {}, {}   # taken on the device
        else:
            if any(w.tokens[0] == AHEAD for w in work):
                self._read_flights()
            work = self._fill_ahead(work)
            self._track_history(work)
        layout = RowsLayout.of([([max(w.tokens[0], 0)] * length, w.context_len, w.block_table,
                                 w.slot, verify) for w in work], self.config.block_size)
        while len(self._flying) > 1:   # the landing buffer is the oldest chain's
            self._read_flights(self._flying[0])
        if resumed:
            landed = self.chain.launch(layout, rounds, rows=rows)
        else:
            landed = self.chain.launch(layout, rounds, *self._fresh_chain_inputs(work))
        self._chain_rows = {w.seq_id: i for i, w in enumerate(work)}
        host = self._chain_landing[self._chains_launched % 2][:landed.numel()].view(landed.shape)
        self._chains_launched += 1
        host.copy_(landed, non_blocking=True)
        done = None   # (tests take the graph path on the CPU, where the copy is done now)
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        flight = InFlight(self, work, None, host, done, start, chain=(rounds, length, resumed))
        self._flying.append(flight)
        return flight

    def _read_flights(self, upto: InFlight | None = None) -> None:
        """Reads the tokens of the steps in flight, oldest first, until `upto` (all of them
        when None). The wait for the device holds no lock, so a launch may go on meanwhile."""
        while True:
            with self._flights:
                if not self._flying or (upto is not None and upto._result is not None):
                    return
                flight = self._flying[0]
            if flight.done is not None:
                flight.done.synchronize()   # other threads run while the device computes
            tokens = flight.host.tolist()   # (the device's argmaxes would wait for later steps)
            with self._flights:
                if not self._flying or self._flying[0] is not flight:
                    continue   # another thread read it meanwhile
                if flight.chain is None:
                    outcomes = [SeqOutcome(w.seq_id, [t], 0, 0)
                                for w, t in zip(flight.work, tokens)]
                else:
                    outcomes = self._chain_outcomes(flight.work, tokens, *flight.chain)
                if self._flying[-1] is flight:   # no launch took these tokens on the device
                    if flight.chain:
                        self._leave_chain_ends()
                    else:
                        self._sampled = {o.seq_id: o.tokens[-1] for o in outcomes}
                        self._sampled_at = {}
                self._flying.popleft()
                now = time.perf_counter()   # (from the flight before's end: it may have waited)
                flight._result = StepResult(outcomes, 0.0, now - max(flight.start, self._read_at))
                self._read_at = now

    def _execute(self, plan: StepPlan) -> StepResult:
        if not plan.work:
            return StepResult()
        if any(w.steps > 1 for w in plan.work):
            return self._execute_chain(plan) if self._chains(plan.work) else \
                self._execute_steps(plan)
        start = time.perf_counter()
        work = self._fill_ahead(plan.work)
        self._track_history(work)
        # Whether there are drafts or verdicts at all follows from the plan alone, so every rank
        # takes rank 0's, or none has any.
        drafts, on_device = self._propose(work)
        drafts = self.tp.agree(drafts) if drafts else drafts
        proposed = time.perf_counter()
        chunks = [self._rows(w, drafts) for w in work]
        verifying = {w.seq_id for w, c in zip(work, chunks) if len(c) > len(w.tokens)}
        layout = RowsLayout.of(
            [(c, w.context_len, w.block_table, w.slot, w.seq_id in verifying and self.ssm is not None)
             for w, c in zip(work, chunks)], self.config.block_size)
        patch = on_device.patch(work, layout) if on_device else None
        hidden, captured, logits = self._forward(layout, patch)
        early = self._commit_before_verdicts(work, layout, drafts, logits)
        self._observe_prompts(work)
        verdicts = self._verdicts(work, layout.seqs, drafts, hidden, logits, on_device, early)
        verdicts = self.tp.agree(verdicts) if verdicts else verdicts
        outcomes, committed, verified = [], [], ([], [])
        rows_state = self.proposer is not None and self.proposer.keeps_row_state
        for w, rows in zip(work, layout.seqs):
            d = drafts.get(w.seq_id, [])
            outcome = verdicts.get(w.seq_id)
            accepted = outcome.accepted if outcome else 0
            if w.seq_id in verifying:
                verified[0].append(w.slot)
                verified[1].append(accepted)
            self.history.extend(w.slot, d[:accepted])
            if outcome:
                outcomes.append(outcome)
                self.stats.record(outcome.proposed, accepted)
            if rows_state:
                committed.append(self._committed_rows(w, rows, d[:accepted], outcome, hidden,
                                                      captured))
        if self.ssm is not None and early is None:
            self.ssm.commit(*verified)
        if rows_state:
            self.proposer.commit(committed)
        self._sampled, self._sampled_at = {o.seq_id: o.tokens[-1] for o in outcomes}, {}
        return StepResult(outcomes, proposed - start, time.perf_counter() - proposed)

    def _chains(self, work: list[SeqWork]) -> bool:
        """Whether a plan of several steps is a chain of rounds (`_execute_chain`): it has
        drafts, or it is greedy decoding, every sequence as many steps, on a worker that chains
        (rounds of depth 0, which the draft policy chose, feed the drafter as verifies do;
        without a proposer they are plain decode steps); else plain decode steps
        (`_execute_steps`, each sequence its own count, each step its host work)."""
        if any(w.num_drafts or w.pad_to for w in work):
            return True
        return bool(self.capacity.chain_rounds) and len({w.steps for w in work}) == 1 and all(
            len(w.tokens) == 1 and w.sample is not None and self._plain_greedy(w) for w in work)

    def _execute_chain(self, plan: StepPlan) -> StepResult:
        """`steps` greedy n-gram, MTP or DFlash rounds of the plan's sequences in a row
        (`SeqWork.steps`), every sequence verifying the same number of drafts (0 included: plain
        decode steps, which feed an MTP or DFlash drafter as its verifies do, or of a worker
        without a proposer when `chain_rounds` asks for it), each
        round proposed, verified, judged and committed on the device: the next round drafts
        from the tokens the last one accepted there, and the host reads all the rounds' tokens
        with one sync at the end. Greedy verdicts are the target's argmaxes whatever the
        drafts, so the tokens are those of the rounds run one by one. On a graph worker a round
        is one replay (workers.chain); elsewhere (CPU, tests) n-gram rounds run the same tensor
        ops eagerly, each reading its drafts back to lay out its forward, and MTP and DFlash
        rounds run as separate rounds."""
        start = time.perf_counter()
        work = self._fill_ahead(plan.work)
        rounds, depth = work[0].steps, max(max(w.num_drafts, w.pad_to) for w in work)
        length, verify = depth + 1, self.ssm is not None and depth > 0
        layout = RowsLayout.of([(w.tokens * length, w.context_len, w.block_table, w.slot, verify)
                                for w in work], self.config.block_size)
        layered = self.proposer is not None and self.proposer.method in LAYER_DRAFTERS
        chained = self.chain is not None and self.graphs.eligible(layout)
        one_by_one = layered and not chained   # (its rounds keep the history and the stats)
        if one_by_one:
            landed = self._rounds_one_by_one(work, length, rounds)
        elif chained:
            self._track_history(work)
            histories, seen = self._fresh_chain_inputs(work)
            landed = self.chain.run(layout, histories, rounds, seen)
        else:
            self._track_history(work)
            landed = self._chain_eagerly(work, [self.history[w.slot] for w in work], depth,
                                         rounds)
        outcomes = self._chain_outcomes(work, landed, rounds, length, record=not one_by_one)
        self._leave_chain_ends()
        return StepResult(outcomes, 0.0, time.perf_counter() - start)

    def _fresh_chain_inputs(self, work: list[SeqWork]) -> tuple[tuple, list | None]:
        """What a chain that starts from the host (not resumed on the device) takes: each
        sequence's history, whole for n-gram lookups, else its pending token (the rest draft
        from it), as zero-padded rows and their lengths, and an MTP or DFlash drafter's rows
        seen once it has caught up on the rows it holds (`before_chain`)."""
        method = self.proposer.method if self.proposer is not None else "none"
        seen = self.proposer.before_chain([w.slot for w in work], [w.context_len for w in work]) \
            if method in LAYER_DRAFTERS else None
        if method == "ngram":
            return self.history.rows([w.slot for w in work]), seen
        return padded_rows([w.tokens for w in work]), seen

    def _leave_chain_ends(self) -> None:
        """After a chain is read: the plan after it (AHEAD rows, `_fill_ahead`) takes each
        sequence's last token and cached length from where the chain left it (`_chain_end`)."""
        self._sampled = {seq: token for seq, (_, token) in self._chain_end.items()}
        self._sampled_at = {seq: length for seq, (length, _) in self._chain_end.items()}

    def _chain_outcomes(self, work: list[SeqWork], landed: list, rounds: int, length: int,
                        resumed: bool = False, record: bool = True) -> list[SeqOutcome]:
        """Each sequence's outcome of a chain's rounds (`landed`: per round and sequence its
        argmaxes, then its accepted count); with `record`, its rounds go into the statistics,
        its tokens into its history, but the last, the next plan's pending token, and an MTP or
        DFlash drafter counts the rows its rounds fed it (`after_chain`). A chain `resumed` on
        the device began at the length and token the chain before ended with."""
        outcomes, ends, depth = [], {}, length - 1
        layered = self.proposer is not None and self.proposer.method in LAYER_DRAFTERS
        every_round = []
        for i, w in enumerate(work):
            tokens, per_round = [], []
            for r in range(rounds):
                accepted = landed[r][i][length]
                tokens += landed[r][i][:accepted + 1]
                per_round.append(accepted)
            context, pending = self._chain_end[w.seq_id] if resumed else (w.context_len, None)
            if record:
                every_round += per_round
                self.history.extend(w.slot, ([pending] if resumed else []) + tokens[:-1])
                if layered:
                    self.proposer.after_chain(w.slot, context, len(tokens))
            ends[w.seq_id] = (context + len(tokens), tokens[-1])
            outcomes.append(SeqOutcome(w.seq_id, tokens, depth * rounds, sum(per_round),
                                       rounds=per_round))
        self.stats.record(depth, *every_round)
        self._chain_end = ends
        return outcomes

    def _chain_eagerly(self, work: list[SeqWork], histories: list[list[int]], depth: int,
                       rounds: int) -> list:
        """A chain's rounds without its graphs: the same tensor ops, each round's drafts read
        back to lay out an eager forward. Returns what ChainRunner.run returns."""
        n, length, dev = len(work), depth + 1, self.device
        verify, bs = self.ssm is not None and depth > 0, self.config.block_size
        history = to_device(padded_histories(histories, max(map(len, histories)) + rounds * length),
                            dev)
        used = to_device([len(h) for h in histories], dev)
        context = to_device([w.context_len for w in work], dev)
        landed = []
        for _ in range(rounds):
            drafts, ids = draft_round(history, used, depth, getattr(self.proposer, "min_n", 0),
                                      getattr(self.proposer, "max_n", 0))
            step = RowsLayout.of([(i, c, w.block_table, w.slot, verify) for i, c, w in zip(
                ids.tolist(), context.tolist(), work)], bs)
            hidden, _, logits = self._forward(step)
            logits = self.model.logits(hidden) if logits is None else logits
            best = kernels.argmax_rows(logits).view(n, length)
            accepted = greedy_counts(drafts, best)
            if verify:
                self.ssm.commit([w.slot for w in work], accepted.tolist())
            advance(history, used, context, best, accepted)
            landed.append(torch.cat([best, accepted[:, None]], 1).tolist())
        return landed

    def _rounds_one_by_one(self, work: list[SeqWork], length: int, rounds: int) -> list:
        """A chain's rounds as separate rounds (`_execute`), each from the tokens the one before
        accepted. Returns what ChainRunner.run returns."""
        landed, pending, context = [], [w.tokens for w in work], [w.context_len for w in work]
        for _ in range(rounds):
            step = [replace(w, tokens=p, context_len=c, steps=1)
                    for w, p, c in zip(work, pending, context)]
            outcomes = {o.seq_id: o for o in self._execute(StepPlan(step)).outcomes}
            row = []
            for i, w in enumerate(work):
                o = outcomes[w.seq_id]
                row.append(o.tokens + [0] * (length - len(o.tokens)) + [o.accepted])
                pending[i], context[i] = o.tokens[-1:], context[i] + len(o.tokens)
            landed.append(row)
        return landed

    def _execute_steps(self, plan: StepPlan) -> StepResult:
        """A plan of decode steps in a row (`SeqWork.steps`, plain decoding): step i runs every
        sequence with more than i steps at context_len + i, on the token step i - 1 sampled
        (AHEAD), drawing its output token number draw + i. One result holds each sequence's
        tokens of all its steps."""
        tokens: dict[int, list[int]] = {w.seq_id: [] for w in plan.work}
        propose_s = forward_s = 0.0
        planned = self._fill_ahead(plan.work)   # (a chain's lengths, after one)
        for i in range(max(w.steps for w in planned)):
            work = [replace(w, steps=1) if i == 0 else
                    replace(w, tokens=[AHEAD], context_len=w.context_len + i, steps=1,
                            sample=replace(w.sample, draw=w.sample.draw + i))
                    for w in planned if w.steps > i]
            result = self._execute(StepPlan(work, plan.planned_at))
            for o in result.outcomes:
                tokens[o.seq_id] += o.tokens
            propose_s, forward_s = propose_s + result.propose_s, forward_s + result.forward_s
        # the plan after this one may be planned ahead of any of its sequences, not only of
        # those in its last step; a chain planned ahead takes the lengths these steps left
        self._sampled = {seq: t[-1] for seq, t in tokens.items() if t}
        self._sampled_at = {w.seq_id: w.context_len + w.steps for w in planned}
        return StepResult([SeqOutcome(seq, t) for seq, t in tokens.items() if t],
                          propose_s, forward_s)

    def _fill_ahead(self, work: list[SeqWork]) -> list[SeqWork]:
        """Rows planned ahead (AHEAD) take the token this worker sampled for their sequence in
        the step before, the plan the scheduler sent just before this one, and after a chain
        of rounds (whose tokens the scheduler could not count) its cached length. The tokens
        are taken once: a step that fails leaves none for the next."""
        sampled, self._sampled = self._sampled, {}
        at, self._sampled_at = self._sampled_at, {}
        if not any(w.tokens[0] == AHEAD for w in work):
            return work
        _check_ahead(work, sampled)
        return [replace(w, tokens=[sampled[w.seq_id]], context_len=at.get(w.seq_id, w.context_len))
                if w.tokens[0] == AHEAD else w for w in work]

    @torch.inference_mode()
    def warm_up(self, rows: int) -> int:
        """Runs one eager prefill of up to `rows` rows (a dummy prompt in slot 0, over blocks
        no sequence holds yet, the slot's state cleared after), so that the kernels of the
        largest prefill step compile, and flash-linear-attention's autotune runs, before the
        first request rather than inside it (56 s for the bundled model on an H200 in one run);
        then short prompts that compile the attention's other variants. Returns the rows."""
        bs = self.config.block_size
        rows = min(rows, self.model.config.max_position_embeddings - 1,
                   (self.kv.num_blocks - 1) * bs)
        if rows < 1:
            return 0
        self._forward(RowsLayout.of([([0] * rows, 0, list(range(-(-rows // bs))), 0)], bs))
        if self.backend == "triton":
            self._warm_up_attention(rows)
        if self.ssm is not None:
            self.ssm.reset([0])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return rows

    def _warm_up_attention(self, rows: int) -> None:
        """The Triton attention kernel is compiled per rows per program (from the longest
        prompt's rows) and per number of key ranges (from the grid and the tables' width), about
        0.9 s each on an H200 inside the step of the first prefill that meets them. Prompts of 1
        to 64 rows (at most `rows`) under tables of every width up to kernels.split_keys() meet
        them all."""
        bs, blocks = self.config.block_size, 1
        while blocks * bs <= kernels.split_keys() and blocks < self.kv.num_blocks:
            for short in (64, 32, 16, 8, 4, 2, 1):
                if short <= min(blocks * bs, rows):
                    self._forward(RowsLayout.of([([0] * short, 0, list(range(blocks)), 0)], bs))
            blocks *= 2

    @torch.inference_mode()
    def time_forward(self, batch_size: int, rows: int, context_len: int, iters: int = 20) -> float:
        """Median milliseconds of one target forward over `batch_size` sequences of `rows` rows
        each (1: a decode step, k+1: a verify of k drafts) after `context_len` cached tokens,
        logits of every row included; the same path `execute` takes. For benchmarks: it writes
        dummy tokens into blocks from 0 and slots from 0, so run it on a worker serving nothing."""
        bs, total = self.config.block_size, context_len + rows
        per_seq = -(-total // bs)
        if batch_size * per_seq > self.kv.num_blocks or batch_size > self.config.max_num_seqs:
            raise ValueError(f"{batch_size} sequences of {total} tokens do not fit this worker")
        verify = rows > 1 and self.ssm is not None
        if verify and any(c < rows - 1 for c in self.ssm.capacity[:batch_size]):
            raise ValueError(f"a verify of {rows} rows needs max_drafts >= {rows - 1}")
        chunks = [([1] * rows, context_len, list(range(i * per_seq, (i + 1) * per_seq)), i, verify)
                  for i in range(batch_size)]
        times = []
        for _ in range(iters + 3):
            start = time.perf_counter()
            hidden, _, logits = self._forward(RowsLayout.of(chunks, bs))
            if logits is None:
                self.model.logits(hidden)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[3:]) * 1000

    def _track_history(self, work: list[SeqWork]) -> None:
        fresh = [w.slot for w in work if w.context_len == 0]
        if fresh and self.ssm is not None:
            self.ssm.reset(fresh)
        for w in work:
            if w.context_len == 0:
                self.history.reset(w.slot)
                self.prompt_len[w.slot] = w.prompt_len
            self.history.extend(w.slot, w.tokens)

    def _commit_before_verdicts(self, work: list[SeqWork], layout: RowsLayout,
                                drafts: dict[int, list[int]], logits: torch.Tensor | None):
        """A greedy verify replayed from a graph on a hybrid target commits its SSM states
        before the host reads its verdicts: the accepted counts are found on the device, so the
        commit's launch overlaps the verify instead of following the round's host sync. Returns
        (argmaxes, accepted counts) on the device, or None where the commit waits for the
        verdicts (sampling, logprobs, a grammar, an eager step, no verify)."""
        length = layout.uniform_length
        if (self.ssm is None or self.graphs is None or logits is None or not length
                or length < 2 or not all(s.verify for s in layout.seqs)
                or not all(len(w.tokens) == 1 and w.sample is not None
                           and self._plain_greedy(w) for w in work)):
            return None
        best = kernels.argmax_rows(logits)
        accepted = self.ssm.commit_greedy(
            self.graphs.input_ids(len(work) * length), best,
            [len(drafts.get(w.seq_id, ())) for w in work], [w.slot for w in work], length)
        return None if accepted is None else (best, accepted)

    def _plain_greedy(self, w: SeqWork) -> bool:
        """Whether a sampling sequence's verdict is its argmaxes alone: greedy, without logprobs
        or a mask."""
        return w.sample.greedy and w.sample.logprobs is None and self._constraint(w) is None

    def _observe_prompts(self, work: list[SeqWork]) -> None:
        """Hands prompt chunks to a proposer that indexes its sequences' tokens (n-gram), after
        the step's launch and before its verdicts wait for the device."""
        observe = getattr(self.proposer, "observe", None)
        if observe is not None:
            for w in work:
                if len(w.tokens) > 1:
                    observe(w.slot, self.history[w.slot])

    def _constraint(self, w: SeqWork):
        """The mask source of a sequence: its in-process constraint, or its compiled grammar."""
        if w.constraint is not None or w.grammar is None:
            return w.constraint
        held = self.grammars[w.slot]
        if w.context_len == 0 or held is None or held[0] != w.grammar:
            if self._grammar_compiler is None:
                cfg = self.model.config
                self._grammar_compiler = grammar_compiler(load_tokenizer(self.config.model),
                                                          cfg.vocab_size, cfg.eos_token_ids)
            held = self.grammars[w.slot] = (w.grammar, self._grammar_compiler.constraint(w.grammar))
        return held[1]

    def _generated(self, w: SeqWork) -> list[int]:
        return self.history[w.slot][self.prompt_len[w.slot]:]

    def _propose(self, work: list[SeqWork]) -> tuple[dict[int, list[int]], "DeviceDrafts | None"]:
        """Drafts per sequence id, for the sequences the plan asks to speculate. When the
        proposer drafts greedily on the device, they stay there (DeviceDrafts) and the dict
        holds placeholders of their lengths until the round's verdicts read them."""
        spec = [w for w in work if w.num_drafts > 0 and self.proposer is not None]
        if not spec:
            return {}, None
        requests = []
        for w in spec:
            allowed, constraint = None, self._constraint(w)
            if constraint is not None:
                generated = self._generated(w)
                allowed = lambda drafts, g=generated, c=constraint: c.allowed(g + drafts)  # noqa: E731
            requests.append(ProposeRequest(w.slot, w.context_len, w.tokens[-1], w.num_drafts,
                                           w.block_table, self.history[w.slot], allowed))
        propose_on_device = getattr(self.proposer, "propose_on_device", None)   # MTP, DFlash
        if propose_on_device and self.tp.size == 1 and not any(r.allowed for r in requests):
            tokens = propose_on_device(requests)
            if tokens is not None:
                return {w.seq_id: [w.tokens[-1]] * w.num_drafts for w in spec}, \
                    DeviceDrafts(tokens, spec)
        proposals = self.proposer.propose(requests)
        return {w.seq_id: p.tokens[:w.num_drafts] for w, p in zip(spec, proposals)}, None

    def _rows(self, w: SeqWork, drafts: dict[int, list[int]]) -> list[int]:
        """The chunk's tokens, its drafts, and with padding filler up to the planned depth."""
        d = drafts.get(w.seq_id, [])
        if self.pad_drafts:
            d = d + [w.tokens[-1]] * (max(w.num_drafts, w.pad_to) - len(d))
        return w.tokens + d

    def _forward(self, layout: RowsLayout, patch=None):
        """Hidden rows, captured layers, and the logits of every row when a CUDA graph ran the
        step (None otherwise: they are computed for the rows read). `patch(ids)` writes the
        drafts still on the device into the step's input ids before it runs."""
        if self.graphs is not None and self.graphs.eligible(layout):
            return self.graphs.run(layout, patch)
        capture = self.proposer.capture_layers if self.proposer else ()
        batch = layout.to(self.device, self.backend)
        if patch is not None:
            patch(batch.input_ids)
        return *self.model(batch, self.kv, self.ssm, capture=capture), None

    def _verdicts(self, work: list[SeqWork], seqs: list[SeqRows], drafts: dict[int, list[int]],
                  hidden: torch.Tensor, logits: torch.Tensor | None,
                  on_device: "DeviceDrafts | None" = None, early=None) -> dict[int, SeqOutcome]:
        """The outcome of every sampling sequence, by id. Logits are one lm_head GEMM over the
        rows read: a CUDA graph computed every row's; otherwise those of each sampling sequence's
        pending token and drafts (filler rows after them are not read) are gathered first.
        Drafts still on the device come to the host with the argmaxes, in the round's one sync,
        and replace their placeholders in `drafts`. With `early` (argmaxes and accepted counts
        of a commit already launched) the counts come in the same sync, and a verdict that
        differs from its count stops the worker: the SSM states would be wrong."""
        sampled = []   # (work, number of drafts, first row of the pending token and the drafts)
        for w, rows in zip(work, seqs):
            if w.sample:
                sampled.append((w, len(drafts.get(w.seq_id, [])), rows.start + len(w.tokens) - 1))
        if not sampled:
            return {}
        if logits is None:
            index = [i for _, k, first in sampled for i in range(first, first + k + 1)]
            logits = self.model.logits(hidden[to_device(index, hidden.device)])
            starts = itertools.accumulate((k + 1 for _, k, _ in sampled), initial=0)
            sampled = [(w, k, at) for (w, k, _), at in zip(sampled, starts)]
        greedy = [self._plain_greedy(w) for w, _, _ in sampled]
        if early is not None:   # its argmaxes, and its counts to check the verdicts against
            best = torch.cat(early)
        else:
            best = logits.argmax(-1) if any(greedy) else None   # plain greedy: over every row
        if on_device:   # its drafts come to the host with the argmaxes, in one sync
            best = on_device.read_into(drafts, best)
        elif best is not None:
            best = best.tolist()
        committed = None
        if early is not None:
            best, committed = best[:early[0].numel()], best[early[0].numel():]
        verdicts = {}
        for (w, k, first), plain in zip(sampled, greedy):
            d = drafts.get(w.seq_id, [])
            if not plain:
                verdicts[w.seq_id] = self._accept(w, d, logits[first:first + k + 1])
            else:
                verdict = greedy_verdict(d, best[first:first + len(d) + 1])
                verdicts[w.seq_id] = SeqOutcome(w.seq_id, verdict.tokens, len(d), verdict.accepted)
        if committed is not None:
            found = [verdicts[w.seq_id].accepted for w in work]
            if found != committed:
                raise RuntimeError(f"the device committed {committed} accepted drafts where the "
                                   f"verdicts found {found}")
        return verdicts

    def _accept(self, w: SeqWork, drafts: list[int], logits: torch.Tensor) -> SeqOutcome:
        """logits: [k+1, vocab] at the pending token and each draft. Applies the rejection sampler."""
        constraint = self._constraint(w)
        if constraint is not None:
            generated = self._generated(w)
            masks = torch.stack([constraint.allowed(generated + drafts[:i])
                                 for i in range(len(drafts) + 1)]).to(logits.device)
            restricted = logits.masked_fill(~masks, float("-inf"))
        else:
            restricted = logits
        spec = w.sample
        probs = target_probs(restricted, [spec] * (len(drafts) + 1))
        streams = [generator_for(spec.at(spec.draw + i), self.device) for i in range(len(drafts) + 1)]
        uniforms = torch.stack([torch.rand((), generator=generator_for(spec.at(spec.draw + i),
                                                                       self.device, stream=1),
                                           device=self.device) for i in range(len(drafts))]) \
            if drafts and not spec.greedy else None
        verdict = verify_drafts(drafts, probs, None, spec.greedy, uniforms, streams)
        outcome = SeqOutcome(w.seq_id, verdict.tokens, len(drafts), verdict.accepted)
        if spec.logprobs is not None:
            n = len(verdict.tokens)
            chosen, top_ids, top_vals = logprobs_of(
                logits[:n], to_device(verdict.tokens, logits.device), spec.logprobs)
            outcome.logprobs = [TokenLogprobs(float(chosen[i]), list(zip(top_ids[i].tolist(),
                                                                          top_vals[i].tolist())))
                                for i in range(n)]
        return outcome

    def _committed_rows(self, w, rows, accepted_drafts, outcome, hidden, captured):
        """The rows now committed for the drafter: the chunk (or pending token) plus accepted
        drafts; each row's next token is the following one, the sampled or looked-ahead last."""
        n = len(w.tokens) + len(accepted_drafts)
        tokens = w.tokens + accepted_drafts
        last_next = outcome.tokens[-1] if outcome else w.next_token
        assert last_next is not None, "a prefill chunk that does not sample carries next_token"
        return CommittedRows(w.slot, w.context_len, tokens, tokens[1:] + [last_next], hidden,
                             captured, slice(rows.start, rows.start + n), w.block_table,
                             w.context_len == 0)
