"""The pipelined load (engine/kv_transfer.py): order, overlap, stops, and a staging pool that
gets every buffer back; then through the engine against real store nodes: a bad chunk in the
middle of a pipelined load, a node killed mid-load, and a thousand loads without a leak."""

import random
import threading

import pytest

from engine.config import EngineConfig
from engine.kv_transfer import StagingPool, pipelined_load
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from kvstore.client import StoreClient
from kvstore.errors import UnavailableError
from tests.helpers import StoreProcess, fragment_arena, freeze, store_nodes, wait_for

CHUNK = 32
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = [random.Random(5).randrange(0, 500) for _ in range(10 * CHUNK + 7)]  # 10 chunks and a tail


class _Event:
    """An asynchronous copy's completion, as land() hands it back (here: a log entry)."""

    def __init__(self, log: list, i: int) -> None:
        self.log, self.i = log, i

    def synchronize(self) -> None:
        self.log.append(("done", self.i))


def _run(pool, num, batch, missing=(), bad=(), fail_fetch_at=None):
    log = []

    def fetch(first, count, views):
        log.append(("fetch", first))
        if fail_fetch_at is not None and first >= fail_fetch_at:
            raise UnavailableError("planned")
        for j, v in enumerate(views):
            v[:4] = (first + j).to_bytes(4, "little")
        return [None if first + j in missing else 4 for j in range(count)]

    holder = {}  # buffer id -> the chunk last landed from it

    def land(i, buf, size):
        assert int.from_bytes(pool.view(buf)[:4], "little") == i  # the buffer holds chunk i
        log.append(("land", i))
        holder[buf] = i
        return i not in bad, _Event(log, i)

    def give(ids):  # the real pool's give, watched: a buffer is never free while its copy runs
        for b in ids:
            if b in holder:
                assert ("done", holder.pop(b)) in log, f"buffer {b} given back before its copy completed"
        StagingPool.give(pool, ids)

    pool.give = give
    errors = []
    n = pipelined_load(pool, num, batch, fetch, land, errors.append)
    return n, log, errors


def test_chunks_land_in_order_and_every_buffer_comes_back():
    pool = StagingPool(64, 4)
    n, log, errors = _run(pool, 10, 2)
    assert n == 10 and not errors and pool.in_use == 0
    assert [i for what, i in log if what == "land"] == list(range(10))
    assert [i for what, i in log if what == "fetch"] == [0, 2, 4, 6, 8]
    # a batch's buffers are reused only after the copies that read them completed: the fetch
    # of batch k+2 (same buffers as batch k) comes after every "done" of batch k
    for k in range(3):
        fetch_at = log.index(("fetch", 2 * (k + 2)))
        assert log.index(("done", 2 * k)) < fetch_at and log.index(("done", 2 * k + 1)) < fetch_at


def test_a_pools_buffers_are_page_aligned_disjoint_slices_of_one_slab():
    """The buffers are cut from one mapping (pinned, on CUDA, by registering it: pin_memory would
    round each buffer up to a power of two); each starts on a page and none overlaps the next."""
    pool = StagingPool(5000, 3)
    try:
        starts = [pool.tensor(i).data_ptr() for i in range(3)]
        assert [s % 4096 for s in starts] == [0, 0, 0] and starts[1] - starts[0] == 8192
        assert pool.slab.nbytes == 3 * 8192 and not pool.pinned  # no CUDA here: nothing to pin
        for i in range(3):
            pool.view(i)[:] = bytes([i + 1]) * 5000
        assert [bytes(pool.view(i)) for i in range(3)] == [bytes([i + 1]) * 5000 for i in range(3)]
    finally:
        pool.close()


def test_the_next_batch_is_fetched_while_this_one_lands():
    pool = StagingPool(64, 4)
    second_fetch = threading.Event()

    def fetch(first, count, views):
        if first == 2:
            second_fetch.set()
        return [1] * count

    def land(i, buf, size):
        if i == 0:  # batch 1's fetch runs while chunk 0 is still landing
            assert second_fetch.wait(60), "batch 1 was not fetched during batch 0's landing"
        return True, None

    assert pipelined_load(pool, 4, 2, fetch, land, lambda exc: None) == 4 and pool.in_use == 0


@pytest.mark.parametrize("stop", ["missing", "bad"])
def test_a_stop_in_the_middle_lands_exactly_the_chunks_before_it(stop):
    pool = StagingPool(64, 6)
    n, log, errors = _run(pool, 12, 3, **{stop: {4}})
    assert n == 4 and not errors and pool.in_use == 0
    assert [i for what, i in log if what == "land"] == ([0, 1, 2, 3] if stop == "missing" else [0, 1, 2, 3, 4])


