"""TLS and mTLS on the gRPC hops (kvstore/tls.py), with real handshakes: a store node, a conductor and
its member agent, the clients, and real `crescent` processes. Wrong CA, expired certificates (either
end), a missing client certificate, plaintext to a TLS port: each call fails cleanly and the server
keeps serving the clients that hold the right certificates."""

import datetime
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading

import grpc
import pytest

from kvstore import tls
from kvstore.client import ClusterClient, Retry, StoreClient
from kvstore.conductor.client import ConductorClient
from kvstore.config import StoreConfig
from kvstore.errors import CrescentError
from kvstore.server import StoreNode
from proto.crescent.v1 import kvstore_pb2 as pb
from proto.crescent.v1 import kvstore_pb2_grpc as pb_grpc
from tests.helpers import ROOT, Proc, StoreProcess, conductor_and_nodes, restored_env, wait_for

ONCE = Retry(attempts=1)


@pytest.fixture(autouse=True)
def no_tls_leaks():
    """Each test sets the process's TLS setting itself; none leaks into the next."""
    with restored_env(*tls.ENV.values()):
        yield


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Two development CAs (`crescent certs init`, the real CLI), and odd certificates of the first."""
    from cryptography import x509

    root = tmp_path_factory.mktemp("certs")
    for name in ("a", "b"):
        r = subprocess.run([sys.executable, "-m", "kvstore.cli", "certs", "init", str(root / name)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    a = {p.stem: str(p) for p in (root / "a").iterdir()}
    ca_cert = x509.load_pem_x509_certificate(open(a["ca"], "rb").read())
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    ca_key = load_pem_private_key(open(a["ca-key"], "rb").read(), None)
    long_ago = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=30)
    for name, kw in (("expired-node", dict(server=True, client=True, not_before=long_ago, days=1)),):
        cert, key = tls.issue(ca_cert, ca_key, name, ["localhost", "127.0.0.1"], **kw)
        (root / f"{name}.pem").write_bytes(cert)
        (root / f"{name}-key.pem").write_bytes(key)
    return {"a": a, "b": {p.stem: str(p) for p in (root / "b").iterdir()}, "root": root}


def use(certs, cert="node", ca="a", client_auth=True, key=None):
    """Sets this process's TLS setting: a certificate of CA a (or a file under root), trusting ``ca``."""
    if cert in ("node", "client"):
        cert_path, key_path = certs["a"][cert], certs["a"][f"{cert}-key"]
    else:
        cert_path, key_path = str(certs["root"] / f"{cert}.pem"), str(certs["root"] / f"{cert}-key.pem")
    tls.configure(cert_path, key or key_path, certs[ca]["ca"], client_auth)


def plaintext():
    tls.configure(None, None, None)


class Renewable:
    """Certificate files at fixed paths under ``folder`` (a node pair, a client pair, one CA), renewed with
    ``install``: each file replaced whole (a new inode), as cert-manager does."""

    NAMES = ("node", "node-key", "client", "client-key", "ca")

    def __init__(self, folder) -> None:
        self.path = {n: str(folder / f"{n}.pem") for n in self.NAMES}

    def install(self, src: dict, names=NAMES) -> None:
        for n in names:
            shutil.copyfile(src[n], self.path[n] + ".new")
            os.replace(self.path[n] + ".new", self.path[n])

    def use(self, who: str, client_auth: bool = True) -> None:
        """This process's setting: the ``who`` ("node" or "client") pair and the CA."""
        tls.configure(self.path[who], self.path[f"{who}-key"], self.path["ca"], client_auth)


def fails(address: str) -> bool:
    """Whether a Health call from a client with the current setting fails (cleanly, in time)."""
    try:
        with StoreClient(address, timeout_s=10, retry=ONCE) as c:
            c.health()
    except CrescentError:
        return True
    return False


