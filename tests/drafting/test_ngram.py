"""The n-gram proposer's incremental index finds what the scan of the whole history finds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.drafting.ngram import NgramProposer, SuffixIndex, ngram_drafts
from metrale.drafting.proposer import ProposeRequest


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.lists(st.sampled_from([0, 1, 2, 2**32 - 1]), max_size=60),   # few symbols: many
       # repeats; the largest id fills its 32 bits of a key
       grows=st.lists(st.integers(1, 6), min_size=1, max_size=20),
       sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)), k=st.integers(1, 5))
def test_index_equals_scan_as_the_history_grows(tokens, grows, sizes, k):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    history: list[int] = []
    index = SuffixIndex(history, min_n, max_n)
    at = 0
    for g in grows:   # the history grows by one or more tokens between lookups, as in rounds
        history.extend(tokens[at:at + g])
        at += g
        assert index.drafts(k) == ngram_drafts(history, k, min_n, max_n)


def test_proposer_rebuilds_when_a_slot_takes_a_new_sequence():
    p = NgramProposer(1, 3)
    first = [5, 6, 7, 5, 6]
    assert p.propose([ProposeRequest(0, 4, 6, 2, [], first)])[0].tokens == [7, 5]
    second = [1, 2, 1]   # a new list: the slot's next sequence
    assert p.propose([ProposeRequest(0, 2, 1, 2, [], second)])[0].tokens == [2, 1]
    first.extend([9, 5, 6])    # the index follows appends to the list it was built on
    p.propose([ProposeRequest(1, 7, 6, 3, [], first)])
    assert p.propose([ProposeRequest(1, 7, 6, 3, [], first)])[0].tokens == [9, 5, 6]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8), k=st.integers(1, 5))
def test_prompt_chunks_observed_before_the_first_round_give_the_scans_drafts(tokens, chunks, k):
    p = NgramProposer(1, 3)
    history: list[int] = []
    at = 0
    for c in chunks:   # prefill chunks: each indexed while the device runs it
        history.extend(tokens[at:at + c])
        at += c
        p.observe(0, history)
    assert p.index[0].indexed == max(len(history) - 1, 0)
    history.extend(tokens[at:at + 2])   # the first sampled token, and one more round's
    got = p.propose([ProposeRequest(0, len(history) - 1, history[-1], k, [], history)])
    assert got[0].tokens == ngram_drafts(history, k, 1, 3)


def test_the_worker_indexes_each_prompt_chunk_in_its_prefill_step(checkpoint):
    from metrale.cluster.params import SamplingParams
    from metrale.deploy.llm import LLM
    llm = LLM(checkpoint("qwen3"), device="cpu", block_size=4, max_num_batched_tokens=8,
              speculative_method="ngram", num_drafts=3)
    prompt = list(range(5, 25)) * 2   # 40 tokens: five chunks of 8
    rid = llm.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    seq = llm.scheduler.by_request[rid][0]
    index = llm.worker.proposer.index
    chunks = 0
    while not seq.output_ids:
        llm.step()
        chunks += 1
        assert index[seq.slot].indexed == seq.num_computed - 1   # before any round looks it up
    assert chunks == 5


@settings(max_examples=200, deadline=None, derandomize=True)
@given(histories=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1,
                          max_size=5),
       spare=st.integers(0, 6), sizes=st.tuples(st.integers(1, 3), st.integers(0, 3)),
       k=st.integers(1, 6))
def test_drafts_on_the_device_are_the_scans_then_filler(histories, spare, sizes, k):
    """A chain's proposer (tensor ops over every sequence at once) drafts what the scan drafts,
    then repeats the last token up to k; columns past each history hold junk it must not read."""
    import torch
    from metrale.drafting.ngram import ngram_drafts_on_device
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    width = max(map(len, histories)) + spare
    table = torch.randint(0, 4, (len(histories), width), generator=torch.Generator().manual_seed(0))
    for row, h in zip(table, histories):
        row[:len(h)] = torch.tensor(h)
    got = ngram_drafts_on_device(table, torch.tensor([len(h) for h in histories]), k, min_n,
                                 max_n).tolist()
    for drafts, h in zip(got, histories):
        want = ngram_drafts(h, k, min_n, max_n)
        assert drafts == want + [h[-1]] * (k - len(want))


@pytest.mark.parametrize("chain_rounds", [0, 8], ids=["round-by-round", "chained"])
def test_every_round_accepts_what_the_lookup_offers(chain_rounds):
    """The bundled model's n-gram speculation at a fixed k, round by round (the host's index
    proposes) and chained (the chain's tensor ops draft from each sequence's history, with
    filler): every round accepts what the lookup's drafts from its history match of the output
    (see assert_rounds_accept_what_the_lookup_offers), prompts of 256 tokens as the bench's."""
    from conftest import assert_rounds_accept_what_the_lookup_offers
    from metrale.deploy.bundled import BUNDLED_MODEL
    from metrale.deploy.gpubench import bundled_prompts
    from metrale.deploy.llm import LLM
    llm = LLM(str(BUNDLED_MODEL), device="cpu", dtype="float32", speculative_method="ngram",
              num_drafts=3, adaptive_drafts=False, max_num_seqs=4, chain_rounds=chain_rounds)
    assert llm.scheduler.capacity.chain_rounds == chain_rounds
    accepted = assert_rounds_accept_what_the_lookup_offers(
        llm, bundled_prompts(BUNDLED_MODEL, 4, 256), 48)
    assert sum(map(sum, accepted)) > 0.1 * 3 * sum(map(len, accepted))   # drafts do pass


def test_indexed_prompts_leave_nothing_for_the_collector():
    """A batch's prompts indexed in its prefill must not leave tracked objects behind. Tuple
    keys did: as a slot's new index grew, its old one's keys were freed, so the collector's
    count (allocations less deallocations) stayed near zero and never ran, while the new keys
    piled up in its youngest generation (some 44 000 at 64 prompts of 256 tokens, walked by
    the first decode step's collection: 3-5 ms of one step on a CPU)."""
    import gc
    import random
    rng = random.Random(0)
    p = NgramProposer(1, 4)
    for batch in range(2):   # the second batch's prompts take the first one's slots
        prompts = [[rng.randrange(4096) for _ in range(256)] for _ in range(16)]
        gc.collect()
        young = len(gc.get_objects(0))
        for slot, prompt in enumerate(prompts):
            p.observe(slot, prompt)
        assert sum(len(i.last) for i in p.index.values()) > 10_000   # the n-grams are there
        assert len(gc.get_objects(0)) - young < 2_000, batch