def test_a_store_error_stops_the_load_and_is_reported():
    pool = StagingPool(64, 4)
    n, _, errors = _run(pool, 8, 2, fail_fetch_at=4)
    assert n == 4 and len(errors) == 1 and isinstance(errors[0], UnavailableError)
    assert pool.in_use == 0


def test_an_exception_in_land_still_returns_every_buffer():
    pool = StagingPool(64, 4)

    def land(i, buf, size):
        if i == 3:
            raise RuntimeError("planned")
        return True, None

    with pytest.raises(RuntimeError, match="planned"):
        pipelined_load(pool, 8, 2, lambda f, c, v: [1] * c, land, lambda exc: None)
    assert pool.in_use == 0


def test_the_pool_refuses_what_it_cannot_hold():
    pool = StagingPool(64, 2)
    with pytest.raises(ValueError):
        pool.take(3)
    ids = pool.take(2)
    with pytest.raises(TimeoutError):
        pool.take(1, timeout_s=0.01)
    pool.give(ids)
    assert pool.in_use == 0


# ---- through the engine, real store nodes ---------------------------------------------------


def make_engine(store=None, client=None, batch=2, check="auto", stream=True) -> LLMEngine:
    """``stream=False``: chunks not read in place go through the staging pool, never streamed."""
    return LLMEngine(EngineConfig(model="random:tiny", dtype="float32", chunk_tokens=CHUNK, store=store,
                                  kv_cache_memory="8MiB", enable_prefix_caching=False,
                                  store_load_batch=batch, chunk_check=check, stream_loads=stream), client=client)


def run(engine: LLMEngine, prompt: list[int]):
    seq = engine.add_request(prompt, PARAMS)
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


def _seed(address: str, reference, check="auto") -> list[bytes]:
    eng = make_engine(address, check=check)
    try:
        seq = run(eng, PROMPT)
        assert eng.connector.flush(timeout_s=120)
        assert list(seq.output) == reference and eng.connector.stats.chunks_saved == 10
        return [bytes(k) for k in eng.connector.keys(PROMPT, None)]
    finally:
        eng.close()


def _rdma_if(transport: str, monkeypatch) -> None:
    """For ``rdma``: the verbs simulated where no device is (``simulate_rdma``), before any node starts."""
    from kvstore.transport.rdma import probe
    from tests.transport.simulated_hca import simulate_rdma

    if transport == "rdma" and probe() is not None:
        simulate_rdma(monkeypatch)


@pytest.mark.parametrize("transport", ["shm", "tcp", "rdma"])
@pytest.mark.parametrize("check", ["xxh3", "wsum"])
@pytest.mark.parametrize("bad", [0, 5, 9])
def test_a_bad_chunk_mid_load_recomputes_from_exactly_that_chunk(nodes, reference, bad, check, transport,
                                                                  monkeypatch):
    """In place (shm), xxh3 payloads are checked before they land; wsum64 payloads where they
    landed, layer by layer beside the step that needs them (the GPU's way; here on the CPU):
    the chunks after a bad one land too, the step computes over them, and is thrown away and
    recomputed from exactly the bad chunk. Streamed (tcp, rdma), both checks end with the
    stream, after the step: thrown away too."""
    from kvstore.chunk import CHECK_WSUM, CHECK_XXH3, parse_header

    _rdma_if(transport, monkeypatch)
    node = nodes()
    keys = _seed(node.address, reference, check)
    with StoreClient(node.address) as c:
        raw = bytearray(c.get(keys[bad]))
        assert parse_header(raw).check == {"xxh3": CHECK_XXH3, "wsum": CHECK_WSUM}[check]
        raw[-1] ^= 0x40  # one payload bit
        c.put(keys[bad], raw)
    # chunk 5 is in the middle of batch 2, 9 ends the last one
    eng = make_engine(client=StoreClient(node.address, transport=transport), batch=2)
    try:
        assert eng.connector.client.transport == transport
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference
        assert seq.num_store_tokens == bad * CHUNK and st.chunks_loaded == bad and st.load_failures == 1
        # checked after the step that computed beside its landing: thrown away
        assert st.late_failures == (1 if check == "wsum" or transport != "shm" else 0)
        assert st.chunks_loaded_in_place == (bad if transport == "shm" else 0)
        assert eng.connector.pool.in_use == 0
        assert eng.connector.flush(timeout_s=120)
    finally:
        eng.close()
    eng = make_engine(node.address)  # the recompute replaced the bad chunk
    try:
        seq = run(eng, PROMPT)
        assert list(seq.output) == reference and seq.num_store_tokens == 10 * CHUNK
    finally:
        eng.close()


