"""TLS and mutual TLS for every Crescent gRPC hop, and development certificates.

One setting per process, from ``crescent --tls-cert FILE --tls-key FILE --tls-ca FILE
[--tls-client-auth]`` or the environment (``CRESCENT_TLS_CERT``, ``CRESCENT_TLS_KEY``,
``CRESCENT_TLS_CA``, ``CRESCENT_TLS_CLIENT_AUTH=1``; the flags set these, so the processes
``crescent up`` starts inherit them). With it, every gRPC server (store node, conductor, engine)
listens with TLS only, and every client channel (``StoreClient``, ``ConductorClient``, member
agents, the gateway's and router's engine channels, ``crescent ctl``) verifies the server's
certificate against the CA and presents its own certificate, so servers started with
``--tls-client-auth`` accept only clients holding a certificate of that CA (mTLS). Without it,
nothing changes: plaintext, as before.

Servers re-read their files when they change on disk (``ServerFiles``: certificates rotate without
a restart); clients read theirs for each new data-channel connection, and their gRPC channels follow
the files (``RotatingChannel``: calls after a change go on a channel made with the new ones).

Certificates name the hosts they serve (subject alternative names); gRPC checks the name a client
dialled against them. ``crescent certs init DIR --host NAME ...`` writes a development CA
(``ca.pem``, ``ca-key.pem``) and one certificate + key pair (``node.pem``, ``node-key.pem``) valid
for both ends (server and client authentication) for the given hosts plus ``localhost`` and
``127.0.0.1``, and a client-only pair (``client.pem``, ``client-key.pem``) for tools.

The TCP data channel (kvstore/datachannel.py), which carries chunk bytes outside gRPC, speaks TLS
with the same certificates (``ServerFiles.ssl_context`` / ``client_context``: Python's ``ssl``, TLS 1.2 or
newer, the client checking the node's name, the node requiring client certificates under
``--tls-client-auth``), through ``TlsStream`` (OpenSSL on memory buffers: far fewer system calls
than ``ssl.SSLSocket``). Shared memory stays same-host and same-user: the arena file is 0600 and
a client proves it read the file's secret before shm grants (kvstore/arena.py, ``shm_proof``).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import ipaddress
import logging
import os
import ssl
import threading
import time

import grpc

log = logging.getLogger(__name__)

ENV = {"cert": "CRESCENT_TLS_CERT", "key": "CRESCENT_TLS_KEY", "ca": "CRESCENT_TLS_CA",
       "client_auth": "CRESCENT_TLS_CLIENT_AUTH"}


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    cert: bytes
    """This process's certificate chain (PEM)."""
    key: bytes
    """Its private key (PEM)."""
    ca: bytes
    """The CA bundle peers' certificates are checked against (PEM)."""
    client_auth: bool = False
    """Servers: require a client certificate signed by ``ca``."""


