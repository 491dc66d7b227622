"""`make demo`: a store node, a prefix-reuse workload across tenants, and tiering, in a minute.

Starts `crescent store` as a real process (64 MiB of DRAM over a disk
tier), then plays a stand-in engine: each request's prompt is split into
chunk keys; the engine looks the prefix up, loads and verifies the hit chunks,
"computes" the rest and stores them. Requests of three tenants share a system
prompt (cross-tenant reuse); one tenant uses a salt (isolated); enough unique
traffic flows to push early chunks from DRAM to disk, and a returning
conversation is then served from disk and promoted back.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

from kvstore.chunk import decode_chunk, encode_chunk, encoded_size
from kvstore.client import StoreClient
from kvstore.config import format_size
from kvstore.errors import ChunkVerificationError
from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_keys, make_namespace
from kvstore.store import Tier

CHUNK = 256
FP = ModelFingerprint("demo-llama", "float16", num_layers=4, num_kv_heads=4, head_dim=64, chunk_tokens=CHUNK)
SHAPE = (FP.num_layers, 2, FP.num_kv_heads, CHUNK, FP.head_dim)  # 1 MiB of fp16 per chunk


def fake_kv(key: bytes) -> torch.Tensor:
    """Deterministic stand-in for the KV an engine would compute for a chunk."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    return torch.randn(SHAPE, generator=g).to(torch.float16)


def tokens_of(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 32000, n).tolist()


def serve_request(c: StoreClient, prompt: list[int], salt: str | None) -> dict:
    ns = make_namespace(FP, salt)
    keys = chunk_keys(prompt, ns, CHUNK)
    num_hit, tiers = c.lookup_tiers(keys)
    bufs = [bytearray(encoded_size(SHAPE, torch.float16, CHUNK)) for _ in range(num_hit)]
    c.batch_get_into(keys[:num_hit], bufs)
    parent = ROOT_KEY
    loaded = 0
    for i, (k, buf) in enumerate(zip(keys[:num_hit], bufs)):
        try:
            kv = decode_chunk(buf, key=k, namespace=ns, parent=parent,
                              tokens=prompt[i * CHUNK : (i + 1) * CHUNK])
        except ChunkVerificationError:
            break  # a bad chunk is a miss: recompute from here
        assert torch.equal(kv, fake_kv(k))
        loaded += 1
        parent = k
    items = []
    for i in range(loaded, len(keys)):
        items.append((keys[i], encode_chunk(fake_kv(keys[i]), ns, parent, prompt[i * CHUNK : (i + 1) * CHUNK])))
        parent = keys[i]
    c.batch_put(items)
    return {"chunks": len(keys), "hit": loaded, "from_disk": sum(t is Tier.DISK for t in tiers[:loaded])}


def main() -> int:
    data = os.path.abspath("crescent-data/demo")
    shutil.rmtree(data, ignore_errors=True)
    cmd = [sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0", "--dram", "64MiB",
           "--disk", data, "--disk-size", "1GiB"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        banner = proc.stdout.readline().strip()
        print(banner)
        address = re.search(r"listening on ([^\s,]+)", banner).group(1)
        c = StoreClient(address)
        system = tokens_of(0, 8 * CHUNK)  # a 2048-token system prompt shared by tenants
        plan = []
        for r in range(9):
            tenant = ["acme", "globex", "initech"][r % 3]
            plan.append((f"{tenant} #{r // 3}", system + tokens_of(100 + r, 4 * CHUNK + 37), None))
        plan.append(("secure (salted)", system + tokens_of(200, 4 * CHUNK), "secure-tenant"))
        for r in range(60):  # unique traffic: fills DRAM, demotes the oldest chunks to disk
            plan.append((f"bulk #{r}", tokens_of(1000 + r, 4 * CHUNK), None))
        plan.append(("acme #0 returns", plan[0][1] + tokens_of(300, CHUNK), None))

        print(f"\n{len(plan)} requests, {CHUNK}-token chunks of {format_size(np.prod(SHAPE) * 2)} each\n")
        print(f"{'request':<18}{'chunks':>7}{'hit':>5}{'from disk':>11}  reuse")
        t0 = time.perf_counter()
        total = hit = 0
        for i, (name, prompt, salt) in enumerate(plan):
            r = serve_request(c, prompt, salt)
            total += r["chunks"]
            hit += r["hit"]
            if not name.startswith("bulk") or i == len(plan) - 2:
                bar = "#" * r["hit"] + "." * (r["chunks"] - r["hit"])
                print(f"{name:<18}{r['chunks']:>7}{r['hit']:>5}{r['from_disk']:>11}  {bar}")
            elif name == "bulk #0":
                print(f"{'bulk #0..#59':<18}  (unique prompts: pushing old chunks to disk)")
        dt = time.perf_counter() - t0
        st = c.stats()
        print(f"\nchunk hit rate {hit / total:.0%} ({hit}/{total}) in {dt:.1f}s")
        print(f"demotions to disk {st['demotions']}, promotions {st['promotions']}, misses {st['misses']}")
        for tier, t in st["tiers"].items():
            print(f"  {tier:<5} {t['num_entries']:>4} values  {format_size(t['used_bytes']):>10} of "
                  f"{format_size(t['capacity_bytes']):>10}  hits {t['hits']}")
        c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(f"store stopped (exit {proc.returncode}); its disk tier is in {data}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