def test_a_node_killed_mid_load_through_the_staging_pool(reference):
    node = StoreProcess("--dram", "16MiB")
    try:
        _seed(node.address, reference)
        client = StoreClient(node.address, transport="tcp")
        real = client.batch_get_into
        calls = []

        def batch_get_into(keys, bufs):  # the real call; the node dies after the first batch
            calls.append(len(keys))
            if len(calls) == 2:
                node.kill9()
            return real(keys, bufs)

        client.batch_get_into = batch_get_into
        eng = make_engine(client=client, batch=3, stream=False)
        try:
            seq = run(eng, PROMPT)
            assert list(seq.output) == reference
            assert seq.num_store_tokens == 3 * CHUNK  # batch 0 landed; batch 1's fetch met a dead node
            assert eng.connector.stats.store_errors >= 1 and eng.connector.pool.in_use == 0
        finally:
            eng.close()
    finally:
        node.stop()


def test_a_thousand_loads_never_leak_a_buffer(nodes, reference):
    node = nodes()
    keys = _seed(node.address, reference)
    with StoreClient(node.address) as c:
        c.delete([keys[7]])  # a miss
        raw = bytearray(c.get(keys[9]))
        raw[200] ^= 1  # a header byte: fails verification
        c.put(keys[9], raw)
    eng = make_engine(node.address, batch=2)
    conn = eng.connector
    pool = conn.pool
    ptrs = [pool.tensor(i).data_ptr() for i in range(pool.count)]
    per_chunk = CHUNK // eng.cfg.page_size
    pages = list(range(10 * per_chunk))
    rng = random.Random(3)
    try:
        want = {0: 7, 6: 1, 8: 1}  # first chunk -> chunks it loads before the miss (7) or the bad one (9)
        for i in range(1000):
            first = rng.choice(list(want))
            num = 10 - first
            got = conn.load(PROMPT, None, pages, first, num)
            assert got == min(want[first], num), (i, first, got)
            assert pool.in_use == 0
        assert [pool.tensor(i).data_ptr() for i in range(pool.count)] == ptrs  # the same buffers throughout
    finally:
        eng.close()


def test_saves_never_make_the_engine_wait_on_a_hung_store(reference):
    """Two save buffers and a frozen store: the engine computes on, skips (and counts) the
    chunks it has no buffer for, and every buffer comes back once the store answers."""
    import os
    import signal

    node = StoreProcess("--dram", "16MiB")
    eng = None
    try:
        eng = LLMEngine(EngineConfig(model="random:tiny", dtype="float32", chunk_tokens=CHUNK, store=node.address,
                                     kv_cache_memory="8MiB", enable_prefix_caching=False, load_from_store=False,
                                     store_save_buffers=2))
        conn = eng.connector
        freeze(node.pid)
        try:
            seq = run(eng, PROMPT)
            assert list(seq.output) == reference
            assert conn.stats.save_failures == 8 and conn.save_pool.in_use == 2  # two wait for the store
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert conn.flush(timeout_s=120)
        assert conn.stats.chunks_saved == 2 and conn.save_pool.in_use == 0
        with StoreClient(node.address) as c:
            assert c.exists([bytes(k) for k in conn.keys(PROMPT, None)[:2]]) == [True, True]
    finally:
        if eng is not None:
            eng.close()
        node.stop()


# ---- in place: leased chunks read where the node keeps them (same host) -------------------------


@pytest.mark.parametrize("transport", ["shm", "tcp", "rdma"])
def test_same_host_loads_read_the_leased_slots_in_place(nodes, reference, transport, monkeypatch):
    """shm reads the leased slots in place; the others stream every chunk (rdma: READs into
    the ring, as an engine on another host does)."""
    _rdma_if(transport, monkeypatch)
    node = nodes()
    _seed(node.address, reference)
    eng = make_engine(client=StoreClient(node.address, transport=transport), batch=3)
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference and seq.num_store_tokens == 10 * CHUNK
        assert st.chunks_loaded_in_place == (10 if transport == "shm" else 0)
        assert eng.connector.pool.in_use == 0
        assert node.transport.leases.stats()["num_remote_leases"] == 0  # every lease ended
        moved = eng.connector.client.stats()["movers"]
        assert moved[transport]["num_reads"] >= 1, moved  # rdma: every chunk read with READs
    finally:
        eng.close()


@pytest.mark.parametrize("check", ["xxh3", "wsum"])
def test_chunks_in_slots_that_are_not_one_run_land_in_place_too(nodes, reference, monkeypatch, check):
    """A fragmented arena (small values freed between larger ones) hands a chunk slots with gaps
    between them: its payload is gathered into one tensor (page-locked on a GPU engine) and
    lands like the others, with the same tokens."""
    from engine.kv_connector import StoreConnector

    node = nodes(slot_size=4096)
    fragment_arena(node.address, 600)
    _seed(node.address, reference, check=check)
    gathered = []
    real = StoreConnector._gather_extents

    def spy(self, mover, extents):
        gathered.append(len(extents))
        return real(self, mover, extents)

    monkeypatch.setattr(StoreConnector, "_gather_extents", spy)
    eng = make_engine(client=StoreClient(node.address, transport="shm"), batch=3, check=check)
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference and seq.num_store_tokens == 10 * CHUNK
        assert st.chunks_loaded_in_place == 10 and st.verify_failures == 0
        assert gathered and max(gathered) > 1  # chunks whose payload had gaps
        assert node.transport.leases.stats()["num_remote_leases"] == 0
    finally:
        eng.close()


