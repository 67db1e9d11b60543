"""Prefix caching across requests (engine/prefix_cache.py): the radix tree alone, then the real server.

The server tests run one tritonserver whose two models have the cache on and a small KV pool
(512 tokens each), so that the prompts below overflow it and the cache must evict.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import re
import time

import pytest
import torch

from tr_client import generate, metric_values, model_stats, router_inputs, wait_kv_released


# --------------------------------------------------------------------------- the tree alone
class _Freed:
    def __init__(self):
        self.slots = []

    def __call__(self, t):
        self.slots.extend(int(x) for x in t)


def _tree(page=1):
    from tokenrouter.engine.prefix_cache import RadixPrefixCache

    freed = _Freed()
    return RadixPrefixCache(page, freed), freed


def test_tree_match_insert_split_and_overlap():
    c, freed = _tree()
    assert c.insert([1, 2, 3, 4], torch.arange(10, 14)) == 0
    slots, node, n = c.match([1, 2, 3, 9, 9])
    assert n == 3 and slots.tolist() == [10, 11, 12]  # the match ends inside a node: split
    assert c.total_tokens == 4 and c.evictable_tokens == 4
    # a second sequence sharing [1, 2]: the tree keeps its own slots and reports the overlap
    assert c.insert([1, 2, 7, 8], torch.arange(20, 24)) == 2
    assert c.match([1, 2, 7, 8])[0].tolist() == [10, 11, 22, 23]
    assert c.match([1, 2, 3, 4], limit=3)[2] == 3  # limit: at most that many tokens
    assert c.match([5, 6])[2] == 0
    assert c.total_tokens == 6 and freed.slots == []


def test_tree_pages_locks_and_lru_eviction():
    c, freed = _tree(page=2)
    c.insert([1, 2, 3, 4, 5], torch.arange(0, 5))  # the partial last page is not cached
    assert c.total_tokens == 4
    assert c.match([1, 2, 3, 9])[2] == 2  # whole pages only
    c.insert([7, 7, 8, 8], torch.arange(100, 104))
    c.insert([1, 2, 6, 6], torch.arange(200, 204))
    _, node, n = c.match([1, 2, 3, 4])
    c.lock(node)
    assert c.locked_tokens == 4 and c.evictable_tokens == 6
    # LRU: [7, 7, 8, 8] was used least recently; [1, 2, 3, 4] is locked
    assert c.evict(1) == 4 and sorted(freed.slots) == [100, 101, 102, 103]
    assert c.flush() == 2 and sorted(freed.slots)[-2:] == [202, 203]  # only the unlocked [6, 6] leaf
    assert c.total_tokens == 4 and c.match([1, 2, 3, 4])[2] == 4
    c.unlock(node)
    assert c.flush() == 4 and c.total_tokens == 0 and len(freed.slots) == 10
    with pytest.raises(RuntimeError):
        c.unlock(node)


# --------------------------------------------------------------------------- the real server
SYSTEMS = [
    "You are a careful assistant for a public library. Answer every question in one short "
    "sentence, name your source when you know it, and say so when you do not know. " * 3,
    "You are a terse math tutor. Show the key step of the computation and then the result, "
    "nothing else. Use plain text, no LaTeX, and keep every answer under twenty words. " * 3,
    "You write short product descriptions for a hardware store. Mention the material, one use "
    "and one safety note in each description, in a friendly tone. " * 3,
]
QUESTIONS = ["What is a good first book about astronomy?", "How many days are in a leap year?",
             "Describe a claw hammer.", "What is 17 times 3?"]
PROMPTS = [s + "\n" + q for s in SYSTEMS for q in QUESTIONS]


KV_POOL = 512  # tokens per model: the 12 prompts below (~100-token system prompts, ~650 tokens cached) overflow it


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import REPO_ROOT
    from tr_server import running_server

    from tokenrouter.tools.repository import make_variant

    work = tmp_path_factory.mktemp("prefix_cache")
    params = {"prefix_cache": "true", "kv_pool_tokens": KV_POOL}
    repo = make_variant(str(REPO_ROOT / "model_repository"), str(work / "repo"),
                        model_params={"slm": params, "llm": params})
    with running_server(repo, work) as s:
        yield s


def _configure(server, **settings):
    from tokenrouter.tools import admin

    for m in ("slm", "llm"):
        admin.configure(server.grpc_url, m, **settings)


def _flush(server):
    from tokenrouter.tools import admin

    return {m: admin.flush(server.grpc_url, m) for m in ("slm", "llm")}


def _ids(server, prompt, sampling):
    out = generate(server, prompt, sampling)
    assert out["_status"] == 200, out
    return out["routing_trace"]["token_ids"], out["routing_summary"]["handoffs"]


def _assert_idle_and_consistent(server):
    """No request holds KV; every allocated slot is the cache's and none of it is locked."""
    st = wait_kv_released(server, timeout=60)
    for m, s in st.items():
        assert s["kv_tokens_in_use"] == 0 and s["kv_rows_in_use"] == 0 and s["active"] == 0, (m, s)
        assert s["kv_tokens_allocated"] == s["prefix_cache_tokens"] == s["prefix_cache_evictable_tokens"], (m, s)
    return st


