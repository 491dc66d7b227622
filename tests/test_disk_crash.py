"""kill -9 of a real `crescent store` while it demotes to disk and while it reads from disk.

After each kill a node restarts on the same disk folder: every key it lists must
read back exactly, and every acknowledged value must still be there unless it
can have been only in DRAM (volatile) when the process died.
"""

import random
import threading

import pytest

from kvstore.client import Retry, StoreClient
from kvstore.errors import CrescentError
from tests.helpers import StoreProcess, wait_for

SIZE = 100_000  # two 64 KiB slots
DRAM_VALUES = (1 << 20) // (128 << 10)  # values the 1 MiB DRAM tier holds
ARGS = ("--dram", "1MiB", "--disk-size", "256MiB", "--promote-after", "1")


def _key(i: int) -> bytes:
    return b"crash-%06d" % i


def _value(i: int) -> bytes:
    head = b"<%d>" % i
    return (head * (SIZE // len(head) + 1))[:SIZE]


def _client(proc) -> StoreClient:
    return StoreClient(proc.address, timeout_s=30, retry=Retry(attempts=1))


def _kill9_under(proc, work, stop: threading.Event, cond, what: str) -> None:
    """Runs ``work`` on a thread against ``proc``, kills the node with SIGKILL once ``cond``
    holds, then stops the thread (it ends on the node's death or on ``stop``)."""
    t = threading.Thread(target=work)
    t.start()
    try:
        wait_for(cond, timeout_s=120, interval_s=0.01, what=what)
        proc.kill9()
    finally:
        stop.set()
        t.join(timeout=120)
        proc.stop()
    assert not t.is_alive()


def _check_after_restart(disk: str, acked: set[int]) -> set[int]:
    """Restarts a node on ``disk``; checks every acknowledged key; returns those present."""
    proc = StoreProcess(*ARGS, "--disk", disk)
    try:
        c = _client(proc)
        keys = sorted(acked)
        got = []
        for w in range(0, len(keys), 32):
            got += c.batch_get([_key(i) for i in keys[w : w + 32]])
        for i, v in zip(keys, got):
            assert v is None or bytes(v) == _value(i), f"key {i} read back wrong bytes after kill -9"
        listed = c.exists([_key(i) for i in keys])
        assert listed == [v is not None for v in got], "a listed key did not read (or an unlisted one did)"
        c.close()
        return {i for i, v in zip(keys, got) if v is not None}
    finally:
        assert proc.stop() == 0


@pytest.mark.parametrize("write_behind", [False, True], ids=["demote-in-put", "write-behind"])
def test_kill9_during_demotions_loses_no_value_that_reached_disk(tmp_path, write_behind):
    disk = str(tmp_path / "disk")
    acked: set[int] = set()
    extra = ("--write-behind",) if write_behind else ()
    for round_ in range(3):  # each round writes on top of what the last left
        proc = StoreProcess(*ARGS, *extra, "--disk", disk)
        stop = threading.Event()

        def writer(base=round_ * 10_000):
            c = _client(proc)
            i = base
            try:
                while not stop.is_set():
                    c.put(_key(i), _value(i))  # DRAM is full: each put demotes to disk
                    acked.add(i)
                    i += 1
            except CrescentError:
                pass  # the node died under the call
            finally:
                c.close()

        start = len(acked)  # killed mid-put: a demotion batch may be half done
        _kill9_under(proc, writer, stop, lambda: len(acked) >= start + 40 + 13 * round_, "puts to be acknowledged")
        present = _check_after_restart(disk, acked)
        # only values still in DRAM at the kill may be gone (and none that reached the disk)
        assert len(present) >= len(acked) - DRAM_VALUES - 1, (len(present), len(acked))
        acked &= present  # what a round lost stays lost: the next round is judged on its own


def test_kill9_during_disk_reads_and_promotions_loses_nothing(tmp_path):
    disk = str(tmp_path / "disk")
    proc = StoreProcess(*ARGS, "--disk", disk)
    acked = set(range(80))
    try:
        c = _client(proc)
        for i in sorted(acked):
            c.put(_key(i), _value(i))
        c.close()
    finally:
        proc.stop()  # a graceful stop: DRAM's values are gone, the disk's stay
    before = _check_after_restart(disk, acked)
    assert len(before) >= len(acked) - DRAM_VALUES
    survivors = sorted(before)
    proc = StoreProcess(*ARGS, "--disk", disk)
    reads = [0]
    stop = threading.Event()

    def reader():
        c = _client(proc)
        rng = random.Random(5)
        try:
            while not stop.is_set():
                batch = rng.sample(survivors, 8)
                for i, v in zip(batch, c.batch_get([_key(i) for i in batch])):
                    assert v is None or bytes(v) == _value(i)
                reads[0] += 1  # each read promotes (--promote-after 1) and demotes others
        except CrescentError:
            pass
        finally:
            c.close()

    _kill9_under(proc, reader, stop, lambda: reads[0] >= 25, "disk reads to run")
    after = _check_after_restart(disk, before)
    # promoted values kept their disk records and demotions wrote whole batches: reads lose
    # nothing but what was put straight into DRAM and never went down (none, after a restart)
    assert after == before, (before, after)
