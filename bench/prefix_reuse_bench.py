"""TTFT with 0%, 50% and 90% of a long prompt cached in the store, against recompute.

One engine (any model; `random:medium` fp32 on CPU by default, bf16 on CUDA)
and a real `crescent store` process on this host. The engine first computes a
prompt and stores its chunks. Then, per cached fraction, prompts made of the
stored prefix plus fresh tokens are run twice: once loading the prefix from the
store, once recomputing everything (store loads off), in the same process,
alternating; the local prefix cache is off so only the store can help. The
first load of the process is reported apart from the warm ones.

Also measured in the same run, as ceilings for the load: host memcpy (CPU), and
on CUDA the pinned host→device bandwidth and a plain copy from a registered
/dev/shm mapping (what a zero-copy load from the node's arena could reach).
And the save side: prefill time of fresh prompts with saving on vs off.

With `--transport tcp` the engine reads the node as another host's engine would
(no shared memory): chunks stream layer-major beside the step; the same run
also times the staging pool's chunk-major load (everything before the step).

    python bench/prefix_reuse_bench.py [--quick] [--write-docs]
    python bench/prefix_reuse_bench.py --transport tcp [--write-docs]   # the remote path
    python bench/prefix_reuse_bench.py --model random:llama3-8b --hf-overrides '{"num_hidden_layers": 8}' \\
        --prompt-tokens 8000 --dram 4GiB          # the GPU figures of issue 12
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import subprocess
import tempfile
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import OUT, ROOT, median, publish, table  # noqa: E402


def log(msg: str) -> None:
    print(f"[prefix_reuse] {msg}", flush=True)


# ---- ceilings, measured in the same run ---------------------------------------------------


def host_memcpy_gbps(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """One thread copying a host buffer into another (the CPU path's ceiling)."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _cuda_copy_gbps(src, reps: int = 5) -> float:
    import torch

    dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return src.numel() / best / 1e9


def pinned_h2d_gbps(nbytes: int = 256 << 20) -> float:
    import torch

    return _cuda_copy_gbps(torch.ones(nbytes, dtype=torch.uint8).pin_memory())


def registered_shm_h2d_gbps(nbytes: int = 256 << 20) -> float:
    """cudaHostRegister on a /dev/shm mapping (as the node's arena is mapped), then a plain copy."""
    import torch

    from kernels.host import register_host_memory, unregister_host_memory

    path = f"/dev/shm/crescent-bench-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        m = mmap.mmap(fd, nbytes)
        host = torch.frombuffer(m, dtype=torch.uint8)
        host.fill_(1)
        why = register_host_memory(host.data_ptr(), nbytes)
        if why is not None:
            raise RuntimeError(why)
        try:
            return _cuda_copy_gbps(host)
        finally:
            unregister_host_memory(host.data_ptr())
            del host
            m.close()
    finally:
        os.close(fd)
        os.unlink(path)


def d2d_gbps(nbytes: int = 256 << 20) -> float:
    """A device-to-device copy (the HBM tier's ceiling: read once, written once)."""
    import torch

    return _cuda_copy_gbps(torch.ones(nbytes, dtype=torch.uint8, device="cuda"))


def disk_hits(conn) -> int:
    """Reads the store node served from its disk tier so far (0 without one)."""
    return conn.client.stats()["tiers"].get("disk", {}).get("hits", 0)


# ---- the run -------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:medium")
    ap.add_argument("--hf-overrides", type=json.loads, default=None,
                    help='model config fields to replace, JSON, e.g. \'{"num_hidden_layers": 8}\'')
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (tokens per step)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dram", default="2GiB", help="the store node's DRAM tier")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--disk-tier", action="store_true",
                    help="the prefix on the node's disk tier: give it a disk tier (O_DIRECT where the file system "
                         "takes it) and --no-promote, and a --dram too small for the prompts (e.g. 64MiB), so every "
                         "load reads the chunks from disk (the Disk -> GPU path on CUDA)")
    ap.add_argument("--disk-size", default="16GiB", help="the node's disk tier with --disk-tier")
    ap.add_argument("--hbm", default="", metavar="SIZE",
                    help="give the node a device (HBM) tier of SIZE and move the prompt's chunks there (a client "
                         "on another host would put them there): loads read them device to device (cuda_ipc)")
    ap.add_argument("--transport", default="auto", choices=["auto", "tcp"],
                    help="tcp: read the node as another host would (streamed layer-major, and the pool to compare)")
    ap.add_argument("--land-direct", action="store_true",
                    help="CUDA: the landing kernel reads chunks in page-locked host memory in place (no device stage)")
    ap.add_argument("--quick", action="store_true", help="random:small, 1024 tokens, 1 rep")
    ap.add_argument("--json", default=None, help="where the figures go (default bench/out/<the docs section>.json)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.model, args.prompt_tokens, args.reps = "random:small", 1024, 1

    import torch

    from engine import LLM

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.hbm and not cuda:
        sys.exit("prefix_reuse_bench: --hbm needs a CUDA GPU (the node's device tier and the engine share it)")
    log(f"ceilings on {device}")
    ceilings = {"host_memcpy_gbps": host_memcpy_gbps()}
    if cuda:
        ceilings["pinned_h2d_gbps"] = pinned_h2d_gbps()
        try:
            ceilings["registered_shm_h2d_gbps"] = registered_shm_h2d_gbps()
        except Exception as exc:  # noqa: BLE001 - a ceiling this host cannot measure is reported, not fatal
            log(f"registered /dev/shm copy: {exc}")
        if args.hbm:
            ceilings["d2d_gbps"] = d2d_gbps()
    log("  " + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items()))

    disk_dir = tempfile.mkdtemp(prefix="crescent-prefix-disk-") if args.disk_tier else None
    disk = ["--disk", disk_dir, "--disk-size", args.disk_size, "--no-promote"] if disk_dir else []
    hbm = ["--device", args.hbm] if args.hbm else []
    store = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "store", "--listen", "127.0.0.1:0",
                              "--dram", args.dram, *disk, *hbm], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    first = store.stdout.readline()
    if "listening on " not in first:  # it exited (its one-line reason is on stderr, above)
        store.wait(timeout=30)
        raise SystemExit(f"the store node did not start (exit {store.returncode}; --dram {args.dram}: "
                         f"/dev/shm must hold it)")
    address = first.split("listening on ")[1].split(",")[0]
    try:
        log(f"loading {args.model} {args.hf_overrides or ''} on {device}")
        t0 = time.perf_counter()
        llm = LLM(args.model, store=address, chunk_tokens=args.chunk_tokens,
                  chunk_size=args.chunk_size, max_num_batched_tokens=max(2048, args.chunk_size),
                  enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
                  hf_overrides=args.hf_overrides, store_transport=args.transport, land_direct=args.land_direct,
                  enforce_eager=True)  # (TTFT only: one token per prompt; no decode graph is ever replayed)
        conn = llm.engine.connector
        mc = llm.engine.model_config
        vocab = mc.vocab_size
        dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
        transport = conn.client.transport
        log(f"  ready in {time.perf_counter() - t0:.1f}s ({mc.num_hidden_layers} layers, {dtype}, "
            f"store transport {transport})")
        rng = random.Random(0)
        n = args.prompt_tokens

        def fresh(k: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(k)]

        # warm-up with neither loads nor saves: kernels, allocator
        conn.save_enabled = conn.load_enabled = False
        llm.generate([fresh(n)], max_tokens=1)

        # the save side: prefill of fresh prompts, saving off vs on (generate() waits for the saves)
        save = {"off": [], "on": [], "on_total": []}
        for rep in range(args.reps):
            for mode in ("off", "on"):
                conn.save_enabled = mode == "on"
                t0 = time.perf_counter()
                out = llm.generate([fresh(n)], max_tokens=1)[0]
                save[mode].append(out.ttft_s)
                if mode == "on":
                    save["on_total"].append(time.perf_counter() - t0)
            log(f"save rep {rep + 1}/{args.reps}: prefill {save['off'][-1]:.3f}s saving off, "
                f"{save['on'][-1]:.3f}s saving on ({save['on_total'][-1]:.3f}s until stored)")

        base = fresh(n)
        log(f"computing and storing the {n}-token prompt")
        conn.save_enabled = True
        before = conn.stats.chunks_saved
        llm.generate([base], max_tokens=1)
        saved = conn.stats.chunks_saved - before
        log(f"  {saved} chunks stored ({conn.stats.bytes_saved / 2**20:.0f} MiB in all)")
        if args.disk_tier:  # two more prompts' chunks push the prompt's out of a DRAM smaller than one prompt
            llm.generate([fresh(n), fresh(n)], max_tokens=1)
        if args.hbm:
            # NOTE: this engine's saves fill the node's DRAM (shm reserves DRAM slots); a put through
            # the node (tcp) lands in the fastest tier with room, the device tier.
            from kvstore.client import StoreClient

            with StoreClient(address, transport="tcp") as c:
                for k in conn.keys(base, None):
                    c.put(bytes(k), c.get(bytes(k)))
                on_device = c.stats()["tiers"]["device"]["num_entries"]
            log(f"  {on_device} chunks moved into the node's device tier; cuda_ipc mapped: "
                f"{conn.client.descriptor_session().device_mapped}")
        conn.save_enabled = False

        def shape(frac: float) -> tuple[int, int]:
            # NOTE: the cached prefix is whole chunks; the prompt's length is then
            # chosen so that the prefix is exactly `frac` of it (90%: 3584 of 3982).
            cached = round(frac * n / args.chunk_tokens) * args.chunk_tokens
            return cached, (round(cached / frac) if frac else n)

        # the process's first load, at 90% cached like the warm ones it is compared with
        cached, total = shape(0.9)
        conn.load_enabled = True
        b0, s0 = conn.stats.bytes_loaded, conn.stats.load_s
        out = llm.generate([base[:cached] + fresh(total - cached)], max_tokens=1)[0]
        first_load = {"ttft": out.ttft_s, "bytes": conn.stats.bytes_loaded - b0, "load_s": conn.stats.load_s - s0}
        log(f"first load of the process (90% cached): TTFT {out.ttft_s:.3f}s")

        results = []
        for frac in (0.0, 0.5, 0.9):
            cached, total = shape(frac)
            ttft_store, ttft_recompute, moved, hits, load_s, from_disk, from_hbm = [], [], [], [], [], [], []
            ttft_pool, pool_load_s = [], []
            modes = ("store", "pool", "recompute") if args.transport == "tcp" and frac else ("store", "recompute")
            for rep in range(args.reps):
                prompt = base[:cached] + fresh(total - cached)
                for mode in modes:
                    conn.load_enabled = mode != "recompute"
                    conn.stream_loads = mode == "store"
                    if mode == "pool":
                        s0 = conn.stats.load_s
                        ttft_pool.append(llm.generate([prompt], max_tokens=1)[0].ttft_s)
                        pool_load_s.append(conn.stats.load_s - s0)
                        continue
                    b0, s0 = conn.stats.bytes_loaded, conn.stats.load_s
                    d0, h0 = disk_hits(conn), conn.stats.chunks_loaded_from_device
                    out = llm.generate([prompt], max_tokens=1)[0]
                    (ttft_store if mode == "store" else ttft_recompute).append(out.ttft_s)
                    if mode == "store":
                        moved.append(conn.stats.bytes_loaded - b0)
                        load_s.append(conn.stats.load_s - s0)
                        hits.append(out.num_cached_tokens)
                        from_disk.append(disk_hits(conn) - d0)
                        from_hbm.append(conn.stats.chunks_loaded_from_device - h0)
                log(f"{frac:.0%} cached, rep {rep + 1}/{args.reps}: store {ttft_store[-1]:.3f}s, "
                    + (f"staging pool {ttft_pool[-1]:.3f}s, " if ttft_pool else "")
                    + f"recompute {ttft_recompute[-1]:.3f}s, {hits[-1]} tokens from the store")
            s, r = median(ttft_store), median(ttft_recompute)
            nbytes, secs = median(moved), median(load_s)
            results.append({"target": frac, "cached_tokens": hits[0], "fraction": hits[0] / total,
                            "prompt_tokens": total, "ttft_store": s, "ttft_recompute": r, "ratio": s / r,
                            "bytes": nbytes, "load_s": secs, "chunks_from_disk": median(from_disk),
                            "chunks_from_device": median(from_hbm),
                            "ttft_pool": median(ttft_pool) if ttft_pool else None,
                            "pool_load_s": median(pool_load_s) if pool_load_s else None})
        conn.stream_loads = True
        # the load alone, nothing computed beside it: the 90% prefix into pages of its own
        # (what the store moves per second; in a TTFT above, the copies overlap the step)
        eng = llm.engine
        cached, _ = shape(0.9)
        num = cached // args.chunk_tokens
        pages = eng.blocks.allocate(eng.blocks.pages_for(cached))
        alone = []
        try:
            for _ in range(max(3, args.reps)):
                b0 = conn.stats.bytes_loaded
                t0 = time.perf_counter()
                got = conn.load(base, None, pages, 0, num)
                alone.append((time.perf_counter() - t0, conn.stats.bytes_loaded - b0))
                if got < num:
                    log(f"  a load alone got {got} of {num} chunks")
        finally:
            eng.blocks.free(pages)
        load_alone_s, load_alone_bytes = median([a for a, _ in alone]), median([b for _, b in alone])
        log(f"the load alone: {load_alone_bytes / 2**20:.0f} MiB in {load_alone_s * 1e3:.1f} ms")
        llm.close()
    finally:
        store.terminate()
        store.wait(timeout=60)
        if disk_dir:
            shutil.rmtree(disk_dir, ignore_errors=True)

    at90 = results[-1]
    order = ("d2d_gbps", "registered_shm_h2d_gbps", "pinned_h2d_gbps", "host_memcpy_gbps")
    ref_name = next(k for k in order if k in ceilings)
    ref = ceilings[ref_name]
    figures = {"model": args.model, "hf_overrides": args.hf_overrides, "device": device, "dtype": dtype,
               "layers": mc.num_hidden_layers, "prompt_tokens": n, "chunk_tokens": args.chunk_tokens,
               "ceilings": ceilings, "results": results, "first_load": first_load,
               "first_over_warm": first_load["ttft"] / at90["ttft_store"],
               "save_prefill_off_s": median(save["off"]), "save_prefill_on_s": median(save["on"]),
               "save_on_until_stored_s": median(save["on_total"]),
               "load_alone_s": load_alone_s, "load_alone_bytes": load_alone_bytes,
               "load_alone_gbps": load_alone_bytes / load_alone_s / 1e9,
               "load_gbps_over_ceiling": load_alone_bytes / load_alone_s / 1e9 / ref, "ceiling": ref_name}
    name = (("prefix_reuse" if device == "cpu" else "prefix_reuse_gpu") + ("_tcp" if args.transport == "tcp" else "")
            + ("_disk" if args.disk_tier else "") + ("_hbm" if args.hbm else "")
            + ("_direct" if args.land_direct and device != "cpu" else ""))
    args.json = args.json or os.path.join(OUT, f"{name}.json")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(figures, f, indent=1)

    rows = [[f"{x['target']:.0%}", x["prompt_tokens"], f"{x['cached_tokens']} ({x['fraction']:.1%})",
             f"{x['ttft_recompute']:.3f}", f"{x['ttft_store']:.3f}", f"{x['ratio']:.2f}×",
             f"{x['bytes'] / 2**20:.0f} MiB", f"{x['load_s'] * 1e3:.1f}" if x["bytes"] else "–",
             *([f"{x['ttft_pool']:.3f}" if x["ttft_pool"] else "–",
                f"{x['pool_load_s'] * 1e3:.1f}" if x["ttft_pool"] else "–"] if args.transport == "tcp" else []),
             *([f"{x['chunks_from_disk']:.0f}"] if args.disk_tier else []),
             *([f"{x['chunks_from_device']:.0f}"] if args.hbm else [])] for x in results]
    md = table(["cached (target)", "prompt tokens", "tokens from store", "TTFT recompute s", "TTFT with store s",
                "× recompute", "bytes from store", "load ms not overlapped",
                *(["TTFT staging pool s (chunk-major)", "pool: load ms not overlapped"]
                  if args.transport == "tcp" else []),
                *(["chunks from the node's disk"] if args.disk_tier
                                                                   else []),
                *(["chunks from the node's HBM (cuda_ipc)"] if args.hbm else [])], rows)
    save_cost = figures["save_prefill_on_s"] / figures["save_prefill_off_s"] - 1
    lines = [f"at {at90['fraction']:.1%} cached, TTFT is {at90['ratio']:.2f}× recompute"
             + (f"; streamed layer-major {at90['ttft_store'] / at90['ttft_pool']:.2f}× the staging pool's "
                f"chunk-major load ({at90['ttft_pool']:.3f}s); load time not overlapped with compute "
                f"{at90['load_s'] * 1e3:.1f} ms streamed vs {at90['pool_load_s'] * 1e3:.1f} ms through the pool"
                if at90["ttft_pool"] else ""),
             f"the load alone {figures['load_alone_gbps']:.2f} GB/s = {figures['load_gbps_over_ceiling']:.2f}× "
             f"{ref_name.removesuffix('_gbps')} ({ref:.1f} GB/s, same run)",
             "ceilings: " + ", ".join(f"{k.removesuffix('_gbps')} {v:.1f} GB/s" for k, v in ceilings.items())]
    lines.append(f"first load of the process {first_load['ttft']:.3f}s = {figures['first_over_warm']:.2f}× "
                 f"a warm one (both 90% cached)")
    lines.append(f"saving on: prefill {figures['save_prefill_on_s']:.3f}s vs {figures['save_prefill_off_s']:.3f}s "
                 f"off ({save_cost:+.1%}), {figures['save_on_until_stored_s']:.3f}s until every chunk is stored")
    print()
    print(md)
    print()
    for line in lines:
        print(line)
    print(f"figures: {args.json}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(results))
    if any(r["ttft_pool"] for r in results):  # three bars: recompute, the pool's load, streamed
        ax.bar([x - 0.27 for x in xs], [r["ttft_recompute"] for r in results], 0.27, label="recompute")
        ax.bar(list(xs), [r["ttft_pool"] or 0 for r in results], 0.27, label="load through the pool (chunk-major)")
        ax.bar([x + 0.27 for x in xs], [r["ttft_store"] for r in results], 0.27,
               label="load streamed layer-major beside the step")
    else:
        ax.bar([x - 0.2 for x in xs], [r["ttft_recompute"] for r in results], 0.4, label="recompute")
        ax.bar([x + 0.2 for x in xs], [r["ttft_store"] for r in results], 0.4, label="load prefix from store")
    ax.set_xticks(list(xs), [f"{r['fraction']:.0%} cached" for r in results])
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"{args.model} ({mc.num_hidden_layers} layers), {n}-token prompt, {device} {dtype}")
    ax.legend()
    fig.tight_layout()
    where = "this 2-core CPU" if device == "cpu" else torch.cuda.get_device_name()
    body = (f"`{args.model}` ({mc.num_hidden_layers} layers, hidden {mc.hidden_size}, "
            f"{mc.num_attention_heads}/{mc.num_key_value_heads} heads of {mc.head_dim}), {dtype} on {where}, "
            f"~{n}-token prompts, {args.chunk_tokens}-token chunks, chunked prefill of {args.chunk_size}, "
            f"store node on this host ({transport} transport"
            + ("; the engine reads it over TCP, as another host's would" if args.transport == "tcp" else "")
            + (f"; the prefix on its disk tier: DRAM {args.dram}, `--no-promote`, so each load reads it from disk"
               if args.disk_tier else "")
            + (f"; the prefix in its device (HBM) tier of {args.hbm}, read device to device through CUDA IPC"
               if args.hbm else "")
            + ("; `--land-direct`: the landing kernel reads the registered arena in place"
               if args.land_direct and device != "cpu" else "") + "), "
            f"median of {args.reps}.\n\n{md}\n\n" + "\n".join(f"- {x}." for x in lines))
    publish(fig, name, body, args.write_docs)


if __name__ == "__main__":
    main()
