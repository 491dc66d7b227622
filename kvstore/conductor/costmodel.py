"""Cost model: how long a prefill, a KV transfer and a decode step take.

The defaults model one documented hardware profile (``HardwareProfile()``): a
LLaMA2-70B-shaped model (80 layers, GQA with 8 KV heads of 128, bf16) served
with tensor parallelism 8 on one 8×H800-80GB node, its host DRAM holding the
node's share of the KV pool, and an RDMA network of 4×200 Gbps per node. Every
number and how it was derived is in docs/conductor.md ("Cost model"). A JSON
file of ``HardwareProfile`` fields replaces it (``--profile``), and the live
conductor refits the prefill part from the prefill times engines measure
(``CostModel.fit``).

Prefill of ``n`` new tokens after ``c`` cached ones:
``t = overhead + per_token·n + per_pair·(n·c + n²/2)`` — the linear layers
cost the same per token, causal attention costs per (query, key) pair.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.store import Tier


@dataclass(frozen=True)
class HardwareProfile:
    """The hardware and model a cost model describes (defaults: 8×H800, LLaMA2-70B shape)."""

    name: str = "8xH800-llama2-70b"
    """A label for reports."""
    kv_bytes_per_token: int = 327_680
    """KV bytes per token: 80 layers × (K, V) × 8 KV heads × 128 × 2 bytes (bf16)."""
    prefill_overhead_s: float = 0.03
    """Fixed cost of one prefill (launches, scheduling, sampling)."""
    prefill_s_per_token: float = 3.5e-5
    """Linear-layer cost per new token: 2 × 69e9 FLOP at about 4 PFLOP/s (8 × 989 TFLOP/s bf16 at 50% MFU)."""
    prefill_s_per_pair: float = 6.5e-10
    """Attention cost per (query, key) pair: 4 × 8192 × 80 FLOP at the same rate."""
    decode_step_s: float = 0.0075
    """Fixed cost of one decode step: reading 140 GB of weights at about 19 TB/s (8 × 3.35 TB/s at 70%)."""
    decode_s_per_seq: float = 3.5e-5
    """Decode compute per sequence in the batch (one token's linear layers)."""
    decode_s_per_context_token: float = 1.75e-8
    """Decode cost per token of context in the batch (reading its KV at about 19 TB/s)."""
    decode_kv_capacity_tokens: int = 1_400_000
    """KV tokens one decode instance holds: (640 GB HBM − 140 GB weights − 40 GB work space) / KV bytes per token."""
    local_bandwidth: float = 100e9
    """Bytes/s from the node's own DRAM into its GPUs (8 PCIe 5.0 x16 links, conservatively)."""
    network_bandwidth: float = 80e9
    """Bytes/s from another node's DRAM (4×200 Gbps RDMA, 80% efficiency)."""
    disk_bandwidth: float = 6e9
    """Bytes/s reading a chunk from a node's NVMe tier."""
    transfer_latency_s: float = 0.001
    """Setup cost of one transfer."""

    @classmethod
    def load(cls, path: str) -> HardwareProfile:
        """Reads a JSON object of field values; unknown fields are an error.

        Raises:
            ValueError: unreadable file, not an object, unknown field or bad value.
        """
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read the profile {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"the profile {path} must hold a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"the profile {path} has unknown fields: {', '.join(unknown)}")
        profile = cls(**data)
        for f in dataclasses.fields(cls):
            v = getattr(profile, f.name)
            if f.name == "name":
                continue
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"profile field {f.name} must be a finite number >= 0, got {v!r}")
            if f.name.endswith("_bandwidth") and v == 0:  # transfer_s divides by it
                raise ValueError(f"profile field {f.name} must be > 0, got {v!r}")
        return profile


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One measured prefill."""

    num_new_tokens: int
    num_cached_tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One measured decode step (no prompt tokens in it)."""

    num_seqs: int
    num_context_tokens: int
    seconds: float


def _nnls(cols: np.ndarray, t: np.ndarray) -> np.ndarray | None:
    """Least squares with every coefficient >= 0 (active set; a handful of unknowns); None if degenerate."""
    k = cols.shape[1]
    active = list(range(k))
    coef = np.zeros(k)
    # NOTE: a coefficient the data would make negative is fixed at 0 and the
    # rest refitted; a negative per-token cost would make the scheduler prefer
    # longer prompts (or bigger batches).
    while active:
        sol, *_ = np.linalg.lstsq(cols[:, active], t, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active = [a for a, v in zip(active, sol) if v > 0]
    if not active or not np.isfinite(coef).all():
        return None
    return coef


def load_prefill_samples(path: str) -> tuple[PrefillSample, ...]:
    """Reads measured prefills: JSONL of ``{"num_new_tokens", "num_cached_tokens", "seconds"}``.

    Raises:
        ValueError: an unreadable file or a malformed line (named by number).
    """
    out = []
    try:
        f = open(path)
    except OSError as exc:
        raise ValueError(f"cannot read the prefill samples {path}: {exc.strerror or exc}") from None
    with f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                sample = PrefillSample(int(obj["num_new_tokens"]), int(obj.get("num_cached_tokens", 0)),
                                       float(obj["seconds"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                raise ValueError(f"{path}:{num}: expected {{\"num_new_tokens\": N, \"num_cached_tokens\": C, "
                                 f"\"seconds\": S}}") from None
            if sample.num_new_tokens <= 0 or sample.num_cached_tokens < 0 or not sample.seconds > 0:
                raise ValueError(f"{path}:{num}: counts must be >= 0 (new > 0) and seconds > 0")
            out.append(sample)
    return tuple(out)


class CostModel:
    """Times of prefill, transfer and decode under a profile; the prefill part can be refitted."""

    def __init__(self, profile: HardwareProfile | None = None) -> None:
        self.profile = profile or HardwareProfile()
        p = self.profile
        self.coefficients: tuple[float, float, float] = (
            p.prefill_overhead_s, p.prefill_s_per_token, p.prefill_s_per_pair)
        self.num_samples = 0
        self.decode_coefficients: tuple[float, float, float] = (
            p.decode_step_s, p.decode_s_per_seq, p.decode_s_per_context_token)
        self.num_decode_samples = 0

    def prefill_s(self, num_new: int, num_cached: int = 0) -> float:
        """Seconds to prefill ``num_new`` tokens after ``num_cached`` cached ones."""
        c0, c1, c2 = self.coefficients
        return c0 + c1 * num_new + c2 * (num_new * num_cached + 0.5 * num_new * num_new)

    def queue_s(self, num_queued_tokens: int, num_waiting: int) -> float:
        """Seconds of prefill work already queued (linear part: the queue's attention is unknown)."""
        c0, c1, _ = self.coefficients
        return c0 * num_waiting + c1 * num_queued_tokens

    def transfer_s(self, num_tokens: int, tier: Tier, remote: bool,
                   kv_bytes_per_token: int | None = None) -> float:
        """Seconds to bring ``num_tokens`` tokens of KV from ``tier`` of a (remote or local) node."""
        if num_tokens <= 0:
            return 0.0
        p = self.profile
        bw = p.network_bandwidth if remote else p.local_bandwidth
        if tier is Tier.DISK:
            bw = min(bw, p.disk_bandwidth)
        return p.transfer_latency_s + num_tokens * (kv_bytes_per_token or p.kv_bytes_per_token) / bw

    def tbt_s(self, num_running: int, num_context_tokens: int) -> float:
        """Seconds per decode step with ``num_running`` sequences; inf past the KV capacity."""
        if num_context_tokens > self.profile.decode_kv_capacity_tokens:
            return math.inf
        d0, d1, d2 = self.decode_coefficients
        return d0 + d1 * num_running + d2 * num_context_tokens

    def fit(self, samples: Sequence[PrefillSample]) -> bool:
        """Refits the prefill coefficients to measured samples by non-negative least squares.

        Needs at least 3 samples; with fewer, or a degenerate set, the model is
        unchanged. Returns whether it changed.
        """
        if len(samples) < 3:
            return False
        n = np.array([s.num_new_tokens for s in samples], dtype=np.float64)
        c = np.array([s.num_cached_tokens for s in samples], dtype=np.float64)
        t = np.array([s.seconds for s in samples], dtype=np.float64)
        cols = np.stack([np.ones_like(n), n, n * c + 0.5 * n * n], axis=1)
        coef = _nnls(cols, t)
        if coef is None or coef[1] <= 0:
            return False
        self.coefficients = (float(coef[0]), float(coef[1]), float(coef[2]))
        self.num_samples = len(samples)
        return True

    def fit_decode(self, samples: Sequence[DecodeSample]) -> bool:
        """Refits the decode step model (fixed + per sequence + per context token) to measured steps.

        Needs at least 3 samples; with fewer, or a degenerate set (e.g. every
        step the same batch), the model is unchanged. Returns whether it changed.
        """
        if len(samples) < 3:
            return False
        b = np.array([s.num_seqs for s in samples], dtype=np.float64)
        c = np.array([s.num_context_tokens for s in samples], dtype=np.float64)
        t = np.array([s.seconds for s in samples], dtype=np.float64)
        coef = _nnls(np.stack([np.ones_like(b), b, c], axis=1), t)
        if coef is None or not coef.any():
            return False
        self.decode_coefficients = (float(coef[0]), float(coef[1]), float(coef[2]))
        self.num_decode_samples = len(samples)
        return True
