"""The data channel under hostile input: a real node process gets seeded random requests of every op
(valid ones run as a client would, reading each answer and reusing the leases it grants; mutated and
truncated ones fired blind), with random sizes, layouts, movers and lease ids, some after the real shm
proof. Whatever arrives, the node must answer or close each connection (no hang), never die, never log
an unhandled exception, keep every value it held byte for byte, and give back every lease and
reservation it granted once they lapse. A failure names the seed and connection to replay."""

from __future__ import annotations

import glob
import os
import random
import socket
import struct
import subprocess
import sys
import threading

import grpc

from kvstore.arena import SHM_DIR, SHM_PREFIX, shm_proof
from kvstore.client import StoreClient
from kvstore.config import MAX_KEY_BYTES
from kvstore.datachannel import HELLO, LAYER_BITS, Op, encode_request
from kvstore.procs import stop_process
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import ROOT, wait_for

SEED = int(os.environ.get("CRESCENT_FUZZ_SEED", "20261207"))
CONNECTIONS = int(os.environ.get("CRESCENT_FUZZ_CONNECTIONS", "1000"))
LEASE_TTL_S = 2.0

CANARIES = {b"canary-%d" % i: random.Random(i).randbytes(n) for i, n in enumerate((1, 100, 4096, 65536, 70000))}
SCRATCH = [b"fuzz-%d" % i for i in range(12)] + [b"", b"k" * MAX_KEY_BYTES, b"\xff" * 16]
ARGS = [-1, 0, 1, 2, 3, 7, 100, 4096, 65536, 70000, 1 << 20, 1 << 31, 1 << 40, -(1 << 63), (1 << 63) - 1,
        (4 << LAYER_BITS) | 24, (1 << LAYER_BITS) | 1, (-1 << LAYER_BITS) | 1, (-8 << LAYER_BITS) | 4096,
        (1 << LAYER_BITS), (70000 << LAYER_BITS) | 1]
MOVERS = [0, 1, 2, 3, 4, 5, 255]


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _answer(s: socket.socket, op: Op) -> tuple[list[tuple[int, int]], bytes, bytes]:
    """One response: its items, its grant's bytes (b"" when none) and the value bytes that follow it."""
    magic, n, tail_len = struct.unpack("<4sII", _recv_exact(s, 12))
    assert magic == b"CRRS", magic
    tail = _recv_exact(s, tail_len)
    items = [struct.unpack_from("<BQ", tail, 9 * i) for i in range(n)]
    (msg_len,) = struct.unpack_from("<H", tail, 9 * n)
    grant = tail[9 * n + 2 + msg_len:]
    body = b""
    if op in (Op.GET, Op.GET_LAYERED):
        body = _recv_exact(s, sum(size for status, size in items if status == 0))
    return items, grant, body