def test_certs_init_writes_a_ca_and_pairs_and_never_overwrites(certs):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    a = certs["a"]
    assert sorted(a) == ["ca", "ca-key", "client", "client-key", "node", "node-key"]
    assert all(os.stat(a[k]).st_mode & 0o777 == 0o600 for k in a if k.endswith("key"))
    node = x509.load_pem_x509_certificate(open(a["node"], "rb").read())
    san = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    usage = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage and ExtendedKeyUsageOID.CLIENT_AUTH in usage
    r = subprocess.run([sys.executable, "-m", "kvstore.cli", "certs", "init", os.path.dirname(a["ca"])], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "exists" in r.stderr
    with pytest.raises(ValueError, match="missing --tls-ca"):
        tls.configure(a["node"], a["node-key"], None)
    with pytest.raises(ValueError, match="not a PEM file"):
        tls.configure(a["node"], a["node-key"], __file__)
    # before, a key of another pair bound no port ("address in use") or failed every handshake
    with pytest.raises(ValueError, match="is not the key of --tls-cert"):
        tls.configure(a["node"], certs["b"]["node-key"], a["ca"])
    with pytest.raises(ValueError, match="no valid CA certificate"):
        tls.configure(a["node"], a["node-key"], a["ca-key"])


def test_mtls_store_node_serves_certified_clients_and_refuses_the_others(certs):
    use(certs)  # the node: its certificate, clients must hold one of CA a
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    try:
        with StoreClient(node.address, timeout_s=30) as c:
            c.put(b"k", b"secret prompt")
            assert c.get(b"k") == b"secret prompt" and c.batch_get([b"k", b"x"]) == [b"secret prompt", None]
            data_port = c.health()["data_port"]
        # the TCP data channel speaks TLS too: big values both ways, batches, gets into buffers
        big = [os.urandom(3 << 20), os.urandom(1 << 16), b""]
        with StoreClient(node.address, timeout_s=30, transport="tcp") as c:
            assert c.transport == "tcp"
            assert all(c.batch_put([(b"b%d" % i, v) for i, v in enumerate(big)]))
            assert c.batch_get([b"b0", b"b1", b"b2", b"nope"]) == big + [None]
            bufs = [bytearray(len(v)) for v in big[:2]]
            assert c.batch_get_into([b"b0", b"b1"], bufs) == [len(v) for v in big[:2]] and bufs == big[:2]
        # a plaintext or wrongly certified peer of the data channel gets nothing, and the node goes on
        with socket.create_connection(("127.0.0.1", data_port), timeout=30) as s:
            try:
                s.sendall(b"CRDC" + bytes(32))  # a plaintext hello
                got = s.recv(100)
            except ConnectionResetError:
                got = b""
            assert got == b"" or got[0] == 0x15  # closed, or a TLS alert record: never a plaintext answer
        tls.configure(certs["b"]["node"], certs["b"]["node-key"], certs["b"]["ca"])
        ctx = tls.client_context()
        with socket.create_connection(("127.0.0.1", data_port), timeout=10) as s:
            with pytest.raises(ssl.SSLError):  # the node's certificate is not of CA b
                ctx.wrap_socket(s, server_hostname="127.0.0.1")
        use(certs)
        with StoreClient(node.address, timeout_s=30, transport="tcp") as c:
            assert c.get(b"b1") == big[1]

        plaintext()
        assert fails(node.address)  # plaintext to a TLS port
        use(certs, ca="b")
        assert fails(node.address)  # a client that trusts another CA: the server's certificate is not valid
        tls.configure(certs["b"]["node"], certs["b"]["node-key"], certs["a"]["ca"])
        assert fails(node.address)  # a certificate of another CA
        use(certs, cert="expired-node")
        assert fails(node.address)  # an expired client certificate
        # no client certificate at all (TLS, but not mutual)
        with grpc.secure_channel(node.address, grpc.ssl_channel_credentials(open(certs["a"]["ca"], "rb").read())) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        use(certs, cert="client")  # the tools' client-only certificate: served, all along
        with StoreClient(node.address, timeout_s=30) as c:
            assert c.get(b"k") == b"secret prompt"
    finally:
        node.stop(grace=0)


def test_threads_move_odd_sized_values_through_one_mtls_node_and_every_byte_arrives(certs):
    """Four threads, a TCP client each, against one node under mTLS: batches of values of sizes around
    TLS records and the stream's send pieces, put, read back whole, into buffers and layer-major
    (GET_LAYERED); every byte compared."""
    import random

    use(certs)
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="256MiB")).start()
    head, layer = 96, (24 << 10) + 8
    errors: list[BaseException] = []

    def work(t: int) -> None:
        rng = random.Random(t)
        try:
            with StoreClient(node.address, timeout_s=60, transport="tcp") as c:
                assert c.transport == "tcp"
                for r in range(12):
                    sizes = [rng.choice([1, 16 << 10, (16 << 10) + 1, (32 << 10) - 5, rng.randrange(1, 700 << 10)])
                             for _ in range(5)] + [head + rng.randrange(1, 9) * layer]
                    keys = [b"t%d-%d-%d" % (t, r, i) for i in range(len(sizes))]
                    vals = [rng.randbytes(n) for n in sizes]
                    assert all(c.batch_put(list(zip(keys, vals))))
                    assert c.batch_get(keys + [b"missing"]) == vals + [None]
                    bufs = [bytearray(n) for n in sizes]
                    assert c.batch_get_into(keys, bufs) == sizes and bufs == vals
                    got = {}
                    ok = c.batch_get_layered(keys[-1:], head, layer, lambda s: got.update(sizes=s),
                                             lambda j, part: memoryview(got.setdefault(part, bytearray(
                                                 head if part < 0 else layer))),
                                             lambda j, part: None)
                    parts = b"".join(bytes(got[p]) for p in sorted(k for k in got if k != "sizes"))
                    assert ok and got["sizes"] == sizes[-1:] and parts == vals[-1]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=300)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors[0]
    finally:
        node.stop()


