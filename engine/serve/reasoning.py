"""Reasoning outputs for the chat endpoint (the gateway's ``--reasoning-parser``).

Reasoning models think before they answer, between ``<think>`` and ``</think>``; the parser
splits a choice's text into the message's ``reasoning`` (vLLM's field; ``reasoning_content``, its
old name and DeepSeek's, carries the same) and its ``content``. Where the output begins is told
by the prompt, as each model's chat template leaves it:

- a prompt that ends with ``<think>`` opened the reasoning (DeepSeek-R1, QwQ, Qwen3's
  thinking-2507 models): the output is reasoning up to ``</think>`` and the answer after it; an
  output cut before ``</think>`` is reasoning only;
- any other prompt (Qwen3, whose model opens ``<think>`` itself; Qwen3 with
  ``enable_thinking: false``, whose template closes an empty one in the prompt): an output that
  begins with ``<think>`` is reasoning up to ``</think>``, any other is all content.

``deepseek_r1`` and ``qwen3`` (vLLM's names for these models' parsers) both read the tags so.
Tool calls are read from the content alone; a structured output's grammar applies from the end
of the reasoning when the prompt opened it (``SamplingParams.structured_after``), else from the
first token.
"""

from __future__ import annotations

from engine.serve.openai_protocol import tag_tail

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def opened(prompt_tail: str) -> bool:
    """Whether a prompt ending with ``prompt_tail`` opened the reasoning."""
    return prompt_tail.rstrip().endswith(START)


def split(text: str, opened: bool) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole output (None where empty)."""
    r, c = Stream(opened).feed(text, final=True)
    return r or None, c or None


class Stream:
    """One choice's text as it streams: ``feed`` says which new part is reasoning and which is
    content, holding back what cannot be told yet (a tail that may begin ``</think>``, an output
    that may still begin with ``<think>``). The pieces of a stream join into ``split``'s parts."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.state = "start"  # then "reasoning", then "content"
        self.buf = ""
        self.content = ""  # all of the content so far

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` that may go out now of what came so far plus ``text``;
        ``final``: the output ended, everything goes out."""
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(START):
                self.buf, self.state = head[len(START):], "reasoning"
            elif START.startswith(head) and not final:
                return "", ""  # (may still begin with <think>)
            else:
                self.state = "reasoning" if self.opened else "content"
        if self.state == "reasoning":
            at = self.buf.find(END)
            if at >= 0:
                reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(END):], "content"
            else:
                keep = 0 if final else tag_tail(self.buf, END)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if self.state == "content":
            content, self.buf = self.buf, ""
            self.content += content
        return reasoning, content


def reasoning_tokens(ids: list[int], decode, opened: bool) -> int:
    """How many of an output's tokens ``ids`` are its reasoning: through the one that completes
    ``</think>`` (all of them if it never closes); none for an output without reasoning."""
    text = decode(ids)
    if not (opened or text.lstrip().startswith(START)):
        return 0
    if END not in text:
        return len(ids)
    lo, hi = 1, len(ids)  # the fewest tokens whose text holds END (it only grows with more tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if END in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