def _read(name: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ValueError(f"--tls-{name} {path}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"--tls-{name} {path}: not a PEM file")
    return data


@functools.lru_cache(maxsize=8)
def _load(cert: str, key: str, ca: str, client_auth: bool, stamp: tuple = ()) -> TlsConfig:
    """The files' contents, checked (``stamp``: their state on disk, so that a change loads anew)."""
    loaded = TlsConfig(_read("cert", cert), _read("key", key), _read("ca", ca), client_auth)
    try:  # a key that is not the certificate's would fail every handshake with a message about something else
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-key {key} is not the key of --tls-cert {cert} (or either is not valid PEM): "
                         f"{exc.reason or exc}") from None
    try:
        ssl.create_default_context(cafile=ca)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-ca {ca}: no valid CA certificate: {exc.reason or exc}") from None
    return loaded


def config() -> TlsConfig | None:
    """This process's TLS setting (from the environment), or None for plaintext.

    Raises:
        ValueError: some but not all of the files are given, or one cannot be read.
    """
    paths = {k: os.environ.get(v) or None for k, v in ENV.items() if k != "client_auth"}
    if not any(paths.values()):
        return None
    missing = [f"--tls-{k}" for k, v in paths.items() if not v]
    if missing:
        raise ValueError(f"TLS needs --tls-cert, --tls-key and --tls-ca; missing {', '.join(missing)}")
    client_auth = os.environ.get(ENV["client_auth"], "") not in ("", "0", "false")
    files = (paths["cert"], paths["key"], paths["ca"])
    return _load(*files, client_auth, _stat(files))  # (files changed on disk load anew: rotation)


def _stat(paths) -> tuple:
    """The files' state on disk: (mtime, size, inode) each, None for one that is missing."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def configure(cert: str | None, key: str | None, ca: str | None, client_auth: bool = False) -> None:
    """Sets this process's (and its children's) TLS setting; checks the files at once.

    Raises:
        ValueError: as ``config``.
    """
    for name, value in (("cert", cert), ("key", key), ("ca", ca)):
        if value:
            os.environ[ENV[name]] = os.path.abspath(value)
        else:
            os.environ.pop(ENV[name], None)
    os.environ[ENV["client_auth"]] = "1" if client_auth else ""
    config()


def files() -> tuple[str, str, str]:
    """This process's certificate, key and CA file paths (under a TLS setting: ``config()`` first)."""
    return os.environ[ENV["cert"]], os.environ[ENV["key"]], os.environ[ENV["ca"]]


def client_context():
    """An ``ssl.SSLContext`` for data-channel clients under TLS (checks the node's name), else None."""

    if config() is None:
        return None
    cert, key, ca = files()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(ca)
    ctx.load_cert_chain(cert, key)
    return ctx


class ServerFiles:
    """A server's certificate, key and CA files, as this process's setting named them when it started,
    re-read when they change on disk: certificates rotate (cert-manager, a renewal cron) without a
    restart. Each new connection is served with the files as they are then; connections already
    open keep theirs. Files that do not load (a rotation half written, a key that is not the
    certificate's) leave the last good ones in use, with a warning, until they do.
    """

    def __init__(self) -> None:
        tls = config()
        if tls is None:
            raise ValueError("no TLS setting (--tls-cert, --tls-key, --tls-ca)")
        self.paths = files()
        self.client_auth = tls.client_auth
        self._stamp = _stat(self.paths)
        self.current = tls
        self._context: ssl.SSLContext | None = None
        self._context_of: TlsConfig | None = None
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Re-reads the files if they changed since the last look; True when new ones were loaded."""
        stamp = _stat(self.paths)
        with self._lock:
            if stamp == self._stamp:
                return False
            self._stamp = stamp
            try:
                loaded = _load(*self.paths, self.client_auth, stamp)
            except ValueError as exc:
                log.warning("TLS files changed but do not load (still serving the last good ones): %s", exc)
                return False
            changed = loaded != self.current
            self.current = loaded
            return changed

    def ssl_context(self) -> ssl.SSLContext:
        """The data channel's server context for a new connection (made again after a rotation)."""
        self.refresh()
        with self._lock:
            if self._context is None or self._context_of is not self.current:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                ctx.verify_mode = ssl.CERT_REQUIRED if self.client_auth else ssl.CERT_NONE
                try:
                    ctx.load_verify_locations(cadata=self.current.ca.decode())
                    ctx.load_cert_chain(self.paths[0], self.paths[1])  # (from files: the ssl module's only way)
                except (ssl.SSLError, OSError) as exc:  # changed again since they were read: the next look
                    if self._context is None:
                        raise
                    log.warning("TLS files do not load (still serving the last good ones): %s", exc)
                    return self._context
                self._context, self._context_of = ctx, self.current
            return self._context

    def grpc_config(self):
        tls = self.current
        return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], root_certificates=tls.ca)

    def grpc_fetch(self):
        """gRPC calls this before each new connection's handshake: a new configuration, or None."""
        try:
            return self.grpc_config() if self.refresh() else None
        except Exception:  # noqa: BLE001 - raising here would fail the handshake; keep the current files
            log.exception("TLS rotation for gRPC failed; serving the last good files")
            return None