def test_a_node_serves_rotated_certificate_files_without_a_restart(certs, tmp_path):
    """The node's certificate, key and CA files replaced on disk (another CA's, as a CA rotation does):
    new gRPC calls and new data-channel connections get the new ones at once, clients of the old CA are
    refused; files that do not load leave the last good ones in use."""
    live = Renewable(tmp_path)
    live.install(certs["a"])
    live.use("node")
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    try:
        use(certs, cert="client")
        with StoreClient(node.address, timeout_s=30, transport="tcp") as c:
            c.put(b"k", b"before")
            assert c.get(b"k") == b"before" and c.transport == "tcp"
        live.install(certs["b"])
        assert fails(node.address)  # a client of CA a: the node's certificate is now CA b's
        tls.configure(certs["b"]["client"], certs["b"]["client-key"], certs["b"]["ca"])
        with StoreClient(node.address, timeout_s=30, transport="tcp") as c:  # new connections, CA b
            assert c.transport == "tcp" and c.get(b"k") == b"before"
            c.put(b"k", b"after")
            data_port = c.health()["data_port"]
        with socket.create_connection(("127.0.0.1", data_port), timeout=30) as s:  # the data channel too
            use(certs, cert="client")
            with pytest.raises(ssl.SSLError):
                tls.TlsStream(s, tls.client_context(), server_hostname="127.0.0.1")
        # a half-done rotation (a key that is not the certificate's): the last good files stay in use
        live.install(certs["a"], ["node-key"])
        tls.configure(certs["b"]["client"], certs["b"]["client-key"], certs["b"]["ca"])
        with StoreClient(node.address, timeout_s=30, transport="tcp") as c:
            assert c.transport == "tcp" and c.get(b"k") == b"after"
    finally:
        node.stop()


