"""The store connector against real store nodes (in-process, gRPC on loopback): replication,
a chunk evicted between lookup and load, fetching chunks as a producer saves them, flush
timeouts and counted save failures. Tokens are always compared with a store-less engine."""

import os
import signal
import threading

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from kvstore.client import StoreClient
from tests.helpers import StoreProcess, freeze, store_nodes, wait_for

CHUNK = 64
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    import random

    r = random.Random(seed)
    return [r.randrange(0, 500) for _ in range(n)]


PROMPT = _prompt(40, 300)  # four full 64-token chunks and a 44-token tail; 308 tokens with the output


def make_engine(store: str | None = None, client=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:tiny", dtype="float32", chunk_tokens=CHUNK, store=store,
                                  kv_cache_memory="8MiB"), client=client)


def run(engine: LLMEngine, prompt: list[int], **kw):
    seq = engine.add_request(prompt, PARAMS, **kw)
    while not seq.is_finished:
        engine.step()
    return seq


@pytest.fixture(scope="module")
def reference() -> list[int]:
    eng = make_engine()
    try:
        return list(run(eng, PROMPT).output)
    finally:
        eng.close()


@pytest.fixture
def nodes(tmp_path):
    yield from store_nodes(tmp_path, with_disk=False)


@pytest.fixture
def seeded(nodes, reference):
    """A node holding PROMPT's four chunks, saved by an engine; yields (node, keys, encoded chunks)."""
    node = nodes()
    eng = make_engine(node.address)
    try:
        seq = run(eng, PROMPT)
        assert eng.connector.flush(timeout_s=120)
        assert list(seq.output) == reference and eng.connector.stats.chunks_saved == 4
        keys = eng.connector.keys(PROMPT, None)
    finally:
        eng.close()
    with StoreClient(node.address) as c:
        assert c.lookup(keys) == 4
        raw = c.batch_get(keys)
    yield node, keys, raw


@pytest.mark.parametrize("replicate", [True, False])
def test_replicate_puts_the_verified_prefetched_chunks_on_the_engines_own_node(seeded, nodes, reference,
                                                                               replicate):
    _, keys, raw = seeded
    own = nodes()  # the engine's own node: empty
    eng = make_engine(own.address)
    try:
        seq = run(eng, PROMPT, prefetched=dict(zip(keys, raw)), replicate=replicate)
        assert eng.connector.flush(timeout_s=120)
        assert list(seq.output) == reference
        assert seq.num_store_tokens == 4 * CHUNK
        st = eng.connector.stats
        assert st.chunks_loaded == 4 and st.load_failures == 0 and st.save_failures == 0
        assert st.chunks_saved == (4 if replicate else 0)
    finally:
        eng.close()
    with StoreClient(own.address) as c:
        if replicate:
            assert c.lookup(keys) == 4
            assert [bytes(b) for b in c.batch_get(keys)] == [bytes(b) for b in raw]
        else:  # nothing new was computed in full chunks, so nothing was saved
            assert c.lookup(keys) == 0


def test_chunk_deleted_between_lookup_and_load_is_recomputed_and_saved_again(seeded, reference):
    node, keys, raw = seeded
    eng = make_engine(node.address)
    try:
        seq = eng.add_request(PROMPT, PARAMS)
        assert seq.store_hit_chunks == 4  # the lookup saw every chunk
        with StoreClient(node.address) as c:
            assert c.delete([keys[2]]) == 1  # evicted before the load
        while not seq.is_finished:
            eng.step()
        assert eng.connector.flush(timeout_s=120)
        assert list(seq.output) == reference
        assert seq.num_store_tokens == 2 * CHUNK  # chunks 0 and 1; 2 and 3 recomputed
        st = eng.connector.stats
        assert st.chunks_loaded == 2 and st.load_failures == 1
        assert st.chunks_saved == 2  # chunks 2 and 3, recomputed
    finally:
        eng.close()
    with StoreClient(node.address) as c:
        assert c.lookup(keys) == 4
        assert [bytes(b) for b in c.batch_get(keys)] == [bytes(b) for b in raw]


