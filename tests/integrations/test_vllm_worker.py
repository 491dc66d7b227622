"""The vLLM connector's worker side (kvstore/integrations/vllm_worker.py) without vLLM: paged caches
of the backend written in test_paged.py, a real store node on loopback. Chunks saved from one
worker's cache are loaded into another's, synchronously and by the loader thread (``load_async``),
whose end of load is reported with, never before, the blocks that failed."""

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.chunk import CHECK_WSUM, parse_header
from kvstore.config import StoreConfig
from kvstore.integrations.storelink import StoreLink, StoreLinkConfig
from kvstore.integrations.vllm_plan import ChunkOp, RequestOps
from kvstore.integrations.vllm_worker import WorkerSide
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_keys, make_namespace
from kvstore.server import StoreNode
from tests.integrations.test_paged import BS, D, H, Backend

LAYERS, C = 2, 2 * BS
NS = make_namespace(ModelFingerprint("worker-test", "float32", num_layers=LAYERS, num_kv_heads=H, head_dim=D,
                                     chunk_tokens=C, tp_rank=0, tp_size=1))
TOKENS = list(range(100, 100 + 3 * C))
KEYS = chunk_keys(TOKENS, NS, C)


@pytest.fixture
def store():
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram=16 << 20)).start()
    yield node
    node.stop(grace=0)


def _worker(address: str, blocks: int = 8, in_place: bool = True) -> tuple[WorkerSide, list[Backend]]:
    config = StoreLinkConfig(address, 10.0, cooldown_s=0.0)
    w = WorkerSide(StoreLink(config), StoreLink(config), lambda scope, index: NS, 0, C, BS, torch.float32)
    w.in_place = in_place
    backends = [Backend(blocks, torch.float32) for _ in range(LAYERS)]
    w.register([(f"layer.{i}", be.cache, be.layout()) for i, be in enumerate(backends)])
    return w, backends


def _ops(block_ids: list[int], chunks=range(3), tokens=TOKENS, keys=KEYS) -> tuple[ChunkOp, ...]:
    per = C // BS
    return tuple(ChunkOp(j, (keys[j],), (keys[j - 1] if j else ROOT_KEY,), tuple(tokens[j * C:(j + 1) * C]),
                         tuple(block_ids[j * per:(j + 1) * per])) for j in chunks)


def _fill_and_save(address: str) -> list[Backend]:
    """A worker whose caches hold the request's KV in blocks 0-5 (written by the backend itself),
    saving its three chunks."""
    w, backends = _worker(address)
    g = torch.Generator().manual_seed(0)
    for be in backends:
        k, v = torch.randn(2, 3 * C, H, D, generator=g)
        be.write(k, v, be.cache, torch.arange(3 * C))
    req = RequestOps("r", None, saves=_ops(list(range(6))))
    w.begin_step([req])
    w.end_step()  # (no layer was handed over during the step: every one is gathered here)
    w.flush()
    assert w.stats.num_saved_chunks == 3
    w.close()
    return backends


def _corrupt(address: str, key: bytes) -> None:
    link = StoreLink(StoreLinkConfig(address, 10.0))
    raw = bytearray(link._client_or_none().get(key))
    raw[-1] ^= 0xFF
    link._client_or_none().put(key, raw)
    link.close()