def add_port(server: grpc.Server, address: str) -> int:
    """``server.add_secure_port`` under TLS (certificates re-read when their files change:
    ``ServerFiles``), else ``add_insecure_port``: the bound port, 0 on failure."""
    tls = config()
    try:
        if tls is None:
            return server.add_insecure_port(address)
        files = ServerFiles()
        creds = grpc.dynamic_ssl_server_credentials(files.grpc_config(), files.grpc_fetch,
                                                    require_client_authentication=tls.client_auth)
        return server.add_secure_port(address, creds)
    except RuntimeError:  # grpc raises on a failed bind
        return 0


def channel(address: str, options=None) -> grpc.Channel:
    """A client channel to ``address``: TLS (``RotatingChannel``: this process's certificate, following its
    files) or plaintext, sending this process's bearer token when it has one (kvstore/auth.py)."""
    from kvstore.auth import with_token

    tls = config()
    if tls is None:
        return with_token(grpc.insecure_channel(address, options=options))
    return RotatingChannel(address, options, tls)


def channel_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """gRPC client credentials from these files: trust their CA, present their certificate."""
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


def _secure_channel(address: str, options, tls: TlsConfig) -> grpc.Channel:
    from kvstore.auth import with_token

    return with_token(grpc.secure_channel(address, channel_credentials(tls), options=options))


class Following:
    """A client object made from this process's TLS files (a gRPC channel, an etcd client), made again with the
    new files once their contents change on disk.

    gRPC fixes a channel's credentials when it is made, and the channel reconnects with them for as long as
    it lives: an engine whose certificate was renewed would keep presenting the old one, and be refused once
    that expired and its connection broke (a node restart). So ``get()`` looks at the files' state at most
    every ``CHECK_S`` (``config()``: a stat of each) and, after a change, returns a new object made with
    them. Calls already running on the old one finish there: it is closed ``RETIRE_S`` after it was
    replaced, or with this. Files that do not load (half a rotation) keep the current one, with a warning.
    """

    CHECK_S = 1.0
    RETIRE_S = 900.0

    def __init__(self, what: str, make, tls: TlsConfig) -> None:
        self._what, self._make, self._tls = what, make, tls
        self._current = make(tls)
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._retired: list[tuple[float, object]] = []
        self._refused: str | None = None
        self._closed = False
        self.rotations = 0
        """How many times the files changed and a new object was made."""

    def get(self):
        """The object a call made now uses (made anew when the files changed since the last one)."""
        now = time.monotonic()
        if now - self._checked >= self.CHECK_S:
            with self._lock:
                if now - self._checked >= self.CHECK_S and not self._closed:
                    self._checked = now
                    self._follow_files(now)
                    while self._retired and now - self._retired[0][0] >= self.RETIRE_S:
                        self._retired.pop(0)[1].close()
        return self._current

    def _follow_files(self, now: float) -> None:
        try:
            tls = config()
        except ValueError as exc:  # half a rotation, or the files went away: keep what works
            if str(exc) != self._refused:
                self._refused = str(exc)
                log.warning("TLS files do not load (%s); %s keeps the last good ones", exc, self._what)
            return
        self._refused = None
        if tls is None or tls is self._tls:
            return
        same = (tls.cert, tls.key, tls.ca) == (self._tls.cert, self._tls.key, self._tls.ca)
        self._tls = tls
        if same:  # touched, not changed
            return
        try:
            made = self._make(tls)
        except Exception as exc:  # noqa: BLE001 - keep what works; the next change tries again
            log.warning("%s: cannot use the new TLS files (%s); keeping the last good ones", self._what, exc)
            return
        self._retired.append((now, self._current))
        self._current = made
        self.rotations += 1
        log.info("TLS files changed: new calls of %s use the new certificate", self._what)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            retired, self._retired = self._retired, []
        for _, obj in retired:
            obj.close()
        self._current.close()


