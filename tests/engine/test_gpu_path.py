"""The engine's GPU data path (runs on a CUDA machine: ``pytest -m gpu``): pinned pools, the
transfer and save streams, loads landing layer by layer, saves put from the device straight into
the node's registered arena, wsum64 computed and checked on the device, exact tokens."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")]

CHUNK = 64


def _prompt(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


@pytest.mark.parametrize("nbytes", [8, 4096, 8 << 20])
def test_wsum64_on_the_gpu_equals_the_cpu(nbytes):
    from kvstore.chunk import wsum64

    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    assert int(wsum64(t.cuda())) == int(wsum64(t))


def test_small_host_lists_reach_the_device_without_waiting_for_its_stream():
    """``kernels.host.to_device`` (page ids, pointer tables, step inputs) queues its copy behind
    the stream's work instead of waiting for it (``torch.tensor(..., device=cuda)`` waits)."""
    from kernels.host import to_device

    to_device([0] * 100, torch.int32, torch.device("cuda"))  # the pinned allocator warmed first
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy stream
    t = to_device(list(range(100)), torch.int32, torch.device("cuda"))
    assert not torch.cuda.current_stream().query()  # returned while the stream was still busy
    assert t.tolist() == list(range(100))


@pytest.fixture
def node(tmp_path):
    from tests.helpers import store_nodes

    gen = store_nodes(tmp_path, with_disk=False)
    make = next(gen)
    yield make(dram=256 << 20)
    next(gen, None)  # (close() would skip the nodes' teardown after the yield)


def _engine(address, client=None, **kw):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    # NOTE: float32, as on the CPU: exactness against recompute is about the data path, and
    # bfloat16 sums in another order could flip a greedy token of a random model; eager: decode
    # graphs are test_cuda_graphs.py's, and capturing them for every engine here costs the
    # GPU run's minutes
    return LLMEngine(EngineConfig(model="random:small", dtype="float32", chunk_tokens=CHUNK,
                                  store=address, kv_cache_memory="256MiB", enable_prefix_caching=False,
                                  store_load_batch=2, **{"enforce_eager": True, "device": "cuda", **kw}),
                     client=client)


def _recomputed(prompt: list[int]) -> list[int]:
    """The tokens an engine with no store generates for ``prompt``."""
    ref = _engine(None)
    try:
        return list(_run(ref, prompt).output)
    finally:
        ref.close()


def _run(eng, prompt):
    from engine.sampling import SamplingParams

    seq = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while not seq.is_finished:
        eng.step()
    return seq


def test_store_reuse_on_the_gpu_gives_the_tokens_of_recompute(node):
    from kvstore.chunk import CHECK_WSUM, parse_header
    from kvstore.client import StoreClient

    prompt = _prompt(9 * CHUNK + 5)
    want = _recomputed(prompt)
    eng = _engine(node.address)
    try:
        # the arena is page-locked here: saves gather on the device and the put DMAs them into it
        assert eng.connector.pool.pinned and eng.connector.save_pool.device.type == "cuda"
        assert eng.connector.check == CHECK_WSUM
        first = _run(eng, prompt)
        assert list(first.output) == want and first.num_store_tokens == 0
        assert eng.connector.flush(timeout_s=120) and eng.connector.stats.chunks_saved == 9
        again = _run(eng, prompt)
        assert list(again.output) == want and again.num_store_tokens == 9 * CHUNK
        # same host: DMA from the node's arena, page-locked at start
        assert eng.connector.stats.chunks_loaded_in_place == 9
        assert eng.connector.client.descriptor_session()._cuda_registered
        assert eng.connector.pool.in_use == 0 and eng.connector.save_pool.in_use == 0
        keys = [bytes(k) for k in eng.connector.keys(prompt, None)]
    finally:
        eng.close()
    with StoreClient(node.address) as c:
        raw = bytearray(c.get(keys[4]))
        assert parse_header(raw).check == CHECK_WSUM  # summed on the device at save
        raw[-3] ^= 0x10
        c.put(keys[4], raw)
    eng = _engine(node.address)
    try:
        seq = _run(eng, prompt)  # the device check finds chunk 4: recomputed from there
        assert list(seq.output) == want and seq.num_store_tokens == 4 * CHUNK
        assert eng.connector.stats.load_failures == 1
        assert eng.connector.stats.late_failures == 1  # found after the step that computed beside it
    finally:
        eng.close()


def test_random_weights_drawn_on_the_gpu_never_share_chunks_with_the_cpus(node):
    """A random preset's weights are drawn where the model runs, so a GPU engine's chunks are
    not a CPU engine's: their namespaces differ (a real checkpoint's do not)."""
    gpu = _engine(node.address)
    try:
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine

        cpu = LLMEngine(EngineConfig(model="random:small", device="cpu", dtype="bfloat16", chunk_tokens=CHUNK))
        try:
            assert gpu.fingerprint.model_id == "random:small:seed=0@cuda"
            assert cpu.fingerprint.model_id == "random:small:seed=0"
        finally:
            cpu.close()
    finally:
        gpu.close()