def test_an_in_place_copy_that_outlives_its_lease_is_a_miss(nodes, reference, monkeypatch):
    """The node may reuse a slot once the lease is over: a chunk whose copy ended after the
    lease's safe end is not trusted, whatever it looked like. Here the copies of the last layer
    end after every lease ran out: the step that computed beside them is thrown away and the
    whole prompt recomputed."""
    import time

    from engine.kv_transfer import LayerwiseLanding

    node = nodes(lease_ttl_s=0.5)
    _seed(node.address, reference)
    eng = make_engine(node.address, batch=4)
    real = LayerwiseLanding.wait

    def wait(self, layer):  # the engine's own copies, the last layer's made slow
        if layer == self.num_layers - 1 and self.landed_layers == layer:
            time.sleep(1.5)
        return real(self, layer)

    monkeypatch.setattr(LayerwiseLanding, "wait", wait)
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference
        assert seq.num_store_tokens == 0 and st.chunks_loaded == 0 and st.late_failures == 1
        assert any("ran out" in e or "expired" in e for e in st.errors), st.errors
        assert node.transport.leases.stats()["num_remote_leases"] == 0
    finally:
        eng.close()


def _pages_equal(eng, ref_eng, ref_seq, loaded_pages, layers) -> bool:
    import torch

    return all(torch.equal(mine[i][loaded_pages], theirs[i][ref_seq.pages[: len(loaded_pages)]])
               for i in layers
               for mine, theirs in ((eng.runner.k_caches, ref_eng.runner.k_caches),
                                    (eng.runner.v_caches, ref_eng.runner.v_caches)))


