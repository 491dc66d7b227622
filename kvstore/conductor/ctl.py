"""``crescent ctl``: admin commands against a running conductor, and trace replay.

Every command prints a readable table, or JSON with ``--json``. Failures are one
line on stderr, ``crescent ctl: error: …``: exit status 1 when the conductor
refuses or cannot be reached, 2 for bad input caught before any call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import sys

from kvstore.config import format_size
from kvstore.errors import CrescentError, UnavailableError


class UsageError(Exception):
    """Bad input caught locally (exit status 2)."""


def _print_json(obj) -> None:
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    print(json.dumps(clean(obj), indent=2, sort_keys=True))


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _client(ns):
    from kvstore.conductor.client import ConductorClient

    from kvstore.conductor.cli import DEFAULT_CONDUCTOR

    from kvstore.config import check_address, check_etcd

    # NOTE: with --etcd and no --conductor, the replicas come from etcd alone
    conductor = ns.conductor or (None if ns.etcd else DEFAULT_CONDUCTOR)
    try:
        for address in (conductor or "").split(",") if conductor is not None else ():
            check_address("--conductor", address.strip())
        check_etcd(ns.etcd)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return ConductorClient(conductor, timeout_s=ns.timeout, etcd=ns.etcd)


# ---- keys from --keys / --tokens / --text ------------------------------------------------------


def _parse_tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UsageError(f"--tokens takes integers separated by commas or spaces, got {text!r}") from None


def _tokenize(text: str, tokenizer: str) -> list[int]:
    if tokenizer == "bytes":
        return list(text.encode())
    path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path).encode(text, add_special_tokens=False).ids
    except Exception as exc:  # tokenizers raises its own exception types
        raise UsageError(f"cannot tokenize with {path}: {exc}") from None


def _namespace_and_chunk(ns, client) -> tuple[bytes, int]:
    """The namespace and chunk size: from the flags, else from the registered engines."""
    if ns.namespace:
        try:
            namespace = bytes.fromhex(ns.namespace)
        except ValueError:
            namespace = b""
        if len(namespace) != 16:
            raise UsageError(f"--namespace must be 32 hex digits, got {ns.namespace!r}")
        return namespace, ns.chunk_tokens or 256
    vllm = getattr(ns, "vllm", False)  # `schedule --vllm`: the keys of the vLLM instances followed
    engines = [m for m in client.members() if m.namespace and m.vllm == vllm]
    found = {(m.namespace, m.chunk_tokens) for m in engines}
    if len(found) != 1:
        why = "no engine has registered one" if not found else f"engines use {len(found)} different ones"
        raise UsageError(f"pass --namespace ({why})")
    namespace, chunk = found.pop()
    return namespace, ns.chunk_tokens or chunk or 256


def _selected_keys(ns, client) -> tuple[list[bytes], int, int]:
    """The keys named by --keys / --tokens / --text, the prompt's token count (0 for --keys), the chunk size."""
    from kvstore.conductor.vllm_events import request_namespace
    from kvstore.keys import Namespace, chunk_keys

    salt, lora = getattr(ns, "cache_salt", None), getattr(ns, "lora", None)
    if (salt is not None or lora is not None) and (ns.keys is not None or not getattr(ns, "vllm", False)):
        raise UsageError("--cache-salt and --lora need --vllm and --tokens or --text (a vLLM request's keys)")
    if ns.keys is not None:
        try:
            keys = [bytes.fromhex(k) for k in ns.keys.replace(",", " ").split()]
        except ValueError:
            raise UsageError(f"--keys takes hex keys separated by commas, got {ns.keys!r}") from None
        if not keys or any(not k for k in keys):
            raise UsageError("--keys needs at least one non-empty hex key")
        return keys, 0, ns.chunk_tokens
    tokens = _parse_tokens(ns.tokens) if ns.tokens is not None else _tokenize(ns.text, ns.tokenizer)
    namespace, chunk = _namespace_and_chunk(ns, client)
    try:
        keys = chunk_keys(tokens, Namespace(request_namespace(namespace, salt, lora)), chunk)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return keys, len(tokens), chunk


# ---- commands ------------------------------------------------------------------------


