"""Drives an LLMEngine from one thread; other threads submit requests and read their tokens.

All engine state is touched by the loop thread only: gRPC handlers put
commands in an inbox and read events from a per-request queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Handle:
    """A submitted request: read ``events`` for ``("token", id)``, ``("done", reason)``, ``("error", msg)``
    (the request itself was refused) or ``("failed", msg)`` (a step failed under it: not its fault).
    With ``params.logprobs``, ``logprobs`` holds one ``TokenLogprobs`` per token, appended before
    its event."""

    events: queue.Queue = field(default_factory=queue.Queue)
    logprobs: list = field(default_factory=list)
    seq: Sequence | None = None
    aborted: bool = False


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_token=None, on_finish=None, on_step=None,
                 on_step_time=None) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._handles: dict[int, Handle] = {}
        self._stop = threading.Event()
        self._on_token = on_token  # callback(seq, now) for metrics
        self._on_finish = on_finish
        self._on_step = on_step  # callback() after each step and each command batch (load reports)
        self._on_step_time = on_step_time  # callback(seconds, prefill_tokens) after each step that ran (metrics)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.num_requests = 0

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the loop; every request still in it, or still queued, ends with ``failed``, so
        that no caller waits on it forever."""
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        left = list(self._handles.values())
        self._handles.clear()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd is not None and cmd[0] == "add":
                left.append(cmd[1])
        for h in left:
            h.events.put(("failed", "the engine stopped"))

    def submit(self, prompt: list[int], params: SamplingParams, cache_salt: str | None = None,
               output_prefix: list[int] | None = None, prefetched: dict | None = None,
               replicate: bool = False, prefetch_skip: int = 0) -> Handle:
        """Queues a request; raises ValueError at once for one the engine cannot serve."""
        self.engine.validate(prompt, params)
        h = Handle()
        self._inbox.put(("add", h, (prompt, params, cache_salt, output_prefix, prefetched, replicate,
                                    prefetch_skip)))
        return h

    def abort(self, h: Handle) -> None:
        """Stops a request and frees its pages (e.g. its client went away). Idempotent."""
        if not h.aborted:
            h.aborted = True
            self._inbox.put(("abort", h, None))

    def _handle_command(self, cmd) -> None:
        op, h, args = cmd
        if op == "add":
            if h.aborted:  # (aborted before it was added: its caller still waits for an end)
                h.events.put(("done", "abort"))
                return
            try:
                seq = self.engine.add_request(*args)
            except ValueError as exc:
                h.events.put(("error", str(exc)))
                return
            h.seq = seq
            self.num_requests += 1
            self._handles[seq.seq_id] = h
        elif op == "abort" and h.seq is not None and h.seq.seq_id in self._handles:
            del self._handles[h.seq.seq_id]
            self.engine.abort(h.seq.seq_id)
            h.events.put(("done", "abort"))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                block = not self.engine.has_work()
                cmd = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
                if cmd is None:
                    continue
                self._handle_command(cmd)
                while True:  # drain whatever else arrived
                    self._handle_command(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_work():
                if self._on_step:
                    self._on_step()
                continue
            t0 = time.perf_counter()
            try:
                outs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
                log.exception("engine step failed")
                for h in list(self._handles.values()):
                    h.events.put(("failed", f"engine step failed: {exc}"))
                    self.engine.abort(h.seq.seq_id)
                self._handles.clear()
                continue
            now = time.perf_counter()
            if self._on_step_time and self.engine.last_step_prefill_tokens is not None:
                self._on_step_time(now - t0, self.engine.last_step_prefill_tokens)
            if self._on_step:
                self._on_step()
            for o in outs:
                h = self._handles.get(o.seq.seq_id)
                if h is None:
                    continue
                if self._on_token:
                    self._on_token(o.seq, now)
                if o.logprobs is not None:
                    h.logprobs.append(o.logprobs)
                h.events.put(("token", o.token))
                if o.finished:
                    del self._handles[o.seq.seq_id]
                    if self._on_finish:
                        self._on_finish(o.seq, now)
                    h.events.put(("done", o.seq.finish_reason))
