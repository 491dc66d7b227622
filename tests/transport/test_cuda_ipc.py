"""The cuda_ipc mover: a same-host GPU client reads the node's device tier device to device.

Without a GPU: a node with no device tier says so and why (Transports, AcquireRead), a client
asks nothing of it and keeps reading through shm, and the mover refuses to open with the reason.
With one (``pytest -m gpu``): a node in another process exports its device tier, a client maps it
once, leases device-tier values in place and reads them as CUDA tensors, and an engine loads a
prefix held in the node's HBM device to device with the tokens of recompute.
"""

import os

import grpc
import pytest
import torch

from kvstore.client import StoreClient
from kvstore.errors import FailedPreconditionError
from kvstore.store import Tier
from kvstore.transport.descriptors import DeviceArenaRef, ItemStatus, Mover
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import StoreProcess

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")
MiB = 1 << 20


def test_a_node_without_a_device_tier_offers_no_cuda_ipc_and_says_why(make_node):
    node = make_node()
    ch = grpc.insecure_channel(node.address)
    r = pb_grpc.KVStoreStub(ch).Transports(pb.TransportsRequest(), timeout=30)
    ch.close()
    assert pb.MOVER_CUDA_IPC not in r.offered and pb.MOVER_SHM in r.offered
    assert not r.device_arena.available and r.device_arena.reason == "no device tier (--device)"
    assert DeviceArenaRef.from_pb(r.device_arena) is None
    with StoreClient(node.address) as c:
        c.put(b"k", b"v" * 1000)
        session = c.descriptor_session()
        assert session.mover is Mover.SHM
        assert session.open_device() == "no device tier (--device)"
        assert not session.device_mapped
        with pytest.raises(FailedPreconditionError, match="not mapped"):
            session.acquire([b"k"], Mover.CUDA_IPC)
        g = session.acquire([b"k"])  # shm as before
        assert g.items[0].status is ItemStatus.OK and g.items[0].tier is Tier.DRAM
        session.release(g.lease_id)


def test_the_lease_table_refuses_device_grants_without_a_device_tier(make_node):
    node = make_node()
    with pytest.raises(FailedPreconditionError, match="no device tier"):
        node.transport.leases.acquire([b"k"], Mover.CUDA_IPC)
    with pytest.raises(FailedPreconditionError, match="need proof"):
        node.transport.leases.acquire([b"k"], Mover.CUDA_IPC, proven=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_the_mover_says_why_it_cannot_open_without_cuda():
    from kvstore.transport.cuda_ipc import CudaIpcMover, CudaIpcUnavailableError

    ref = DeviceArenaRef("x.hbm", 4 * MiB, MiB, "", (0, b"h", 4 * MiB, 0, b"rc", 0, b"", False))
    with pytest.raises(CudaIpcUnavailableError, match="no CUDA device"):
        CudaIpcMover(ref)


# ---------------------------------------------------------------- on a GPU


@pytest.fixture
def gpu_node(tmp_path):
    # NOTE: another process: CUDA IPC maps another process's memory, never the opener's own.
    node = StoreProcess("--dram", "64MiB", "--device", "64MiB", "--slot-size", "1MiB")
    yield node
    node.stop()


@pytest.mark.gpu
@cuda
def test_device_tier_values_are_leased_and_read_in_place_as_cuda_tensors(gpu_node):
    values = {f"k{i}".encode(): os.urandom(MiB * (i % 3) + 1000 * i + 7) for i in range(6)}
    with StoreClient(gpu_node.address, transport="tcp") as tcp:  # through the node: the fastest tier first
        for k, v in values.items():
            tcp.put(k, v)
    with StoreClient(gpu_node.address) as c:
        assert c.stats()["tiers"]["device"]["num_entries"] == 6
        session = c.descriptor_session()
        assert session.open_device() is None and session.device_mapped
        keys = list(values) + [b"absent"]
        g = session.acquire(keys, Mover.CUDA_IPC)
        assert [d.status for d in g.items] == [ItemStatus.OK] * 6 + [ItemStatus.NOT_FOUND]
        assert all(d.tier is Tier.DEVICE for d in g.items[:6])
        with session.in_place(g) as view:
            assert view is not None and view.mover is Mover.CUDA_IPC
            for d, want in zip(g.items, values.values()):
                got = torch.cat([view.tensor(off, n) for off, n in d.extents(view.ref.slot_bytes)])
                assert got.is_cuda and bytes(got.cpu().numpy()) == want
        session.release(g.lease_id)
        assert c.stats()["movers"]["cuda_ipc"]["num_reads"] == 1
        g = session.acquire(keys[:2])  # shm: those are not in DRAM
        assert [d.status for d in g.items] == [ItemStatus.ELSEWHERE] * 2
        with pytest.raises(Exception, match="writes"):
            session._handle.device.write([(0, 0, 1)])


@pytest.mark.gpu
@cuda
def test_an_engine_loads_a_prefix_from_the_nodes_hbm_device_to_device(gpu_node):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(model="random:small", device="cuda", dtype="float32", chunk_tokens=64,
                                 store=gpu_node.address, kv_cache_memory="256MiB", enable_prefix_caching=False,
                                 enforce_eager=True))

    def run(prompt):
        seq = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        while not seq.is_finished:
            eng.step()
        return seq

    try:
        assert eng.connector.client.descriptor_session().device_mapped  # mapped at start
        prompt = torch.randint(3, 500, (9 * 64 + 5,), generator=torch.Generator().manual_seed(3)).tolist()
        first = run(prompt)
        assert eng.connector.flush(timeout_s=120) and eng.connector.stats.chunks_saved == 9
        # The engine's saves filled the node's DRAM (shm reserves DRAM slots); a put through the
        # node, as from another host, lands in the fastest tier with room: the device tier.
        with StoreClient(gpu_node.address, transport="tcp") as c:
            for k in eng.connector.keys(prompt, None):
                c.put(bytes(k), c.get(bytes(k)))
            assert c.stats()["tiers"]["device"]["num_entries"] == 9
        again = run(prompt)
        st = eng.connector.stats
        assert list(again.output) == list(first.output) and again.num_store_tokens == 9 * 64
        assert st.chunks_loaded_in_place == 9 and st.chunks_loaded_from_device == 9, st
    finally:
        eng.close()
