"""Bearer tokens with scopes on every gRPC server: ``crescent --auth-file FILE`` and ``--token``.

A server started with an auth file (``crescent --auth-file FILE``, or ``$CRESCENT_AUTH_FILE``) takes a
call only with ``authorization: Bearer <token>`` naming one of its tokens:

    {"tokens": [{"token": "s3cr3t-ops", "tenant": "ops", "scopes": ["admin"]},
                {"token": "s3cr3t-acme", "tenant": "acme", "scopes": ["tenant"]}]}

- no token or an unknown one: ``UNAUTHENTICATED``;
- the cluster's own calls and the admin operations need the ``admin`` scope, anything else
  ``PERMISSION_DENIED``: membership (``Register``, ``Heartbeat``, ``StreamEvents``, ``Deregister``),
  ``Drain``, ``PinChunks``, ``EvictChunks`` on the conductor; ``Delete``, ``Clear``, ``Pin`` on store
  nodes (a tenant token could otherwise remove chunks other tenants share);
- ``tenant`` tokens may read and write chunks, schedule, locate and generate;
- the standard ``grpc.health.v1`` service needs no token (Kubernetes probes carry none).

Every client channel of a process started with ``crescent --token TOKEN`` (or ``$CRESCENT_TOKEN``)
sends that token: store and cluster clients, member agents, the gateway's engine channels,
``crescent ctl``. The processes of a cluster therefore run with an ``admin`` token. Tokens are kept
as SHA-256 digests and compared in constant time; the file is read once at start.

**Key namespaces.** The node derives a caller's key space from its token, never from its word: the
keys of a token without the ``admin`` scope are stored under its namespace's prefix
(``namespace_prefix``: a mark and 8 bytes of a BLAKE2b of the name), on store nodes (gRPC and the data
channel, whose per-namespace session token ``Health`` hands out) and in the conductor's index
(``Schedule``, ``Locate``). A tenant that knows another's keys reads misses. The namespace is the
tenant's name unless the entry says ``"namespace"``: tokens naming the same one share their chunks.
``admin`` tokens (the cluster's own processes) work on the keys as they are.

**Quotas.** An entry's ``"quota": {"dram": "1GiB", "disk": "4GiB"}`` bounds the bytes its namespace
holds on each node (``dram`` counts the arena tiers, HBM included; either may be left out). Tokens
naming the same namespace must agree on it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import os

import grpc

FILE_ENV = "CRESCENT_AUTH_FILE"
TOKEN_ENV = "CRESCENT_TOKEN"
SCOPES = ("tenant", "admin")
ADMIN_ONLY = frozenset({
    "/crescent.v1.Conductor/Register", "/crescent.v1.Conductor/Heartbeat", "/crescent.v1.Conductor/StreamEvents",
    "/crescent.v1.Conductor/Deregister", "/crescent.v1.Conductor/Drain", "/crescent.v1.Conductor/PinChunks",
    "/crescent.v1.Conductor/EvictChunks",
    "/crescent.v1.KVStore/Delete", "/crescent.v1.KVStore/Clear", "/crescent.v1.KVStore/Pin",
})
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


NS_MARK = b"\x00ns:"
"""How every namespaced key begins (raw content-hash keys do not start with a zero byte and this)."""


def namespace_prefix(namespace: str) -> bytes:
    """The bytes a namespace's keys are stored under."""
    return NS_MARK + hashlib.blake2b(namespace.encode(), digest_size=8, person=b"crescent-ns").digest()


@dataclasses.dataclass(frozen=True)
class Quota:
    """A namespace's byte limits on one node (None: no limit)."""

    namespace: str
    dram_bytes: int | None = None
    disk_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class Principal:
    tenant: str
    scopes: frozenset[str]
    namespace: str | None = None
    """Its key space; None for ``admin`` tokens (keys as they are)."""
    prefix: bytes = b""
    """``namespace_prefix(namespace)``, or empty."""
    quota: Quota | None = None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def json_entries(path: str, flag: str, field: str, shape: str) -> list:
    """The non-empty list ``field`` of the JSON object in ``path`` (an auth or API-key file).

    Raises:
        ValueError: the file cannot be read, is not JSON, or has no such list (naming ``flag``).
    """
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag} {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    entries = doc.get(field) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'{flag} {path}: needs {{"{field}": [{shape}, ...]}}')
    return entries


