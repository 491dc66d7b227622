"""Coordination through etcd: kept-alive leases and leader election.

Crescent keeps no consensus of its own: cluster metadata that must survive a
process (who leads the conductors; later, who is a member) lives in etcd, the
store Mooncake uses for the same job. The client is ``etcd-sdk-python``
(``import pyetcd``), a maintained fork of python-etcd3 whose stubs are
generated for current protobuf and grpcio; it speaks etcd's v3 gRPC API,
synchronously, which fits the thread-per-loop servers here, and fails over
between endpoints (docs/architecture.md, "Conductor high availability").

Leader election (``LeaderElection``): a candidate creates
``<prefix>/<name>/leader`` holding its address, with a lease of ``ttl_s``, in
one transaction that succeeds only if the key does not exist; the winner keeps
its lease alive and leads until it resigns, or until it cannot renew for
two thirds of the TTL (it then steps down before etcd lets the lease expire,
so two leaders never overlap). The others answer with the key's value (the
leader's address) and watch the key from the revision they saw, campaigning
again the moment it goes: a crashed leader is replaced within its TTL plus
etcd's lease-expiry check.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from kvstore.errors import CrescentError, InvalidArgumentError, UnavailableError, from_grpc

log = logging.getLogger(__name__)
DEFAULT_PREFIX = "/crescent"


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """``[https://]host:port[,[https://]host:port...]`` → [(host, port)] (``etcd_tls`` says which scheme).

    Raises:
        InvalidArgumentError: an empty list, an entry that is not host:port, or a mix of schemes.
    """
    return _parse(text)[1]


def etcd_tls(text: str) -> bool:
    """Whether the endpoints are ``https://`` ones: etcd spoken to over TLS, with this process's
    certificate (``crescent --tls-*``, kvstore/tls.py)."""
    return _parse(text)[0]


def _parse(text: str) -> tuple[bool, list[tuple[str, int]]]:
    out, schemes = [], set()
    for part in (p.strip() for p in text.split(",")):
        scheme, sep, rest = part.partition("://")
        if not sep:
            scheme, rest = "http", part
        host, _, port = rest.rpartition(":")
        if scheme not in ("http", "https") or not host or not (port.isascii() and port.isdigit()) \
                or not 0 < int(port) < 65536:
            raise InvalidArgumentError(f"etcd endpoints must be [https://]host:port[,...], got {text!r}")
        schemes.add(scheme)
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise InvalidArgumentError("no etcd endpoint given")
    if len(schemes) > 1:
        raise InvalidArgumentError(f"etcd endpoints must all be https:// or none, got {text!r}")
    return schemes == {"https"}, out


class Etcd:
    """A client of one etcd cluster (its endpoints tried in turn) under a key prefix."""

    def __init__(self, endpoints: str, prefix: str = DEFAULT_PREFIX, timeout_s: float = 5.0) -> None:
        import pyetcd

        secure, self.endpoints = _parse(endpoints)
        self.prefix = prefix.rstrip("/")
        self.timeout_s = timeout_s

        def connect(t):
            from kvstore import tls

            creds = tls.channel_credentials(t) if t is not None else None
            eps = [pyetcd.Endpoint(h, p, secure=secure, creds=creds, time_retry=1.0) for h, p in self.endpoints]
            return pyetcd.MultiEndpointEtcd3Client(eps, timeout=timeout_s, failover=True)

        self._follow = self._plain = None
        if secure:  # mutual TLS with this process's certificate; etcd checks it against its trusted CA
            from kvstore import tls

            t = tls.config()
            if t is None:
                raise InvalidArgumentError("https:// etcd endpoints need this process's TLS files "
                                           "(--tls-cert, --tls-key, --tls-ca)")
            # renewed files: the next calls go on a client made with them (kvstore/tls.py, Following)
            self._follow = tls.Following(f"the etcd client of {endpoints}", connect, t)
        else:
            self._plain = connect(None)
        self._errors = (pyetcd.exceptions.ConnectionFailedError, pyetcd.exceptions.ConnectionTimeoutError,
                        pyetcd.exceptions.NoServerAvailableError)

    @property
    def client(self):
        """The pyetcd client for a call made now."""
        return self._follow.get() if self._follow is not None else self._plain

    def key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts))

    def call(self, fn: Callable, *args, **kwargs):
        """``fn(*args)`` on this client, retried on the next endpoint once per endpoint.

        Raises:
            UnavailableError: no endpoint answered.
            CrescentError: etcd answered with an error status (e.g. NotFoundError: no such lease).
        """
        import grpc

        last = None
        for _ in range(len(self.endpoints)):
            try:
                return fn(*args, **kwargs)
            except self._errors as exc:
                last = exc
            except grpc.RpcError as exc:  # a status pyetcd passes through as it is
                raise from_grpc(exc) from None
        raise UnavailableError(f"etcd at {','.join(f'{h}:{p}' for h, p in self.endpoints)} is unreachable: "
                               f"{type(last).__name__}")

    def renew(self, lease_id: int) -> int:
        """Renews a lease once; its remaining TTL in seconds (0: it had expired)."""
        # NOTE: refresh_lease is a generator: it must run inside call(), where its errors are caught
        answer = self.call(lambda: next(iter(self.client.refresh_lease(lease_id)), None))
        if answer is None:
            raise UnavailableError("etcd closed the lease keep-alive stream")
        return answer.TTL

    def get(self, key: str) -> bytes | None:
        value, _ = self.call(self.client.get, key)
        return value

    def close(self) -> None:
        (self._follow or self._plain).close()


class LeaderElection:
    """One candidate for ``<prefix>/<name>/leader``; ``on_change(is_leader, leader_value)`` on each change.

    ``start()`` campaigns in a background thread; ``leader()`` is the current
    leader's value as last seen (this candidate's own while it leads);
    ``stop()`` resigns (deletes the key at once, so a follower takes over
    without waiting for the TTL).
    """

    def __init__(self, etcd: Etcd, name: str, value: str, ttl_s: float = 5.0,
                 on_change: Callable[[bool, str | None], None] | None = None, poll_s: float | None = None) -> None:
        if not ttl_s >= 2:
            raise InvalidArgumentError(f"the leader lease TTL must be >= 2 s (etcd grants whole seconds), got {ttl_s}")
        self.etcd = etcd
        self.key = etcd.key(name, "leader")
        self.value = value
        self.ttl_s = int(ttl_s)
        self.poll_s = poll_s if poll_s is not None else min(0.5, self.ttl_s / 4)
        self.on_change = on_change
        self.is_leader = False
        self._leader: str | None = None
        self._lease = None
        self._seen_revision = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"election-{name}", daemon=True)
        self.num_elected = 0
        """Times this candidate won."""

    def start(self) -> LeaderElection:
        self._thread.start()
        return self

    def leader(self) -> str | None:
        return self.value if self.is_leader else self._leader

    def _set(self, is_leader: bool, leader: str | None) -> None:
        changed = (is_leader, leader) != (self.is_leader, self._leader)
        self.is_leader, self._leader = is_leader, leader
        if changed:
            if is_leader:
                self.num_elected += 1
            log.info("%s: %s", self.key, "elected" if is_leader else f"following {leader or 'nobody'}")
            if self.on_change is not None:
                self.on_change(is_leader, leader)

    def _campaign(self) -> bool:
        """One attempt; True when this candidate now leads (with its lease in ``self._lease``)."""
        c = self.etcd.client
        lease = self.etcd.call(c.lease, self.ttl_s)
        won, responses = self.etcd.call(
            c.transaction, compare=[c.transactions.create(self.key) == 0],
            success=[c.transactions.put(self.key, self.value, lease=lease)],
            failure=[c.transactions.get(self.key)])
        if won:
            self._lease = lease
            return True
        self.etcd.call(c.revoke_lease, lease.id)
        held = responses[0][0] if responses and responses[0] else None
        self._set(False, held[0].decode() if held else None)
        self._seen_revision = held[1].mod_revision if held else 0
        return False

    def _wait_for_vacancy(self) -> None:
        """Returns once the leader key changes after the revision seen (its lease lapsed, or the leader
        resigned), or after a TTL at most. Watching from that revision, a deletion that happened
        before the watch was set up is replayed at once: a dead leader is replaced within its TTL plus
        etcd's lease-expiry check (every 0.5 s), not a polling period later."""
        import pyetcd

        if not self._seen_revision:
            self._stop.wait(self.poll_s)
            return
        try:
            self.etcd.call(self.etcd.client.watch_once, self.key, timeout=self.ttl_s,
                           start_revision=self._seen_revision + 1)
        except pyetcd.exceptions.WatchTimedOut:
            pass

    def _lead(self) -> None:
        """Keeps the lease alive until stop, a lost lease, or renewals failing for 2/3 of the TTL."""
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                ttl = self.etcd.renew(self._lease.id)
            except CrescentError as exc:
                log.warning("%s: cannot renew the leader lease: %s", self.key, exc)
                if time.monotonic() - last_ok >= self.ttl_s * 2 / 3:
                    break  # step down before the lease can expire under a new leader
                continue
            if ttl <= 0:
                log.warning("%s: the leader lease expired", self.key)
                break
            last_ok = time.monotonic()
        self._set(False, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._campaign():
                    self._set(True, self.value)
                    self._lead()
                    continue
                self._wait_for_vacancy()
            except Exception as exc:  # noqa: BLE001 - the candidacy must outlive any one failed call
                log.warning("%s: %s", self.key, exc, exc_info=not isinstance(exc, CrescentError))
                self._set(False, None)
                self._stop.wait(self.poll_s)

    def stop(self, resign: bool = True) -> None:
        """Stops campaigning; ``resign`` gives up leadership at once (else it lapses with the lease)."""
        self._stop.set()
        self._thread.join(timeout=self.etcd.timeout_s * 2 + self.ttl_s)
        if resign and self._lease is not None:
            try:
                self.etcd.call(self.etcd.client.revoke_lease, self._lease.id)
            except CrescentError as exc:  # unreachable, or the lease already lapsed (NOT_FOUND)
                log.warning("%s: cannot resign: %s", self.key, exc)
        self._lease = None
        self.is_leader = False


class Registration:
    """A key held under a lease this object keeps alive (a member's registration).

    ``start()`` puts ``key = value`` with a lease of ``ttl_s`` and renews it every
    TTL/3 in a background thread; a lease that lapsed (etcd answered TTL 0, e.g.
    after the process was paused) is replaced by a new one and the key put again.
    While etcd is unreachable it keeps retrying. ``stop()`` revokes the lease: the
    key goes at once.
    """

    def __init__(self, etcd: Etcd, key: str, value: str, ttl_s: float) -> None:
        self.etcd = etcd
        self.key = key
        self.value = value
        self.ttl_s = max(2, math.ceil(ttl_s))
        self.lease = None
        self.num_leases = 0
        """Leases granted so far (more than one: the registration lapsed and was restored)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-registration", daemon=True)

    def start(self) -> Registration:
        self._thread.start()
        return self

    def update(self, value: str) -> None:
        """A new value, put at once on the current lease (or with the next one)."""
        self.value = value
        if self.lease is not None:
            try:
                self.etcd.call(self.etcd.client.put, self.key, value, lease=self.lease)
            except CrescentError as exc:
                log.warning("%s: %s", self.key, exc)

    def _put(self) -> None:
        c = self.etcd.client
        self.lease = self.etcd.call(c.lease, self.ttl_s)
        self.etcd.call(c.put, self.key, self.value, lease=self.lease)
        self.num_leases += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.lease is None:
                    self._put()
                elif self.etcd.renew(self.lease.id) <= 0:
                    log.warning("%s: the registration's lease lapsed; registering again", self.key)
                    self.lease = None
                    continue
            except Exception as exc:  # noqa: BLE001 - keep retrying: the registration must outlive any one call
                log.warning("%s: %s", self.key, exc, exc_info=not isinstance(exc, CrescentError))
            self._stop.wait(self.ttl_s / 3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.etcd.timeout_s * 2 + 1)
        if self.lease is not None:
            try:
                self.etcd.call(self.etcd.client.revoke_lease, self.lease.id)
            except CrescentError as exc:  # unreachable, or the lease already lapsed
                log.info("%s: cannot revoke the lease: %s", self.key, exc)
            self.lease = None


class LocalEtcd:
    """A one-member etcd (the ``etcd`` binary, e.g. Debian's etcd-server) as a child process on
    free loopback ports, for ``crescent up --etcd local``, tests and benchmarks; ``stop()`` ends it by pid.
    With ``tls``, its clients speak mutual TLS with this process's certificate files (kvstore/tls.py:
    its server certificate, and the CA its clients' certificates must be of), and ``endpoint`` is an
    ``https://`` one. ``ports`` (client, peer; ``self.ports`` says which it got) restarts a member on
    the same data directory at the same endpoint.

    Raises:
        FileNotFoundError: no ``etcd`` binary on PATH.
        RuntimeError: it exited or did not serve within ``timeout_s``.
        ValueError: ``tls`` without this process's TLS setting.
    """

    def __init__(self, data_dir: str, host: str = "127.0.0.1", timeout_s: float = 120.0, tls: bool = False,
                 ports: tuple[int, int] | None = None) -> None:
        import os
        import shutil
        import subprocess
        import urllib.request

        from kvstore.procs import port_for_child

        exe = shutil.which("etcd")
        if exe is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        os.makedirs(data_dir, exist_ok=True)
        self.log = os.path.join(data_dir, "etcd.log")
        member_dir = os.path.join(data_dir, "data")
        fresh = not os.path.exists(member_dir)
        scheme, tls_flags, ctx = "http", [], None
        if tls:
            import ssl

            from kvstore import tls as tls_files

            if tls_files.config() is None:
                raise ValueError("a TLS etcd needs this process's TLS files (--tls-cert, --tls-key, --tls-ca)")
            cert, key, ca = tls_files.files()
            scheme = "https"
            tls_flags = ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
            ctx = ssl.create_default_context(cafile=ca)  # its health check, as a client of CA ca
            ctx.load_cert_chain(cert, key)
        deadline = time.monotonic() + timeout_s
        tries = 3 if ports is None else 1
        for attempt in range(tries):
            # NOTE: etcd cannot bind port 0 and say which it got: it gets ports below the ephemeral range,
            # and should another process bind one first, etcd exits and gets new ones (unless ``ports``,
            # its client and peer ports, are given: a restart at the same endpoint)
            if tries > 1:
                ports = [port_for_child(host), port_for_child(host)]
                while ports[1] == ports[0]:
                    ports[1] = port_for_child(host)
            self.ports = (ports[0], ports[1])
            client = f"{scheme}://{host}:{ports[0]}"
            self.endpoint = client if tls else f"{host}:{ports[0]}"
            peer = f"http://{host}:{ports[1]}"
            cmd = [exe, "--name", "crescent", "--data-dir", member_dir,
                   "--listen-client-urls", client, "--advertise-client-urls", client,
                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                   "--initial-cluster", f"crescent={peer}", *tls_flags]
            with open(self.log, "w") as log:  # etcd logs a lot: a pipe nobody reads would stall it
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
            self.pid = self.proc.pid
            while True:
                if self.proc.poll() is not None:
                    with open(self.log) as f:
                        text = f.read()
                    if "address already in use" in text and attempt < tries - 1:
                        if fresh:  # a member it began with the taken ports would not start on others
                            shutil.rmtree(member_dir, ignore_errors=True)
                        break
                    raise RuntimeError(f"etcd exited with status {self.proc.returncode}: {text[-1500:]}")
                try:
                    urllib.request.urlopen(f"{client}/health", timeout=5, context=ctx).read()
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"etcd did not serve on {self.endpoint} within {timeout_s:g} s") from None
                    time.sleep(0.1)

    def stop(self) -> None:
        from kvstore.procs import stop_process

        stop_process(self.proc)
