"""Shared fixtures: tiny checkpoints written by transformers, built once per session."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

import checkpoints
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM

# Variants of the supported architectures: head dims, GQA ratios, layer patterns, tied embeddings,
# and both Qwen3.5 layouts.
VARIANTS = {
    "qwen3": dict(arch="qwen3"),
    "qwen3-mha-tied": dict(arch="qwen3", num_key_value_heads=4, head_dim=32,
                           tie_word_embeddings=True),
    "qwen3_5": dict(arch="qwen3_5", mtp=True),
    "qwen3_5-pattern": dict(arch="qwen3_5", num_hidden_layers=5, head_dim=32, num_key_value_heads=1,
                            layer_types=["full_attention", "linear_attention", "linear_attention",
                                         "full_attention", "linear_attention"],
                            linear_num_key_heads=1, linear_num_value_heads=2,
                            linear_key_head_dim=16, linear_value_head_dim=8,
                            tie_word_embeddings=True),
    "qwen3_5-vl": dict(arch="qwen3_5", layout="vl", mtp=True),
}

LOGIT_DIFFS: dict[str, float] = {}
PROMPTS = ["def schedule(self, tokens):", "The café engine", "日本語 🙂 x = [1, 2, 3]\n",
           "# serves pages and blocks before the logits are ready"]


def run_with_arrivals(llm: LLM, arrivals: dict[int, list[list[int]]], params: SamplingParams):
    """Adds prompts at the given engine steps (continuous batching); returns outputs in order."""
    ids, step = [], 0
    while step <= max(arrivals) or llm.scheduler.has_work:
        for prompt in arrivals.get(step, []):
            ids.append(llm.add_request(prompt, params))
        llm.step()
        step += 1
    return [llm.finished_output(r) for r in ids]


def assert_stops_where_first_met(llm: LLM, prompts: list[list[int]], refs: list[list[int]],
                                 at: int) -> None:
    """Each prompt again with its greedy reference's token number `at` as a stop token: every
    sequence ends where that token first comes (inside a chain of steps or not)."""
    stops = [r[at] for r in refs]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=len(r), temperature=0,
                                                 ignore_eos=True, stop_token_ids=[t])
                                  for r, t in zip(refs, stops)])
    assert [o.token_ids for o in outs] == [r[:r.index(t) + 1] for r, t in zip(refs, stops)]
    assert_stats_count_what_was_kept(outs)


def assert_stats_count_what_was_kept(outs) -> None:
    """A request's speculation statistics count the rounds that ran while it did and the drafts
    it kept: each round emits its accepted drafts and one token, after the prefill's first."""
    for o in outs:
        assert o.spec.drafts_accepted + o.spec.rounds <= len(o.token_ids) - 1, o.spec


def assert_rounds_accept_what_the_lookup_offers(llm: LLM, prompts: list[list[int]],
                                              max_tokens: int) -> list[list[int]]:
    """Greedy n-gram speculation of `prompts` together, every round checked against its own
    output: a round at output position p, carrying d drafts, must accept at least what the
    lookup's drafts from prompt + output[:p + 1] match of output[p + 1:] (capped at d), and at
    most that with the chain's filler (the history's last token) after the lookup's drafts.
    Exactness tests cannot see a round that drafted from a stale or wrong history: its
    verdicts still give the target's tokens, only fewer of its drafts pass. Returns each
    sequence's accepted counts, round by round."""
    from metrale.drafting.ngram import ngram_drafts
    proposer = llm.worker.proposer
    rounds: dict[int, list[tuple[int, int]]] = {}   # seq id -> (drafts, accepted) per round
    update = llm.scheduler.update

    def recorded(plan, result):
        for o in result.outcomes:
            accepted = o.rounds if o.rounds is not None else [o.accepted]
            rounds.setdefault(o.seq_id, []).extend((o.proposed // len(accepted), a)
                                                   for a in accepted)
        return update(plan, result)
    llm.scheduler.update = recorded
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        ids = [llm.add_request(p, params, streamed=False) for p in prompts]
        seqs = [llm.scheduler.by_request[i][0] for i in ids]
        while llm.has_work:
            llm.step()
    finally:
        llm.scheduler.update = update

    def matched(drafts: list[int], after: list[int]) -> int:
        return next((i for i, (d, t) in enumerate(zip(drafts, after)) if d != t),
                    min(len(drafts), len(after)))
    accepted_by_seq = []
    for prompt, seq in zip(prompts, seqs):
        out, emitted, kept = seq.output_ids, 0, []
        assert len(out) == max_tokens
        for drafts, accepted in rounds[seq.seq_id]:
            if emitted >= len(out):   # a chain's rounds after the sequence ended
                break
            if emitted:   # (the first token is the prefill's)
                history, after = list(prompt) + out[:emitted], out[emitted:]
                offered = ngram_drafts(history, drafts, proposer.min_n, proposer.max_n)
                filled = offered + [history[-1]] * (drafts - len(offered))
                low, high = matched(offered, after), matched(filled, after)
                assert low <= min(accepted, len(after)) <= high, (
                    f"sequence {seq.seq_id}: the round at output position {emitted - 1} "
                    f"accepted {accepted} of {drafts} drafts; the lookup's drafts match "
                    f"{low}, with filler {high}")
                kept.append(accepted)
            emitted += accepted + 1
        assert emitted >= len(out)
        accepted_by_seq.append(kept)
    return accepted_by_seq


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> directory of the named variant (see VARIANTS)."""
    built = {}

    def get(name: str):
        if name not in built:
            spec = dict(VARIANTS[name])
            arch = spec.pop("arch")
            built[name] = checkpoints.write_checkpoint(tmp_path_factory.mktemp(name), arch, **spec)
        return built[name]
    return get


@pytest.fixture(scope="session")
def dflash_drafter(checkpoint, tmp_path_factory):
    """dflash_drafter(name) -> a random DFlash drafter directory for the named target."""
    built = {}

    def get(name: str, block_size: int = 4):
        key = (name, block_size)
        if key not in built:
            built[key] = checkpoints.write_dflash_drafter(
                tmp_path_factory.mktemp(f"dflash-{name}"), checkpoint(name), block_size=block_size)
        return built[key]
    return get


def wait_for_200(url: str, timeout_s: float, proc=None, log: Path | None = None) -> None:
    """Polls `url` until it answers 200; fails (early, if `proc` exits) showing `log`, else the
    last answer."""
    deadline = time.time() + timeout_s
    while True:
        try:
            answer = httpx.get(url)
            if answer.status_code == 200:
                return
            last = answer.text
        except httpx.TransportError as e:
            last = repr(e)
        assert (proc is None or proc.poll() is None) and time.time() < deadline, \
            log.read_text() if log else last
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the session (8 logical CPUs, so several CPU workers fit on a small
    machine), exporting Prometheus metrics every second on the port it yields."""
    import ray
    metrics_port = free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, namespace="metrale",
             log_to_driver=False, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    yield metrics_port
    ray.shutdown()


@pytest.fixture
def logit_report():
    def record(name: str, diff: float):
        LOGIT_DIFFS[name] = max(diff, LOGIT_DIFFS.get(name, 0.0))
    return record


def pytest_terminal_summary(terminalreporter):
    if LOGIT_DIFFS:
        terminalreporter.section("max |logit difference| vs transformers (float32)")
        for name, diff in sorted(LOGIT_DIFFS.items()):
            terminalreporter.write_line(f"{name:20s} {diff:.3e}")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