def test_fetch_as_they_arrive_waits_for_a_producer_and_gives_up_after_the_timeout(seeded, nodes):
    _, keys, raw = seeded
    target = nodes()  # empty: a producer saves the chunks there one by one, the last one never
    eng = make_engine(target.address)
    started = threading.Event()
    errors = []

    def produce():
        try:
            with StoreClient(target.address) as c:
                started.wait(60)
                for i in range(3):
                    c.put(keys[i], raw[i])
                    # the next chunk appears only once the consumer has read this one
                    wait_for(lambda i=i: c.stats()["tiers"]["dram"]["hits"] >= i + 1, timeout_s=120,
                             what=f"the consumer to fetch chunk {i}")
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        started.set()
        got = eng.connector.fetch_as_they_arrive(keys, timeout_s=15.0)
        producer.join(timeout=300)
        assert not errors, errors
        assert list(got) == keys[:3]
        assert [bytes(got[k]) for k in keys[:3]] == [bytes(b) for b in raw[:3]]
        # nothing ever arrives: an empty answer once the timeout passes
        other = eng.connector.keys(_prompt(41, 200), None)
        assert eng.connector.fetch_as_they_arrive(other, timeout_s=0.5) == {}
        assert eng.connector.stats.store_errors == 0
    finally:
        producer.join(timeout=300)
        eng.close()


def test_fetch_as_they_arrive_stops_at_a_stopped_node(seeded):
    node, keys, raw = seeded
    eng = make_engine(node.address)
    try:
        node.stop(grace=0)
        assert eng.connector.fetch_as_they_arrive(keys, timeout_s=30.0) == {}
        assert eng.connector.stats.store_errors >= 1
    finally:
        eng.close()


@pytest.fixture
def store_proc(tmp_path):
    proc = StoreProcess("--dram", "64MiB")
    yield proc
    if proc.proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
    proc.stop()


def test_flush_times_out_while_the_store_is_frozen_and_completes_after(store_proc, reference):
    eng = make_engine(client=StoreClient(store_proc.address, timeout_s=300))
    try:
        seq = eng.add_request(PROMPT, PARAMS)
        assert seq.store_hit_chunks == 0
        freeze(store_proc.pid)  # the saves hang in the saver thread
        while not seq.is_finished:
            eng.step()
        assert list(seq.output) == reference
        assert eng.connector.flush(timeout_s=1.0) is False
        assert eng.connector.stats.chunks_saved == 0
        os.kill(store_proc.pid, signal.SIGCONT)
        assert eng.connector.flush(timeout_s=300) is True
        st = eng.connector.stats
        assert st.chunks_saved == 4 and st.save_failures == 0
    finally:
        eng.close()
    with StoreClient(store_proc.address) as c:
        assert c.lookup(eng.connector.keys(PROMPT, None)) == 4


def test_save_failures_are_counted_when_the_node_is_stopped(nodes, reference):
    node = nodes()
    eng = make_engine(client=StoreClient(node.address, timeout_s=30))
    try:
        node.stop(grace=0)
        seq = run(eng, PROMPT)
        assert eng.connector.flush(timeout_s=300)
        assert list(seq.output) == reference
        st = eng.connector.stats
        assert seq.num_store_tokens == 0
        assert st.chunks_saved == 0 and st.save_failures == 4
        assert st.store_errors >= 2  # the lookup and at least one save
        assert any(e.startswith("save") for e in st.errors)
    finally:
        eng.close()


def test_save_failures_are_counted_when_the_node_is_full(nodes, reference):
    node = nodes(dram=64 << 10)  # one slot, held by a pinned value: no room for any chunk
    with StoreClient(node.address) as c:
        c.put(b"\x01" * 16, b"pinned filler")
        assert c.pin([b"\x01" * 16]) == 1
    eng = make_engine(node.address)
    try:
        seq = run(eng, PROMPT)
        assert eng.connector.flush(timeout_s=300)
        assert list(seq.output) == reference
        st = eng.connector.stats
        assert st.chunks_saved == 0 and st.save_failures == 4
    finally:
        eng.close()


def test_the_connectors_side_threads_run_torch_on_one_intra_op_thread(nodes):
    """The threads beside the forward (fetcher, lander, streamer, saver) make no OpenMP team of their
    own: with one, libgomp manages more threads than there are CPUs and cuts every team's spinning,
    and each small op of the forward paid a sleep and a wake (kernels.host.one_intra_op_thread)."""
    import torch

    node = nodes()
    eng = make_engine(node.address)
    try:
        conn = eng.connector
        pools = [conn.pool.fetcher, conn._streamer] + ([conn.stream_ring.lander] if conn.stream_ring else [])
        assert [p.submit(torch.get_num_threads).result(timeout=60) for p in pools] == [1] * len(pools)
        seen = []
        real = conn.client.batch_put

        def batch_put(batch):  # called on the saver thread
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return real(batch)

        conn.client.batch_put = batch_put
        run(eng, PROMPT)
        assert conn.flush(timeout_s=120) and seen and set(seen) == {("kv-saver", 1)}
        assert torch.get_num_threads() > 1 or os.cpu_count() == 1  # (the caller's own count is untouched)
    finally:
        eng.close()
