"""CUDA tensors as sources and destinations: through pinned host buffers, on CUDA streams.

A one-sided mover copies between host addresses; a CUDA tensor is reached
through ``depth`` pinned staging buffers of ``chunk_bytes``: the host copy of
chunk k (arena → pinned, by the mover) overlaps the DMA of chunk k-1 (pinned →
device) on another stream. The reverse direction issues the DMA of chunk k+1
before draining chunk k into the arena.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Fill = Callable[[int, int, int], None]
"""``fill(host_addr, value_offset, length)``: moves value bytes to or from a host address."""


def is_cuda(buf) -> bool:
    return getattr(buf, "is_cuda", False) is True


def _flat_bytes(t):
    import torch

    if not t.is_contiguous():
        raise ValueError("the CUDA tensor must be contiguous")
    return t.reshape(-1).view(torch.uint8)


class CudaStaging:
    """Pinned staging buffers and streams for one client; one transfer at a time.

    Raises:
        RuntimeError: torch sees no CUDA device.
    """

    def __init__(self, chunk_bytes: int = 8 << 20, depth: int = 2) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("CUDA tensors need a CUDA device; torch sees none")
        self._torch = torch
        self.chunk_bytes = chunk_bytes
        self._bufs = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self._by_device: dict = {}
        self._lock = threading.Lock()

    def _streams_of(self, device) -> list:
        """``depth`` streams on the tensor's own GPU (made on its first transfer). A stream of
        another GPU would not order the copy: ``copy_`` into a tensor on GPU 1 runs on GPU 1's
        current stream, so an event on a GPU 0 stream would say done before the DMA that still
        reads the buffer."""
        streams = self._by_device.get(device)
        if streams is None:
            streams = self._by_device[device] = [self._torch.cuda.Stream(device) for _ in self._bufs]
        return streams

    def to_device(self, dst, nbytes: int, fill: Fill) -> None:
        """Writes ``nbytes`` value bytes into CUDA tensor ``dst``; ``fill`` puts each chunk in pinned memory."""
        torch = self._torch
        out = _flat_bytes(dst)
        assert nbytes <= out.numel()
        with self._lock:
            events = [None] * len(self._bufs)
            streams = self._streams_of(dst.device)
            caller = torch.cuda.current_stream(dst.device)
            for s in streams:
                s.wait_stream(caller)  # earlier work on dst comes first
            for k, off in enumerate(range(0, nbytes, self.chunk_bytes)):
                b = k % len(self._bufs)
                n = min(self.chunk_bytes, nbytes - off)
                if events[b] is not None:
                    events[b].synchronize()  # its previous DMA has read the buffer
                fill(self._bufs[b].data_ptr(), off, n)
                with torch.cuda.stream(streams[b]):
                    out[off : off + n].copy_(self._bufs[b][:n], non_blocking=True)
                    events[b] = torch.cuda.Event()
                    events[b].record(streams[b])
            for ev in events:
                if ev is not None:
                    ev.synchronize()

    def from_device(self, src, nbytes: int, drain: Fill) -> None:
        """Reads ``nbytes`` from CUDA tensor ``src``; ``drain`` takes each chunk from pinned memory."""
        torch = self._torch
        inp = _flat_bytes(src)
        assert nbytes <= inp.numel()
        with self._lock:
            streams = self._streams_of(src.device)
            caller = torch.cuda.current_stream(src.device)
            offs = list(range(0, nbytes, self.chunk_bytes))
            events = []

            def issue(k: int) -> None:
                b, off = k % len(self._bufs), offs[k]
                n = min(self.chunk_bytes, nbytes - off)
                s = streams[b]
                s.wait_stream(caller)
                with torch.cuda.stream(s):
                    self._bufs[b][:n].copy_(inp[off : off + n], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(s)
                events.append(ev)

            if offs:
                issue(0)
            for k, off in enumerate(offs):
                if k + 1 < len(offs):
                    issue(k + 1)  # the next DMA runs while this chunk drains
                events[k].synchronize()
                drain(self._bufs[k % len(self._bufs)].data_ptr(), off, min(self.chunk_bytes, nbytes - off))


def host_to_cuda(dst, src_view: memoryview) -> None:
    """Copies host bytes into CUDA tensor ``dst`` (the streamed movers' CUDA path)."""
    import torch

    out = _flat_bytes(dst)
    host = torch.frombuffer(src_view, dtype=torch.uint8) if src_view.nbytes else None
    if host is not None:
        out[: src_view.nbytes].copy_(host.pin_memory(), non_blocking=False)