def test_a_long_lived_client_follows_its_renewed_certificate_files_across_a_node_restart(certs, tmp_path,
                                                                                          monkeypatch):
    """A client's certificate files renewed on disk (here to another CA's, the node's too) while it keeps its
    gRPC channel: calls after the change go on a channel made with the new files, so once the node restarts
    (only new handshakes) the client reaches it; a call running on the old channel finishes there; files
    that do not load keep the current channel. gRPC alone would reconnect with the old certificate forever."""
    monkeypatch.setattr(tls.Following, "CHECK_S", 0.0)  # (a stat of the files at every call)
    live = Renewable(tmp_path)
    live.install(certs["a"])
    live.use("node")
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    port = node.address.rpartition(":")[2]
    live.use("client")
    c = StoreClient(node.address, timeout_s=30, retry=ONCE, transport="grpc")
    try:
        c.put(b"k", b"v" * (3 << 20))
        assert c.get(b"k") == b"v" * (3 << 20)
        running = pb_grpc.KVStoreStub(c._channel).Get(pb.GetRequest(keys=[b"k"]), timeout=60)
        assert next(running).header.found  # a streaming call open on the channel of CA a's files

        live.install(certs["b"])
        assert c.health()  # on a new channel: CA b's files at both ends (the node re-read its own)
        assert c._channel.rotations == 1
        got = b"".join(f.data for f in running)  # the old channel was not closed under the call
        assert got == b"v" * (3 << 20)

        node.stop()
        live.use("node")
        node = StoreNode(StoreConfig(listen=f"127.0.0.1:{port}", dram="16MiB")).start()  # CA b only
        live.use("client")

        def reached() -> bool:
            try:
                return c.health() is not None
            except CrescentError:
                return False

        wait_for(reached, what="the client to reach the restarted node with its renewed certificate")
        c.put(b"k2", b"after the restart")
        assert c.get(b"k2") == b"after the restart"

        # half a rotation on the client's side (a key that is not its certificate's): calls go on
        live.install(certs["a"], ["client-key"])
        assert c.get(b"k2") == b"after the restart" and c._channel.rotations == 1
        retired = c._channel._follow._retired
        assert len(retired) == 1  # the first channel, kept for calls that were running on it
        monkeypatch.setattr(tls.Following, "RETIRE_S", 0.0)
        assert c.get(b"k2") == b"after the restart" and not retired  # closed once its time is up
    finally:
        c.close()
        node.stop()


def test_conductors_elect_a_leader_on_an_etcd_spoken_to_over_mtls(certs, tmp_path):
    """``https://`` etcd endpoints: the etcd client speaks mutual TLS with the process's certificate
    (``crescent up --tls`` starts its local etcd so); a client of another CA, one whose certificate is
    of another CA, a plaintext client and an https endpoint without TLS files are refused cleanly."""
    from kvstore.conductor.config import ConductorConfig
    from kvstore.conductor.service import Conductor
    from kvstore.coord import Etcd, etcd_tls, parse_endpoints
    from kvstore.errors import InvalidArgumentError, UnavailableError
    from tests.helpers import EtcdProcess

    assert etcd_tls("https://a:1,https://b:2") and not etcd_tls("a:1,http://b:2")
    assert parse_endpoints("https://[::1]:2379") == [("::1", 2379)]
    for bad in ("https://a:1,b:2", "ftp://a:1", "https://a"):
        with pytest.raises(InvalidArgumentError):
            parse_endpoints(bad)
    use(certs)
    etcd = EtcdProcess(str(tmp_path / "etcd"), tls=True)
    conductors = []
    try:
        assert etcd.endpoint.startswith("https://127.0.0.1:")
        conductors = [Conductor(ConductorConfig(listen="127.0.0.1:0", etcd=etcd.endpoint, leader_ttl=2.0)).start()
                      for _ in range(2)]
        wait_for(lambda: sum(c.is_leader for c in conductors) == 1, what="one leader elected over mTLS")
        leader = next(c for c in conductors if c.is_leader)
        client = Etcd(etcd.endpoint, timeout_s=10)
        try:
            assert client.get(client.key("conductor", "leader")) == leader.address.encode()
        finally:
            client.close()
        port = etcd.endpoint.rsplit(":", 1)[1]
        for setting in ("b", "b-cert", "plaintext"):
            if setting == "b":  # a client of CA b
                tls.configure(certs["b"]["node"], certs["b"]["node-key"], certs["b"]["ca"])
                endpoint = etcd.endpoint
            elif setting == "b-cert":  # trusts etcd's CA, but its own certificate is of CA b
                tls.configure(certs["b"]["node"], certs["b"]["node-key"], certs["a"]["ca"])
                endpoint = etcd.endpoint
            else:  # plaintext to the TLS port
                plaintext()
                endpoint = f"127.0.0.1:{port}"
            other = Etcd(endpoint, timeout_s=5)
            try:
                with pytest.raises(UnavailableError):
                    other.get(other.key("conductor", "leader"))
            finally:
                other.close()
        # TLS without a client certificate: etcd requires one (--client-cert-auth)
        import pyetcd

        creds = grpc.ssl_channel_credentials(root_certificates=open(certs["a"]["ca"], "rb").read())
        anonymous = pyetcd.MultiEndpointEtcd3Client(
            [pyetcd.Endpoint("127.0.0.1", int(port), secure=True, creds=creds, time_retry=1.0)], timeout=5)
        try:
            with pytest.raises((pyetcd.exceptions.Etcd3Exception, grpc.RpcError)):
                anonymous.get("/crescent/conductor/leader")
        finally:
            anonymous.close()
        plaintext()
        with pytest.raises(InvalidArgumentError, match="need this process's TLS files"):
            Etcd(etcd.endpoint)
    finally:
        for c in conductors:
            c.stop(0)
        etcd.stop()