def _wait_finished(w: WorkerSide, timeout_s: float = 60.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = w.take_finished_loads()
        if done:
            return done
        time.sleep(0.01)
    raise AssertionError("the asynchronous load never finished")


def _blocks_equal(a: Backend, b: Backend, src: list[int], dst: list[int]) -> bool:
    return torch.equal(a.cache[src], b.cache[dst])


def _leases(node: StoreNode) -> int:
    return node.transport.leases.stats()["num_remote_leases"]


def _no_leases_left(node: StoreNode) -> bool:
    """Every read lease ended (a copied load's client ends its leases without waiting for the
    node's answer: given a while to arrive)."""
    deadline = time.monotonic() + 30
    while _leases(node) and time.monotonic() < deadline:
        time.sleep(0.01)
    return _leases(node) == 0


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("load_async", [False, True])
def test_chunks_saved_from_one_worker_load_into_another_workers_blocks(store, load_async, in_place):
    """Loads read the node's arena where it keeps the chunks (a node on this host: under a read
    lease, ended with the load), or copy them into the worker's buffer first."""
    src = _fill_and_save(store.address)
    w, backends = _worker(store.address, in_place=in_place)
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst), async_load=load_async)])
    if load_async:
        assert _wait_finished(w) == {"r"}
    else:
        assert w.take_finished_loads() == set()
    assert w.take_invalid_blocks() == set()
    for a, b in zip(src, backends):
        assert _blocks_equal(a, b, list(range(6)), dst)
    assert w.stats.num_loaded_chunks == 3 and w.stats.num_loaded_tokens == 3 * C
    assert (id(w.link) in w._staging or id(w.load_link) in w._staging) != in_place
    assert w.stats.num_in_place_chunks == (3 if in_place else 0)
    assert _no_leases_left(store)
    w.close()


def test_a_load_from_inside_a_chunk_keeps_the_blocks_before_it_and_the_buffer_grows(store):
    """A one-chunk load, then a three-chunk one whose first chunk starts at its second block (vLLM
    computed the first): the worker's read buffer grows for the second, the block before the start
    keeps what it held, every other block gets the saved KV."""
    src = _fill_and_save(store.address)
    w, backends = _worker(store.address, in_place=False)
    w.begin_step([])
    w.load([RequestOps("one", None, loads=_ops([4, 0], [0]))])
    small = w._staging[id(w.link)].numel()
    ops = list(_ops([7, 2, 5, 1, 3, 6]))
    ops[0] = ChunkOp(ops[0].index, ops[0].keys, ops[0].parents, ops[0].tokens, ops[0].block_ids, first_block=1)
    before = [be.cache[7].clone() for be in backends]
    w.load([RequestOps("r", None, loads=tuple(ops))])
    assert w._staging[id(w.link)].numel() > small
    assert w.take_invalid_blocks() == set()
    for a, b, old in zip(src, backends, before):
        assert torch.equal(b.cache[7], old)
        assert _blocks_equal(a, b, [1, 2, 3, 4, 5], [2, 5, 1, 3, 6])
        assert _blocks_equal(a, b, [0, 1], [4, 0])
    w.close()