class Fuzzer:
    def __init__(self, rng: random.Random, proof: bytes) -> None:
        self.rng, self.proof = rng, proof
        self.leases: list[int] = []  # granted to earlier requests: released, committed, aborted at random

    def keys(self, writes: bool) -> list[bytes]:
        pool = SCRATCH if writes else SCRATCH + list(CANARIES)
        return [self.rng.choice(pool) for _ in range(self.rng.choice((0, 1, 1, 2, 3, 5)))]

    def arg(self) -> int:
        r = self.rng.random()
        return self.rng.choice(ARGS) if r < 0.7 else self.rng.randrange(-(1 << 63), 1 << 63) if r < 0.8 \
            else self.rng.choice(self.leases or [1])

    def request(self) -> tuple[Op, list[bytes], bytes]:
        rng = self.rng
        op = rng.choice(list(Op))
        if op is Op.PROVE:
            keys = [self.proof if rng.random() < 0.7 else rng.randbytes(16)]
            return op, keys, encode_request(op, keys, [0])
        keys = self.keys(writes=op in (Op.PUT, Op.RESERVE))
        mover = (3 if rng.random() < 0.7 else rng.choice(MOVERS)) if op in (Op.ACQUIRE, Op.RESERVE) \
            else rng.choice((0, 0, 0, 3))
        if op is Op.PUT:
            sizes = [rng.choice((0, 1, 5, 4096, 70000, -1, 1 << 30)) for _ in keys]
            body = b"".join(rng.randbytes(max(0, min(n, 70000))) for n in sizes)
            return op, keys, encode_request(op, keys, sizes, mover) + body
        if op in (Op.RELEASE, Op.COMMIT, Op.ABORT):
            ids = [rng.choice(self.leases) if self.leases and rng.random() < 0.8 else self.arg()
                   for _ in range(rng.choice((1, 1, 2, 0)))]
            return op, [b""] * len(ids), encode_request(op, [b""] * len(ids), ids, mover)
        if op is Op.REPORT:
            args = [self.arg() for _ in range(rng.choice((3, 3, 2)))]
            return op, [b""] * len(args), encode_request(op, [b""] * len(args), args, mover)
        if op is Op.GET_LAYERED:
            arg = self.arg()
            return op, keys, encode_request(op, keys, [arg] * len(keys), mover)
        if op is Op.RESERVE:
            sizes = [rng.choice((0, 1, 4096, 4096, 70000, 70000, 1 << 40, -5)) for _ in keys]
            return op, keys, encode_request(op, keys, sizes, mover)
        return op, keys, encode_request(op, keys, [self.arg() for _ in keys], mover)

    def conversation(self, port: int, token: bytes) -> str:
        """Requests run one by one, each answer read (leases remembered); what happened, for a failure."""
        trace = []
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            s.sendall(HELLO + token)
            if self.rng.random() < 0.7:  # as a same-host client does before its first shm grant
                s.sendall(encode_request(Op.PROVE, [self.proof], [0]))
                assert _answer(s, Op.PROVE)[0] == [(0, 0)]
            for _ in range(self.rng.randrange(1, 8)):
                op, keys, data = self.request()
                trace.append(f"{op.name} {data[:80].hex()}")
                try:
                    s.sendall(data)
                    items, grant, body = _answer(s, op)
                except (EOFError, ConnectionResetError, BrokenPipeError):  # it closed on a bad request
                    trace.append("closed by the node")
                    return "; ".join(trace)
                trace.append(f"-> {items}")
                assert len(items) == len(keys), trace  # one answer per key, whatever the op
                if len(grant) >= 8:
                    self.leases.append(struct.unpack_from("<Q", grant)[0])
                if op is Op.GET_LAYERED and len(keys) == 1 and keys[0] in CANARIES and items[0][0] == 0:
                    assert body == CANARIES[keys[0]], trace  # one value's layers in order: the value
                if op is Op.GET:  # the values it sends are the values stored, byte for byte
                    at = 0
                    for key, (status, size) in zip(keys, items):
                        if status == 0:
                            if key in CANARIES:
                                assert body[at:at + size] == CANARIES[key], trace
                            at += size
        return "; ".join(trace)

    def blind(self, port: int, token: bytes) -> str:
        """Requests (and the hello) mutated or cut, sent at once; the answers read until the node closes."""
        rng = self.rng
        hello = HELLO + token
        if rng.random() < 0.05:
            hello = bytearray(hello)
            hello[rng.randrange(len(hello))] ^= 1 << rng.randrange(8)
        stream = bytearray(b"".join(self.request()[2] for _ in range(rng.randrange(1, 5))))
        for _ in range(rng.randrange(1, 4)):
            if stream:
                stream[rng.randrange(len(stream))] = rng.randrange(256)
        if rng.random() < 0.3:
            stream = stream[: rng.randrange(len(stream) + 1)]
        with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
            got = []
            reader = threading.Thread(target=lambda: got.append(_drain(s)), daemon=True)
            reader.start()
            try:
                s.sendall(bytes(hello) + stream)
                s.shutdown(socket.SHUT_WR)  # all sent: the node sees the end of the stream
            except OSError:  # (a broken pipe, a reset, not connected) the node closed on a bad hello or request
                pass
            reader.join(timeout=90)
            assert not reader.is_alive(), f"the node neither answered nor closed: {bytes(stream[:120]).hex()}"
        return f"blind {bytes(stream[:120]).hex()}"


def _drain(s: socket.socket) -> int:
    n = 0
    try:
        while chunk := s.recv(1 << 20):
            n += len(chunk)
    except ConnectionResetError:
        pass
    return n


def test_the_data_channel_survives_random_and_mutated_requests(tmp_path):
    log_path = tmp_path / "node.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0",
                                 "--dram", "32MiB", "--transport", "auto", "--lease-ttl-s", str(LEASE_TTL_S)],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        banner = proc.stdout.readline()
        assert "listening on" in banner, open(log_path).read()
        address = banner.split("listening on ")[1].split()[0].rstrip(",")
        with grpc.insecure_channel(address) as ch:
            health = pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=60)
        (arena,) = glob.glob(os.path.join(SHM_DIR, f"{SHM_PREFIX}{proc.pid}-*"))
        with open(arena, "rb") as f:
            f.seek(-32, os.SEEK_END)
            proof = shm_proof(f.read())  # as a same-host client that reads the arena file proves
        with StoreClient(address, timeout_s=60) as c:
            for key, value in CANARIES.items():
                c.put(key, value)

        rng = random.Random(SEED)
        fuzzer = Fuzzer(rng, proof)
        for i in range(CONNECTIONS):
            what = ""
            try:
                if rng.random() < 0.5:
                    what = fuzzer.conversation(health.data_port, health.data_token)
                else:
                    what = fuzzer.blind(health.data_port, health.data_token)
            except Exception as exc:  # noqa: BLE001 - report which connection, to replay it
                raise AssertionError(f"seed {SEED}, connection {i}: {exc!r}; {what}") from exc
            assert proc.poll() is None, f"the node died at connection {i} (seed {SEED}): {open(log_path).read()}"

        with StoreClient(address, timeout_s=60) as c:
            for transport in ("tcp", "grpc"):
                with StoreClient(address, timeout_s=60, transport=transport) as t:
                    assert [t.get(k) for k in CANARIES] == list(CANARIES.values()), transport

            def all_given_back() -> bool:  # every grant lapses within its TTL; the reaper frees them
                st = c.stats()
                return st["num_remote_leases"] == st["num_remote_reservations"] == st["num_leases"] == 0

            wait_for(all_given_back, what="the leases and reservations of the fuzzed connections to be freed")
            c.put(b"after", b"fine")
            assert c.get(b"after") == b"fine"
        assert proc.poll() is None
        text = open(log_path).read()
        assert "Traceback" not in text, text[-4000:]
    finally:
        stop_process(proc, 60)
        proc.stdout.close()