def cmd_nodes(ns) -> int:
    with _client(ns) as c:
        members = c.members()
        leader = c.address  # the client followed any follower's hint: this one answered
    if ns.json:
        _print_json([{"member_id": m.member_id, "kind": m.kind.label, "address": m.address, "state": m.state,
                      "last_seen_s": m.last_seen_s, "num_chunks": m.num_chunks, "store_node": m.store_node,
                      "namespace": m.namespace.hex(), "chunk_tokens": m.chunk_tokens,
                      "engine": dataclasses.asdict(m.engine) if m.engine else None,
                      "predicted_queue_s": m.predicted_queue_s if m.engine else None,
                      "lease_ttl_s": m.lease_ttl_s if m.lease_ttl_s >= 0 else None, "host_id": m.host_id,
                      "vllm": m.vllm, "store": m.store} for m in members])
        return 0
    rows = []
    for m in members:
        if m.store is not None:
            used = sum(t["used_bytes"] for t in m.store["tiers"].values())
            cap = sum(t["capacity_bytes"] for t in m.store["tiers"].values())
            load = f"{format_size(used)} / {format_size(cap)}" if cap else "-"
            extra = f"{m.num_chunks} chunks"
        else:
            e = m.engine
            load = f"{e.num_queued_tokens} queued tok, {e.num_running} running, wait {m.predicted_queue_s:.2f}s"
            extra = f"vLLM, {m.num_chunks} chunks cached" if m.vllm else f"store {m.store_node or '-'}"
        lease = f"{m.lease_ttl_s:.0f}s" if m.lease_ttl_s >= 0 else "-"
        rows.append([m.member_id, m.kind.label, m.host_id or "-", m.address or "-", m.state, f"{m.last_seen_s:.1f}s",
                     lease, load, extra])
    print(f"conductor leader {leader}")
    print(_table(["member", "kind", "host", "address", "state", "seen", "lease", "load", "info"], rows) if rows
          else "no live members")
    return 0


def cmd_stats(ns) -> int:
    with _client(ns) as c:
        s = c.stats()
        members = c.members()
    if ns.json:
        s["nodes"] = [{"member_id": m.member_id, "kind": m.kind.label, "state": m.state,
                       "num_chunks": m.num_chunks, "store": m.store,
                       "engine": dataclasses.asdict(m.engine) if m.engine else None} for m in members]
        _print_json(s)
        return 0
    sch = s["schedule"]
    print(f"members {s['num_members']}  chunks {s['num_chunks']} ({s['num_copies']} copies)  "
          f"dead so far {s['num_dead']}")
    print(f"store hit rate {s['hit_rate']:.3f}  misses {s['misses']}  "
          f"in {format_size(s['bytes_in'])}  out {format_size(s['bytes_out'])}")
    rows = [[t, f"{v['hit_rate']:.3f}", v["hits"], v["num_entries"], format_size(v["used_bytes"]),
             format_size(v["capacity_bytes"]), v["evictions"]] for t, v in s["tiers"].items()]
    if rows:
        print(_table(["tier", "hit rate", "hits", "entries", "used", "capacity", "evictions"], rows))
    print(f"schedule ({sch['policy']}): {sch['num_scheduled']} scheduled, {sch['num_rejected']} rejected, "
          f"{sch['cached_fraction']:.3f} of prompt chunks cached, {sch['num_replications']} replications")
    coef = s["cost_model"]["coefficients"]
    if coef:
        print(f"prefill model: {coef[0]:.4f} s + {coef[1] * 1e6:.2f} us/token + {coef[2] * 1e9:.3f} ns/pair "
              f"({s['cost_model']['num_samples']} samples)")
    rows = []
    for m in members:
        if m.store is not None:
            used = sum(t["used_bytes"] for t in m.store["tiers"].values())
            rows.append([m.member_id, m.kind.label, m.state, f"{m.num_chunks} chunks, {format_size(used)}"])
        else:
            rows.append([m.member_id, m.kind.label, m.state,
                         f"{m.engine.num_queued_tokens} queued tok, {m.engine.num_running} running, "
                         f"kv {m.engine.kv_usage:.0%}"])
    if rows:
        print(_table(["member", "kind", "state", "load"], rows))
    return 0