@pytest.mark.gpu
def test_chunks_save_from_and_load_into_caches_on_the_gpu(store):
    """Caches on a CUDA device: a worker saves three chunks from them (layer 0 handed over during
    the step, layer 1 gathered at its end; wsum64 summed on the device; the saver thread DMAs them
    into the slots it reserved in the node's registered arena, then again through pinned memory as
    for a node elsewhere), a CPU worker loads them and reads what the device held, and another GPU worker loads
    them into other blocks, every layer before the forward and layer by layer (read into its pinned
    buffer, or DMA'd straight from the node's registered arena under a lease; each layer scattered
    on a transfer stream, its wsum64 summed there); a chunk corrupted in the store is caught by that
    device sum and its blocks reported."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def gpu_worker():
        config = StoreLinkConfig(store.address, 10.0, cooldown_s=0.0)
        w = WorkerSide(StoreLink(config), StoreLink(config), lambda scope, index: NS, 0, C, BS, torch.float32)
        backends = [Backend(8, torch.float32) for _ in range(LAYERS)]
        caches = [be.cache.cuda() for be in backends]
        w.register([(f"layer.{i}", cache, dataclasses.replace(be.layout(), index=be.layout().index.cuda()))
                    for i, (be, cache) in enumerate(zip(backends, caches))])
        w.warm_up(3 * C)  # (the arena registered, the transfer stream and device stage made now)
        return w, backends, caches

    w, backends, caches = gpu_worker()
    g = torch.Generator().manual_seed(0)
    for be, cache in zip(backends, caches):
        k, v = torch.randn(2, 3 * C, H, D, generator=g)
        be.write(k, v, be.cache, torch.arange(3 * C))
        cache.copy_(be.cache)
    w.begin_step([RequestOps("r", None, saves=_ops(list(range(6))))])
    w.save_layer("layer.0", caches[0])
    w.end_step()
    w.flush()
    assert w.stats.num_saved_chunks == 3
    assert w.stats.num_device_saved_chunks == 3  # (DMA'd from the device into the registered arena)
    w.save_link._no_shm = True  # (as for a node on another host: one DMA into pinned memory first)
    w.begin_step([RequestOps("r", None, saves=_ops(list(range(6))))])
    w.end_step()
    w.flush()
    assert w.stats.num_saved_chunks == 6 and w.stats.num_device_saved_chunks == 3
    w.close()
    cpu, cpu_backends = _worker(store.address)
    dst = [7, 2, 5, 1, 3, 6]
    cpu.begin_step([])
    cpu.load([RequestOps("r", None, loads=_ops(dst))])
    assert cpu.take_invalid_blocks() == set()
    for cache, b in zip(caches, cpu_backends):
        assert torch.equal(cache[:6].cpu(), b.cache[dst])
    cpu.close()
    link = StoreLink(StoreLinkConfig(store.address, 10.0))
    assert parse_header(link._client_or_none().get(KEYS[0])).check == CHECK_WSUM  # (summed on the device)
    link.close()
    w2, _, caches2 = gpu_worker()
    for in_place, layerwise in ((False, False), (True, False), (True, True)):
        w2.in_place = in_place
        for cache2 in caches2:
            cache2.zero_()
        w2.begin_step([])
        w2.load([RequestOps("r", None, loads=_ops(dst))], layerwise=layerwise)
        for i in range(LAYERS):
            w2.wait_layer(f"layer.{i}")  # (the compute stream waits for the layer's copies)
        torch.cuda.current_stream().synchronize()
        for cache, cache2 in zip(caches, caches2):
            assert torch.equal(cache[:6], cache2[dst])
        w2.end_step()
        assert w2.take_invalid_blocks() == set()
    assert w2._staging[id(w2.link)].is_pinned()  # (the copied load's)
    assert w2.link.shm_session(register_cuda=True) is not None  # (the arena registered: in place is DMA)
    assert w2.stats.num_layerwise_loads == 1 and w2.stats.num_loaded_chunks == 9
    _corrupt(store.address, KEYS[2])  # (its header is good: the payload's wsum64 is checked on the device)
    w2.begin_step([])
    w2.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
    assert w2.take_invalid_blocks() == {3, 6}
    assert w2.stats.num_failed_chunks == 1
    w2.close()


def test_an_asynchronous_load_reports_its_failed_blocks_with_its_end(store):
    """Chunk 1 corrupt: chunk 0 is written, chunks 1-2 are not; their blocks come out of
    take_invalid_blocks only once the request was reported finished (vLLM reads both in one pass)."""
    src = _fill_and_save(store.address)
    _corrupt(store.address, KEYS[1])
    w, backends = _worker(store.address)
    dst = [7, 2, 5, 1, 3, 6]
    before = [be.cache.clone() for be in backends]
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst), async_load=True)])
    assert _wait_finished(w) == {"r"}
    assert w.take_invalid_blocks() == {5, 1, 3, 6}
    assert w.take_invalid_blocks() == set()
    for a, b, old in zip(src, backends, before):
        assert _blocks_equal(a, b, [0, 1], [7, 2])
        assert torch.equal(b.cache[[5, 1, 3, 6]], old[[5, 1, 3, 6]])
    assert w.stats.num_failed_chunks == 2 and w.stats.num_loaded_chunks == 1
    w.close()


def test_an_asynchronous_load_from_a_stopped_store_still_ends(store):
    """The node is gone: the request is reported finished with every block invalid (vLLM
    recomputes it), not left waiting; many such loads leave no thread or queue behind."""
    _fill_and_save(store.address)
    w, _ = _worker(store.address)
    store.stop(grace=0)
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([])
    reqs = [RequestOps(f"r{i}", None, loads=_ops(dst, [0]), async_load=True) for i in range(50)]
    w.load(reqs)
    done, invalid = set(), set()
    deadline = time.monotonic() + 120
    while len(done) < 50 and time.monotonic() < deadline:
        done |= w.take_finished_loads()
        invalid |= w.take_invalid_blocks()
        time.sleep(0.01)
    assert done == {r.req_id for r in reqs} and invalid == {7, 2}
    assert w.stats.num_failed_chunks == 50
    loader = w._loader
    w.close()
    assert not loader.is_alive() and w._loads.unfinished_tasks == 0


def test_tokens_of_a_load_are_those_the_chunk_was_saved_under(store):
    """A chunk is verified against the tokens the plan names: other tokens under the same key read
    as a miss (as a collision would), asynchronously as synchronously."""
    _fill_and_save(store.address)
    w, _ = _worker(store.address)
    op = _ops([7, 2])[0]
    wrong = ChunkOp(op.index, op.keys, op.parents, tuple(np.asarray(op.tokens) + 1), op.block_ids)
    w.begin_step([])
    w.load([RequestOps("r", None, loads=(wrong,), async_load=True)])
    assert _wait_finished(w) == {"r"} and w.take_invalid_blocks() == {7, 2}
    w.close()


def test_closing_drops_the_loads_not_yet_begun(store):
    """A worker closed while its loader is busy with one request drops the 199 queued behind it
    (a stalled store costs shutdown one call, not one per request) and still joins the loader."""
    _fill_and_save(store.address)
    w, _ = _worker(store.address)
    busy, release = threading.Event(), threading.Event()

    def namespace_for(scope, index):
        if scope == "first" and index == 0:  # (the loader thread, in the first request's load)
            busy.set()
            assert release.wait(120)
        return NS

    w.namespace_for = namespace_for
    w.begin_step([])
    w.load([RequestOps(f"r{i}", "first" if i == 0 else None, loads=_ops([7, 2, 5, 1, 3, 6]), async_load=True)
            for i in range(200)])
    assert busy.wait(60)
    closer = threading.Thread(target=w.close)
    closer.start()
    deadline = time.monotonic() + 60
    while w._loads.qsize() > 1 and time.monotonic() < deadline:  # (drained: only the stop sentinel left)
        time.sleep(0.01)
    release.set()
    closer.join(120)
    assert not closer.is_alive()
    assert w.stats.num_loaded_chunks == 3 and w.stats.num_failed_chunks == 0
    assert w._loads.unfinished_tasks == 0


def test_a_layerwise_load_writes_each_layer_before_the_forward_reaches_it(store):
    """``layerwise``: the lander thread writes the pages a layer at a time; once ``wait_layer``
    returns for a layer its blocks hold the saved KV (what that layer's attention reads), and the
    step's end counts a load every layer of which the forward waited for."""
    src = _fill_and_save(store.address)
    w, backends = _worker(store.address)
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([RequestOps("r", None, loads=_ops(dst))])
    w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
    for i, (a, b) in enumerate(zip(src, backends)):
        w.wait_layer(f"layer.{i}")
        assert _blocks_equal(a, b, list(range(6)), dst), f"layer {i}"
    w.end_step()
    assert w.take_invalid_blocks() == set()
    assert w.stats.num_layerwise_loads == 1 and w.stats.num_loaded_chunks == 3
    # a step whose forward skipped the hooks still ends with every layer written (not counted)
    again = [be.cache.clone() for be in backends]
    for be in backends:
        be.cache.zero_()
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
    assert w.take_invalid_blocks() == set()
    for old, b in zip(again, backends):
        assert torch.equal(old[dst], b.cache[dst])
    assert w.stats.num_layerwise_loads == 1 and w.stats.num_loaded_chunks == 6
    w.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_two_requests_in_one_step_each_get_their_own_chunks_around_a_bad_one(store, layerwise, in_place):
    """One step loads two requests into one host buffer: the first's chunk 1 is corrupt (its
    chunks 1-2 are neither written nor kept: their slots stay empty), the second's one chunk lands
    after them. The first's failed blocks are reported and its saves this step dropped; the
    second's blocks and the first's chunk 0 hold the saved KV."""
    src = _fill_and_save(store.address)
    _corrupt(store.address, KEYS[1])
    w, backends = _worker(store.address, blocks=10, in_place=in_place)
    a_blocks, b_blocks = [7, 2, 5, 1, 3, 6], [9, 4]
    reqs = [RequestOps("a", None, loads=_ops(a_blocks), saves=_ops([0, 8], [0])),
            RequestOps("b", None, loads=_ops(b_blocks, [0]))]
    before = [be.cache.clone() for be in backends]
    w.begin_step(reqs)
    w.load(reqs, layerwise=layerwise)
    for i in range(LAYERS):
        w.wait_layer(f"layer.{i}")
    w.end_step()
    w.flush()
    assert w.take_invalid_blocks() == {5, 1, 3, 6}
    for a, b, old in zip(src, backends, before):
        assert _blocks_equal(a, b, [0, 1], [7, 2]) and _blocks_equal(a, b, [0, 1], [9, 4])
        assert torch.equal(b.cache[[5, 1, 3, 6]], old[[5, 1, 3, 6]])
    assert w.stats.num_loaded_chunks == 2 and w.stats.num_failed_chunks == 2
    assert w.stats.num_saved_chunks == 0 and w.stats.num_dropped_chunks == 1
    assert _no_leases_left(store)
    w.close()


def test_a_load_whose_pages_cannot_be_written_fails_its_blocks_instead_of_the_step(store):
    """A block id past the end of the cache (a plan that disagrees with vLLM's cache): writing the
    pages fails on the lander thread; the forward's waits still return, and every block of the
    step's loads is reported failed (vLLM recomputes them), none left half-trusted."""
    _fill_and_save(store.address)
    w, _ = _worker(store.address)
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops([7, 2, 5, 1, 3, 999]))], layerwise=True)
    for i in range(LAYERS):
        w.wait_layer(f"layer.{i}")
    w.end_step()
    assert w.take_invalid_blocks() == {7, 2, 5, 1, 3, 999}
    assert w.stats.num_loaded_chunks == 0 and w.stats.num_layerwise_loads == 0
    w.close()


