"""Host memory for the device: small host lists as device tensors without waiting for the device,
and page-locking memory that something else allocated (the node's arena mapping)."""

from __future__ import annotations

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


CUDA_HOST_REGISTER_PORTABLE_MAPPED = 1 | 2
"""``cudaHostRegisterPortable | cudaHostRegisterMapped``: page-locked for every device's context
(a TP worker's GPU is often not device 0) and mapped into the device's address space, so that a
kernel can read the bytes in place (``kv_pages`` asks the driver for the device alias)."""


def register_host_memory(address: int, nbytes: int) -> str | None:
    """Page-locks ``nbytes`` of host memory at ``address`` for CUDA (``cudaHostRegister``; the pages
    stay their owner's), so that device copies from and to it are DMA. None when done, else why not
    (the caller then copies through the driver's staging, slower but correct).

    A failed registration leaves no error behind. The runtime records it as the thread's last error,
    and torch checks every kernel launch with ``cudaGetLastError``: the next kernel on this thread,
    however unrelated, would raise it.
    """
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
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


def unregister_host_memory(address: int) -> None:
    """Undoes :func:`register_host_memory` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(address)
