"""Runs one engine in its own process: `python -m tests.engine.worker '<json args>'` prints JSON outputs."""

import json
import sys

from engine import LLM


def main() -> None:
    args = json.loads(sys.argv[1])
    prompts = args.pop("prompts")
    gen = args.pop("generate", {})
    with LLM(**args) as llm:
        outs = llm.generate(prompts, **gen)
        stats = vars(llm.engine.connector.stats) if llm.engine.connector else {}
    print(json.dumps({"outputs": [{"token_ids": o.token_ids, "num_cached_tokens": o.num_cached_tokens,
                                   "num_local_cached_tokens": o.num_local_cached_tokens} for o in outs],
                      "stats": stats}))


if __name__ == "__main__":
    main()
