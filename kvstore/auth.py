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
as SHA-256 digests and compared in constant time; the file is read once at start. Not yet: deriving a
tenant's key namespace from its token (so that a tenant cannot read another's chunks even knowing
their keys), and per-tenant quotas.
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


@dataclasses.dataclass(frozen=True)
class Principal:
    tenant: str
    scopes: frozenset[str]


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
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"--auth-file {path}: tokens[{i}].tenant must be a non-empty string")
        if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
            raise ValueError(f"--auth-file {path}: tokens[{i}].scopes must list some of {', '.join(SCOPES)}")
        if _digest(token) in out:
            raise ValueError(f"--auth-file {path}: tokens[{i}] repeats an earlier token")
        out[_digest(token)] = Principal(tenant, frozenset(scopes))
    return out


def table() -> dict[bytes, Principal] | None:
    """The principals of this process's auth file, or None when it takes every call."""
    path = os.environ.get(FILE_ENV)
    return load(os.path.abspath(path)) if path else None


def configure(auth_file: str | None, token: str | None) -> None:
    """Sets this process's (and its children's) auth file and client token; reads the file at once.

    Raises:
        ValueError: as ``load``.
    """
    if auth_file:
        os.environ[FILE_ENV] = os.path.abspath(auth_file)
        table()
    if token:
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


def server_interceptors() -> list:
    """``interceptors=`` for a ``grpc.server`` of this process (empty without an auth file)."""
    principals = table()
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