@functools.lru_cache(maxsize=4)
def load(path: str) -> dict[bytes, Principal]:
    """Token digest → principal, from an auth file.

    Raises:
        ValueError: the file cannot be read or is malformed (the message names what).
    """
    entries = json_entries(path, "--auth-file", "tokens", '{"token", "tenant", "scopes"}')
    out: dict[bytes, Principal] = {}
    for i, e in enumerate(entries):
        token, tenant, scopes = (e.get(k) if isinstance(e, dict) else None for k in ("token", "tenant", "scopes"))
        if not isinstance(token, str) or len(token) < 8:
            raise ValueError(f"--auth-file {path}: tokens[{i}].token must be a string of at least 8 characters")
        if not printable_token(token):  # no client could send it
            raise ValueError(f"--auth-file {path}: tokens[{i}].token must be printable ASCII without spaces")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"--auth-file {path}: tokens[{i}].tenant must be a non-empty string")
        if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
            raise ValueError(f"--auth-file {path}: tokens[{i}].scopes must list some of {', '.join(SCOPES)}")
        if _digest(token) in out:
            raise ValueError(f"--auth-file {path}: tokens[{i}] repeats an earlier token")
        namespace = e.get("namespace", tenant)
        if not isinstance(namespace, str) or not namespace:
            raise ValueError(f"--auth-file {path}: tokens[{i}].namespace must be a non-empty string")
        if "admin" in scopes:
            namespace = None
        quota = _quota(path, i, namespace, e.get("quota"))
        out[_digest(token)] = Principal(tenant, frozenset(scopes), namespace,
                                        namespace_prefix(namespace) if namespace else b"", quota)
    quotas: dict[str, Quota | None] = {}
    for p in out.values():
        if p.namespace is not None and quotas.setdefault(p.namespace, p.quota) != p.quota:
            raise ValueError(f"--auth-file {path}: the tokens of namespace {p.namespace!r} give different quotas")
    return out