def test_chunks_written_with_the_device_check_load_on_the_cpu(store):
    """A GPU worker writes wsum64 (summed on the device); a CPU worker reading them checks that sum
    on the host: good chunks load, a corrupt one is rejected from where it is."""
    from kvstore.chunk import encode_chunk

    g = torch.Generator().manual_seed(3)
    kv = torch.randn(3, LAYERS, 2, H, C, D, generator=g)
    link = StoreLink(StoreLinkConfig(store.address, 10.0))
    assert link.save([(KEYS[j], encode_chunk(kv[j], NS, KEYS[j - 1] if j else ROOT_KEY, TOKENS[j * C:(j + 1) * C],
                                             CHECK_WSUM)) for j in range(3)]) == 3
    link.close()
    w, backends = _worker(store.address)
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
    assert w.take_invalid_blocks() == set()
    for layer, be in enumerate(backends):
        want = Backend(8, torch.float32)  # (the backend itself writes the same KV in token order)
        k, v = (kv[:, layer, i].permute(0, 2, 1, 3).reshape(3 * C, H, D) for i in (0, 1))
        want.write(k, v, want.cache, torch.arange(3 * C))
        assert _blocks_equal(want, be, list(range(6)), dst), f"layer {layer}"
    _corrupt(store.address, KEYS[2])
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))])
    assert w.take_invalid_blocks() == {3, 6}
    w.close()


