"""The prefix index, the routers' rules and what a request routes on."""
from __future__ import annotations

import json

import pytest

from kvserve.config.replicas import ReplicaConfig
from kvserve.replicas.prefix_index import BLOCK, PrefixIndex, block_keys
from kvserve.replicas.routers import ROUTERS, NoReplicaError
from kvserve.replicas.routing_key import routing_prompt

LONG = tuple(range(4 * BLOCK))


def test_block_keys_chain_so_equal_keys_mean_equal_prefixes():
    a, b = block_keys(LONG), block_keys(LONG[:2 * BLOCK] + (9,) * 2 * BLOCK)
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]
    assert block_keys(LONG[:BLOCK - 1]) == []  # a partial block is not kept
    assert block_keys("x" * BLOCK) == block_keys("x" * (BLOCK + 3))


def test_the_index_forgets_least_recently_used_blocks_first():
    index = PrefixIndex(1, capacity=4)
    old, new = block_keys(LONG), block_keys(tuple(range(500, 500 + 2 * BLOCK)))
    index.insert(old, 0)
    index.insert(new, 0)
    assert index.size(0) == 4 and index.match(new, 0) == 2
    assert index.match(old, 0) == 0  # its first two blocks were evicted
    index.forget(0)
    assert index.size(0) == 0


def _router(name: str = "cache_aware", **kw):
    return ROUTERS[name](ReplicaConfig(num_replicas=3, **kw))


def test_cache_aware_follows_the_longest_prefix_then_balances():
    router = _router()
    keys = block_keys(LONG)
    first = router.route(keys, [0, 0, 0], [True] * 3)
    assert (first.replica, first.reason) == (0, "cache_miss")
    hit = router.route(keys, [5, 0, 0], [True] * 3)
    assert (hit.replica, hit.reason, hit.match_ratio) == (0, "cache_hit", 1.0)
    # 33 more than the least loaded and more than 1.5x its load: balance instead
    moved = router.route(keys, [40, 7, 9], [True] * 3)
    assert (moved.replica, moved.reason) == (1, "imbalance")
    # a prompt sharing a quarter of its blocks is under the 0.3 threshold: least loaded
    quarter = block_keys(LONG[:BLOCK] + (7,) * 3 * BLOCK)
    assert router.route(quarter, [0, 3, 1], [True] * 3).reason == "cache_miss"


def test_a_miss_goes_to_the_least_loaded_then_the_emptiest_index():
    router = _router()
    router.route(block_keys(LONG), [0, 0, 0], [True] * 3)
    other = block_keys(tuple(range(900, 900 + 2 * BLOCK)))
    assert router.route(other, [0, 0, 0], [True] * 3).replica == 1
    assert router.route(block_keys((1,) * BLOCK), [2, 2, 1], [True] * 3).replica == 2


def test_down_replicas_are_never_chosen():
    for name in ROUTERS.names():
        router = _router(name)
        keys = block_keys(LONG)
        router.route(keys, [0, 0, 0], [True, True, True])
        picks = {router.route(keys, [0, 0, 0], [False, True, False]).replica for _ in range(4)}
        assert picks == {1}
        with pytest.raises(NoReplicaError, match="no replica is up"):
            router.route(keys, [0, 0, 0], [False] * 3)


def test_round_robin_ignores_the_cache():
    router = _router("round_robin")
    keys = block_keys(LONG)
    assert [router.route(keys, [0] * 3, [True] * 3).replica for _ in range(4)] == [0, 1, 2, 0]


@pytest.mark.parametrize("path,body,expected", [
    ("/v1/completions", {"prompt": "abc"}, "abc"),
    ("/v1/completions", {"prompt": [1, 2, 3]}, (1, 2, 3)),
    ("/v1/completions", {"prompt": [[4, 5], [6]]}, (4, 5)),
    ("/v1/completions", {"prompt": ["first", "second"]}, "first"),
    ("/v1/completions", {"prompt": 3}, ()),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [
                                               {"type": "text", "text": "hi"}]}]},
     "system\nbe brief\nuser\nhi\n"),
    ("/v1/chat/completions", {"messages": "nope"}, ""),
    ("/tokenize", {"prompt": "abc"}, ()),
])
def test_routing_prompt(path, body, expected):
    assert routing_prompt(path, json.dumps(body).encode()) == expected


def test_routing_prompt_of_a_body_that_is_not_json_is_empty():
    assert routing_prompt("/v1/completions", b"{not json") == ()
    assert routing_prompt("/v1/completions", b"[" * 100_000 + b"]" * 100_000) == ()
    chat = {"messages": [{"role": "user", "content": [{"text": None}, {"text": 5}]}]}
    assert routing_prompt("/v1/chat/completions", json.dumps(chat).encode()) == "user\n\n"


@pytest.mark.parametrize("kw,message", [
    ({"num_replicas": 0}, "replicas must be a positive integer"),
    ({"cache_threshold": 1.5}, "router_cache_threshold must be in"),
    ({"balance_rel_threshold": 0.5}, "router_balance_rel_threshold must be >= 1"),
    ({"balance_abs_threshold": -1}, "router_balance_abs_threshold must be >= 0"),
])
def test_bad_replica_settings_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        ReplicaConfig(**kw)


def test_an_unknown_router_is_refused_where_the_replica_config_is_made():
    from kvserve.cli import build_parser
    from kvserve.replicas.launch import replica_config_from
    args = build_parser().parse_args(["serve", "--replicas", "2"])
    args.router = "random"  # past the flag's choices, as a Serve config's args could
    with pytest.raises(ValueError, match=r"router must be one of \['round_robin', "
                                         r"'cache_aware'\], got 'random'"):
        replica_config_from(args)


@pytest.mark.parametrize("argv,message", [
    (["--replicas", "2", "--ray-address", "ray://head:10001"], "Ray Client"),
    (["--ray-address", "auto"], "needs --replicas"),
    (["--replicas", "2", "--router-cache-threshold", "2"], "router_cache_threshold"),
])
def test_bad_replica_flags_are_refused_before_anything_loads(argv, message):
    from kvserve.cli import build_parser
    from kvserve.replicas.launch import run_replicated_server
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=message):
        run_replicated_server(args)