class RotatingChannel(grpc.Channel):
    """A TLS client channel that follows this process's certificate files (``Following``): stubs made from
    it resolve its current channel at each call. A connectivity ``subscribe`` watches the channel that is
    current when it is made."""

    def __init__(self, address: str, options, tls: TlsConfig) -> None:
        self._follow = Following(f"the channel to {address}", lambda t: _secure_channel(address, options, t), tls)

    @property
    def rotations(self) -> int:
        return self._follow.rotations

    def current(self) -> grpc.Channel:
        return self._follow.get()

    def _method(self, kind: str, args, kwargs):
        return _FollowingCall(self, kind, args, kwargs)

    def unary_unary(self, *args, **kwargs):
        return self._method("unary_unary", args, kwargs)

    def unary_stream(self, *args, **kwargs):
        return self._method("unary_stream", args, kwargs)

    def stream_unary(self, *args, **kwargs):
        return self._method("stream_unary", args, kwargs)

    def stream_stream(self, *args, **kwargs):
        return self._method("stream_stream", args, kwargs)

    def subscribe(self, callback, try_to_connect=False):
        self.current().subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback):
        self.current().unsubscribe(callback)

    def close(self) -> None:
        self._follow.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


class _FollowingCall:
    """A stub method of a ``RotatingChannel``: the same method of its current channel."""

    __slots__ = ("_owner", "_kind", "_args", "_kwargs", "_bound")

    def __init__(self, owner: RotatingChannel, kind: str, args, kwargs) -> None:
        self._owner, self._kind, self._args, self._kwargs = owner, kind, args, kwargs
        self._bound = (None, None)

    def _target(self):
        channel = self._owner.current()
        bound, method = self._bound
        if bound is not channel:
            method = getattr(channel, self._kind)(*self._args, **self._kwargs)
            self._bound = (channel, method)
        return method

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)

    def with_call(self, *args, **kwargs):
        return self._target().with_call(*args, **kwargs)

    def future(self, *args, **kwargs):
        return self._target().future(*args, **kwargs)