def test_an_in_place_load_holds_its_lease_until_its_pages_are_written(store):
    """The layer-wise landing reads the node's arena while the forward runs: the read lease is
    held until every layer is written (the step's end), then ended."""
    src = _fill_and_save(store.address)
    w, backends = _worker(store.address)
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
    assert _leases(store) == 1
    w.wait_layer("layer.0")
    assert _leases(store) == 1
    w.wait_layer("layer.1")
    w.end_step()
    assert _leases(store) == 0 and w.take_invalid_blocks() == set()
    for a, b in zip(src, backends):
        assert _blocks_equal(a, b, list(range(6)), dst)
    assert w._staging == {}  # (nothing was copied into the worker's buffer)
    w.close()


def test_a_lease_that_runs_out_before_its_pages_are_written_fails_the_load(tmp_path):
    """A node whose read leases last 0.3 s and a landing that ends later (a forward that took
    longer than the lease): the node may have reused the slots under the copies, so every block
    of the request is reported failed (vLLM recomputes them), not trusted."""
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram=16 << 20, lease_ttl_s=0.3)).start()
    try:
        _fill_and_save(node.address)
        w, _ = _worker(node.address)
        dst = [7, 2, 5, 1, 3, 6]
        w.begin_step([])
        w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
        time.sleep(1.0)
        w.end_step()
        assert w.take_invalid_blocks() == set(dst)
        assert w.stats.num_loaded_chunks == 0
        w.close()
    finally:
        node.stop(grace=0)