def cmd_lookup(ns) -> int:
    with _client(ns) as c:
        keys, num_tokens, _ = _selected_keys(ns, c)
        loc = c.locate(keys)
    if ns.json:
        _print_json({"num_keys": len(keys), "num_tokens": num_tokens, "num_prefix": loc.num_prefix,
                     "keys": [{"key": k.hex(), "holders": {n: t.name.lower() for n, t in h.items()}}
                              for k, h in zip(keys, loc.holders)],
                     "nodes": [{"node_id": n.node_id, "address": n.address, "num_prefix": n.num_prefix}
                               for n in loc.nodes]})
        return 0
    print(f"{len(keys)} chunk keys, {loc.num_prefix} leading ones cached somewhere")
    if loc.nodes:
        print(_table(["node", "address", "prefix chunks"], [[n.node_id, n.address, n.num_prefix] for n in loc.nodes]))
    rows = [[i, k.hex(), ", ".join(f"{n} ({t.name.lower()})" for n, t in sorted(h.items())) or "-"]
            for i, (k, h) in enumerate(zip(keys, loc.holders))]
    if rows:
        print(_table(["#", "key", "holders"], rows))
    return 0


def cmd_schedule(ns) -> int:
    with _client(ns) as c:
        keys, num_tokens, chunk = _selected_keys(ns, c)
        r = c.schedule(keys, ns.num_tokens or num_tokens or len(keys) * (chunk or 256),
                       chunk_tokens=chunk, policy=ns.policy or "", vllm=ns.vllm)
    if ns.json:
        _print_json(dataclasses.asdict(r))
        return 0
    if not r.accepted:
        print(f"rejected: {r.reject_reason}")
        return 0
    print(f"prefill {r.prefill} ({r.prefill_address or '-'})  decode {r.decode or '-'}  "
          f"source {r.source_node or '-'}  cached {r.num_cached_chunks} chunks / {r.num_cached_tokens} tokens  "
          f"TTFT {r.predicted_ttft_s:.3f} s  policy {r.policy}"
          + (f"  replicate to {r.replicate_to}" if r.replicate_to else ""))
    return 0


def cmd_drain(ns) -> int:
    with _client(ns) as c:
        state = c.drain(ns.member, undo=ns.undo)
    if ns.json:
        _print_json({"member_id": ns.member, "state": state})
    else:
        print(f"{ns.member}: {state}")
    return 0


def _cmd_pin(ns, ttl: float, verb: str) -> int:
    if not ttl >= 0 or math.isinf(ttl):
        raise UsageError(f"--ttl must be a finite number of seconds >= 0, got {ttl}")
    with _client(ns) as c:
        keys, _, _ = _selected_keys(ns, c)
        n, nodes = c.pin(keys, ttl)
    if ns.json:
        _print_json({"num_keys": len(keys), "num_copies": n, "num_nodes": nodes, "ttl_s": ttl})
    else:
        print(f"{verb} {n} copies of {len(keys)} keys on {nodes} nodes")
    return 0


def cmd_pin(ns) -> int:
    return _cmd_pin(ns, ns.ttl, "pinned")


def cmd_unpin(ns) -> int:
    return _cmd_pin(ns, 0.0, "unpinned")


def cmd_evict(ns) -> int:
    with _client(ns) as c:
        keys, _, _ = _selected_keys(ns, c)
        n, nodes = c.evict(keys)
    if ns.json:
        _print_json({"num_keys": len(keys), "num_copies": n, "num_nodes": nodes})
    else:
        print(f"evicted {n} copies of {len(keys)} keys from {nodes} nodes")
    return 0


