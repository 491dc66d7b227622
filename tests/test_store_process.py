"""`crescent store` as a real process: kill -9 and restart, start-up errors, graceful stop."""

import os
import socket
import subprocess
import sys

import torch

from kvstore.chunk import decode_chunk, encode_chunk
from kvstore.client import StoreClient
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_keys, make_namespace
from kvstore.store import Tier
from tests.helpers import ROOT, StoreProcess

NS = make_namespace(ModelFingerprint("tiny", "float32", 2, 2, 64, 64))


def _chunks(n):
    tokens = list(range(n * 64))
    keys = chunk_keys(tokens, NS, 64)
    out, parent = [], ROOT_KEY
    for i, k in enumerate(keys):
        kv = torch.randn(2, 2, 2, 64, 64)  # 128 KiB payload
        out.append((k, parent, tokens[i * 64 : (i + 1) * 64], kv))
        parent = k
    return out


def test_kill9_then_restart_keeps_every_disk_value(tmp_path):
    disk = str(tmp_path / "disk")
    proc = StoreProcess("--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")
    try:
        c = StoreClient(proc.address)
        chunks = _chunks(24)  # ~3 MiB: most get demoted to disk
        for k, parent, toks, kv in chunks:
            c.put(k, encode_chunk(kv, NS, parent, toks))
        n, tiers = c.lookup_tiers([k for k, *_ in chunks])
        assert n == len(chunks)
        on_disk = [ch for ch, t in zip(chunks, tiers) if t is Tier.DISK]
        assert len(on_disk) >= 10
        c.close()
        proc.kill9()
    finally:
        proc.stop()
    proc = StoreProcess("--dram", "1MiB", "--disk", disk, "--disk-size", "64MiB")
    try:
        c = StoreClient(proc.address)
        for k, parent, toks, kv in on_disk:
            buf = c.batch_get([k])[0]
            assert buf is not None
            got = decode_chunk(buf, key=k, namespace=NS, parent=parent, tokens=toks)
            assert torch.equal(got, kv)
        c.close()
    finally:
        assert proc.stop() == 0


def _run_store(*args):
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "store", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_corrupt_lmdb_file_is_a_one_line_startup_error(tmp_path):
    d = tmp_path / "disk"
    d.mkdir()
    (d / "data.mdb").write_bytes(os.urandom(128 << 10))
    r = _run_store("--listen", "127.0.0.1:0", "--disk", str(d))
    assert r.returncode == 2
    assert r.stderr.startswith("crescent store: error: ") and "disk tier" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_bad_flags_and_busy_port_are_clear_errors(tmp_path):
    r = _run_store("--dram", "lots")
    assert r.returncode == 2 and "not a size" in r.stderr
    r = _run_store("--listen", "127.0.0.1:0", "--low-watermark", "0.99", "--high-watermark", "0.5")
    assert r.returncode == 2 and "watermark" in r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = _run_store("--listen", f"127.0.0.1:{s.getsockname()[1]}")
    assert r.returncode == 2 and "cannot listen" in r.stderr
    assert "Traceback" not in r.stderr


def test_sigterm_stops_gracefully_and_frees_the_arena():
    proc = StoreProcess("--dram", "8MiB")
    try:
        segs = [f for f in os.listdir("/dev/shm") if f.startswith(f"crescent-{proc.pid}-")]
        assert len(segs) == 1
        c = StoreClient(proc.address)
        c.put(b"k", b"v")
        c.close()
    finally:
        code = proc.stop()
    assert code == 0
    assert not os.path.exists(f"/dev/shm/{segs[0]}")


def test_help_documents_every_flag():
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "store", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    import dataclasses

    from kvstore.config import StoreConfig
    docs = open(os.path.join(ROOT, "docs", "cli.md")).read()
    for f in dataclasses.fields(StoreConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in r.stdout
        assert f"`{flag}" in docs, f"{flag} is missing from docs/cli.md"
        line = r.stdout.split(flag, 1)[1][:200]
        assert len(line.strip()) > 10, f"{flag} has no help"