def test_a_thousand_loads_leave_no_lease_buffer_or_thread_behind(store):
    """Every load ends its leases and reuses its buffers, whichever way it went: in place and
    copied, layer by layer and not, a chunk missing, a step whose forward never waited."""
    _fill_and_save(store.address)
    w, _ = _worker(store.address)
    dst = [7, 2, 5, 1, 3, 6]
    missing = ChunkOp(2, (b"\x01" * 16,), (KEYS[1],), tuple(TOKENS[2 * C:3 * C]), tuple(dst[4:]))
    threads = 0
    for i in range(1000):
        if i == 20:  # (every kind of load made once: the lander, the client's channels are there)
            threads = threading.active_count()
        w.in_place = i % 4 != 3
        ops = _ops(dst) if i % 5 else (*_ops(dst, range(2)), missing)
        w.begin_step([])
        w.load([RequestOps("r", None, loads=ops)], layerwise=i % 2 == 0)
        if i % 3:
            for layer in range(LAYERS):
                w.wait_layer(f"layer.{layer}")
        w.end_step()
        assert w.take_invalid_blocks() == (set() if i % 5 else {3, 6}), i
    assert _no_leases_left(store)
    assert w.stats.num_loaded_chunks == 800 * 3 + 200 * 2 and w.stats.num_failed_chunks == 200
    assert [b.numel() for b in w._staging.values()] == [w.link.staging_bytes(3, torch.float32, w.chunk_shape)]
    assert threading.active_count() <= threads
    w.close()


