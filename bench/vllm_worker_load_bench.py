"""The vLLM connector's data path on this host: vLLM's paged cache <-> verified chunks <-> a store node.

A request's prefix of ``--tokens`` tokens (``--chunk-tokens`` per chunk) is saved, again and again,
by the connector's worker side (kvstore/integrations/vllm_worker.py) from one paged cache, and
loaded, again and again, into another, through a real store node process on this host. A save
gathers each layer of all chunks on vLLM's thread (what the forward waits for), then the saver
thread checksums and stores them. Each load fetches the chunks into the
worker's reusable host buffer (copied), or leases them and reads them where the node keeps them
(in place: its arena is mapped here), verifies every chunk (header, key, xxh3 of the payload;
wsum64 on the device with ``--device cuda``) and writes each layer of all chunks into the blocks
(a page layout like vLLM's CPU backend: K transposed per head, V row-major), every layer before
the load returns, then again in place layer by layer as a forward would wait for them
(``layerwise``: timed to layer 0, when the forward may start, and to the last). Baselines in the same run: the store read
alone (``batch_get_into`` of the same chunks into one buffer: what the transport costs) and a
memcpy of the same bytes (with ``--device cuda``, caches on a GPU: a pinned host-to-device copy
of them).

    .venv/bin/python bench/vllm_worker_load_bench.py [--tokens 4096] [--layers 8] [--device cuda] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--first-repeats", type=int, default=5, help="fresh workers timed on their first load, each way")
    ap.add_argument("--device", default="cpu", help="where the paged caches live (cuda: vLLM on a GPU)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    import torch

    from bench.common import publish, table
    from kvstore.chunk import encoded_size
    from kvstore.client import StoreClient
    from kvstore.integrations.paged import BlockLayout
    from kvstore.integrations.storelink import StoreLink, StoreLinkConfig
    from kvstore.integrations.vllm_plan import ChunkOp, RequestOps
    from kvstore.integrations.vllm_worker import WorkerSide
    from kvstore.keys import ROOT_KEY, ModelFingerprint, chunk_keys, make_namespace
    from tests.helpers import StoreProcess

    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    L, H, D, BS, C = args.layers, args.kv_heads, args.head_dim, args.block_size, args.chunk_tokens
    n = args.tokens // C
    m = C // BS
    ns = make_namespace(ModelFingerprint("load-bench", args.dtype, L, H, D, C))
    tokens = list(range(1000, 1000 + n * C))
    keys = chunk_keys(tokens, ns, C)
    ops = tuple(ChunkOp(j, (keys[j],), (keys[j - 1] if j else ROOT_KEY,), tuple(tokens[j * C:(j + 1) * C]),
                        tuple(range(j * m, (j + 1) * m))) for j in range(n))
    # vLLM CPU's page: [heads, block, 2 * head_dim], K transposed ([head_dim, block] per head), V row-major
    kv, h, t, d = torch.meshgrid(torch.arange(2), torch.arange(H), torch.arange(BS), torch.arange(D), indexing="ij")
    index = (h * BS * 2 * D + torch.where(kv == 0, d * BS + t, BS * D + t * D + d)).flatten()
    layout = BlockLayout(H, BS, D, index.to(dev), H * BS * 2 * D)

    def caches():
        return [torch.zeros(n * m + 8, H, BS, 2 * D, dtype=dtype, device=dev) for _ in range(L)]

    src = caches()
    g = torch.Generator().manual_seed(0)
    for c in src:
        c[: n * m].copy_(torch.randn(c[: n * m].shape, generator=g).to(dtype))

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)
    payload_mib = n * L * 2 * H * C * D * dtype.itemsize / 2**20
    print(f"caches on {dev}: " + (torch.cuda.get_device_name(dev) if cuda else "the CPU"), flush=True)
    print(f"{n} chunks of {C} tokens, {L} layers x {H} KV heads x {D}, {args.dtype}: {payload_mib:.0f} MiB of KV",
          flush=True)
    store = StoreProcess("--dram", f"{int(payload_mib * 2 + 256)}MiB")
    times = {"store read alone (batch_get_into)": [],
             "connector load, copied (read into its buffer, verify, write pages)": [],
             "connector load, in place (leased in the node's arena, verify, write pages)": [],
             "layer-wise load: until layer 0 is written (the forward may start)": [],
             "layer-wise load: until every layer is written": [],
             "pinned host->device copy of the same bytes" if cuda else "memcpy of the same bytes": [],
             "connector save: on vLLM's thread (gather pages)": [],
             "connector save: saver thread (checksum, store)": []}
    try:
        config = StoreLinkConfig(store.address, 60.0)
        saver = WorkerSide(StoreLink(config), StoreLink(config), lambda s, i: ns, 0, C, BS, dtype)
        saver.register([(f"l{i}", c, layout) for i, c in enumerate(src)])
        for i in range(args.repeats + 1):
            saver.begin_step([RequestOps("r", None, saves=ops)])
            sync()
            t0 = time.perf_counter()
            saver.end_step()
            sync()
            t1 = time.perf_counter()
            saver.flush()
            t2 = time.perf_counter()
            if i:
                times["connector save: on vLLM's thread (gather pages)"].append(t1 - t0)
                times["connector save: saver thread (checksum, store)"].append(t2 - t1)
            print(f"  save {i}/{args.repeats}: {(t1 - t0) * 1e3:.1f} + {(t2 - t1) * 1e3:.1f} ms", flush=True)
        assert saver.stats.num_saved_chunks == n * (args.repeats + 1), saver.stats
        saves_note = (f"saved chunks written from the device straight into the node's registered arena: "
                      f"{saver.stats.num_device_saved_chunks} of {saver.stats.num_saved_chunks}")
        saver.close()

        dst = caches()
        w = WorkerSide(StoreLink(config), StoreLink(config), lambda s, i: ns, 0, C, BS, dtype)
        w.register([(f"l{i}", c, layout) for i, c in enumerate(dst)])
        req = RequestOps("r", None, loads=ops)
        nbytes = n * encoded_size(w.chunk_shape, dtype, C)
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        size = nbytes // n
        views = [buf[i * size:(i + 1) * size] for i in range(n)]
        other = torch.empty(nbytes, dtype=torch.uint8, device=dev)  # (on a GPU: the pinned host->device copy)
        with StoreClient(store.address) as client:
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                got = client.batch_get_into(list(keys), views)
                t1 = time.perf_counter()
                assert all(s is not None for s in got)
                marks = [t0, t1]
                for in_place in (False, True):
                    w.in_place = in_place
                    w.begin_step([req])
                    w.load([req])
                    w.finish_loads()  # (in place: the lease ends once the copies have completed)
                    sync()
                    marks.append(time.perf_counter())
                    assert not w.take_invalid_blocks()
                w.begin_step([req])
                w.load([req], layerwise=True)
                w.wait_layer("l0")
                # (GPU: the compute stream alone, which waited for layer 0's event; a device-wide
                # sync would wait for the layers queued after it on the transfer stream too)
                if cuda:
                    torch.cuda.current_stream(dev).synchronize()
                marks.append(time.perf_counter())
                for layer in range(1, L):
                    w.wait_layer(f"l{layer}")
                w.end_step()
                marks.append(time.perf_counter())
                assert not w.take_invalid_blocks()
                other.copy_(buf, non_blocking=True)
                sync()
                marks.append(time.perf_counter())
                t = marks
                if i:  # (the first of each is a warm-up: buffers allocated, pages touched)
                    for name, dt in zip(times, (t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], t[5] - t[3],
                                                t[6] - t[5])):
                        times[name].append(dt)
                print(f"  load {i}/{args.repeats}: copied {(t[2] - t[1]) * 1e3:.1f} ms, in place "
                      f"{(t[3] - t[2]) * 1e3:.1f}, layer-wise {(t[4] - t[3]) * 1e3:.1f} to layer 0 and "
                      f"{(t[5] - t[3]) * 1e3:.1f} to all", flush=True)
        for a, b in zip(src, dst):
            assert torch.equal(a[: n * m], b[: n * m]), "the loaded pages differ from the saved ones"
        w.close()
        first = {}  # a fresh worker's first load (in place), with and without what warm_up makes at start
        for i in range(2 * args.first_repeats):
            warm = i % 2 == 1
            fresh = WorkerSide(StoreLink(config), StoreLink(config), lambda s, i: ns, 0, C, BS, dtype)
            fresh.register([(f"l{i}", c, layout) for i, c in enumerate(dst)])
            if warm:
                fresh.warm_up(args.tokens)
            sync()
            t0 = time.perf_counter()
            fresh.begin_step([req])
            fresh.load([req])
            fresh.finish_loads()
            sync()
            first.setdefault(warm, []).append(time.perf_counter() - t0)
            assert not fresh.take_invalid_blocks()
            fresh.close()
            print(f"  a fresh worker's first load ({'warm_up at start' if warm else 'nothing made at start'}): "
                  f"{first[warm][-1] * 1e3:.1f} ms", flush=True)
        times["a fresh worker's first load, in place: nothing made at start"] = first[False]
        times["a fresh worker's first load, in place: after warm_up"] = first[True]
    finally:
        store.stop()

    base = statistics.median(times["store read alone (batch_get_into)"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append([name, f"{med * 1e3:.1f}", f"{nbytes / med / 1e9:.2f}", f"{med / base:.2f}x"])
    text = table(["step", "median ms", "GB/s", "time vs the store read"], rows)
    print(text)
    if cuda:
        print(saves_note)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4))
    names = list(times)[::-1]
    ax.barh(names, [statistics.median(times[k]) * 1e3 for k in names],
            color=["#8c564b", "#8c564b", "#2ca02c", "#2ca02c", "#999999", "#9467bd", "#9467bd", "#1f77b4",
                   "#1f77b4", "#ff7f0e"])
    ax.set_xlabel(f"ms per {n} chunks ({payload_mib:.0f} MiB), median of {args.repeats} "
                  f"(fresh workers: of {args.first_repeats})")
    ax.set_title(f"vLLM connector data path ({torch.cuda.get_device_name(dev) if cuda else 'CPU, 2 cores'})")
    fig.tight_layout()
    where = f"caches on {torch.cuda.get_device_name(dev)}" if cuda else "this host (2 cores)"
    check = "wsum64, on the device" if cuda else "xxh3"
    body = (f"The vLLM connector's worker side, {where}: {n} chunks of {C} tokens "
            f"({L} layers x {H} KV heads x {D}, {args.dtype}: {payload_mib:.0f} MiB of KV) saved {args.repeats} "
            f"times from a paged cache (blocks of {BS}, vLLM CPU's page layout) into a store node process: each "
            f"layer of all chunks gathered on vLLM's thread, then checksummed ({check}) and stored by the saver "
            f"thread; then loaded {args.repeats} times into another paged cache, three ways: copied (read into the "
            f"worker's reusable host buffer, every chunk verified: header, key, the payload's {check}; each layer "
            f"of all chunks written at once, every layer before the call returns), in place (the same, the "
            f"chunks leased and read where the node keeps them, its arena mapped here: no copy before the "
            f"pages{', the mapping registered with CUDA' if cuda else ''}), and in place layer by layer "
            f"(`layerwise`: "
            f"{'a transfer stream, the compute stream waiting on each layer' if cuda else 'the lander thread'}), "
            f"timed until layer 0 is written (when a forward may start) and until every layer is; last, "
            f"{args.first_repeats} fresh workers' first loads (in place) each way: with nothing made at start, "
            f"and after `warm_up` (the session open, the arena mapped"
            f"{' and registered' if cuda else ''}, buffers made). The loaded "
            f"pages equal the saved ones. Baselines in the same run: the store read "
            f"alone into one buffer and {'a pinned host-to-device' if cuda else 'a memcpy'} copy of the same "
            f"bytes. Command: `.venv/bin/python bench/vllm_worker_load_bench.py{' --device cuda' if cuda else ''} "
            f"--write-docs`.\n\n{text}\n")
    publish(fig, "vllm_worker_load" + ("_cuda" if cuda else ""), body, args.write_docs)


if __name__ == "__main__":
    main()