def test_a_load_lands_layer_by_layer_beside_the_step_and_holds_its_leases_until_then(nodes, reference,
                                                                                      monkeypatch):
    """The step computes while the chunks land: when layer l computes, layer l of every loaded
    chunk is in its pages and no later layer is yet; the read leases are held until the copies
    have completed, and ended after; the pages hold exactly what recomputing writes."""
    from engine.kv_transfer import LayerwiseLanding

    node = nodes()
    _seed(node.address, reference)
    ref_eng = make_engine()
    seq = ref_eng.add_request(PROMPT, PARAMS)
    ref_eng.step()  # the whole prompt in one step (chunked prefill budget permitting)
    eng = make_engine(node.address, batch=3)
    loaded_pages = list(range(10 * CHUNK // eng.cfg.page_size))
    seen = []
    real = LayerwiseLanding.wait

    def wait(self, layer):
        ks = eng.runner.k_caches
        filled = [bool(ks[i][loaded_pages].any()) for i in range(len(ks))]
        real(self, layer)
        after = [bool(ks[i][loaded_pages].any()) for i in range(len(ks))]
        leases = node.transport.leases.stats()["num_remote_leases"]
        seen.append((layer, filled, after, leases))

    monkeypatch.setattr(LayerwiseLanding, "wait", wait)
    try:
        seq2 = eng.add_request(PROMPT, PARAMS)
        eng.step()
        layers = len(eng.runner.k_caches)
        assert [s[0] for s in seen] == list(range(layers))  # once per layer, in order, before it computes
        for layer, filled, after, leases in seen:
            assert filled == [i < layer for i in range(layers)]
            assert after == [i <= layer for i in range(layers)]
            assert leases == 4  # 10 chunks in leases of 3: all held while the step computes
        assert node.transport.leases.stats()["num_remote_leases"] == 0
        assert seq2.num_store_tokens == 10 * CHUNK and eng.connector.stats.chunks_loaded_in_place == 10
        assert _pages_equal(eng, ref_eng, seq, loaded_pages, range(layers))
        while not seq2.is_finished:
            eng.step()
        assert list(seq2.output) == reference
    finally:
        eng.close()
        ref_eng.close()


def test_a_node_killed_while_its_chunks_land_in_place(reference, monkeypatch):
    """The node dies while the step computes beside the copies from its arena (still mapped
    here): its leases cannot be ended, so nothing read under them is trusted; the step is
    thrown away and the prompt recomputed, with the same tokens."""
    from engine.kv_transfer import LayerwiseLanding

    node = StoreProcess("--dram", "16MiB")
    try:
        _seed(node.address, reference)
        eng = make_engine(client=StoreClient(node.address, transport="shm", timeout_s=30), batch=4)
        real = LayerwiseLanding.wait

        def wait(self, layer):
            if layer == 1 and node.proc.poll() is None:
                node.kill9()
            return real(self, layer)

        monkeypatch.setattr(LayerwiseLanding, "wait", wait)
        try:
            seq = run(eng, PROMPT)
            st = eng.connector.stats
            assert list(seq.output) == reference
            assert seq.num_store_tokens == 0 and st.late_failures == 1 and st.chunks_loaded == 0
        finally:
            eng.close()
    finally:
        node.stop()


@pytest.fixture
def disk_nodes(tmp_path):
    yield from store_nodes(tmp_path, with_disk=True)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("lead_in_dram", [0, 3])
def test_chunks_on_the_nodes_disk_load_after_those_in_place(disk_nodes, reference, lead_in_dram, stream):
    """A same-host load reads the node's arena in place up to the first chunk the node holds on
    disk, then the rest streamed layer-major (or through the staging pool, pinned on CUDA; the
    node reads disk values into it): every chunk loads, and the tokens are the recomputed ones."""
    from kvstore.store import Tier

    node = disk_nodes(dram=8 * (32 << 10), slot_size=32 << 10, promote=False)
    keys = _seed(node.address, reference)  # 10 chunks into 8 slots: the oldest go to disk
    with StoreClient(node.address) as c:
        again = c.batch_get(keys[:lead_in_dram])
        assert all(v is not None for v in again)
        c.batch_put(list(zip(keys[:lead_in_dram], again)))  # the same bytes, now the newest (in DRAM)
    assert node.store.settle()
    tiers = [node.store.tier_of(k) for k in keys]
    lead = next(i for i, t in enumerate(tiers) if t is not Tier.DRAM)
    assert lead == lead_in_dram and Tier.DISK in tiers[lead:], tiers
    disk_hits = node.store.stats()["tiers"][Tier.DISK]["hits"]
    eng = make_engine(node.address, batch=3, stream=stream)
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference and seq.num_store_tokens == 10 * CHUNK, st.errors
        assert st.chunks_loaded == 10 and st.chunks_loaded_in_place == lead and st.load_failures == 0
        assert node.store.stats()["tiers"][Tier.DISK]["hits"] - disk_hits == tiers.count(Tier.DISK)
        assert eng.connector.pool.in_use == 0
        # batch_get_into's releases are sent without waiting for the node: it ends them on arrival
        wait_for(lambda: node.transport.leases.stats()["num_remote_leases"] == 0, what="every lease to end")
    finally:
        eng.close()


def test_a_layerwise_landing_lands_each_layer_when_asked_and_the_rest_at_finish():
    """On the CPU: ``wait(l)`` lands layers up to l of every chunk into its own pages and nothing
    later; ``finish`` lands what the step did not ask for; each chunk's wsum64 comes back as it
    landed; the pages hold what the page scatter's twin writes."""
    import torch

    from engine.kv_transfer import LayerwiseLanding
    from kernels.reference import scatter_kv_pages
    from kvstore.chunk import wsum64

    class Caches:  # what a landing needs of the model runner: its caches, device and streams
        device, transfer_stream = torch.device("cpu"), None
        k_caches = [torch.zeros(12, 4, 2, 8) for _ in range(3)]
        v_caches = [torch.zeros(12, 4, 2, 8) for _ in range(3)]

    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(3, 2, 2, 8, 8, generator=g) for _ in range(3)]  # [L, 2, KVH, 8 tokens, D]
    pages = [[7, 1], [4, 10], [0, 3]]
    landing = LayerwiseLanding(Caches, chunks, pages, checksum=True)
    landing.start()
    landing.wait(0)
    assert Caches.k_caches[0].any() and not Caches.k_caches[1].any() and not Caches.v_caches[2].any()
    sums = landing.finish()
    assert sums.tolist() == [int(wsum64(c)) for c in chunks]
    want_k = [torch.zeros(12, 4, 2, 8) for _ in range(3)]
    want_v = [torch.zeros(12, 4, 2, 8) for _ in range(3)]
    for c, p in zip(chunks, pages):
        scatter_kv_pages(c, want_k, want_v, torch.tensor(p, dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(Caches.k_caches + Caches.v_caches, want_k + want_v))


# ---- streamed: another host's node sends chunks layer-major, landed beside the step ---------------


def test_chunks_from_another_host_stream_in_layer_by_layer_beside_the_step(nodes, reference, monkeypatch):
    """Over TCP the node sends every chunk's header, then layer 0 of all, layer 1, … and the
    step computes layer l as soon as layer l has landed. Layer 1's bytes are held on the
    socket until layer 0 has computed: a load that waited for every layer before the step could
    not finish. When layer l computes, layers <= l hold exactly what recomputing writes."""
    from engine.kv_transfer import StreamedLanding

    node = nodes()
    _seed(node.address, reference)
    ref_eng = make_engine()
    ref_seq = ref_eng.add_request(PROMPT, PARAMS)
    ref_eng.step()
    eng = make_engine(client=StoreClient(node.address, transport="tcp"), batch=3)
    layers = len(eng.runner.k_caches)
    loaded_pages = list(range(10 * CHUNK // eng.cfg.page_size))
    layer0_computed = threading.Event()
    real_dest, real_wait = StreamedLanding._dest, StreamedLanding.wait
    seen = []

    def dest(self, j, part):
        if part == 1 and j == 0:
            assert layer0_computed.wait(120), "layer 1 was wanted before layer 0 computed"
        return real_dest(self, j, part)

    def wait(self, layer):
        later_empty = not any(bool(eng.runner.k_caches[i][loaded_pages].any()) for i in range(max(layer, 1), layers))
        if layer == 1:
            layer0_computed.set()
        real_wait(self, layer)
        seen.append((layer, later_empty, _pages_equal(eng, ref_eng, ref_seq, loaded_pages, range(layer + 1))))

    monkeypatch.setattr(StreamedLanding, "_dest", dest)
    monkeypatch.setattr(StreamedLanding, "wait", wait)
    try:
        seq = eng.add_request(PROMPT, PARAMS)
        eng.step()
        assert [s[0] for s in seen] == list(range(layers))
        assert seen[0][1] and seen[1][1]  # layer 1 and later were still on the wire as the step began
        assert all(ok for *_, ok in seen)
        st = eng.connector.stats
        assert seq.num_store_tokens == 10 * CHUNK and st.chunks_loaded == 10 and st.chunks_loaded_in_place == 0
        assert st.late_failures == 0 and _pages_equal(eng, ref_eng, ref_seq, loaded_pages, range(layers))
        while not seq.is_finished:
            eng.step()
        assert list(seq.output) == reference
    finally:
        eng.close()
        ref_eng.close()


def test_a_header_that_fails_stops_the_stream_there_before_the_step(nodes, reference):
    node = nodes()
    keys = _seed(node.address, reference)
    with StoreClient(node.address) as c:
        raw = bytearray(c.get(keys[4]))
        raw[200] ^= 1  # a header byte
        c.put(keys[4], raw)
    eng = make_engine(client=StoreClient(node.address, transport="tcp"))
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference
        assert seq.num_store_tokens == 4 * CHUNK and st.late_failures == 0 and st.verify_failures == 1
    finally:
        eng.close()


def test_a_stream_that_breaks_mid_step_throws_the_step_away(nodes, reference, monkeypatch):
    """The connection dies after layer 0 of the first chunk (its socket closed under the
    stream): no chunk arrives whole, the step that computed beside the stream
    is thrown away and the prompt recomputed, with the same tokens; the next load streams
    again on a new connection."""
    from engine.kv_transfer import StreamedLanding

    node = nodes()
    _seed(node.address, reference)
    client = StoreClient(node.address, transport="tcp")
    eng = make_engine(client=client)
    real, real_wait = StreamedLanding._arrived, StreamedLanding.wait
    broke, step_began = [], threading.Event()

    def arrived(self, j, part):
        real(self, j, part)
        if (j, part) == (0, 0) and not broke:
            assert step_began.wait(120)
            broke.append(True)
            client._data_channel().current().sock.close()

    def wait(self, layer):
        step_began.set()
        real_wait(self, layer)

    monkeypatch.setattr(StreamedLanding, "_arrived", arrived)
    monkeypatch.setattr(StreamedLanding, "wait", wait)
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert broke and list(seq.output) == reference
        assert seq.num_store_tokens == 0 and st.late_failures == 1 and st.chunks_loaded == 0
        seq = run(eng, PROMPT)  # the recompute saved nothing new (the chunks were there): they stream again
        assert list(seq.output) == reference and seq.num_store_tokens == 10 * CHUNK
    finally:
        eng.close()


def test_a_node_that_stalls_before_its_headers_is_recomputed_not_waited_on(reference, monkeypatch):
    node = StoreProcess("--dram", "16MiB")
    eng = None
    try:
        _seed(node.address, reference)
        eng = make_engine(client=StoreClient(node.address, transport="tcp", timeout_s=60))
        conn = eng.connector
        conn.stream_timeout_s = 3.0  # how long a load waits for headers before recomputing
        real = conn.lookup

        def lookup(tokens, salt):
            n = real(tokens, salt)
            freeze(node.pid)  # after the lookup: the load's stream meets a frozen node
            return n

        monkeypatch.setattr(conn, "lookup", lookup)
        try:
            seq = run(eng, PROMPT)
        finally:
            import os
            import signal

            os.kill(node.pid, signal.SIGCONT)
        assert list(seq.output) == reference and seq.num_store_tokens == 0
        assert any("no chunk headers" in e for e in conn.stats.errors)
    finally:
        if eng is not None:
            eng.close()
        node.stop()


def test_streamed_loads_reuse_their_ring_and_leak_no_thread(nodes, reference):
    node = nodes()
    keys = _seed(node.address, reference)
    with StoreClient(node.address) as c:
        c.delete([keys[7]])  # a miss
        raw = bytearray(c.get(keys[9]))
        raw[-1] ^= 1  # a payload bit: found as it streams in
        c.put(keys[9], raw)
    eng = make_engine(client=StoreClient(node.address, transport="tcp"))
    conn = eng.connector
    ring = conn.stream_ring.buf.data_ptr()
    per_chunk = CHUNK // eng.cfg.page_size
    pages = list(range(10 * per_chunk))
    rng = random.Random(4)
    try:
        threads = None
        want = {0: 7, 6: 1, 8: 1}  # first chunk -> chunks good before the miss (7) or the bad payload (9)
        for i in range(300):
            first = rng.choice(list(want))
            got = conn.load(PROMPT, None, pages, first, 10 - first)
            assert got == want[first], (i, first, got)
            if i == 10:
                threads = threading.active_count()
        assert threading.active_count() == threads and conn.stream_ring.buf.data_ptr() == ring
        assert conn.pool.in_use == 0 and not any("whole" in e or "headers" in e for e in conn.stats.errors)
    finally:
        eng.close()


def test_two_sequences_stream_in_the_same_step_one_after_the_other_through_one_ring(nodes, reference):
    node = nodes()
    other = [random.Random(9).randrange(0, 500) for _ in range(6 * CHUNK + 3)]
    _seed(node.address, reference)
    eng = make_engine(node.address)
    try:
        want_other = list(run(eng, other).output)  # computed, and its chunks saved
        assert eng.connector.flush(timeout_s=120)
    finally:
        eng.close()
    eng = make_engine(client=StoreClient(node.address, transport="tcp"))
    try:
        a, b = eng.add_request(PROMPT, PARAMS), eng.add_request(other, PARAMS)
        eng.step()
        assert a.num_computed > 10 * CHUNK and b.num_computed > 6 * CHUNK  # both loaded, in that one step
        while not (a.is_finished and b.is_finished):
            eng.step()
        assert list(a.output) == reference and list(b.output) == want_other
        assert a.num_store_tokens == 10 * CHUNK and b.num_store_tokens == 6 * CHUNK
        assert eng.connector.stats.late_failures == 0 and eng.connector.stats.chunks_loaded == 16
    finally:
        eng.close()


@pytest.mark.parametrize("bad", [None, 4])
def test_a_node_read_one_sided_streams_layer_by_layer_too(nodes, reference, monkeypatch, bad):
    """A node this engine reads with one-sided reads (RDMA across hosts) streams through
    ``DescriptorSession.get_layered``: one lease, each chunk's header, then layer 0 of all,
    layer 1, … read straight into the ring beside the step. RDMA cannot run here, so the same
    protocol runs over the shm mover, with in-place loads turned off to make the load stream:
    exact tokens, the lease ended, and a changed payload fails its check after the step and is
    recomputed from exactly that chunk."""
    from engine.kv_connector import StoreConnector

    node = nodes()
    keys = _seed(node.address, reference)
    if bad is not None:
        with StoreClient(node.address) as c:
            raw = bytearray(c.get(keys[bad]))
            raw[-1] ^= 0x08
            c.put(keys[bad], raw)
    client = StoreClient(node.address, transport="shm")
    session = client.descriptor_session()
    streams = []

    def get_layered(*args):
        streams.append(len(args[0]))
        return session.get_layered(*args)

    monkeypatch.setattr(StoreConnector, "_in_place_session", lambda self: None)
    monkeypatch.setattr(StoreConnector, "_layered_reader", lambda self: get_layered)
    eng = make_engine(client=client, batch=3)
    try:
        seq = run(eng, PROMPT)
        st = eng.connector.stats
        assert list(seq.output) == reference
        assert streams[0] == 10  # the whole prefix in one one-sided stream
        assert seq.num_store_tokens == (10 if bad is None else bad) * CHUNK
        assert st.chunks_loaded_in_place == 0 and st.late_failures == (0 if bad is None else 1)
        assert session.num_invalid_reads == 0 and eng.connector.pool.in_use == 0
        assert node.transport.leases.stats()["num_remote_leases"] == 0
    finally:
        eng.close()


def test_loads_and_saves_copy_only_through_buffers_made_at_start(nodes, reference, monkeypatch):
    """What an RDMA session registers once (``StoreConnector._long_lived_buffers``: the staging
    pools, the stream ring and its drain) is every buffer a load or a save copies into or out
    of, but the chunks' headers (a few hundred bytes each): a layer-major stream, a load through
    the pool and the saves of a new prompt, each through a one-sided session's mover (shm
    here: RDMA cannot run, and registers exactly what this records)."""
    from engine.kv_connector import StoreConnector
    from kvstore.transport.rdma import Regions

    node = nodes()
    _seed(node.address, reference)
    client = StoreClient(node.address, transport="shm")
    session = client.descriptor_session()
    m = session._handle.mover
    seen = []
    for name in ("read", "write"):
        def spy(ops, bufs, real=getattr(m, name), name=name):
            seen.extend((name, a, n) for a, n in bufs)
            return real(ops, bufs)

        monkeypatch.setattr(m, name, spy)
    monkeypatch.setattr(StoreConnector, "_in_place_session", lambda self: None)
    monkeypatch.setattr(StoreConnector, "_layered_reader", lambda self: session.get_layered)
    eng = make_engine(client=client, batch=3)
    try:
        conn = eng.connector
        regions = Regions()
        for a, n in conn._long_lived_buffers():
            regions.add(a, n, (a, n))
        head = conn.chunk_bytes - conn.payload_bytes
        assert list(run(eng, PROMPT).output) == reference  # streamed, layer-major
        phases = [len(seen)]
        monkeypatch.setattr(StoreConnector, "_layered_reader", lambda self: None)
        assert list(run(eng, PROMPT).output) == reference  # through the staging pool
        phases.append(len(seen))
        assert conn.stats.chunks_loaded == 20 and conn.stats.verify_failures == 0
        other = [t + 1 for t in PROMPT]
        run(eng, other)
        assert conn.flush(timeout_s=120) and conn.stats.chunks_saved >= 10
        phases.append(len(seen))
        assert 0 < phases[0] < phases[1] < phases[2]
        assert any(op == "write" for op, _, _ in seen[phases[1]:])
        outside = [(op, n) for op, a, n in seen if n != head and regions.covering(a, n) is None]
        assert outside == []
        assert sum(1 for _, _, n in seen if n == head) <= 20  # one header per chunk streamed
    finally:
        eng.close()


@pytest.mark.parametrize("group", [3, 32])
def test_rdma_streams_read_ahead_through_the_ring_beside_the_step(nodes, reference, monkeypatch, group):
    """The connector's own RDMA reader (``_layered_reader``: ``get_layered`` with ``ahead`` at most
    a ring group) over reads that land asynchronously (an RDMA mover on a simulated HCA whose
    remote memory is the node's arena: no ibverbs device here), the ring's groups smaller than a
    layer's chunks (3: four groups a layer, the lander freeing units while later ones are read
    ahead) or not: exact tokens, every chunk from the stream, the reads into the ring registered
    once (none per part but the headers), nothing leased or taken at the end."""
    from engine import kv_connector
    from engine.kv_connector import StoreConnector
    from kvstore.transport.descriptors import Mover
    from tests.transport.simulated_hca import reads_over_simulated_rdma

    node = nodes()
    _seed(node.address, reference)
    client = StoreClient(node.address, transport="shm")
    session = client.descriptor_session()
    streams = []
    real = session.get_layered

    def get_layered(*args, **kwargs):
        streams.append(kwargs.get("ahead"))
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "get_layered", get_layered)
    monkeypatch.setattr(kv_connector, "STAGE_CHUNKS", group)
    monkeypatch.setattr(StoreConnector, "_in_place_session", lambda self: None)
    monkeypatch.setattr(StoreConnector, "_session", lambda self, mover: session if mover is Mover.RDMA else None)
    with reads_over_simulated_rdma(session) as hca:
        eng = make_engine(client=client, batch=3)
        try:
            session.register_buffers(eng.connector._host_buffers)
            seq = run(eng, PROMPT)
            st = eng.connector.stats
            assert list(seq.output) == reference
            assert streams == [min(8, group)] and eng.connector.stream_ring.group == group
            assert seq.num_store_tokens == 10 * CHUNK and st.chunks_loaded_in_place == 0
            rdma = session._handle.mover.rdma
            assert rdma.num_registrations == 10 and rdma.num_reconnects == 0  # the headers' buffers only
            assert hca.executed > 10 * 2  # the heads and every layer of every chunk
            assert session.num_invalid_reads == 0 and eng.connector.pool.in_use == 0
            assert all(ev.is_set() for ev in eng.connector.stream_ring.free)
            assert node.transport.leases.stats()["num_remote_leases"] == 0
        finally:
            eng.close()  # and the client