def cmd_replay(ns) -> int:
    from kvstore.conductor.config import POLICY_NAMES
    from kvstore.conductor.costmodel import HardwareProfile, load_prefill_samples
    from kvstore.conductor.report import ProgressBar, markdown_table, plot, summarize, text_table
    from kvstore.conductor.simulator import ReplayConfig, replay
    from kvstore.conductor.trace import infinite_cache_hit_rate, load_trace

    try:
        profile = HardwareProfile.load(ns.profile) if ns.profile else HardwareProfile()
        samples = load_prefill_samples(ns.prefill_samples) if ns.prefill_samples else ()
        policies = list(POLICY_NAMES) if ns.compare else [ns.policy]
        cfgs = [ReplayConfig(policy=p, num_prefill=ns.prefill, num_decode=ns.decode, cache_blocks=ns.cache_blocks,
                             slo_ttft=ns.slo_ttft, slo_tbt=ns.slo_tbt, seed=ns.seed, profile=profile,
                             prefill_samples=samples)
                for p in policies]
        if ns.limit is not None and ns.limit < 1:
            raise ValueError("--limit must be >= 1")
        requests = load_trace(ns.trace, ns.limit)
        if ns.compare:  # before the replays, not after them
            try:
                os.makedirs(ns.out, exist_ok=True)
                with tempfile.TemporaryFile(dir=ns.out):
                    pass
            except OSError as exc:
                raise ValueError(f"--out {ns.out}: cannot write there ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    rows = []
    for cfg in cfgs:
        bar = None if ns.no_progress else ProgressBar(cfg.policy)
        try:
            rows.append(summarize(replay(requests, cfg, bar), cfg))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    ideal = infinite_cache_hit_rate(requests)
    if ns.compare:
        os.makedirs(ns.out, exist_ok=True)
        md = os.path.join(ns.out, "replay_compare.md")
        png = os.path.join(ns.out, "replay_compare.png")
        with open(md, "w") as f:
            f.write(markdown_table(rows) + "\n")
        plot(rows, png, f"{os.path.basename(ns.trace)}: {len(requests)} requests, {ns.prefill} prefill / "
                        f"{ns.decode} decode, {ns.cache_blocks} blocks per node ({profile.name})")
    if ns.json:
        out = {"trace": ns.trace, "num_requests": len(requests), "infinite_cache_hit_rate": ideal,
               "results": rows}
        if ns.compare:
            out["table"], out["plot"] = md, png
        _print_json(out)
        return 0
    print(f"{ns.trace}: {len(requests)} requests, infinite-cache hit rate {ideal:.3f}; "
          f"{ns.prefill} prefill / {ns.decode} decode instances, {ns.cache_blocks} blocks per node, "
          f"profile {profile.name}")
    print(text_table(rows))
    if ns.compare:
        print(f"wrote {md} and {png}")
    return 0


def cmd_sizing(ns) -> int:
    for flag, v in (("--target-rps", ns.target_rps), ("--ttft-slo", ns.ttft_slo), ("--itl-slo", ns.itl_slo)):
        if v is not None and not (v > 0 and math.isfinite(v)):
            raise UsageError(f"{flag} must be a number > 0, got {v}")
    if ns.quantile is not None and not 0 < ns.quantile < 1:
        raise UsageError(f"--quantile must be in (0, 1), got {ns.quantile}")
    with _client(ns) as c:
        s = c.sizing(target_rps=ns.target_rps or 0.0, slo_ttft_s=ns.ttft_slo or 0.0,
                     slo_itl_s=ns.itl_slo or 0.0, quantile=ns.quantile or 0.0)
    if ns.json:
        _print_json(s)
        return 0
    verdict = "" if s["feasible"] else "  (INFEASIBLE: see below)"
    print(f"prefill {s['num_prefill']}  decode {s['num_decode']}  P:D {s['num_prefill'] / s['num_decode']:.2f}"
          f"  for {s['target_rps']:.3g} req/s, p{s['quantile'] * 100:g} TTFT <= {s['slo_ttft_s']:g} s, "
          f"ITL <= {s['slo_itl_s'] * 1e3:g} ms{verdict}")
    for line in s["reasoning"]:
        print(f"  {line}")
    rows = [[e["member_id"], e["kind"], f"{e['prefill_tokens_per_s']:,.0f}" if e["prefill_tokens_per_s"] else "-",
             f"{e['decode_tokens_per_s']:,.0f}" if e["decode_tokens_per_s"] else "-", e["num_samples"]]
            for e in s["engines"]]
    if rows:
        print("measured per engine:")
        print(_table(["engine", "kind", "prefill tok/s", "decode tok/s", "samples"], rows))
    return 0


def run(ns: argparse.Namespace) -> int:
    """Runs one ctl command with the errors mapped to one line and an exit status."""
    try:
        return globals()[ns.ctl_handler](ns)
    except UsageError as exc:
        print(f"crescent ctl: error: {exc}", file=sys.stderr)
        return 2
    except UnavailableError as exc:
        detail = " ".join(str(exc).split())
        from kvstore.conductor.cli import DEFAULT_CONDUCTOR

        where = ns.conductor or (f"the replicas registered in etcd {ns.etcd}" if ns.etcd else DEFAULT_CONDUCTOR)
        print(f"crescent ctl: error: cannot reach the conductor at {where} ({detail})", file=sys.stderr)
        return 1
    except CrescentError as exc:
        print(f"crescent ctl: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:
        print(f"crescent ctl: error: {exc}", file=sys.stderr)
        return 1