# ---- development certificates (crescent certs init) -------------------------------------


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Crescent (development)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]):
    from cryptography import x509

    out = []
    for h in dict.fromkeys(hosts):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(out)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def issue(ca_cert, ca_key, common_name: str, hosts: list[str], *, server: bool, client: bool,
          not_before: datetime.datetime | None = None, days: float = 365.0):
    """A new EC key and a certificate for it signed by the CA: ``(cert PEM, key PEM)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    b = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if hosts:
        b = b.add_extension(_san(hosts), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def new_ca(common_name: str = "Crescent development CA", days: float = 3650.0):
    """A self-signed CA: ``(cert, key)`` objects."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def init_dir(folder: str, hosts: list[str], days: float = 365.0) -> dict[str, str]:
    """Writes a development CA, a node pair (server + client) and a client pair into ``folder``; keys 0600.
    Returns file role → path.

    Raises:
        FileExistsError: ``folder`` already holds a CA (never overwritten).
    """
    from cryptography.hazmat.primitives import serialization

    os.makedirs(folder, exist_ok=True)
    paths = {n: os.path.join(folder, f) for n, f in (("ca", "ca.pem"), ("ca_key", "ca-key.pem"),
                                                     ("node", "node.pem"), ("node_key", "node-key.pem"),
                                                     ("client", "client.pem"), ("client_key", "client-key.pem"))}
    if os.path.exists(paths["ca"]):
        raise FileExistsError(f"{paths['ca']} exists: use another folder, or remove it first")
    ca_cert, ca_key = new_ca()
    node = issue(ca_cert, ca_key, "crescent-node", ["localhost", "127.0.0.1", *hosts], server=True, client=True,
                 days=days)
    client = issue(ca_cert, ca_key, "crescent-client", [], server=False, client=True, days=days)
    files = {"ca": ca_cert.public_bytes(serialization.Encoding.PEM), "ca_key": _pem_key(ca_key),
             "node": node[0], "node_key": node[1], "client": client[0], "client_key": client[1]}
    for role, data in files.items():
        fd = os.open(paths[role], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if role.endswith("key") else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return paths


# ---- the data channel's TLS stream -------------------------------------------------------

_FIRST_PIECE = 32 << 10  # the first bytes encrypted and sent of a message
_SEND_PIECE = 1 << 20  # the most encrypted before they go to the socket in one send
_RECV_FIRST = 64 << 10  # a connection's receive buffer at first
_RECV_PIECE = 512 << 10  # ... grown while recvs fill it, up to this


class TlsStream:
    """TLS over a connected TCP socket, for the data channel: the subset of the socket API it uses
    (``recv``, ``recv_into``, ``sendall``, ``send_views``, ``settimeout``, ``fileno``, ``shutdown``,
    ``close``).

    ``ssl.SSLSocket`` makes system calls per TLS record (16 KiB): two ``recv`` per record read (its
    header, then its body), one ``send`` per record written, so a MiB took 128 ``recv`` calls to read
    and 64 ``send`` calls to write. Here OpenSSL works on memory buffers
    (``SSLObject`` over ``MemoryBIO``): up to 512 KiB come off the socket per ``recv`` (the buffer
    starts at 64 KiB and grows while recvs fill it, so a connection that carries only requests stays
    small) and up to 1 MiB of records go out per ``send``; records are decrypted straight into the
    caller's buffer.
    The handshake runs in the constructor under the socket's timeout. A peer that closes (with or
    without close_notify) reads as end of stream; a bad record raises ``ssl.SSLError`` (an OSError).
    """

    def __init__(self, sock, ctx: ssl.SSLContext, *, server_side: bool = False,
                 server_hostname: str | None = None) -> None:
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._view = memoryview(bytearray(_RECV_FIRST))
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionResetError("peer closed the connection during the TLS handshake") from None
            except ssl.SSLError:
                self._flush()  # the alert that says why, if any, then the error
                raise
        self._flush()

    def _flush(self) -> None:
        if self._out.pending:
            self._sock.sendall(self._out.read())

    def _fill(self) -> bool:
        """Moves what the socket has (waiting for some) into OpenSSL's input; False at end of stream."""
        n = self._sock.recv_into(self._view)
        if n == 0:
            self._in.write_eof()
            return False
        self._in.write(self._view[:n])
        if n == self._view.nbytes < _RECV_PIECE:  # bulk data: take more at a time
            self._view = memoryview(bytearray(2 * n))
        return True

    def recv_into(self, view, nbytes: int = 0) -> int:
        """Decrypts up to ``nbytes`` (all of ``view``) into ``view``: at least one byte, 0 at end of stream."""
        n = nbytes or memoryview(view).nbytes
        if not n:
            return 0
        while True:
            try:
                got = self._tls.read(n, view)
            except ssl.SSLWantReadError:
                if not self._fill():
                    return 0  # closed without close_notify: an end like any other (the reader knows its sizes)
                continue
            except ssl.SSLZeroReturnError:
                return 0
            if self._out.pending:  # a post-handshake message (a key update) to answer
                self._flush()
            return got

    def recv(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[: self.recv_into(buf)])

    def send_views(self, views) -> None:
        """Encrypts ``views`` in order and sends the records in pieces that start at 32 KiB (the peer
        decrypts the first while the next is encrypted) and double up to a MiB (fewer system calls)."""
        piece = _FIRST_PIECE
        for v in views:
            v = memoryview(v).cast("B")
            at = 0
            while at < v.nbytes:
                self._tls.write(v[at : at + piece])
                at += piece
                if self._out.pending >= piece:
                    self._flush()
                    piece = min(2 * piece, _SEND_PIECE)
        self._flush()

    def sendall(self, data) -> None:
        self.send_views([data])

    def settimeout(self, t: float | None) -> None:
        self._sock.settimeout(t)

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def version(self) -> str | None:
        return self._tls.version()

    def getpeercert(self, binary_form: bool = False):
        return self._tls.getpeercert(binary_form)
