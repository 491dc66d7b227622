"""Argument parsers of ``crescent conductor`` and ``crescent ctl``; registered by kvstore/cli.py.

Import-light on purpose (argparse and the config dataclass): the work happens
in handlers that import what they need, so ``crescent --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstore.conductor.config import POLICY_NAMES, ConductorConfig
from kvstore.config import count_arg, seconds_arg

DEFAULT_CONDUCTOR = "127.0.0.1:7300"


def register(sub) -> None:
    """Adds ``conductor`` and ``ctl`` to the ``crescent`` subcommands."""
    _register_conductor(sub)
    _register_ctl(sub)


def _register_conductor(sub) -> None:
    from kvstore.cli import add_config_args

    p = sub.add_parser("conductor", help="run the conductor (membership, global index, scheduling)",
                       description="Run the conductor: store nodes and engines register and heartbeat, store "
                                   "nodes stream KV events into the global prefix index, Schedule picks "
                                   "engines (crescent.v1.Conductor). Stops gracefully on SIGTERM/SIGINT.")
    add_config_args(p, ConductorConfig)
    p.set_defaults(handler=_run_conductor, etcd=os.environ.get("CRESCENT_ETCD") or None)


def _run_conductor(ns: argparse.Namespace) -> int:
    from kvstore.cli import config_from_args
    from kvstore.conductor.service import serve

    try:
        serve(config_from_args(ConductorConfig, ns))
    except (ValueError, OSError) as exc:
        print(f"crescent conductor: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--conductor", default=os.environ.get("CRESCENT_CONDUCTOR"), metavar="HOST:PORT[,...]",
                   help=f"the conductor, or its replicas (default: $CRESCENT_CONDUCTOR, else the replicas "
                        f"registered in --etcd, else {DEFAULT_CONDUCTOR})")
    p.add_argument("--etcd", default=os.environ.get("CRESCENT_ETCD") or None, metavar="[https://]HOST:PORT[,...]",
                   help="etcd where conductor replicas register: find them there (default: $CRESCENT_ETCD)")
    p.add_argument("--timeout", type=seconds_arg, default=5.0, metavar="S", help="deadline of each call (default: 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def _key_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--keys", metavar="HEX,...", help="chunk keys in hex")
    g.add_argument("--tokens", metavar="ID,...", help="a prompt's token ids (comma or space separated)")
    g.add_argument("--text", help="a prompt's text, tokenized with --tokenizer")
    p.add_argument("--tokenizer", default="bytes",
                   help="a tokenizer.json (or its folder) for --text; 'bytes': UTF-8 bytes as ids (default)")
    p.add_argument("--namespace", metavar="HEX",
                   help="chunk-key namespace, 32 hex digits (default: the one the registered engines share)")
    p.add_argument("--chunk-tokens", type=count_arg, default=0, metavar="N",
                   help="tokens per chunk (default: the engines', else 256)")


def _vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm", action="store_true",
                   help="the vLLM instances the conductor follows (--vllm-kv-events): keys under their "
                        "namespace; schedule chooses among them")
    p.add_argument("--cache-salt", metavar="SALT",
                   help="with --vllm and --tokens/--text: the request's cache_salt (its keys are salted)")
    p.add_argument("--lora", metavar="NAME", help="with --vllm and --tokens/--text: the request's LoRA adapter")


def _run_ctl(ns: argparse.Namespace) -> int:
    from kvstore.conductor import ctl

    return ctl.run(ns)


def _register_ctl(sub) -> None:
    common = _common()
    p = sub.add_parser("ctl", help="admin commands against a conductor; trace replay",
                       description="Admin commands against a running conductor, and trace replay in "
                                   "simulated time. Errors are one line on stderr; exit status 1 when the "
                                   "conductor refuses or is unreachable, 2 for bad input.")
    p.set_defaults(handler=_run_ctl)
    cmds = p.add_subparsers(dest="ctl_command", required=True)

    c = cmds.add_parser("nodes", parents=[common], help="live members: store nodes and engines")
    c.set_defaults(ctl_handler="cmd_nodes")
    c = cmds.add_parser("stats", parents=[common], help="hit rate by tier, bytes, scheduling, per-node load")
    c.set_defaults(ctl_handler="cmd_stats")
    c = cmds.add_parser("lookup", parents=[common], help="where a prompt's chunks are cached")
    _key_args(c)
    _vllm_args(c)
    c.set_defaults(ctl_handler="cmd_lookup")
    c = cmds.add_parser("schedule", parents=[common], help="ask Schedule where a prompt would run")
    _key_args(c)
    c.add_argument("--num-tokens", type=count_arg, default=0, help="prompt length (default: from --tokens/--text)")
    c.add_argument("--policy", choices=POLICY_NAMES, help="override the conductor's policy")
    _vllm_args(c)
    c.set_defaults(ctl_handler="cmd_schedule")
    c = cmds.add_parser("drain", parents=[common], help="stop giving new work to a member")
    c.add_argument("member", help="member id (see `crescent ctl nodes`)")
    c.add_argument("--undo", action="store_true", help="take the member back into service")
    c.set_defaults(ctl_handler="cmd_drain")
    c = cmds.add_parser("pin", parents=[common], help="protect chunks from eviction on every holder")
    _key_args(c)
    c.add_argument("--ttl", type=float, default=600.0, metavar="S", help="seconds (default: 600)")
    c.set_defaults(ctl_handler="cmd_pin")
    c = cmds.add_parser("unpin", parents=[common], help="undo pin")
    _key_args(c)
    c.set_defaults(ctl_handler="cmd_unpin")
    c = cmds.add_parser("evict", parents=[common], help="delete chunks from every holder")
    _key_args(c)
    c.set_defaults(ctl_handler="cmd_evict")

    c = cmds.add_parser("sizing", parents=[common], help="recommend prefill and decode replica counts",
                        description="Recommend prefill and decode instance counts (and their ratio) for a "
                                    "target load from what the conductor measured: the requests Schedule saw "
                                    "(prompt, reused and output tokens, arrival times) and the prefill and "
                                    "decode times engines reported. Prints the reasoning.")
    c.add_argument("--target-rps", type=float, metavar="R", help="requests per second to size for "
                                                                 "(default: the measured rate)")
    c.add_argument("--ttft-slo", type=float, metavar="S",
                   help="time-to-first-token SLO in seconds (default: the conductor's --slo-ttft, else 2)")
    c.add_argument("--itl-slo", type=float, metavar="S",
                   help="inter-token latency SLO in seconds (default: the conductor's --slo-tbt, else 0.1)")
    c.add_argument("--quantile", type=float, metavar="Q",
                   help="share of requests that must meet each SLO (default: 0.9)")
    c.set_defaults(ctl_handler="cmd_sizing")

    r = cmds.add_parser("replay", help="replay a Mooncake-format trace in simulated time",
                        description="Replay a Mooncake-format trace (JSONL: timestamp ms, input_length, "
                                    "output_length, hash_ids of 512-token blocks) through the conductor's "
                                    "policies on a simulated cluster with the cost model's hardware profile.")
    r.add_argument("trace", help="trace file (JSONL)")
    r.add_argument("--policy", choices=POLICY_NAMES, default="cache-aware", help="default: cache-aware")
    r.add_argument("--prefill", type=int, default=2, metavar="N", help="prefill instances (default: 2)")
    r.add_argument("--decode", type=int, default=2, metavar="M", help="decode instances (default: 2)")
    r.add_argument("--cache-blocks", type=int, default=50_000, metavar="C",
                   help="trace blocks each prefill node's store holds (default: 50000, ample for the synthetic trace)")
    r.add_argument("--slo-ttft", type=float, metavar="S", help="TTFT SLO in seconds (early rejection, goodput)")
    r.add_argument("--slo-tbt", type=float, metavar="T", help="TBT SLO in seconds (early rejection, goodput)")
    r.add_argument("--compare", action="store_true",
                   help="run every policy; write replay_compare.md and replay_compare.png into --out")
    r.add_argument("--out", default=".", metavar="DIR", help="folder for --compare's files (default: .)")
    r.add_argument("--profile", metavar="FILE", help="JSON of HardwareProfile fields (default: built-in 8xH800)")
    r.add_argument("--prefill-samples", metavar="FILE",
                   help="JSONL of measured prefills {num_new_tokens, num_cached_tokens, seconds}: fit the "
                        "prefill model to them (as the live conductor does with engines' reports)")
    r.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    r.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    r.add_argument("--json", action="store_true", help="print JSON instead of a table")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.set_defaults(ctl_handler="cmd_replay", conductor="-")