def test_chunks_side_by_side_are_written_from_one_strided_view():
    """The CPU landing writes each run of chunks that sit at one distance from each other (a host
    buffer's slots, chunks the node stored side by side) from one strided view; a chunk elsewhere
    starts a new run. Every view reads back its chunks."""
    from kvstore.integrations.vllm_worker import _strided_runs

    buf = torch.arange(40, dtype=torch.float32)
    other = torch.arange(100, 104, dtype=torch.float32)
    payloads = [buf[0:4].view(2, 2), buf[6:10].view(2, 2), buf[12:16].view(2, 2),  # every 6 elements
                buf[20:24].view(2, 2), buf[28:32].view(2, 2),  # every 8 from the last
                other.view(2, 2)]  # another buffer
    runs = _strided_runs(payloads)
    assert [(i, v.shape[0]) for i, v in runs] == [(0, 3), (3, 2), (5, 1)]
    for i, view in runs:
        for k in range(view.shape[0]):
            assert torch.equal(view[k], payloads[i + k])


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_a_load_that_breaks_before_it_lands_fails_its_requests_not_the_step(store, in_place):
    """The namespace callback raises for one request's second chunk (a scope the connector cannot
    key): the step's load reports every block of the step's requests failed, ends the leases it
    took, and returns; the next step loads as usual."""
    src = _fill_and_save(store.address)
    w, backends = _worker(store.address, blocks=10, in_place=in_place)

    def namespace_for(scope, index):
        if scope == "bad" and index == 1:
            raise ValueError("no namespace for this scope")
        return NS

    w.namespace_for = namespace_for
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([])
    w.load([RequestOps("good", None, loads=_ops(dst, [0])),
            RequestOps("bad", "bad", loads=_ops([0, 4, 8, 9], [0, 1]))])
    w.end_step()
    assert w.take_invalid_blocks() == {7, 2, 0, 4, 8, 9}
    assert _no_leases_left(store)
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))])
    assert w.take_invalid_blocks() == set()
    for a, b in zip(src, backends):
        assert _blocks_equal(a, b, list(range(6)), dst)
    w.close()


