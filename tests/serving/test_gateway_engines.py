"""The gateway's engine channels: those named at start stay, others close once idle."""

import pytest

from engine.config import EngineConfig
from engine.serve.engine_server import EngineNode
from engine.serve.gateway import Engines
from proto.crescent.v1 import engine_pb2 as pb


class Clock:
    """The time the channels' idleness is judged by, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engines():
    nodes = [EngineNode("decode", EngineConfig(model="random:tiny", kv_cache_memory=8 << 20)).start()
             for _ in range(3)]
    yield nodes
    for n in nodes:
        n.stop()


def test_channels_to_engines_routed_to_close_once_idle_and_named_ones_stay(engines):
    """An autoscaler's engines come back at new addresses: a gateway that runs for months kept a
    channel, and the engine's model facts, for every engine it ever called."""
    named, routed, other = engines
    clock = Clock()
    e = Engines([named.address], idle_s=900, clock=clock)
    try:
        assert e[named.address].Health(pb.EngineHealthRequest(), timeout=30).serving
        stub = e[routed.address]
        h = stub.Health(pb.EngineHealthRequest(), timeout=30)
        assert h.serving and h.max_model_len > 0 and h.eos_token_ids
        eos, context, vocab = e.model(routed.address, timeout_s=30)
        assert (eos, context, vocab) == (frozenset(h.eos_token_ids), h.max_model_len, h.vocab_size)
        assert sorted(e.addresses()) == sorted([named.address, routed.address])

        clock.now += 600
        e[other.address]  # routed's channel is 600 s idle: it stays
        assert routed.address in e.addresses()
        clock.now += 301
        e[other.address]  # 901 s: it closes, and what was learnt of its engine goes with it
        assert sorted(e.addresses()) == sorted([named.address, other.address])
        assert routed.address not in e._models
        with pytest.raises(ValueError, match="closed channel"):
            stub.Health(pb.EngineHealthRequest(), timeout=30)

        clock.now += 10_000  # the named engine, idle as long as any, keeps its channel
        e[other.address]
        assert named.address in e.addresses()
        assert e.health(timeout_s=30) == {named.address: True}
        # the engine routed to again gets a new channel
        assert e[routed.address].Health(pb.EngineHealthRequest(), timeout=30).serving
        assert e.model(routed.address, timeout_s=30) == (eos, context, vocab)
    finally:
        e.close()


def test_a_channel_in_use_is_never_closed_under_its_calls(engines):
    """Every call the gateway makes has a deadline under ``idle_s``; a channel asked for again is
    not idle however long ago it opened."""
    _, routed, _ = engines
    clock = Clock()
    e = Engines([], idle_s=900, clock=clock)
    try:
        for _ in range(20):
            clock.now += 200  # asked for every 200 s: never 900 s idle
            call = e[routed.address].Generate(pb.GenerateRequest(
                prompt_token_ids=[3, 4, 5], sampling=pb.SamplingOptions(max_tokens=2, ignore_eos=True)), timeout=60)
            assert sum(len(m.token_ids) for m in call) == 2
        assert e.addresses() == [routed.address]
    finally:
        e.close()