def _quota(path: str, i: int, namespace: str | None, doc) -> Quota | None:
    if doc is None:
        return None
    from kvstore.config import parse_size

    where = f"--auth-file {path}: tokens[{i}].quota"
    if namespace is None:
        raise ValueError(f"{where}: an admin token has no namespace to bound")
    if not isinstance(doc, dict) or not doc or set(doc) - {"dram", "disk"}:
        raise ValueError(f'{where} must be {{"dram": SIZE, "disk": SIZE}} (either may be left out)')
    try:
        sizes = {k: parse_size(v) for k, v in doc.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return Quota(namespace, sizes.get("dram"), sizes.get("disk"))


def quotas(principals: dict[bytes, Principal] | None) -> dict[bytes, Quota]:
    """Namespace prefix → quota, of ``principals`` (``table()``; empty for None)."""
    return {p.prefix: p.quota for p in (principals or {}).values() if p.quota is not None}


def caller(context, principals: dict[bytes, Principal] | None) -> Principal | None:
    """The principal of a call that ``ServerAuth(principals)`` let through (None: no auth)."""
    if principals is None:
        return None
    header = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
    return principals.get(_digest(header[len("Bearer "):].strip()))


def scoped(prefix: bytes, keys) -> list[bytes]:
    """``keys`` in the key space of ``prefix`` (a principal's).

    Raises:
        InvalidArgumentError: a key would exceed the key limit with the prefix.
    """
    if not prefix:
        return list(keys)
    from kvstore.config import MAX_KEY_BYTES
    from kvstore.errors import InvalidArgumentError

    out = []
    for k in keys:
        if isinstance(k, (bytes, bytearray)) and len(k) + len(prefix) > MAX_KEY_BYTES:
            raise InvalidArgumentError(
                f"key of {len(k)} bytes exceeds the limit of {MAX_KEY_BYTES - len(prefix)} for a tenant's keys")
        out.append(prefix + k if isinstance(k, (bytes, bytearray)) and k else k)
    return out


def prefix_of(context, principals: dict[bytes, Principal] | None) -> bytes:
    """The key prefix of a call's principal (empty: keys as they are); ``principals`` are the
    server's (``table()`` when it was made)."""
    p = caller(context, principals)
    return p.prefix if p is not None else b""


def table() -> dict[bytes, Principal] | None:
    """The principals of this process's auth file, or None when it takes every call."""
    path = os.environ.get(FILE_ENV)
    return load(os.path.abspath(path)) if path else None


def printable_token(token: str) -> bool:
    """Whether ``token`` fits a bearer header (printable ASCII, no spaces): what a gRPC header value carries."""
    return all(33 <= ord(c) <= 126 for c in token)


def configure(auth_file: str | None, token: str | None) -> None:
    """Sets this process's (and its children's) auth file and client token; reads the file at once.

    Raises:
        ValueError: as ``load``.
    """
    if auth_file:
        os.environ[FILE_ENV] = os.path.abspath(auth_file)
        table()
    if token:
        if not printable_token(token):
            raise ValueError("--token must be printable ASCII without spaces")
        os.environ[TOKEN_ENV] = token


def check(principals: dict[bytes, Principal], method: str, metadata) -> tuple[grpc.StatusCode, str] | None:
    """Why a call is refused (code, message), or None when it may go on."""
    if method.startswith(OPEN_PREFIXES):
        return None
    header = next((v for k, v in metadata or () if k == "authorization"), None)
    if not isinstance(header, str) or not header.startswith("Bearer "):
        return grpc.StatusCode.UNAUTHENTICATED, "this server needs authorization: Bearer <token>"
    digest = _digest(header[len("Bearer "):].strip())
    principal = next((p for d, p in principals.items() if hmac.compare_digest(d, digest)), None)
    if principal is None:
        return grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token"
    if method in ADMIN_ONLY and "admin" not in principal.scopes:
        return grpc.StatusCode.PERMISSION_DENIED, f"{method.rsplit('/', 1)[1]} needs a token with the admin scope"
    return None


class ServerAuth(grpc.ServerInterceptor):
    """Refuses calls ``check`` refuses, before they reach the service."""

    def __init__(self, principals: dict[bytes, Principal]) -> None:
        self.principals = principals

    def intercept_service(self, continuation, handler_call_details):
        refused = check(self.principals, handler_call_details.method, handler_call_details.invocation_metadata)
        if refused is None:
            return continuation(handler_call_details)
        code, message = refused

        def deny(request, context):
            context.abort(code, message)

        def deny_stream(request_iterator, context):
            context.abort(code, message)

        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny_stream)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def server_interceptors(principals: dict[bytes, Principal] | None) -> list:
    """``interceptors=`` for a ``grpc.server`` taking ``principals`` (``table()``; empty: every call)."""
    return [ServerAuth(principals)] if principals is not None else []


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return d._replace(metadata=[*(d.metadata or ()), self.header]) if hasattr(d, "_replace") else _Details(
            d.method, d.timeout, [*(d.metadata or ()), self.header], d.credentials, d.wait_for_ready,
            d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


@dataclasses.dataclass(frozen=True)
class _Details(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list | None
    credentials: object
    wait_for_ready: bool | None
    compression: object


def with_token(channel: grpc.Channel) -> grpc.Channel:
    """``channel`` sending this process's token (``--token``) on every call, when it has one."""
    token = os.environ.get(TOKEN_ENV)
    return grpc.intercept_channel(channel, _Token(token)) if token else channel
