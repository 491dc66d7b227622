"""`crescent up`: a whole Crescent on one machine — conductor, store, prefill and decode engines, gateway.

Each part is a real process (the same commands a deployment runs); `up`
starts them on loopback, waits until every one answers its health check,
prints the URLs, writes them to ``<data>/up.json``, and on Ctrl-C or SIGTERM
stops them all (SIGTERM, then SIGKILL after a grace period), newest first.
A lock file in the data folder makes a second `up` on the same folder fail
with a clear message, and busy ports are reported before anything starts.
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc

from engine.serve.cli import REASONING_PARSERS, TOOL_PARSERS
from kvstore import tls
from kvstore.config import port_arg
from kvstore.procs import stop_processes
from proto.crescent.v1 import engine_pb2, engine_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc

NETNS_SUBNET = "10.251.78"
RESTARTS_PER_MINUTE = 10
"""--restart: a part that exits this often within a minute stops the cluster instead (a crash loop)."""
"""--netns: the hosts' network (the machine itself is .254 on it)."""


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="random:small", help="HF checkpoint folder or random:tiny|small|medium "
                                                            "(default: random:small)")
    p.add_argument("--data", default="./crescent-data", help="data folder: disk tier, logs, up.json "
                                                             "(default: ./crescent-data)")
    p.add_argument("--host", default="127.0.0.1", help="address every part binds (default: 127.0.0.1)")
    p.add_argument("--store-port", type=port_arg, default=7400, help="store gRPC port (0: any free port)")
    p.add_argument("--prefill-port", type=port_arg, default=7500, help="prefill engine port (0: any free port)")
    p.add_argument("--decode-port", type=port_arg, default=7501, help="decode engine port (0: any free port)")
    p.add_argument("--gateway-port", type=port_arg, default=8000, help="gateway HTTP port (0: any free port)")
    p.add_argument("--dram", default="1GiB", help="store DRAM tier (default: 1GiB)")
    p.add_argument("--disk-size", default="4GiB", help="store disk tier (default: 4GiB)")
    p.add_argument("--chunk-size", type=int, default=512, help="chunked-prefill size (default: 512)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per stored chunk (default: 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of an engine step (default: chunk size + 64, so that one prefill chunk "
                        "plus the running decodes fit and a step never holds more prefill than one chunk)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="KV pool per engine (default: 512MiB)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="engines launch each step before the last one's tokens reach the host (docs/engine.md)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="engines serve requests first come, first served, or by their priority (lower first; "
                        "requests' \"priority\", as vLLM's) (default: fcfs)")
    p.add_argument("--mode", choices=["disagg", "mono"], default="disagg",
                   help="disagg: prefill + decode engines with the store; mono: one engine doing both, "
                        "no prefill engine (default: disagg)")
    p.add_argument("--no-store", action="store_true", help="run without a store node")
    p.add_argument("--conductor-port", type=port_arg, default=7300, help="conductor port (0: any free port)")
    p.add_argument("--no-conductor", action="store_true",
                   help="run without a conductor (the gateway routes round-robin)")
    p.add_argument("--conductors", type=int, default=1, metavar="M",
                   help="conductor replicas; more than one elect a leader through etcd (default: 1)")
    p.add_argument("--etcd", default=None, metavar="[https://]HOST:PORT[,...]|local",
                   help="etcd for the conductors' leader election; 'local' starts one under --data "
                        "(default: local when --conductors > 1, else none)")
    p.add_argument("--policy", default=None, help="conductor scheduling policy (default: cache-aware)")
    p.add_argument("--slo-ttft", type=float, default=None, help="conductor: reject requests predicted to miss "
                                                                 "this TTFT (seconds)")
    p.add_argument("--slo-tbt", type=float, default=None, help="conductor: reject requests predicted to miss "
                                                                "this time between tokens (seconds)")
    p.add_argument("--nodes", type=int, default=1, metavar="N",
                   help="hosts, each with a store node and an engine (prefill and decode alternate; one host "
                        "runs both); more than one needs the conductor (default: 1)")
    p.add_argument("--netns", action=argparse.BooleanOptionalAction, default=None,
                   help="run each host in a network namespace of its own, at 10.251.78.<i+1> with the default "
                        "ports (root only); the gateway stays on --host, reachable as usual (default: on when "
                        "run as root with --nodes > 1 and namespaces can be made, else distinct loopback ports)")
    p.add_argument("--startup-timeout-s", type=float, default=300.0, help="give up if not healthy by then")
    p.add_argument("--auth", action="store_true",
                   help="bearer tokens on every gRPC server: <data>/auth.json (made on first use) with an admin "
                        "token the parts use and a tenant token for clients (docs/cli.md, \"Bearer tokens\")")
    p.add_argument("--api-keys", default=None, metavar="JSON",
                   help="the gateway takes only requests with one of this file's API keys (tenants, cache salts, "
                        "concurrency quotas: docs/serving.md)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="the gateway reads tool calls out of the model's text for tool_choice \"auto\" (docs/serving.md)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="the gateway splits chat choices' <think> reasoning from their content (docs/serving.md)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="the gateway lets chat requests bring their own chat_template (Jinja it runs): trusted "
                        "clients only")
    p.add_argument("--max-stored-responses", type=int, default=1000, metavar="N",
                   help="the gateway keeps the N Responses API responses used last (previous_response_id); "
                        "0: none (default: 1000)")
    p.add_argument("--max-stored-responses-mib", type=int, default=256, metavar="MIB",
                   help="the gateway's Responses API: and no more memory than this for them (default: 256)")
    p.add_argument("--restart", action="store_true",
                   help="restart a part that exits (kill -9, a crash) with its command, on its address; the gateway "
                        "is not restarted, and a part exiting 10 times within a minute stops the cluster")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS on every gRPC hop: development certificates in <data>/tls (made on first use, "
                        "`crescent certs init`), every part started with them and --tls-client-auth; the gateway serves HTTPS")


def _subnet_in_use() -> bool:
    """Whether the machine already has the hosts' network's own address (another cluster's uplink)."""
    return bool(subprocess.run(["ip", "-o", "addr", "show", "to", f"{NETNS_SUBNET}.254"],
                               capture_output=True, text=True).stdout.strip())


def _port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now, binding as the parts do (SO_REUSEADDR:
    a port whose last connections linger in TIME_WAIT, as after a cluster just stopped, is free)."""
    if port == 0:
        return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _host_unusable(host: str) -> str | None:
    """Why no part could bind on ``host`` (an unknown name, an address of no interface here), or None."""
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


class Part:
    """One child process, its log, and the address it printed when ready."""

    def __init__(self, name: str, cmd: list[str], log_dir: str) -> None:
        self.name = name
        self.cmd = cmd
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.address: str | None = None
        self.metrics_port: int | None = None
        """The /metrics port its banner names (it binds port 0 and says which it got)."""
        self.restarts: list[float] = []
        """When it was restarted (``--restart``)."""

    def restart(self) -> None:
        """Starts the part again with its command, on the address it had (its clients keep theirs)."""
        self.proc.wait()
        cmd = list(self.cmd)
        if self.address and "--listen" in cmd and not self.address.startswith("http"):
            cmd[cmd.index("--listen") + 1] = self.address
        if self.metrics_port is not None and "--metrics-port" in cmd:
            cmd[cmd.index("--metrics-port") + 1] = str(self.metrics_port)
        self.log.write(f"\n--- crescent up: {self.name} exited ({self.proc.returncode}); restarting ---\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.restarts.append(time.monotonic())

    def wait_banner(self, pattern: str, deadline: float) -> str:
        rx = re.compile(pattern)
        while time.monotonic() < deadline:
            with open(self.log_path) as f:
                text = f.read()
            m = rx.search(text)
            if m:
                self.address = m.group(1)
                line_end = text.find("\n", m.end())
                metrics = re.search(r"metrics :(\d+)", text[m.start():line_end if line_end >= 0 else None])
                if metrics:
                    self.metrics_port = int(metrics.group(1))
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not start in time:\n{self.tail()}")

    def tail(self, n: int = 15) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])


def _stop_parts(parts: list[Part], grace_s: float = 30.0) -> None:
    """Stops the parts a layer at a time, in the reverse of their start: the gateway, the engines,
    the stores, the conductors. The processes of one layer drain side by side."""
    def layer(p: Part) -> str:
        return "engine" if p.name.startswith(("prefill", "decode")) else p.name.split("-")[0]

    for _, stage in itertools.groupby(reversed(parts), key=layer):
        stage = list(stage)
        stop_processes([p.proc for p in stage], grace_s)
        for p in stage:
            p.log.close()


def _healthy_grpc(stub_cls, req, address: str) -> bool:
    try:
        with tls.channel(address) as ch:
            return bool(stub_cls(ch).Health(req, timeout=2).serving)
    except grpc.RpcError:
        return False


def _healthy_http(url: str, ca: str | None = None) -> bool:
    import ssl

    try:
        ctx = ssl.create_default_context(cafile=ca) if ca else None
        with urllib.request.urlopen(url + "/health", timeout=5, context=ctx) as r:
            return r.status == 200
    except OSError:
        return False


def _all_registered(conductor: str, expected: int) -> bool:
    from kvstore.conductor.client import ConductorClient
    from kvstore.errors import CrescentError

    try:
        c = ConductorClient(conductor, timeout_s=2)
        try:
            return sum(m.state == "alive" for m in c.members()) >= expected
        finally:
            c.close()
    except CrescentError:
        return False


def run_up(ns: argparse.Namespace) -> int:
    data = os.path.abspath(ns.data)
    logs = os.path.join(data, "logs")
    os.makedirs(logs, exist_ok=True)
    lock = open(os.path.join(data, "up.lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "?"
        print(f"crescent up: error: another `crescent up` (pid {owner}) is running on {data}; "
              "stop it first or use --data", file=sys.stderr)
        return 2
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    if not 1 <= ns.conductors <= 9:
        print(f"crescent up: error: --conductors must be 1..9, got {ns.conductors}", file=sys.stderr)
        return 2
    if not 1 <= ns.nodes <= 16:
        print(f"crescent up: error: --nodes must be 1..16, got {ns.nodes}", file=sys.stderr)
        return 2
    if ns.nodes > 1 and (ns.no_conductor or ns.no_store):
        print("crescent up: error: --nodes > 1 needs the conductor and the store (engines find the store nodes "
              "through the conductor)", file=sys.stderr)
        return 2
    with_store = not ns.no_store
    hosts = None
    if ns.netns or (ns.netns is None and ns.nodes > 1):
        from kvstore.netns import unavailable

        why = unavailable()
        if ns.netns is None:  # auto: emulated hosts where they can be made and there is more than one
            ns.netns = why is None
    if ns.netns:
        if why is None and _subnet_in_use():
            from kvstore.netns import reclaim_stale

            gone = reclaim_stale()  # hosts a killed `crescent up` (or test) left behind
            if gone:
                print(f"crescent up: removed emulated hosts left by a process no longer running: {', '.join(gone)}",
                      file=sys.stderr)
            if _subnet_in_use():
                why = f"{NETNS_SUBNET}.0/24 is in use (another `crescent up --netns` is running?)"
        if why:
            print(f"crescent up: error: --netns: {why}", file=sys.stderr)
            return 2
    ports = {"gateway": ns.gateway_port}
    if not ns.netns:
        ports["decode"] = ns.decode_port
        if with_store:
            ports["store"] = ns.store_port
        if not ns.no_conductor:
            ports["conductor"] = ns.conductor_port
        if ns.mode == "disagg":
            ports["prefill"] = ns.prefill_port
    if (why := _host_unusable(ns.host)) is not None:
        print(f"crescent up: error: --host {ns.host}: cannot listen there ({why})", file=sys.stderr)
        return 2
    busy = [f"{name} port {p}" for name, p in ports.items() if not _port_free(ns.host, p)]
    if busy:
        print(f"crescent up: error: {', '.join(busy)} in use on {ns.host} (another cluster or service?); "
              "choose other ports with --*-port", file=sys.stderr)
        return 2

    tls_dir = None
    if ns.tls:  # the parts inherit the setting through the environment (kvstore/tls.py)
        tls_dir = os.path.join(data, "tls")
        if not os.path.exists(os.path.join(tls_dir, "ca.pem")):
            tls.init_dir(tls_dir, [ns.host, socket.gethostname(), *(f"{NETNS_SUBNET}.{i}" for i in range(1, 17)),
                                   f"{NETNS_SUBNET}.254"])
        tls.configure(os.path.join(tls_dir, "node.pem"), os.path.join(tls_dir, "node-key.pem"),
                      os.path.join(tls_dir, "ca.pem"), client_auth=True)
    auth_tokens = None
    if ns.auth:  # the parts inherit the file and the admin token through the environment (kvstore/auth.py)
        import secrets

        from kvstore import auth

        auth_path = os.path.join(data, "auth.json")
        if not os.path.exists(auth_path):
            doc = {"tokens": [{"token": secrets.token_urlsafe(24), "tenant": "cluster", "scopes": ["admin", "tenant"]},
                              {"token": secrets.token_urlsafe(24), "tenant": "default", "scopes": ["tenant"]}]}
            fd = os.open(auth_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1)
        with open(auth_path) as f:
            tokens = json.load(f)["tokens"]
        auth_tokens = {"file": auth_path, "admin": tokens[0]["token"], "tenant": tokens[1]["token"]}
        try:
            auth.configure(auth_path, auth_tokens["admin"])
        except ValueError as exc:
            print(f"crescent up: error: {exc}", file=sys.stderr)
            return 2
    py = [sys.executable, "-m", "kvstore.cli"]
    metrics_at: dict[str, str] = {}  # each part's Prometheus /metrics host:port (the gateway's: its HTTP port)

    def on_host(i: int) -> list[str]:
        """The command prefix of a part on host ``i``."""
        if hosts is None:
            return py
        return hosts.exec_prefix(i) + py + ["--host-id", f"h{i}"]

    def listen(i: int, port: int, default: int, first: bool) -> str:
        """Where a part on host ``i`` listens: with --netns its host's address and the given port (or
        the default: each host has an address of its own), else --host and the given port for the first
        of its kind, any free port for the others."""
        if hosts is not None:
            return f"{hosts.addr(i)}:{port or default}"
        return f"{ns.host}:{port if first else 0}"

    def metrics_port(port: int) -> str:
        """With --netns each host has its own address, so the part takes its kind's port; else port 0: the
        part binds a free one and names it in its banner (picking one here for it to bind later raced with
        every other socket on the machine: "Address already in use")."""
        return str(port) if hosts is not None else "0"

    def metrics_of(name: str, i: int, part: Part) -> None:
        host = hosts.addr(i) if hosts is not None else ns.host
        if part.metrics_port is None:
            raise RuntimeError(f"{name} did not say its metrics port:\n{part.tail()}")
        metrics_at[name] = f"[{host}]:{part.metrics_port}" if ":" in host else f"{host}:{part.metrics_port}"

    def numbered(kind: str, k: int) -> str:
        return kind if k == 0 else f"{kind}-{k + 1}"

    parts: list[Part] = []
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    deadline = time.monotonic() + ns.startup_timeout_s
    state_path = os.path.join(data, "up.json")
    etcd = None
    try:
        if ns.netns:
            from kvstore.netns import EmulatedHosts

            hosts = EmulatedHosts(ns.nodes, f"crup{os.getpid() % 100000}", NETNS_SUBNET, reachable=True)
        conductor = None
        if not ns.no_conductor:
            extra = [f for flag, v in (("--policy", ns.policy), ("--slo-ttft", ns.slo_ttft),
                                       ("--slo-tbt", ns.slo_tbt)) if v is not None for f in (flag, str(v))]
            endpoints = ns.etcd if ns.etcd != "local" else None
            if ns.etcd == "local" or (ns.etcd is None and ns.conductors > 1):
                from kvstore.coord import LocalEtcd

                try:
                    etcd = LocalEtcd(os.path.join(data, "etcd"), host=hosts.machine_addr if hosts else ns.host,
                                     tls=tls_dir is not None)
                except FileNotFoundError as exc:
                    raise RuntimeError(f"{exc}; or give --etcd HOST:PORT") from None
                endpoints = etcd.endpoint
            if endpoints:
                extra += ["--etcd", endpoints]
            replicas = []
            for k in range(ns.conductors):
                name, i = numbered("conductor", k), k % ns.nodes  # replicas spread over the hosts
                p = Part(name, on_host(i) + ["conductor", "--listen", listen(i, ns.conductor_port, 7300, k == 0),
                                             "--chunk-tokens", str(ns.chunk_tokens),
                                             "--metrics-port", metrics_port(9300), *extra], logs)
                parts.append(p)
                replicas.append(p.wait_banner(r"listening on ([^\s,]+)", deadline))
                metrics_of(name, i, p)
            conductor = ",".join(replicas)  # members, the gateway and ctl follow the leader among them
        join = ["--conductor", conductor] if conductor else []
        stores: list[str | None] = [None] * ns.nodes
        if with_store:
            for i in range(ns.nodes):
                name = numbered("store", i)
                p = Part(name, on_host(i) + ["store", "--listen", listen(i, ns.store_port, 7400, i == 0),
                                             "--dram", ns.dram, "--disk", os.path.join(data, f"store-{i}" if i else "store"),
                                             "--disk-size", ns.disk_size, "--node-id", f"store-{i}",
                                             "--metrics-port", metrics_port(9400), *join], logs)
                parts.append(p)
                stores[i] = p.wait_banner(r"listening on ([^\s,]+)", deadline)
                metrics_of(name, i, p)
        store_addr = stores[0]
        common = ["--model", ns.model, "--chunk-size", str(ns.chunk_size), "--chunk-tokens", str(ns.chunk_tokens),
                  "--kv-cache-memory", ns.kv_cache_memory,
                  "--max-num-batched-tokens", str(ns.max_num_batched_tokens or ns.chunk_size + 64)] + join
        if ns.async_scheduling:
            common.append("--async-scheduling")
        if ns.scheduling_policy != "fcfs":
            common += ["--scheduling-policy", ns.scheduling_policy]
        engines = []  # (name, role, host)
        if ns.mode == "mono":
            engines = [(numbered("decode", i), "both", i) for i in range(ns.nodes)]
        elif ns.nodes == 1:
            engines = [("prefill", "prefill", 0), ("decode", "decode", 0)]
        else:  # one engine per host, prefill and decode in turn
            engines = [(numbered(role, i // 2), role, i)
                       for i, role in ((i, "prefill" if i % 2 == 0 else "decode") for i in range(ns.nodes))]
        for name, role, i in engines:
            store = ["--store", stores[i]] if stores[i] else []  # the store node on the engine's own host
            port, default = (ns.prefill_port, 7500) if role == "prefill" else (ns.decode_port, 7501)
            parts.append(Part(name, on_host(i) + ["engine", role,
                                                  "--listen", listen(i, port, default, name in ("prefill", "decode")),
                                                  "--metrics-port", metrics_port(default + 2000)]
                              + store + common, logs))
        addrs = {}
        for (name, _, i), part in zip(engines, parts[-len(engines):]):
            addrs[name] = part.wait_banner(r"listening on ([^\s,]+)", deadline)
            metrics_of(name, i, part)
        prefills = [addrs[name] for name, role, _ in engines if role == "prefill"]
        decodes = [addrs[name] for name, role, _ in engines if role != "prefill"]
        gw_cmd = py + ["gateway", "--listen", f"{ns.host}:{ns.gateway_port}", "--model", ns.model,
                       "--decode", *decodes]
        if prefills:
            gw_cmd += ["--prefill", *prefills]
        gw_cmd += join
        if ns.api_keys:
            gw_cmd += ["--api-keys", os.path.abspath(ns.api_keys)]
        if ns.tool_call_parser:
            gw_cmd += ["--tool-call-parser", ns.tool_call_parser]
        if ns.reasoning_parser:
            gw_cmd += ["--reasoning-parser", ns.reasoning_parser]
        if ns.trust_request_chat_template:
            gw_cmd += ["--trust-request-chat-template"]
        if ns.max_stored_responses != 1000:
            gw_cmd += ["--max-stored-responses", str(ns.max_stored_responses)]
        if ns.max_stored_responses_mib != 256:
            gw_cmd += ["--max-stored-responses-mib", str(ns.max_stored_responses_mib)]
        if tls_dir:  # HTTPS for OpenAI clients too (they check the development CA, <data>/tls/ca.pem)
            gw_cmd += ["--https-cert", os.path.join(tls_dir, "node.pem"),
                       "--https-key", os.path.join(tls_dir, "node-key.pem")]
        gw = Part("gateway", gw_cmd, logs)
        parts.append(gw)
        gw_url = gw.wait_banner(r"on (https?://\S+?)/v1", deadline)
        ca = os.path.join(tls_dir, "ca.pem") if tls_dir else None
        checks = [lambda: _healthy_http(gw_url, ca)]
        checks += [lambda a=a: _healthy_grpc(engine_pb2_grpc.EngineStub, engine_pb2.EngineHealthRequest(), a)
                   for a in addrs.values()]
        checks += [lambda a=a: _healthy_grpc(kvstore_pb2_grpc.KVStoreStub, kvstore_pb2.HealthRequest(), a)
                   for a in stores if a]
        if conductor:
            checks.append(lambda: _all_registered(conductor, len(addrs) + sum(1 for a in stores if a)))
        while not all(c() for c in checks):
            if time.monotonic() > deadline or stop.is_set():
                raise RuntimeError("the cluster did not become healthy in time")
            time.sleep(0.2)
        metrics = {"gateway": f"{gw_url}/metrics", **{name: f"http://{at}/metrics" for name, at in metrics_at.items()}}
        state = {"pid": os.getpid(), "model": ns.model, "openai_base_url": f"{gw_url}/v1", "gateway": gw_url,
                 "store": store_addr, "stores": [a for a in stores if a], "conductor": conductor,
                 **{f"{k}_engine": v for k, v in addrs.items()}, "logs": logs,
                 "metrics": metrics, "pids": {p.name: p.proc.pid for p in parts},
                 "console": metrics["conductor"].removesuffix("/metrics") + "/ui" if conductor else None,
                 "etcd": etcd.endpoint if etcd else (ns.etcd if ns.etcd != "local" else None),
                 "hosts": ({f"h{i}": {"namespace": h, "address": hosts.addr(i)} for i, h in enumerate(hosts.hosts)}
                           if hosts else None),
                 "tls": tls_dir, "auth": auth_tokens}
        if etcd is not None:
            state["pids"]["etcd"] = etcd.pid
        with open(state_path + ".tmp", "w") as f:
            json.dump(state, f, indent=1)
        os.replace(state_path + ".tmp", state_path)
        print(f"Crescent is up ({ns.model}, {ns.mode}).", flush=True)
        print(f"  OpenAI API   {gw_url}/v1   (model: {ns.model})", flush=True)
        for k, v in addrs.items():
            print(f"  {k:<12} {v}", flush=True)
        for i, a in enumerate(stores):
            if a:
                print(f"  {numbered('store', i):<12} {a}", flush=True)
        if hosts is not None:
            print(f"  hosts        {', '.join(f'h{i} {hosts.addr(i)} ({h})' for i, h in enumerate(hosts.hosts))}",
                  flush=True)
        if conductor:
            ctl_tls = (f"--tls-cert {tls_dir}/client.pem --tls-key {tls_dir}/client-key.pem --tls-ca {tls_dir}/ca.pem "
                       if tls_dir else "")
            print(f"  conductor    {conductor}   (crescent {ctl_tls}ctl nodes --conductor {conductor})", flush=True)
        if tls_dir:
            print(f"  mTLS         every gRPC hop, HTTPS at the gateway; certificates in {tls_dir} (CA: ca.pem)", flush=True)
        if auth_tokens:
            print(f"  tokens       {auth_tokens['file']} (admin: crescent --token <admin token> ctl ...; clients: "
                  "the tenant token)", flush=True)
        if state["console"]:
            print(f"  console      {state['console']}   (the conductor's web console)", flush=True)
        if state["etcd"]:
            print(f"  etcd         {state['etcd']}   (conductor leader election)", flush=True)
        for name, url in metrics.items():
            print(f"  metrics      {url}   ({name})", flush=True)
        print(f"  logs         {logs}", flush=True)
        print("Ctrl-C stops everything.", flush=True)
        store_down = False
        while not stop.wait(0.5):
            dead = [p for p in parts if p.proc.poll() is not None]
            if ns.restart and dead and gw not in dead:
                now = time.monotonic()
                for p in dead:
                    if sum(t > now - 60 for t in p.restarts) >= RESTARTS_PER_MINUTE:
                        print(f"crescent up: error: {p.name} keeps exiting ({p.proc.returncode}); stopping:\n"
                              f"{p.tail()}", file=sys.stderr)
                        return 1
                    print(f"crescent up: {p.name} exited ({p.proc.returncode}); restarting it", file=sys.stderr,
                          flush=True)
                    p.restart()
                    state["pids"][p.name] = p.proc.pid
                    state.setdefault("restarts", {})[p.name] = len(p.restarts)
                with open(state_path + ".tmp", "w") as f:
                    json.dump(state, f, indent=1)
                os.replace(state_path + ".tmp", state_path)
                continue
            if dead and all(p.name.startswith(("store", "conductor")) for p in dead):
                if not store_down:  # NOTE: the engines carry on without them (recompute, round-robin)
                    for p in dead:
                        print(f"crescent up: warning: the {p.name} exited ({p.proc.returncode}); "
                              "engines continue without it", file=sys.stderr, flush=True)
                    store_down = True
            elif dead:
                name = next(p for p in dead if not p.name.startswith(("store", "conductor")))
                print(f"crescent up: error: {name.name} exited ({name.proc.returncode}); stopping:\n"
                      f"{name.tail()}", file=sys.stderr)
                return 1
        print("crescent up: stopping", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"crescent up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        _stop_parts(parts)
        if etcd is not None:
            etcd.stop()
        if hosts is not None:
            hosts.close()
        if os.path.exists(state_path):
            os.remove(state_path)
        lock.close()
