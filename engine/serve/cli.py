"""Subcommands `crescent engine`, `crescent gateway` and `crescent up`."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

TOOL_PARSERS = ("hermes", "llama3_json", "pythonic")
"""engine/serve/tools.py's PARSERS (named here: importing it would import torch into every command)."""
REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""engine/serve/reasoning.py's PARSERS."""


def register(sub) -> None:
    from engine.config import EngineConfig
    from kvstore.cli import add_config_args
    from kvstore.config import address_arg, grace_arg, port_arg, seconds_arg

    p = sub.add_parser("engine", help="run a prefill, decode or monolithic engine",
                       description="Run an engine behind the crescent.v1.Engine gRPC service. prefill: "
                                   "stateless chunked prefill that saves the prompt's chunks to the store; "
                                   "decode: loads them and streams tokens (prefilling locally when needed); "
                                   "both: a monolithic engine.")
    p.add_argument("role", choices=["prefill", "decode", "both"])
    p.add_argument("--listen", default="127.0.0.1:7500", type=address_arg,
                   help="gRPC address host:port (default: 127.0.0.1:7500)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="host the conductor and gateway reach this engine at (default: the --listen host, or "
                        "this machine's hostname when that is a wildcard such as 0.0.0.0)")
    p.add_argument("--metrics-port", type=port_arg, default=None, help="Prometheus /metrics port (default: none)")
    p.add_argument("--fetch-timeout-s", type=grace_arg, default=2.0,
                   help="decode: how long to wait for a prefill engine's chunks to appear in the store "
                        "after the last one arrived (0: not at all) (default: 2.0)")
    p.add_argument("--shutdown-grace", type=grace_arg, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: leave the cluster, take no new calls and let the calls in flight (a "
                        "stream being generated) finish for up to S seconds (a second signal ends it) (default: 30)")
    add_config_args(p, EngineConfig)
    p.set_defaults(handler=_run_engine, etcd=os.environ.get("CRESCENT_ETCD") or None)

    g = sub.add_parser("gateway", help="run the OpenAI-compatible HTTP gateway",
                       description="OpenAI-compatible HTTP front door: /v1/completions, /v1/chat/completions "
                                   "(stream: true as SSE), /v1/responses (GET and DELETE /v1/responses/{id}), /v1/models, "
                                   "/tokenize, /detokenize, /health, /metrics.")
    g.add_argument("--listen", default="127.0.0.1:8000", type=address_arg,
                   help="HTTP address host:port (default: 127.0.0.1:8000)")
    g.add_argument("--model", default="random:tiny", help="model (for the tokenizer and the served name)")
    g.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    g.add_argument("--prefill", nargs="*", default=[], metavar="ADDR", help="prefill engine addresses")
    g.add_argument("--decode", nargs="*", default=[], metavar="ADDR",
                   help="decode engine addresses (round-robin; with --conductor, the fallback when it is away)")
    g.add_argument("--conductor", default=None, metavar="HOST:PORT[,...]",
                   help="route each request by the conductor's Schedule (cache-aware); replicas comma-separated")
    g.add_argument("--etcd", default=os.environ.get("CRESCENT_ETCD") or None, metavar="[https://]HOST:PORT[,...]",
                   help="etcd where conductor replicas register: route through them (default: $CRESCENT_ETCD)")
    g.add_argument("--api-keys", default=None, metavar="JSON",
                   help="take only requests with one of this file's OpenAI-style API keys, each bound to a tenant "
                        "and its cache salt (docs/serving.md)")
    g.add_argument("--https-cert", default=None, metavar="PEM",
                   help="serve HTTPS with this certificate chain (with --https-key); default: plain HTTP")
    g.add_argument("--https-key", default=None, metavar="PEM", help="the private key of --https-cert")
    g.add_argument("--shutdown-grace", type=grace_arg, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT: stop taking connections and let the requests in flight finish for up "
                        "to S seconds (a second signal ends it; 0: none) (default: 30)")
    g.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="serve at most N client connections at once (a thread each); one more gets a 503 with "
                        "Retry-After (default: 1024)")
    g.add_argument("--idle-timeout", type=seconds_arg, default=60.0, metavar="S",
                   help="close a client connection silent this long: kept alive with no next request, stalled "
                        "in a request, or not reading its answer (default: 60)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="read tool calls out of the model's text for tool_choice \"auto\" (hermes: <tool_call> JSON, "
                        "as Qwen 2.5/3 and Hermes models write them; llama3_json: JSON calls, Llama 3.x/4; "
                        "pythonic: [f(x=1)], Llama 3.2/4); without it \"auto\" is refused")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a chat choice's <think> reasoning (message.reasoning, reasoning_content) from its "
                        "content, as vLLM's deepseek_r1/qwen3 parsers do (docs/serving.md)")
    g.add_argument("--max-stored-responses", type=int, default=1000, metavar="N",
                   help="Responses API: keep the N responses used last in memory, for previous_response_id and "
                        "GET /v1/responses/{id} (0: none; store: true is then refused) (default: 1000)")
    g.add_argument("--max-stored-responses-mib", type=int, default=256, metavar="MIB",
                   help="Responses API: and no more than this much memory for them, each counted as its JSON "
                        "(default: 256)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests bring their own chat_template (Jinja the gateway runs in a sandbox; "
                        "one can still spend its CPU and memory): only for clients you trust")
    g.set_defaults(handler=_run_gateway)

    u = sub.add_parser("up", help="run a whole cluster on this machine (conductor, store, engines, gateway)",
                       description="Start a conductor, a store node, a prefill engine, a decode engine and the "
                                   "gateway on loopback, wait until all are healthy, print the URLs, and stop "
                                   "everything on Ctrl-C or SIGTERM.")
    from engine.serve.up import add_up_args

    add_up_args(u)
    u.set_defaults(handler=_run_up)


