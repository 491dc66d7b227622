"""A real vLLM publishing its KV events, for tests/integrations/test_vllm_kv_events.py (run with the
vLLM venv's python; single-process vLLM on CPU, the caller sets the env).

    python vllm_events_run.py MODEL_DIR PUB_ENDPOINT REPLAY_ENDPOINT

Prints "@@ ready", then obeys one command per stdin line, answering each on a stdout line starting
"@@ " (vLLM logs to stdout too): ``generate [[token ids], ...]`` (or ``{"prompts": [...], "cache_salt":
SALT, "lora": ADAPTER_DIR}``, each optional: LoRA adapter "ad") → ``@@ done``; ``reset`` (the prefix
cache, then one step that publishes it) → ``@@ reset True|False``; ``quit``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, endpoint, replay = sys.argv[1:4]
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    llm = LLM(model=model, tokenizer=model, dtype="float32", block_size=32, enforce_eager=True, max_model_len=512,
              max_num_seqs=8, seed=0, enable_prefix_caching=True, enable_lora=True, max_lora_rank=8, max_loras=1,
              kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                                              replay_endpoint=replay))
    print("@@ ready", flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "generate":
            req = json.loads(arg)
            req = req if isinstance(req, dict) else {"prompts": req}
            salt = {"cache_salt": req["cache_salt"]} if req.get("cache_salt") else {}
            prompts = [{"prompt_token_ids": ids, **salt} for ids in req["prompts"]]
            lora = None
            if req.get("lora"):
                from vllm.lora.request import LoRARequest

                lora = LoRARequest("ad", 1, req["lora"])
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                         lora_request=lora)
            print("@@ done", flush=True)
        elif cmd == "reset":
            ok = llm.reset_prefix_cache()
            # vLLM publishes the KV events of a step with its outputs, so the AllBlocksCleared goes out
            # with the next step: run one (a prompt shorter than a block stores no block)
            llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1), use_tqdm=False)
            print(f"@@ reset {ok}", flush=True)
        elif cmd == "quit":
            break


if __name__ == "__main__":
    main()
