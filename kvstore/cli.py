"""``crescent``: the command line.

The store layer's own subcommands (``store``, ``conductor``, ``ctl``) are built
in. Every other package adds its subcommands through the ``crescent.commands``
entry-point group (pyproject.toml): an entry names ``register(subparsers)``,
which adds parsers whose defaults set ``handler(ns) -> exit code``. That keeps
imports pointing down: the engine layer (``engine.serve.cli``: ``engine``,
``gateway``, ``up``) plugs itself in, and nothing here imports it.

Flags of ``crescent store`` are derived from ``StoreConfig``'s fields and their
docstrings, so they are described once.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import logging
import os
import sys
import textwrap
import typing

from kvstore.config import StoreConfig, format_size, parse_size


def attr_docs(cls) -> dict[str, str]:
    """The docstrings written under a dataclass's fields (PEP 257 attribute docstrings)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and \
                isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def json_object_arg(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return v


def add_config_args(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per dataclass field: ``--field-name``, typed, with the field's docstring as help."""
    docs = attr_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        default = f.default
        help_text = docs.get(f.name, "")
        if f.metadata.get("size"):
            parser.add_argument(flag, type=size_arg, default=default, metavar="SIZE",
                                help=f"{help_text} (default: {format_size(default)})")
        elif hint is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)
        elif typing.get_origin(hint) is typing.Literal:
            parser.add_argument(flag, choices=typing.get_args(hint), default=default,
                                help=f"{help_text} (default: {default})")
        else:
            args = [a for a in typing.get_args(hint) if a is not type(None)]
            typ = args[0] if args else hint
            if typing.get_origin(typ) is list:  # a repeatable flag
                parser.add_argument(flag, action="append", default=default, help=help_text + " (repeatable)")
                continue
            if typ is dict:
                typ, help_text = json_object_arg, help_text + " (a JSON object)"
            shown = f" (default: {default})" if default not in (None, "") else ""
            parser.add_argument(flag, type=typ, default=default, help=help_text + shown)


def config_from_args(cls, ns: argparse.Namespace):
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def _register_store(sub) -> None:
    p = sub.add_parser("store", help="run a store node",
                       description="Run a store node: DRAM (+ disk, + GPU) tiers behind the "
                                   "crescent.v1.KVStore gRPC service. Stops gracefully on SIGTERM/SIGINT.")
    add_config_args(p, StoreConfig)
    p.set_defaults(handler=_run_store, etcd=os.environ.get("CRESCENT_ETCD") or None)


