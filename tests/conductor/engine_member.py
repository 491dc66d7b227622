"""A stand-in engine process for the live tests: a real process that joins the cluster with
``MemberAgent`` (register, heartbeat, load reports), prints one line once registered, and
leaves on SIGTERM. The engines themselves are another issue's work."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from kvstore.conductor.agent import MemberAgent
from kvstore.conductor.membership import EngineLoad, MemberKind


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--conductor", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--kind", choices=["prefill", "decode"], default="prefill")
    p.add_argument("--store-node", default="")
    p.add_argument("--namespace", default="")
    p.add_argument("--chunk-tokens", type=int, default=0)
    p.add_argument("--queued-tokens", type=int, default=0)
    ns = p.parse_args(argv)
    agent = MemberAgent(ns.conductor, ns.id, MemberKind[ns.kind.upper()], store_node=ns.store_node or None,
                        namespace=bytes.fromhex(ns.namespace), chunk_tokens=ns.chunk_tokens)
    agent.report_load(EngineLoad(num_queued_tokens=ns.queued_tokens))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    agent.start()
    if not agent.registered.wait(60):
        print(f"engine {ns.id} could not register", flush=True)
        agent.stop()
        return 1
    print(f"engine {ns.id} registered", flush=True)
    done.wait()
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