def test_an_etcd_client_follows_its_renewed_certificate_files_across_an_etcd_restart(certs, tmp_path,
                                                                                       monkeypatch):
    """The conductor's and the nodes' etcd client (``coord.Etcd``) over mTLS: its files renewed (to another
    CA's) while it lives, and etcd restarted at the same endpoint with only the new CA: its calls reach
    etcd again, on a client made with the new files."""
    from kvstore.coord import Etcd
    from tests.helpers import EtcdProcess

    monkeypatch.setattr(tls.Following, "CHECK_S", 0.0)
    live = Renewable(tmp_path)
    live.install(certs["a"])
    live.use("node")
    etcd = EtcdProcess(str(tmp_path / "etcd"), tls=True)
    live.use("client")
    client = Etcd(etcd.endpoint, timeout_s=5)
    try:
        client.call(client.client.put, client.key("k"), "v")
        assert client.get(client.key("k")) == b"v"
        etcd.stop()
        live.install(certs["b"])
        live.use("node")
        etcd = EtcdProcess(str(tmp_path / "etcd"), tls=True, ports=etcd.ports)  # CA b only
        live.use("client")

        def reached() -> bool:
            try:
                return client.get(client.key("k")) == b"v"
            except CrescentError:
                return False

        wait_for(reached, what="the etcd client to reach the restarted etcd with its renewed certificate")
    finally:
        client.close()
        etcd.stop()


def test_an_expired_server_certificate_is_refused_and_tls_without_client_auth_takes_any_tls_client(certs):
    use(certs, cert="expired-node", client_auth=False)
    expired = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    use(certs, client_auth=False)
    node = StoreNode(StoreConfig(listen="127.0.0.1:0", dram="16MiB")).start()
    try:
        assert fails(expired.address)
        ca = open(certs["a"]["ca"], "rb").read()
        with grpc.secure_channel(node.address, grpc.ssl_channel_credentials(ca)) as ch:
            assert pb_grpc.KVStoreStub(ch).Health(pb.HealthRequest(), timeout=30).serving
    finally:
        expired.stop(grace=0)
        node.stop(grace=0)


def test_a_conductor_its_store_nodes_and_cluster_clients_under_mtls(certs):
    use(certs)
    with conductor_and_nodes() as (conductor, _):  # registered over mTLS
        with ClusterClient(conductor.address, timeout_s=30) as c:
            keys = [bytes([i]) * 16 for i in range(8)]
            assert all(c.batch_put([(k, k * 4) for k in keys]))
            with ConductorClient(conductor.address) as cc:
                wait_for(lambda: cc.locate(keys).num_prefix == 8, what="the chunks indexed")
            assert c.batch_get(keys) == [k * 4 for k in keys]
        plaintext()
        with pytest.raises(CrescentError):
            with ConductorClient(conductor.address, timeout_s=10, retry=ONCE) as cc:
                cc.members()
        use(certs)  # (to stop them)


