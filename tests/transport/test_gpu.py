"""CUDA tensors as destinations and sources: pinned staging on streams (shm), host bounce (tcp)."""

import pytest
import torch

from kvstore.client import StoreClient

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none")]

MiB = 1 << 20


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cuda_round_trip(make_node, transport):
    node = make_node(dram=64 * MiB)
    c = StoreClient(node.address, transport=transport)
    assert c.transport == transport
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randint(0, 255, (20 * MiB + 3,), dtype=torch.uint8, device="cuda", generator=g)  # > 2 chunks
    header = b"hdr" * 10
    c.put(b"gpu", [header, src])  # a CUDA part is staged out of the device
    host = c.get(b"gpu")
    assert host[:30] == header and host[30:] == src.cpu().numpy().tobytes()
    c.put(b"plain", src)
    dst = torch.zeros(src.numel() + 10, dtype=torch.uint8, device="cuda")
    small = torch.zeros(8, dtype=torch.float32, device="cuda")
    assert c.batch_get_into([b"plain", b"missing"], [dst, small]) == [src.numel(), None]
    torch.cuda.synchronize()
    assert torch.equal(dst[: src.numel()], src)
    as_half = torch.zeros((src.numel() + 1) // 2, dtype=torch.float16, device="cuda")  # any dtype: bytes
    assert c.batch_get_into([b"plain"], [as_half]) == [src.numel()]
    assert torch.equal(as_half.view(torch.uint8)[: src.numel()], src)
    c.close()


def test_cuda_destination_too_small_is_refused(make_node):
    from kvstore.errors import InvalidArgumentError

    node = make_node()
    c = StoreClient(node.address, transport="shm")
    c.put(b"k", b"x" * 1000)
    with pytest.raises(InvalidArgumentError, match="exceeds its buffer"):
        c.batch_get_into([b"k"], [torch.zeros(10, dtype=torch.uint8, device="cuda")])
    assert c.stats()["num_remote_leases"] == 0
    c.close()


def test_a_registered_arena_takes_cuda_values_straight_from_the_device(make_node):
    """Once the client page-locked the node's arena (``register_cuda``), a CUDA part is copied
    by DMA into the reserved slots (no pinned bounce); the bytes are the same, values that span
    several slots included."""
    node = make_node(dram=64 * MiB, slot_size=1 * MiB)
    c = StoreClient(node.address, transport="shm")
    session = c.descriptor_session()
    assert session.register_cuda() is None
    g = torch.Generator(device="cuda").manual_seed(1)
    vals = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g) for n in (5, 3 * MiB + 7)]
    assert c.batch_put([(b"a", [b"head", vals[0]]), (b"b", vals[1])]) == [True, True]
    assert session._staging is None  # never needed a bounce buffer
    assert c.get(b"a") == b"head" + vals[0].cpu().numpy().tobytes()
    assert c.get(b"b") == vals[1].cpu().numpy().tobytes()
    c.close()
