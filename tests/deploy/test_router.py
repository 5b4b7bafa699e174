"""The router policy: the shorter of two queues, and the replica that saw a prompt's prefix while
the queues are balanced."""

from __future__ import annotations

from metrale.deploy.router import Router

SYSTEM = list(range(100, 132))   # a 32-token system prompt: two blocks of 16


def test_power_of_two_choices_never_picks_the_longer_of_its_pair():
    router = Router(4, block_size=16, imbalance=0, seed=1)
    queues = [9, 3, 7, 1]
    picks = [router.choose([i, i + 1], queues) for i in range(200)]
    assert 0 not in picks                       # the longest queue loses every pair it is in
    assert picks.count(3) > picks.count(1) > picks.count(2) > 0   # wins 3, 2 and 1 of 6 pairs


def test_a_repeated_prefix_goes_where_it_went_while_balanced():
    router = Router(4, block_size=16, imbalance=2, seed=2)
    first = router.choose(SYSTEM + [1, 2, 3], [0, 0, 0, 0])
    queues = [1, 1, 1, 1]
    queues[first] = 2                           # within the imbalance allowance
    assert all(router.choose(SYSTEM + [7, i], queues) == first for i in range(20))


def test_the_longest_shared_prefix_wins():
    router = Router(2, block_size=16, imbalance=4, seed=3)
    other = [7] * 16
    a = router.choose(SYSTEM + [1], [0, 0])
    unbalanced = [0, 0]
    unbalanced[a] = 10                          # sends the next one to the other replica
    b = router.choose(SYSTEM[:16] + other + [2], unbalanced)
    assert b == 1 - a
    assert router.choose(SYSTEM + [3], [0, 0]) == a             # two blocks match a, one b
    assert router.choose(SYSTEM[:16] + other + [4], [0, 0]) == b  # two blocks match b, one a


def test_imbalance_overrides_affinity():
    router = Router(2, block_size=16, imbalance=2, seed=4)
    home = router.choose(SYSTEM, [0, 0])
    queues = [0, 0]
    queues[home] = 10
    assert router.choose(SYSTEM + [1], queues) == 1 - home


def test_memory_is_bounded():
    router = Router(1, block_size=4, remembered=8)
    for i in range(50):
        router.choose(list(range(i, i + 16)), [0])
    assert len(router.prefixes[0]) == 8
