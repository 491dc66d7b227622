"""Model-based test: TieredStore against a plain dict, with capacities small enough
that every run evicts, demotes, promotes and drops.

The model learns of drops from the store's events, so every read must match it
exactly; a held read lease must keep its bytes whatever else happens.
"""

import shutil
import tempfile

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.config import StoreConfig
from kvstore.errors import ResourceExhaustedError
from kvstore.store import Tier, TieredStore

SLOT = 4096
KEYS = [b"k%d" % i for i in range(12)]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="crescent-hyp-")
        self.model: dict[bytes, bytes] = {}
        self.leases = []  # (lease, bytes it must keep showing)
        self.version = 0
        self.store = TieredStore(
            StoreConfig(dram=6 * SLOT, slot_size=SLOT, disk=self.dir, disk_size=160 << 10,
                        high_watermark=0.9, low_watermark=0.6),
            listener=self._on_event)

    def _on_event(self, ev):
        if ev.kind == "removed" and ev.reason in ("evicted", "corrupt"):
            self.model.pop(ev.key, None)

    def _value(self, key, size):
        self.version += 1
        head = key + b"#%d#" % self.version
        return (head * (size // len(head) + 1))[:size]

    @rule(key=st.sampled_from(KEYS), size=st.sampled_from([0, 1, 100, SLOT - 1, SLOT, SLOT + 1, 2 * SLOT + 7, 7 * SLOT]))
    def put(self, key, size):
        value = self._value(key, size)
        try:
            self.store.put(key, value)
        except ResourceExhaustedError:
            return  # no room anywhere: the old value (if any) stays, as the model has it
        self.model[key] = value

    @rule(key=st.sampled_from(KEYS))
    def get(self, key):
        assert self.store.get(key) == self.model.get(key)

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key):
        assert self.store.delete([key]) == (1 if key in self.model else 0)
        self.model.pop(key, None)

    @precondition(lambda self: len(self.leases) < 3)
    @rule(key=st.sampled_from(KEYS))
    def acquire(self, key):
        lease = self.store.acquire(key)
        assert (lease is None) == (key not in self.model)
        if lease is not None:
            assert b"".join(lease.views) == self.model[key]
            self.leases.append((lease, self.model[key]))

    @precondition(lambda self: self.leases)
    @rule(i=st.integers(0, 2))
    def release(self, i):
        lease, expected = self.leases.pop(i % len(self.leases))
        assert b"".join(lease.views) == expected, "leased bytes changed under the reader"
        self.store.release(lease)

    @rule(key=st.sampled_from(KEYS), ttl=st.sampled_from([0.0, 3600.0]))
    def pin(self, key, ttl):
        assert self.store.pin([key], ttl) == (1 if key in self.model else 0)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def lookup(self, keys):
        n, tiers = self.store.lookup(keys)
        expected = 0
        while expected < len(keys) and keys[expected] in self.model:
            expected += 1
        assert n == expected and len(tiers) == n

    @invariant()
    def index_matches_model(self):
        assert self.store.exists(KEYS) == [k in self.model for k in KEYS]
        for lease, expected in self.leases:
            assert b"".join(lease.views) == expected

    @invariant()
    def accounting_is_consistent(self):
        s = self.store.stats()
        dram = s["tiers"][Tier.DRAM]
        assert dram["used_bytes"] <= dram["capacity_bytes"]
        assert sum(t["num_entries"] for t in s["tiers"].values()) == len(self.model)
        assert s["num_leases"] == len(self.leases)

    def teardown(self):
        for lease, _ in self.leases:
            self.store.release(lease)
        assert self.store.stats()["tiers"][Tier.DRAM]["used_bytes"] == sum(
            -(-len(v) // SLOT) * SLOT if len(v) else SLOT
            for k, v in self.model.items() if self.store.tier_of(k) is Tier.DRAM)
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=80, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestTieredStore = StoreMachine.TestCase