def _run_store(ns: argparse.Namespace) -> int:
    from kvstore.disk import DiskTierError
    from kvstore.server import serve

    try:
        serve(config_from_args(StoreConfig, ns))
    except (ValueError, DiskTierError, OSError, RuntimeError) as exc:
        print(f"crescent store: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _register_conductor(sub) -> None:
    from kvstore.conductor.cli import register  # `crescent conductor` and `crescent ctl`

    register(sub)


# Each adds its subcommands: ``register(subparsers)`` sets ``handler(ns) -> exit code``.
# Keep imports inside handlers so `crescent --help` stays fast.
def _register_certs(sub) -> None:
    p = sub.add_parser("certs", help="development TLS certificates",
                       description="Development TLS certificates for --tls-cert/--tls-key/--tls-ca (kvstore/tls.py).")
    cmds = p.add_subparsers(dest="certs_command", required=True)
    c = cmds.add_parser("init", help="write a CA, a node certificate (server + client) and a client certificate",
                        description="Writes DIR/ca.pem, ca-key.pem, node.pem, node-key.pem (server and client "
                                    "authentication, for the given hosts plus localhost and 127.0.0.1), "
                                    "client.pem, client-key.pem (client authentication only). Keys are 0600; "
                                    "an existing CA is never overwritten.")
    c.add_argument("dir", help="folder to write (created if missing)")
    c.add_argument("--host", action="append", default=[], metavar="NAME",
                   help="a host name or IP the node certificate is valid for (repeatable)")
    c.add_argument("--days", type=float, default=365.0, help="validity of the node and client certificates")
    c.set_defaults(handler=_run_certs_init)


def _run_certs_init(ns: argparse.Namespace) -> int:
    from kvstore import tls

    if not 0 < ns.days <= 36500:
        print("crescent certs init: error: --days must be in (0, 36500]", file=sys.stderr)
        return 2
    try:
        paths = tls.init_dir(ns.dir, ns.host, ns.days)
    except (FileExistsError, OSError) as exc:
        print(f"crescent certs init: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(os.path.basename(p) for p in paths.values())} to {ns.dir}")
    print(f"serve with: crescent --tls-cert {paths['node']} --tls-key {paths['node_key']} --tls-ca {paths['ca']} "
          "--tls-client-auth ...")
    return 0


BUILTIN = [_register_store, _register_conductor, _register_certs]
ENTRY_POINT_GROUP = "crescent.commands"


def plugin_registrars() -> list:
    """``register`` functions of the installed ``crescent.commands`` entry points, by entry name.

    Raises:
        RuntimeError: an entry point that cannot be loaded (named, with the cause).
    """
    from importlib.metadata import entry_points

    out = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            out.append(ep.load())
        except (ImportError, AttributeError) as exc:
            raise RuntimeError(f"cannot load the {ENTRY_POINT_GROUP} entry point {ep.name!r} "
                               f"({ep.value}): {exc}") from exc
    return out


def build_parser() -> argparse.ArgumentParser:
    # NOTE: no abbreviations: a subcommand flag such as `up --tls` must not read as a prefix of --tls-cert
    parser = argparse.ArgumentParser(prog="crescent", description="Crescent: a KV-cache store for LLM serving",
                                     allow_abbrev=False)
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="logging level (default: WARNING)")
    parser.add_argument("--host-id", default=None, metavar="NAME",
                        help="this process's host, for same-host movers (default: $CRESCENT_HOST_ID, else the "
                             "hostname): processes with different host ids never use shared memory")
    tls = parser.add_argument_group("TLS (every gRPC server and client of this process and its children; "
                                    "$CRESCENT_TLS_CERT, _KEY, _CA, _CLIENT_AUTH)")
    tls.add_argument("--tls-cert", metavar="PEM", help="this process's certificate chain")
    tls.add_argument("--tls-key", metavar="PEM", help="its private key")
    tls.add_argument("--tls-ca", metavar="PEM", help="the CA that peers' certificates must chain to")
    tls.add_argument("--tls-client-auth", action="store_true",
                     help="servers: accept only clients with a certificate of that CA (mTLS)")
    auth = parser.add_argument_group("bearer tokens (kvstore/auth.py)")
    auth.add_argument("--auth-file", metavar="JSON", help="servers: take only calls with one of this file's tokens "
                                                          "($CRESCENT_AUTH_FILE)")
    auth.add_argument("--token", metavar="TOKEN", help="clients: send this bearer token ($CRESCENT_TOKEN)")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in BUILTIN + plugin_registrars():
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except RuntimeError as exc:
        print(f"crescent: error: {exc}", file=sys.stderr)
        return 2
    ns = parser.parse_args(argv)
    if ns.host_id:
        from kvstore.transport.identity import HOST_ID_ENV, host_identity

        os.environ[HOST_ID_ENV] = ns.host_id  # children (crescent up's parts) inherit it
        host_identity.cache_clear()
    if ns.tls_cert or ns.tls_key or ns.tls_ca or ns.tls_client_auth:
        from kvstore import tls

        try:  # through the environment: children (crescent up's parts) inherit it
            tls.configure(ns.tls_cert, ns.tls_key, ns.tls_ca, ns.tls_client_auth)
        except ValueError as exc:
            print(f"crescent: error: {exc}", file=sys.stderr)
            return 2
    if ns.auth_file or ns.token:
        from kvstore import auth

        try:  # (the environment again, for children)
            auth.configure(ns.auth_file, ns.token)
        except ValueError as exc:
            print(f"crescent: error: {exc}", file=sys.stderr)
            return 2
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvstore.procs import raise_fd_limit

    raise_fd_limit()  # (a server's clients each take descriptors; crescent up's parts inherit it)
    return ns.handler(ns)


if __name__ == "__main__":
    sys.exit(main())
