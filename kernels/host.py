"""Small host lists as device tensors, without waiting for the device."""

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