def _run_engine(ns: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.serve.engine_server import serve
    from kvstore.cli import config_from_args
    from kvstore.errors import CrescentError

    try:
        cfg = config_from_args(EngineConfig, ns)
        serve(ns.role, cfg, ns.listen, ns.metrics_port, ns.fetch_timeout_s, ns.advertise_host, ns.shutdown_grace)
    except (ValueError, OSError, RuntimeError, CrescentError) as exc:
        print(f"crescent engine: error: {exc}", file=sys.stderr)
        return 2
    # NOTE: the engine has stopped (its store client closed, its calls answered): the process
    # leaves without the interpreter's teardown, whose last collection walks torch's heap (~1 s)
    # and whose end has Triton's bindings report the objects they still hold as leaks
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            pass
    os._exit(0)


def _run_gateway(ns: argparse.Namespace) -> int:
    from engine.serve.gateway import Gateway, https_context, load_api_keys, serve
    from kvstore.config import check_address, check_etcd

    try:
        for flag, addresses in (("--prefill", ns.prefill), ("--decode", ns.decode),
                                ("--conductor", ns.conductor.split(",") if ns.conductor else [])):
            for address in addresses:  # (before, a typo here served, and every request it routed failed)
                check_address(flag, address.strip())
        check_etcd(ns.etcd)
        if bool(ns.https_cert) != bool(ns.https_key):
            raise ValueError("HTTPS needs both --https-cert and --https-key")
        ctx = https_context(ns.https_cert, ns.https_key) if ns.https_cert else None
        keys = load_api_keys(ns.api_keys) if ns.api_keys else None
        gw = Gateway(ns.model, ns.prefill, ns.decode, ns.served_model_name, conductor=ns.conductor,
                     etcd=ns.etcd, api_keys=keys, tool_parser=ns.tool_call_parser,
                     reasoning_parser=ns.reasoning_parser, trust_request_chat_template=ns.trust_request_chat_template,
                     max_stored_responses=ns.max_stored_responses,
                     max_stored_responses_mib=ns.max_stored_responses_mib)
        serve(gw, ns.listen, ctx, idle_s=ns.idle_timeout, grace_s=ns.shutdown_grace,
              max_connections=ns.max_connections)
    except (ValueError, OSError) as exc:
        print(f"crescent gateway: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_up(ns: argparse.Namespace) -> int:
    from engine.serve.up import run_up
    from kvstore.config import parse_size

    try:  # checked here, once, not by each part as it starts (exit 1 with a child's usage text)
        for flag, value in (("--dram", ns.dram), ("--disk-size", ns.disk_size), ("--kv-cache-memory", ns.kv_cache_memory)):
            try:
                size = parse_size(value)
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
            if size <= 0:
                raise ValueError(f"{flag} must be positive, got {value!r}")
        for flag, value in (("--chunk-size", ns.chunk_size), ("--chunk-tokens", ns.chunk_tokens)):
            if value <= 0:
                raise ValueError(f"{flag} must be a positive number of tokens, got {value}")
        if ns.max_num_batched_tokens is not None and ns.max_num_batched_tokens < ns.chunk_size:
            raise ValueError(f"--max-num-batched-tokens must be at least --chunk-size ({ns.chunk_size}), "
                             f"got {ns.max_num_batched_tokens}")  # (0 was taken as the default)
        for flag, value in (("--slo-ttft", ns.slo_ttft), ("--slo-tbt", ns.slo_tbt),
                            ("--startup-timeout-s", ns.startup_timeout_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
        os.makedirs(os.path.join(os.path.abspath(ns.data), "logs"), exist_ok=True)
    except ValueError as exc:
        print(f"crescent up: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"crescent up: error: --data {ns.data}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return run_up(ns)
