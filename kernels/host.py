"""Host memory for the device: small host lists as device tensors without waiting for the device,
and page-locking memory that something else allocated (the node's arena mapping)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch


def to_device(values: Sequence[int] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a list, or a CPU tensor) as a ``dtype`` tensor on ``device``, queued on the
    current stream.

    ``torch.tensor(values, device=cuda)`` copies from pageable memory and synchronises the
    current stream: the host waits for every kernel queued on it (on a transfer stream that
    waits for the compute stream, for the step in flight). Through page-locked memory the copy
    is asynchronous; the pinned allocator keeps the block until the copy has run. Use the
    result on the current stream (or after synchronising with it).
    """
    t = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def one_intra_op_thread() -> None:
    """Gives the calling side thread (lander, loader, saver, fetcher) one intra-op thread: its torch
    ops run beside the forward, whose OpenMP team has the cores.

    A side thread with a team of its own is worse than slow: libgomp then manages more threads
    than there are CPUs and cuts every team's spinning at barriers to almost nothing, so the
    forward's threads sleep and wake at each of its ops. Measured in vLLM on 2 cores: its two
    forward threads went from 26 and 41 voluntary context switches in a run to 12,891 and 17,511
    with an idle lander alive, and the run took a few percent longer. In this project's engine on
    2 cores: 224 small page writes (a load's landing) took 4.3 ms, 23.6 ms once another thread had
    run one parallel op; a decode step of ``random:small`` 1.2-1.5 ms, 2.0 ms. Calls torch's own setter:
    vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op (its threads are bound), and
    the count set here is the calling thread's only (libgomp's is per thread)."""
    torch._C.set_num_threads(1)


CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2
"""``cudaHostRegisterPortable | cudaHostRegisterMapped``: page-locked for every device's context
(a TP worker's GPU is often not device 0) and mapped into the device's address space, so that a
kernel can read the bytes in place (``kv_pages`` asks the driver for the device alias)."""


def register_host_memory(address: int, nbytes: int, device: torch.device | int | None = None) -> str | None:
    """Page-locks ``nbytes`` of host memory at ``address`` for CUDA (``cudaHostRegister``; the pages
    stay their owner's), so that device copies from and to it are DMA. None when done, else why not
    (the caller then copies through the driver's staging, slower but correct).

    ``device`` is the GPU the copies serve (default: this thread's current one). The call runs in
    its context: a thread that set no device would otherwise make a context on GPU 0 (hundreds of
    MiB of its memory) for an engine on another GPU.

    A failed registration leaves no error behind. The runtime records it as the thread's last error,
    and torch checks every kernel launch with ``cudaGetLastError``: the next kernel on this thread,
    however unrelated, would raise it.
    """
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    with torch.cuda.device(device):
        return _register(address, nbytes)


def _register(address: int, nbytes: int) -> str | None:
    try:
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
    except Exception as exc:  # noqa: BLE001 - an old torch, a driver without it: stage instead
        return f"cudaHostRegister unavailable: {exc}"
    if int(err) == 0:
        return None
    try:
        why = f"cudaHostRegister failed: {torch.cuda.cudart().cudaGetErrorString(err)} ({int(err)})"
    except Exception:  # noqa: BLE001 - the message is a courtesy
        why = f"cudaHostRegister failed: error {int(err)}"
    # NOTE: torch exposes no cudaGetLastError; a kernel launch's check reads (and so clears) it.
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass
    return why


def unregister_host_memory(address: int, device: torch.device | int | None = None) -> None:
    """Undoes :func:`register_host_memory` (before the memory is unmapped), in ``device``'s context."""
    with torch.cuda.device(device):
        torch.cuda.cudart().cudaHostUnregister(address)


class HostSlab:
    """``nbytes`` of host memory in one anonymous mapping (exactly that, page-rounded), page-locked
    for CUDA when ``pin`` and a device is there: ``tensor`` is a uint8 tensor over all of it.

    Staging pools take their buffers as slices of one slab. Each ``pin_memory`` allocation is
    rounded up to a power of two by torch's pinned allocator: a 32 MiB chunk plus its header pinned
    64 MiB, so the pools held about twice the host memory they used. Registered
    (:func:`register_host_memory`) the mapping is locked as it is; copies from and to it are DMA
    as from ``pin_memory``'s. If registration fails, the slab falls back to one ``pin_memory``
    allocation (rounded, but page-locked); ``pinned`` says whether it is page-locked at all.

    ``close`` (or the slab's collection, or the process's exit) waits for the device's queued work,
    which may still read or write the slab, and then unregisters it.
    """

    def __init__(self, nbytes: int, pin: bool, device: torch.device | None = None) -> None:
        """
        Args:
            pin: page-lock it (when a CUDA device is there).
            device: the GPU whose copies read and write it (default: the current one).
        """
        import mmap
        import weakref

        if nbytes <= 0:
            raise ValueError("a host slab needs a positive size")
        self.nbytes = nbytes
        self.pinned = False
        self.why_not_registered: str | None = None
        # NOTE: populated now (the pages faulted in at start, not by the first load that fills them)
        buf = mmap.mmap(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
        self.tensor = torch.frombuffer(buf, dtype=torch.uint8)
        address, index = 0, -1
        if pin:
            self.why_not_registered = register_host_memory(self.tensor.data_ptr(), nbytes, device)
            if self.why_not_registered is None:
                address, self.pinned = self.tensor.data_ptr(), True
                with torch.cuda.device(device):
                    index = torch.cuda.current_device()
            elif torch.cuda.is_available():
                self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
        self._release = weakref.finalize(self, _release_slab, address, index, self.tensor, os.getpid())

    def close(self) -> None:
        self._release()


def _release_slab(address: int, device: int, tensor: torch.Tensor, owner_pid: int) -> None:
    """Unregisters a slab's mapping once ``device`` (current when it was registered: the one whose
    copies read and write it) is done with it. ``tensor`` (held until this runs) keeps the mapping
    alive: unmapped while registered, its pages would stay locked. Not every device: that would
    make a context on each GPU of the host that this process never used. A forked child that
    exits runs this too, and has no CUDA of its own to unregister with."""
    if not address or os.getpid() != owner_pid:
        return
    try:
        torch.cuda.synchronize(device)
        unregister_host_memory(address, device)
    except Exception:  # noqa: BLE001 - at exit the runtime may be gone; the process frees it all
        pass
