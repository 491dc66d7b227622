"""The gateway's detokenizer: host time per streamed token against the output's length.

Every token a choice streams goes through ``_Detok.push`` on the gateway (text out, stop strings
looked for). The baseline, in the same run, decodes the whole output at every push and looks for
the stop strings in all of it (what the gateway did before; ``tests/serving/test_detok.py`` keeps it
as the twin the incremental one must agree with): its cost per token grows with the output. One
token per push, as a decode engine streams them; two tokenizers: bytes (random models) and a
byte-level BPE trained here (the kind Llama 3 and Qwen ship). Both give the same text (checked).

    .venv/bin/python bench/detok_bench.py [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import publish, table  # noqa: E402
from engine.serve.gateway import _Detok  # noqa: E402
from engine.tokenizer import ByteTokenizer  # noqa: E402
from tests.serving.test_detok import CORPUS, Twin, _hf  # noqa: E402


class _Dir:
    """``tmp_path`` for the test module's tokenizer builder."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __truediv__(self, name: str):
        import pathlib

        return pathlib.Path(self.path) / name


def per_token_us(cls, tok, ids: list[int], stop: list[str]) -> tuple[float, str]:
    d = cls(tok, stop)
    out = []
    t0 = time.perf_counter()
    for i in ids:
        out.append(d.push([i]))
    out.append(d.push([], final=True))
    return (time.perf_counter() - t0) / len(ids) * 1e6, "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1000,4000,16000,32000")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    tmp = tempfile.mkdtemp(prefix="crescent-detok-")
    toks = {"bytes": ByteTokenizer(), "byte-level BPE": _hf(_Dir(tmp), "bytelevel")}
    r = random.Random(0)
    text = " ".join(r.choice(CORPUS) for _ in range(4000))
    stop = ["<|never|>", "\n\n\n"]
    rows, series = [], {}
    for name, tok in toks.items():
        all_ids = tok.encode(text)
        for n in lengths:
            ids = (all_ids * (n // len(all_ids) + 1))[:n]
            new, got = per_token_us(_Detok, tok, ids, stop)
            old, want = per_token_us(Twin, tok, ids, stop)
            assert got == want, f"{name}, {n} tokens: the two disagree"
            rows.append([name, f"{n:,}", f"{old:,.1f}", f"{new:,.1f}", f"{old / new:,.1f}x",
                         f"{old * n / 1e6:,.2f}", f"{new * n / 1e6:,.3f}"])
            series.setdefault(name, []).append((n, old, new))
            print(f"{name:>15} {n:>6} tokens: whole decode {old:8.1f} us/token, incremental {new:6.1f}", flush=True)
    text_table = table(["tokenizer", "output tokens", "µs/token, whole decode each push", "µs/token, incremental",
                        "speed-up", "s per output, whole", "s per output, incremental"], rows)
    print(text_table)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o--", label=f"{name}: whole decode each push")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=f"{name}: incremental")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("output tokens")
    ax.set_ylabel("µs per streamed token")
    ax.set_title("gateway detokenizer, one token per push (CPU, one thread)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    body = ("Host time per streamed token of the gateway's detokenizer (`_Detok.push`: the text of the new "
            "token, no half characters, stop strings looked for), one token per push as a decode engine "
            "streams them, against the output's length; the baseline, in the same run, decodes the whole "
            "output at every push and looks for the stop strings in all of it (the gateway before; the test's "
            "twin). Both gave the same text. CPU: one thread of this 2-core VM. Command: "
            f"`.venv/bin/python bench/detok_bench.py --write-docs`.\n\n{text_table}\n")
    publish(fig, "detok", body, args.write_docs)


if __name__ == "__main__":
    main()