@pytest.mark.parametrize("threshold", [None, 0.0])
def test_greedy_output_equal_with_and_without_cache(server, threshold):
    """Routed greedy requests sharing prefixes give the same tokens with the cache on (concurrent,
    repeated, under eviction: 12 prompts overflow the 512-token pools) as with it off."""
    sp = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    if threshold is not None:
        sp["routing_threshold"] = threshold  # None: the router's default (handoffs); 0.0: the LLM writes
    _configure(server, prefix_cache=False)
    assert all(model_stats(server, m)["prefix_cache_enabled"] == 0 for m in ("slm", "llm"))
    with cf.ThreadPoolExecutor(4) as ex:  # four at a time, as with the cache on below
        ref = dict(zip(PROMPTS, ex.map(lambda p: _ids(server, p, sp), PROMPTS)))
    if threshold is None:
        assert sum(h for _, h in ref.values()) > 0, "the default threshold should route some tokens to the LLM"
    _configure(server, prefix_cache=True)
    before = {m: model_stats(server, m) for m in ("slm", "llm")}
    for _ in range(2):
        with cf.ThreadPoolExecutor(4) as ex:
            got = dict(zip(PROMPTS, ex.map(lambda p: _ids(server, p, sp)[0], PROMPTS)))
        for p in PROMPTS:
            assert got[p] == ref[p][0], f"prompt {p[-40:]!r}: cached {got[p]} != uncached {ref[p][0]}"
    st = _assert_idle_and_consistent(server)
    for m in ("slm", "llm"):
        hits = st[m]["prefix_cache_hits"] - before[m]["prefix_cache_hits"]
        queries = st[m]["prefix_cache_queries"] - before[m]["prefix_cache_queries"]
        assert 0 < hits < queries, (m, hits, queries)
        assert st[m]["prefix_cache_tokens"] <= st[m]["kv_capacity_tokens"]
    assert st["slm"]["prefix_cache_evicted_tokens"] > before["slm"]["prefix_cache_evicted_tokens"], \
        "12 prompts of ~130 tokens with outputs overflow a 512-token pool: the cache must evict"


def test_chat_turns_reuse_the_history(server):
    """A second chat turn that resends the first turn and its answer finds both cached."""
    _configure(server, prefix_cache=True)
    _flush(server)
    sp = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "routing_threshold": 1.0}  # slm only
    turn1 = SYSTEMS[0] + "\nUser: Name a planet.\nAssistant:"
    out1 = generate(server, turn1, sp)
    wait_kv_released(server)
    s0 = model_stats(server, "slm")
    turn2 = turn1 + out1["text_output"] + "\nUser: And a moon of it?\nAssistant:"
    generate(server, turn2, sp)
    s1 = _assert_idle_and_consistent(server)["slm"]
    hit = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
    n_turn1 = len(out1["routing_trace"]["token_ids"])
    assert hit >= n_turn1 + 60, f"turn 2 found only {hit} tokens cached (turn 1 output alone is {n_turn1})"


def test_cancelled_requests_leave_no_references_and_flush_empties(server):
    _configure(server, prefix_cache=True)
    import tritonclient.grpc as grpcclient

    sp_long = {"max_tokens": 300, "temperature": 0, "ignore_eos": True}

    def cancel_one(i):
        q: "queue.Queue" = queue.Queue()
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        c.async_stream_infer("token_router", router_inputs(SYSTEMS[1] + f"\nTell a long story number {i}.",
                                                           sp_long, True))
        for _ in range(3):
            result, error = q.get(timeout=120)
            assert error is None, error
        c.stop_stream(cancel_requests=True)
        c.close()

    with cf.ThreadPoolExecutor(3) as ex:
        list(ex.map(cancel_one, range(3)))
    st = _assert_idle_and_consistent(server)
    assert st["slm"]["prefix_cache_tokens"] > 0  # the cancelled requests' prompts stay cached
    flushed = _flush(server)
    assert flushed["slm"]["kind"] == "flushed" and flushed["slm"]["flushed_tokens"] == st["slm"]["prefix_cache_tokens"]
    for m in ("slm", "llm"):
        s = model_stats(server, m)
        assert s["prefix_cache_tokens"] == 0 and s["kv_tokens_allocated"] == 0, (m, s)


def test_metrics_and_configure(server):
    """The prefix-cache counters and gauges reach Triton's metrics endpoint; bad settings are refused."""
    from tokenrouter.tools import admin

    _configure(server, prefix_cache=True)
    sp = {"max_tokens": 4, "temperature": 0, "routing_threshold": 1.0}
    for q in QUESTIONS[:2]:
        generate(server, SYSTEMS[2] + "\n" + q, sp)
    s = _assert_idle_and_consistent(server)["slm"]
    names = {"tokenrouter_prefix_cache_queries_total": "prefix_cache_queries",
             "tokenrouter_prefix_cache_hits_total": "prefix_cache_hits",
             "tokenrouter_prefix_cache_tokens": "prefix_cache_tokens",
             "tokenrouter_prefix_cache_evictable_tokens": "prefix_cache_evictable_tokens",
             "tokenrouter_prefix_cache_evicted_tokens_total": "prefix_cache_evicted_tokens"}
    deadline = time.time() + 15
    while True:
        got = {n: metric_values(server, n).get("slm") for n in names}
        if all(got[n] == s[k] for n, k in names.items()) or time.time() > deadline:
            break
        time.sleep(0.2)
    assert got == {n: float(s[k]) for n, k in names.items()}, (got, s)
    assert s["prefix_cache_hits"] > 0
    with pytest.raises(RuntimeError, match="prefix_cache must be true or false"):
        admin.configure(server.grpc_url, "slm", prefix_cache="yes")
    assert re.search(r"prefix_cache", str(admin.model_stats(server.grpc_url, "slm")))