def test_real_processes_with_the_tls_flags(certs):
    a = certs["a"]
    flags = ["--tls-cert", a["node"], "--tls-key", a["node-key"], "--tls-ca", a["ca"], "--tls-client-auth"]
    conductor = Proc([sys.executable, "-m", "kvstore.cli", *flags, "conductor", "--listen", "127.0.0.1:0",
                      "--heartbeat-interval", "0.2"], "listening on")
    address = conductor.line.split("listening on ")[1].split()[0].rstrip(",")
    store = StoreProcess("--node-id", "n1", "--conductor", address, "--dram", "16MiB", top=flags)
    try:
        def ctl(*top):
            return subprocess.run([sys.executable, "-m", "kvstore.cli", *top, "ctl", "nodes", "--conductor", address,
                                   "--timeout", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)

        wait_for(lambda: "n1" in ctl(*flags).stdout, timeout_s=60, what="ctl nodes over mTLS to list n1")
        client_flags = ["--tls-cert", a["client"], "--tls-key", a["client-key"], "--tls-ca", a["ca"]]
        assert "n1" in ctl(*client_flags).stdout
        r = ctl()  # plaintext
        assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
        r = ctl("--tls-cert", a["node"], "--tls-key", a["node-key"])
        assert r.returncode == 2 and "missing --tls-ca" in r.stderr
    finally:
        store.stop()
        conductor.stop()


def _contexts(certs) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The data channel's client context (the client pair of CA a) and its node's (mTLS)."""
    use(certs, cert="client")
    client_ctx = tls.client_context()
    use(certs, client_auth=True)
    return client_ctx, tls.ServerFiles().ssl_context()


def _stream_pair(client_ctx: ssl.SSLContext, server_ctx: ssl.SSLContext):
    """A TlsStream client and, from a thread, its server over a real loopback TCP connection:
    ``(client, {"server": stream} or {"error": the server's handshake error})``."""
    with socket.create_server(("127.0.0.1", 0)) as ls:
        raw_client = socket.create_connection(ls.getsockname(), timeout=30)
        raw_server, _ = ls.accept()
    raw_server.settimeout(30)
    got: dict = {}

    def accept():
        try:
            got["server"] = tls.TlsStream(raw_server, server_ctx, server_side=True)
        except OSError as exc:
            got["error"] = exc
            raw_server.close()

    t = threading.Thread(target=accept)
    t.start()
    try:
        client = tls.TlsStream(raw_client, client_ctx, server_hostname="127.0.0.1")
    finally:
        t.join(timeout=60)
    return client, got


def _recv_exact(stream, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view.nbytes:
        k = stream.recv_into(view)
        assert k > 0, "end of stream before the message was whole"
        view = view[k:]
    return bytes(buf)


def test_tls_stream_moves_every_byte_both_ways_and_ends_cleanly(certs):
    """The data channel's TLS stream (SSLObject over memory buffers): messages of every size around a
    record (16 KiB) and the send pieces (32 KiB .. 1 MiB), gathered views, both directions, partial reads,
    a peer's close read as end of stream, and a tampered record an SSLError, never wrong bytes."""
    contexts = _contexts(certs)
    client, got = _stream_pair(*contexts)
    server = got["server"]
    assert client.version() == server.version() and client.version().startswith("TLS")
    assert server.getpeercert()["subject"]  # the node saw the client's certificate (mTLS)
    sizes = [1, 100, 16 << 10, (16 << 10) + 1, (32 << 10) - 1, 32 << 10, (1 << 20) + 3, 5 << 20]
    msgs = [os.urandom(n) for n in sizes]

    def echo():
        for n in sizes:
            data = _recv_exact(server, n)
            server.send_views([data[:7], memoryview(data)[7:], b""])

    t = threading.Thread(target=echo)
    t.start()
    for m in msgs:
        client.sendall(m)
        assert _recv_exact(client, len(m)) == m
    t.join(timeout=60)
    # partial reads: a reader's buffer smaller than what has arrived takes it in turns
    server.sendall(b"abcdefgh")
    assert client.recv(3) == b"abc" and _recv_exact(client, 5) == b"defgh"
    assert client.recv_into(bytearray(0)) == 0
    # the peer closes: end of stream (0 / b""), not an error, on either end; politely (a close_notify
    # alert first, as other TLS stacks send) or not
    with pytest.raises(ssl.SSLWantReadError):  # (it would wait for the peer's own close_notify)
        server._tls.unwrap()  # noqa: SLF001
    server._flush()  # noqa: SLF001
    assert client.recv(10) == b""
    server.close()
    client.close()
    client, got = _stream_pair(*contexts)
    got["server"].close()
    assert client.recv(10) == b""
    client.close()

    # a record altered on the wire is refused by the reader (the AEAD tag), never handed on as data
    client, got = _stream_pair(*contexts)
    server = got["server"]
    client._tls.write(b"x" * 1000)  # noqa: SLF001 (encrypt, then flip one byte of the ciphertext)
    wire = bytearray(client._out.read())  # noqa: SLF001
    wire[-20] ^= 1
    client._sock.sendall(wire)  # noqa: SLF001
    with pytest.raises(ssl.SSLError):
        _recv_exact(server, 1000)
    client.close()
    server.close()

    # a plaintext peer: the handshake fails with an SSLError on the TLS end, with an alert or a close sent
    with socket.create_server(("127.0.0.1", 0)) as ls:
        raw = socket.create_connection(ls.getsockname(), timeout=30)
        conn, _ = ls.accept()
    conn.settimeout(30)
    raw.sendall(b"CRDC" + bytes(60))
    with pytest.raises(ssl.SSLError):
        tls.TlsStream(conn, contexts[1], server_side=True)
    conn.close()
    answer = raw.recv(100)
    assert answer == b"" or answer[0] == 0x15  # a TLS alert record
    raw.close()

    # a peer that closes during the handshake: a clean OSError (the node's connection thread just ends)
    with socket.create_server(("127.0.0.1", 0)) as ls:
        raw = socket.create_connection(ls.getsockname(), timeout=30)
        conn, _ = ls.accept()
    raw.close()
    conn.settimeout(30)
    with pytest.raises(OSError):
        tls.TlsStream(conn, contexts[1], server_side=True)
    conn.close()


def test_tls_stream_refuses_a_client_certificate_of_another_ca(certs):
    """Under --tls-client-auth, a client of CA b fails the node's handshake; the client's next read fails
    (TLS 1.3 finishes the client's side first) and nothing is delivered."""
    tls.configure(certs["b"]["node"], certs["b"]["node-key"], certs["a"]["ca"])
    client_ctx = tls.client_context()
    _, server_ctx = _contexts(certs)
    client, got = _stream_pair(client_ctx, server_ctx)
    assert isinstance(got.get("error"), ssl.SSLError) and "certificate" in str(got["error"]).lower()
    try:
        client.sendall(b"CRDC" + bytes(16))
        answer = client.recv(10)
    except OSError:  # the node's alert
        answer = b""
    client.close()
    assert answer == b""


def test_kv_events_bound_beyond_the_host_under_tls_are_named_plaintext_in_a_warning(certs, caplog):
    """KV events stay vLLM's plaintext ZeroMQ protocol (what the routers reading them speak): under TLS,
    a publisher reachable from other hosts says so when it starts; one on loopback does not."""
    from kvstore.kvevents import EventPublisher

    def start(endpoint, replay=None):
        caplog.clear()
        pub = EventPublisher(endpoint, replay)
        pub.stop()
        return [r.getMessage() for r in caplog.records if "plaintext although" in r.getMessage()]

    with caplog.at_level("WARNING", logger="kvstore.kvevents"):
        assert start("tcp://0.0.0.0:*") == []  # plaintext process: nothing to say
        use(certs)
        assert start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") == []
        said = start("tcp://0.0.0.0:*", "tcp://127.0.0.1:*")
        assert len(said) == 1 and said[0].startswith("KV events on tcp://0.0.0.0:")
        assert len(start("tcp://*:*", "tcp://*:*")) == 2  # the replay socket too