@pytest.mark.parametrize("stream", [True, False])
def test_loads_over_tcp_stream_in_or_land_through_the_pinned_pool(node, stream):
    from kvstore.client import StoreClient

    prompt = _prompt(6 * CHUNK + 9, seed=3)
    want = _recomputed(prompt)
    eng = _engine(None, client=StoreClient(node.address, transport="tcp"))
    eng.connector.stream_loads = stream
    try:
        _run(eng, prompt)
        assert eng.connector.flush(timeout_s=120)
        seq = _run(eng, prompt)
        assert list(seq.output) == want and seq.num_store_tokens == 6 * CHUNK
        assert eng.connector.stats.chunks_loaded_in_place == 0 and eng.connector.pool.in_use == 0
        assert eng.connector.stats.late_failures == 0
        assert eng.connector.save_pool.pinned  # no arena mapped here: saves bounce through pinned memory
        assert eng.connector.stream_ring.buf.is_pinned()
    finally:
        eng.close()


@pytest.mark.parametrize("bad", [None, 0, 6])
def test_a_streamed_load_lands_groups_from_a_reused_ring_on_the_transfer_stream(node, monkeypatch, bad):
    """Over TCP, 9 chunks in groups of 4, 4 and 1 per layer through a ring of three pinned
    buffers (reused within a layer: each waits for its last DMA): exact tokens; a chunk whose
    payload was changed in the store fails its wsum64 where it landed, after the step, and the
    prompt is recomputed from exactly it."""
    import engine.kv_connector as kvc
    from kvstore.client import StoreClient

    monkeypatch.setattr(kvc, "STAGE_CHUNKS", 4)
    prompt = _prompt(9 * CHUNK + 5, seed=8)
    want = _recomputed(prompt)
    eng = _engine(None, client=StoreClient(node.address, transport="tcp"))
    try:
        assert eng.connector.stream_ring.buf.shape[:2] == (3, 4)
        _run(eng, prompt)
        assert eng.connector.flush(timeout_s=120)
        if bad is not None:
            with StoreClient(node.address, transport="tcp") as c:
                key = bytes(eng.connector.keys(prompt, None)[bad])
                raw = bytearray(c.get(key))
                raw[-3] ^= 0x10
                c.put(key, raw)
        seq = _run(eng, prompt)
        st = eng.connector.stats
        assert list(seq.output) == want
        assert seq.num_store_tokens == (9 if bad is None else bad) * CHUNK
        assert st.late_failures == (0 if bad is None else 1)
    finally:
        eng.close()


def test_a_load_lands_layer_by_layer_on_the_transfer_stream_in_groups(node, monkeypatch):
    """The in-place load queues every layer on the transfer stream (groups of a staging buffer
    smaller than the load here) and the step waits on per-layer events: exact tokens."""
    import engine.kv_connector as kvc
    from engine.kv_transfer import LayerwiseLanding

    monkeypatch.setattr(kvc, "STAGE_CHUNKS", 4)  # 9 chunks: groups of 4, 4 and 1 per layer
    prompt = _prompt(9 * CHUNK + 5, seed=7)
    want = _recomputed(prompt)
    waits = []
    real = LayerwiseLanding.wait

    def wait(self, layer):
        waits.append((layer, self.events is not None, self.stage.group))
        return real(self, layer)

    monkeypatch.setattr(LayerwiseLanding, "wait", wait)
    eng = _engine(node.address)
    try:
        _run(eng, prompt)
        assert eng.connector.flush(timeout_s=120)
        seq = _run(eng, prompt)
        assert list(seq.output) == want and seq.num_store_tokens == 9 * CHUNK
        layers = len(eng.runner.k_caches)
        assert [w[0] for w in waits] == list(range(layers))
        assert all(on_stream and group == 4 for _, on_stream, group in waits)
        assert eng.connector.stats.late_failures == 0
    finally:
        eng.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("bad", [None, 4])
def test_direct_landing_reads_the_registered_arena_and_the_pinned_ring_in_place(node, transport, bad):
    """``land_direct``: the landing kernel reads each chunk's layer where it is (shm: the node's
    arena, registered here; tcp: the stream's pinned ring), with no DMA into a device stage, and
    sums its wsum64 from the same loads: exact tokens; a chunk changed in the store fails its
    check after the step and the prompt is recomputed from exactly it."""
    from kvstore.client import StoreClient

    prompt = _prompt(7 * CHUNK + 3, seed=11)
    want = _recomputed(prompt)
    eng = _engine(None, client=StoreClient(node.address, transport=transport), land_direct=True)
    conn = eng.connector
    try:
        assert conn.land_direct and conn.stream_stage is None and conn.stream_ring.tables is not None
        if transport == "shm":
            assert conn._arena_registered
        _run(eng, prompt)
        assert conn.flush(timeout_s=120)
        if bad is not None:
            with StoreClient(node.address, transport="tcp") as c:
                key = bytes(conn.keys(prompt, None)[bad])
                raw = bytearray(c.get(key))
                raw[-5] ^= 0x01
                c.put(key, raw)
        seq = _run(eng, prompt)
        assert list(seq.output) == want
        assert seq.num_store_tokens == (7 if bad is None else bad) * CHUNK
        assert conn.stats.late_failures == (0 if bad is None else 1)
        in_place = conn.stats.chunks_loaded_in_place
        assert in_place > 0 if transport == "shm" else in_place == 0
    finally:
        eng.close()


