"""Pure parts of the movers: copy plans, extents, the parallel copier, the mover choice."""

import os

import numpy as np
import pytest

from kvstore.transport.descriptors import Mover, ops_for, value_extents
from kvstore.transport.identity import HostIdentity, host_identity, one_sided_candidates
from kvstore.transport.memcopy import PIECE_BYTES, CopyEngine, _pieces, local_buffer, plan, slice_extents

hypothesis = pytest.importorskip("hypothesis")  # a dev dependency: the module skips without it
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def test_value_extents_merge_adjacent_slots_and_cut_the_tail():
    assert value_extents([3, 4, 5, 9], 3 * 100 + 7, 100) == [(300, 300), (900, 7)]
    assert value_extents([7], 0, 100) == []
    assert value_extents([2, 1], 150, 100) == [(200, 100), (100, 50)]


@given(st.lists(st.integers(0, 50), min_size=1, max_size=12, unique=True), st.integers(0, 1200),
       st.sampled_from([16, 64, 100]))
def test_ops_for_covers_the_value_once_in_order(slots, size, sb):
    size = min(size, len(slots) * sb)
    ops: list = []
    ops_for(1000, slots, size, sb, ops)
    assert sum(n for _, _, n in ops) == size
    pos = 0
    for local, off, n in ops:  # value byte pos lives at arena slots[pos // sb] * sb + pos % sb
        assert local == 1000 + pos
        assert off == slots[pos // sb] * sb + pos % sb
        pos += n
    assert [(o, n) for _, o, n in ops] == value_extents(slots, size, sb)


@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_plan_pairs_bytes_in_order(local_sizes, arena_sizes):
    total = min(sum(local_sizes), sum(arena_sizes))
    local = _cut(local_sizes, total, base=10_000)
    arena = _cut(arena_sizes, total, base=0)
    src = bytes(range(256)) * 4
    out = bytearray(total)
    for laddr, off, n in plan(local, arena):  # "copy" arena bytes to local positions
        lpos = _position(local, laddr)
        out[lpos : lpos + n] = src[_position_off(arena, off) : _position_off(arena, off) + n]
    assert bytes(out) == src[:total]


def test_slice_extents():
    ext = [(100, 10), (500, 5), (900, 20)]
    assert slice_extents(ext, 0, 35) == ext
    assert slice_extents(ext, 8, 4) == [(108, 2), (500, 2)]
    assert slice_extents(ext, 15, 3) == [(900, 3)]
    assert slice_extents(ext, 35, 0) == []


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copy_engine_moves_every_byte(threads):
    src = np.frombuffer(os.urandom(9 << 20), dtype=np.uint8)
    dst = np.zeros_like(src)
    s, d = src.ctypes.data, dst.ctypes.data
    cuts = [0, 1, 4097, 3 << 20, (3 << 20) + 5, 9 << 20]  # uneven pieces, one of 3 MiB
    moves = [(d + a, s + a, b - a) for a, b in zip(cuts, cuts[1:])]
    engine = CopyEngine(threads)
    engine.run(moves)
    engine.close()
    assert np.array_equal(src, dst)


def test_pieces_cut_large_moves_in_order():
    moves = [(0, 1000, PIECE_BYTES * 2 + 3), (10 ** 9, 2 * 10 ** 9, 1)]
    assert _pieces(moves) == [(0, 1000, PIECE_BYTES), (PIECE_BYTES, 1000 + PIECE_BYTES, PIECE_BYTES),
                              (2 * PIECE_BYTES, 1000 + 2 * PIECE_BYTES, 3), (10 ** 9, 2 * 10 ** 9, 1)]


def test_local_buffer_accepts_bytes_like_and_tensors_without_copying():
    import torch

    ba = bytearray(b"abc")
    addr, n, keep = local_buffer(ba)
    assert n == 3 and np.frombuffer(ba, np.uint8).ctypes.data == addr
    t = torch.arange(4, dtype=torch.int64)
    assert local_buffer(t)[:2] == (t.data_ptr(), 32)
    with pytest.raises(ValueError, match="contiguous"):
        local_buffer(torch.arange(8)[::2])


def test_candidates():
    here = host_identity()
    assert here.same_host(HostIdentity(here.hostname, here.boot_id))
    assert not here.same_host(HostIdentity(here.hostname, "another-boot"))
    assert not HostIdentity("h", "").same_host(HostIdentity("h", ""))
    every = {Mover.SHM, Mover.RDMA, Mover.TCP}
    assert one_sided_candidates("auto", every, True, None, None).candidates == (Mover.SHM, Mover.RDMA)
    c = one_sided_candidates("auto", every, False, "no ibverbs device", None)
    assert c.candidates == () and "same host" in c.notes[0] and "no ibverbs device" in c.notes[1]
    assert one_sided_candidates("rdma", every, True, None, None).candidates == (Mover.RDMA,)
    c = one_sided_candidates("shm", {Mover.TCP}, True, None, None)
    assert c.candidates == () and "does not offer shm" in c.notes[0]
    assert one_sided_candidates("tcp", every, True, None, None).candidates == ()
    with pytest.raises(ValueError, match="transport must be"):
        one_sided_candidates("udp", every, True, None, None)


def _cut(sizes, total, base):
    out, pos, addr = [], 0, base
    for n in sizes:
        n = min(n, total - pos)
        if n <= 0:
            break
        out.append((addr, n))
        addr += n + 7  # gaps between runs
        pos += n
    return out


def _position(extents, addr):
    pos = 0
    for a, n in extents:
        if a <= addr < a + n:
            return pos + addr - a
        pos += n
    raise AssertionError(addr)


_position_off = _position


def test_rdma_regions_find_the_one_that_holds_a_whole_range():
    from kvstore.transport.rdma import Regions

    r = Regions()
    r.add(1000, 100, "a")
    r.add(3000, 50, "c")
    r.add(2000, 1000, "b")  # ends exactly where c starts
    assert len(r) == 3 and r.has(2000, 1000) and not r.has(2000, 999)
    assert r.covering(1000, 100) == "a" and r.covering(1050, 50) == "a"
    assert r.covering(2999, 1) == "b" and r.covering(3000, 50) == "c"
    assert r.covering(1050, 51) is None  # runs past a's end
    assert r.covering(999, 2) is None and r.covering(2990, 20) is None  # before a; across b and c
    assert r.covering(1100, 1) is None and r.covering(5, 1) is None
    for addr, n in [(1099, 2), (950, 60), (2500, 10), (2999, 2), (3049, 100)]:
        with pytest.raises(ValueError, match="overlaps"):
            r.add(addr, n, "x")
    with pytest.raises(ValueError, match="empty"):
        r.add(5000, 0, "x")
    assert r.pop(2000) == "b" and r.pop(2000) is None and r.pop(1001) is None
    assert r.covering(2500, 10) is None and len(r) == 2
    r.add(2500, 10, "d")  # the freed range can be registered again
    assert r.covering(2505, 5) == "d"


@given(st.lists(st.integers(1, 64), min_size=1, max_size=12), st.data())
def test_rdma_regions_agree_with_a_linear_scan(sizes, data):
    from kvstore.transport.rdma import Regions

    r, regions, addr = Regions(), [], 0
    for i, n in enumerate(sizes):
        addr += data.draw(st.integers(0, 8))  # gaps, or none
        regions.append((addr, n, i))
        addr += n
    for a, n, i in data.draw(st.permutations(regions)):
        r.add(a, n, i)
    for _ in range(20):
        a = data.draw(st.integers(0, addr + 4))
        n = data.draw(st.integers(1, 70))
        want = next((i for ra, rn, i in regions if ra <= a and a + n <= ra + rn), None)
        assert r.covering(a, n) == want