class _GatedLink(StoreLink):
    """A real link whose saves wait until the test opens the gate (a saver thread running behind)."""

    def __init__(self, config: StoreLinkConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()

    def save(self, items):
        assert self.gate.wait(60), "the test never opened the gate"
        return super().save(items)


def test_save_buffers_are_reused_and_never_written_while_the_saver_still_holds_them(store):
    """A CPU worker gathers each step's chunks into a pooled host buffer the saver thread gives back
    once they are stored. Three steps queued behind a held-back saver get three buffers (none is
    reused before its chunks are stored), each with what the cache held in its step; once stored,
    later steps reuse the pool's buffers (one more for a larger step, then none)."""
    config = StoreLinkConfig(store.address, 10.0, cooldown_s=0.0)
    gated = _GatedLink(config)
    w = WorkerSide(StoreLink(config), gated, lambda scope, index: NS, 0, C, BS, torch.float32)
    backends = [Backend(8, torch.float32) for _ in range(LAYERS)]
    w.register([(f"layer.{i}", be.cache, be.layout()) for i, be in enumerate(backends)])
    g = torch.Generator().manual_seed(1)
    steps = []
    for s in range(3):
        tokens = [1000 * (s + 1) + t for t in range(2 * C)]
        keys = chunk_keys(tokens, NS, C)
        for be in backends:  # (this step's KV: written into blocks 0-3, rewritten by the next step)
            k, v = torch.randn(2, 2 * C, H, D, generator=g)
            be.write(k, v, be.cache, torch.arange(2 * C))
        steps.append((tokens, keys, [be.cache[:4].clone() for be in backends]))
        w.begin_step([RequestOps(f"r{s}", None, saves=_ops(list(range(4)), range(2), tokens, keys))])
        if s == 0:
            w.save_layer("layer.0", backends[0].cache)  # (layer 0 handed over during the step)
        w.end_step()
    assert w._save_buffers.num_allocated == 3 and w._save_buffers.num_free == 0
    gated.gate.set()
    w.flush()
    assert w.stats.num_saved_chunks == 6 and w._save_buffers.num_free == 2  # (the largest kept)
    reader, rb = _worker(store.address)
    for s, (tokens, keys, pages) in enumerate(steps):
        reader.begin_step([])
        reader.load([RequestOps("r", None, loads=_ops(list(range(4, 8)), range(2), tokens, keys))])
        assert reader.take_invalid_blocks() == set(), s
        for want, be in zip(pages, rb):
            assert torch.equal(be.cache[4:8], want), f"step {s}"
    reader.close()
    for s in range(20):
        ops = _ops(list(range(6)), range(2 if s % 2 else 3))
        w.begin_step([RequestOps("again", None, saves=ops)])
        w.end_step()
        w.flush()
    # (one buffer more, for the first three-chunk step: then the largest two serve every step)
    assert w._save_buffers.num_allocated == 4 and w.stats.num_saved_chunks == 6 + 50
    w.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_a_node_killed_in_the_middle_of_a_layerwise_load(in_place):
    """A store node process killed (SIGKILL) once the forward has its first layer: the step ends (no
    hang, no exception), and every block it does not report failed holds the saved KV. So does the
    next step's load, promptly: a lease the dead node cannot grant fails its blocks, and a copy read
    where this client remembers the chunks (the killed node's arena file is still mapped here, its
    generations unchanged: a one-sided read needs no call) lands the chunks it verifies."""
    from tests.helpers import StoreProcess

    proc = StoreProcess("--dram", "64MiB")
    try:
        src = _fill_and_save(proc.address)
        w, backends = _worker(proc.address, in_place=in_place)
        dst = [7, 2, 5, 1, 3, 6]
        w.begin_step([])
        w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
        w.wait_layer("layer.0")
        proc.kill9()
        for i in range(1, LAYERS):
            w.wait_layer(f"layer.{i}")
        w.end_step()

        def only_good_blocks_kept() -> None:
            failed = w.take_invalid_blocks()
            assert failed <= set(dst)
            good = [(s, d) for s, d in zip(range(6), dst) if d not in failed]
            for a, b in zip(src, backends):
                assert torch.equal(a.cache[[s for s, _ in good]], b.cache[[d for _, d in good]])

        only_good_blocks_kept()
        assert w.stats.num_in_place_chunks == (3 if in_place else 0)
        for be in backends:
            be.cache.zero_()
        t0 = time.monotonic()
        w.begin_step([])
        w.load([RequestOps("r", None, loads=_ops(dst))], layerwise=True)
        w.end_step()
        only_good_blocks_kept()
        assert time.monotonic() - t0 < 60  # (a dead node is a miss, never a wait for the call's deadline)
        w.close()
    finally:
        proc.stop()


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "copied"])
def test_warm_up_makes_at_start_what_the_first_load_and_save_would(store, in_place):
    """``warm_up`` (called by the connector once vLLM registered its caches): the store session is
    open (the loader thread's too, with ``load_async``), the lander thread started, a save buffer
    for a step's tokens made (the first save allocates nothing) and, where loads are copied, their
    read buffer (the first load grows nothing). Against a stopped store it returns (the first load finds it)."""
    _fill_and_save(store.address)
    w, backends = _worker(store.address, in_place=in_place)
    w.warm_up(3 * C, load_async=True)
    assert w._lander is not None and w.link._client is not None
    assert w._loader is not None and w.load_link._client is not None  # (load_async: its thread and session)
    assert w._save_buffers.num_allocated == 1 and w._save_buffers.num_free == 1
    staged = {k: v.data_ptr() for k, v in w._staging.items()}
    assert bool(staged) != in_place
    w.begin_step([RequestOps("r", None, saves=_ops(list(range(6))))])
    w.end_step()
    w.flush()
    assert w.stats.num_saved_chunks == 3 and w._save_buffers.num_allocated == 1
    dst = [7, 2, 5, 1, 3, 6]
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))])
    assert w.take_invalid_blocks() == set()
    assert {k: v.data_ptr() for k, v in w._staging.items()} == staged
    w.begin_step([])
    w.load([RequestOps("r2", None, loads=_ops(dst), async_load=True)])
    assert _wait_finished(w) == {"r2"} and w.take_invalid_blocks() == set()
    w.close()
    store.stop(grace=0)
    w, _ = _worker(store.address, in_place=in_place)
    w.warm_up(3 * C)
    w.begin_step([])
    w.load([RequestOps("r", None, loads=_ops(dst))])
    assert w.take_invalid_blocks() == set(dst)
    w.close()