@pytest.mark.parametrize("land_direct", [False, True])
def test_chunks_in_slots_that_are_not_one_run_land_from_a_fragmented_arena(tmp_path, land_direct):
    """A fragmented arena gives a chunk slots with gaps: its payload is gathered into page-locked
    memory (the direct kernel reads only that; pageable memory made the step raise): exact tokens."""
    from kvstore.client import StoreClient
    from tests.helpers import fragment_arena, store_nodes

    gen = store_nodes(tmp_path, with_disk=False)
    node = next(gen)(dram=256 << 20, slot_size=4096)
    try:
        fragment_arena(node.address, 4000)
        prompt = _prompt(7 * CHUNK + 3, seed=12)
        want = _recomputed(prompt)
        eng = _engine(None, client=StoreClient(node.address, transport="shm"), land_direct=land_direct)
        try:
            _run(eng, prompt)
            assert eng.connector.flush(timeout_s=120)
            seq = _run(eng, prompt)
            assert list(seq.output) == want and seq.num_store_tokens == 7 * CHUNK
            assert eng.connector.stats.chunks_loaded_in_place == 7 and eng.connector.stats.verify_failures == 0
        finally:
            eng.close()
    finally:
        next(gen, None)


def test_a_load_is_checked_on_the_transfer_stream_without_waiting_for_the_step():
    """The wsum64 sums of a load are read on the transfer stream that summed them: the host waits
    for the landing, not for the step computing on the compute stream beside it."""
    from engine.kv_connector import _first_mismatch

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        sums = [torch.tensor(v, dtype=torch.int64, device="cuda") for v in (5, -7, 9)]
    side.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy compute stream
    checks = [(0, sums[0], 5), (1, sums[1], (1 << 64) - 7), (2, sums[2], 10)]
    assert _first_mismatch(checks, side) == 2
    assert not torch.cuda.current_stream().query()  # returned while the step was still computing
    assert _first_mismatch(checks[:2], side) is None


def test_an_overlapped_step_admitting_a_store_hit_returns_while_it_computes(node):
    """Async scheduling: a step that admits a request whose prompt is in the store (its chunks
    landing beside the decodes) is launched, its load checked and the last step's tokens
    handled while the device still computes it. The step's forward is made long (a sleep queued
    after it on the compute stream); step() returns before it ends. Tokens as recomputed."""
    from engine.sampling import SamplingParams

    prompt = _prompt(4 * CHUNK + 5, seed=3)
    want = _recomputed(prompt)
    saver = _engine(node.address)
    try:
        _run(saver, prompt)
        assert saver.connector.flush(timeout_s=120) and saver.connector.stats.chunks_saved == 4
    finally:
        saver.close()
    eng = _engine(node.address, async_scheduling=True)
    try:
        decoders = [eng.add_request(_prompt(40, seed=10 + i), SamplingParams(max_tokens=30, ignore_eos=True))
                    for i in range(3)]
        for _ in range(100):
            if eng.num_overlapped_steps >= 2:
                break
            eng.step()
        run = eng.runner.run

        def long_run(*a, **k):
            out = run(*a, **k)
            torch.cuda._sleep(2_000_000_000)  # ~1 s more of the step on the compute stream
            return out

        eng.runner.run = long_run
        late = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        k = eng.num_overlapped_steps
        eng.step()
        assert eng.num_overlapped_steps == k + 1 and late.num_store_tokens == 4 * CHUNK
        assert not torch.cuda.current_stream().query()  # returned while the step was still computing
        eng.runner.run = run
        for _ in range(1000):
            if not eng.has_work():
                break
            eng.step()
        assert list(late.output) == want and all(s.is_finished for s in decoders)
        assert eng.connector.stats.late_failures == 0
    finally:
        eng.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (an engine on cuda:1)")
def test_an_engine_on_the_second_gpu_stepped_from_another_thread_gives_the_tokens_of_recompute(node):
    """An engine on ``cuda:1``, made on this thread and stepped from a new one (whose current GPU
    is 0, as a serving loop's is): Triton launches on the current GPU and an event without a
    stream records on its stream, so the engine makes its GPU current wherever it steps."""
    import threading

    prompt = _prompt(5 * CHUNK + 3)
    torch.cuda.set_device(0)
    ref = _engine(None, device="cuda:1")
    try:
        want = list(_run(ref, prompt).output)
    finally:
        ref.close()
    torch.cuda.set_device(0)
    eng = _engine(node.address, device="cuda:1")
    got = []
    try:
        for _ in range(2):  # computed and saved, then loaded from the store
            t = threading.Thread(target=lambda: got.append(_run(eng, prompt)))
            t.start()
            t.join(timeout=600)
            assert eng.connector.flush(timeout_s=120)
        assert [list(s.output) for s in got] == [want, want] and got[1].num_store_tokens == 5 * CHUNK
    finally:
        eng.close()
