"""``crescent``: the command line. Subcommands are added as components land.

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
    p.set_defaults(handler=_run_store)


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


def _register_serving(sub) -> None:
    from engine.serve.cli import register  # `crescent engine`, `crescent gateway`, `crescent up`

    register(sub)


# Each entry adds its subcommands: ``register(subparsers)`` sets ``handler(ns) -> exit code``.
# Keep imports inside handlers so `crescent --help` stays fast.
REGISTRARS = [_register_store, _register_conductor, _register_serving]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crescent", description="Crescent: a KV-cache store for LLM serving")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTRARS:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return ns.handler(ns)


if __name__ == "__main__":
    sys.exit(main())
