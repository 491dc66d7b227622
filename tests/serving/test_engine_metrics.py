"""An engine's Prometheus endpoint: TTFT/ITL histograms, queue depth and KV pages, by role."""

import urllib.request

import grpc

from engine.config import EngineConfig
from engine.serve.engine_server import EngineNode
from proto.crescent.v1 import engine_pb2 as pb
from proto.crescent.v1 import engine_pb2_grpc as pb_grpc


def test_engine_metrics_split_by_role():
    node = EngineNode("decode", EngineConfig(model="random:tiny", kv_cache_memory=16 << 20), metrics_port=0)
    node.start()
    port = node.metrics_port
    try:
        with grpc.insecure_channel(node.address) as ch:
            req = pb.GenerateRequest(prompt_token_ids=list(range(3, 40)),
                                     sampling=pb.SamplingOptions(max_tokens=5, ignore_eos=True))
            tokens = [t for msg in pb_grpc.EngineStub(ch).Generate(req, timeout=120) for t in msg.token_ids]
        assert len(tokens) == 5
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        assert 'crescent_engine_ttft_seconds_count{role="decode"} 1.0' in text
        assert 'crescent_engine_itl_seconds_count{role="decode"} 4.0' in text
        assert 'crescent_engine_requests_total{reason="length",role="decode"} 1.0' in text
        assert 'crescent_engine_queue_depth{role="decode",state="running"} 0.0' in text
        assert 'crescent_engine_kv_pages{role="decode",state="used"} 0.0' in text
    finally:
        node.stop()


def test_engine_reports_decode_steps_and_output_lengths_to_the_conductor():
    """What P:D sizing reads: decode steps (batch, context, seconds) and tokens generated per request,
    carried by the engine's heartbeats; a step that computed prompt tokens is not a decode sample."""
    from kvstore.conductor.config import ConductorConfig
    from kvstore.conductor.service import Conductor
    from tests.helpers import wait_for

    conductor = Conductor(ConductorConfig(listen="127.0.0.1:0", heartbeat_interval=0.1, dead_timeout=30)).start()
    node = EngineNode("decode", EngineConfig(model="random:tiny", kv_cache_memory=16 << 20,
                                             conductor=conductor.address)).start()
    try:
        with grpc.insecure_channel(node.address) as ch:
            stub = pb_grpc.EngineStub(ch)
            for n in (5, 9):
                req = pb.GenerateRequest(prompt_token_ids=list(range(3, 40)),
                                         sampling=pb.SamplingOptions(max_tokens=n, ignore_eos=True))
                assert sum(len(m.token_ids) for m in stub.Generate(req, timeout=120)) == n
        member = f"decode@{node.address}"

        def reported():
            m = conductor.members.get(member)
            return m is not None and m.engine_load.num_finished == 2 and m
        m = wait_for(reported, what="the engine's heartbeat with both requests finished")
        assert m.engine_load.num_generated_tokens == 14
        # One prefill step per request (it samples the first token), the other tokens come from decode steps.
        assert m.decode_tokens == 12 and m.decode_seconds > 0
        assert len(conductor._decode_window.samples) == 12
        assert all(s.num_seqs == 1 and s.num_context_tokens >= 37 for s in conductor._decode_window.samples)
    finally:
        node.stop()
        conductor.stop(0)


def test_streams_past_the_batch_wait_in_the_engines_queue_and_probes_are_answered():
    """70 Generate streams at an engine that runs 4 at a time: the other 66 wait in the engine's own
    queue, where its load reports (and so the conductor) count them, and health probes are answered.
    Each stream holds one of the gRPC server's threads; with 64, the 65th call and every one after it
    (health probes too: a liveness probe would have restarted the engine) waited unseen behind them."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.helpers import wait_for

    node = EngineNode("decode", EngineConfig(model="random:tiny", kv_cache_memory=16 << 20, max_num_seqs=4)).start()
    calls = []
    try:
        with grpc.insecure_channel(node.address) as ch:
            stub = pb_grpc.EngineStub(ch)
            for i in range(70):
                calls.append(stub.Generate(pb.GenerateRequest(
                    prompt_token_ids=[3, 4, 5, 6 + i], sampling=pb.SamplingOptions(max_tokens=1000, ignore_eos=True)),
                    timeout=600))
            load = wait_for(lambda: (lambda x: x.num_running + x.num_waiting == 70 and x)(node.engine.load()),
                            timeout_s=120, what="all 70 requests in the engine, running or waiting")
            assert load.num_running <= 4 and load.num_waiting >= 66
            in_flight = lambda: node.metrics.registry.get_sample_value(  # noqa: E731
                "crescent_engine_rpcs_in_flight", {"role": "decode"})
            assert in_flight() >= 70
            assert stub.Health(pb.EngineHealthRequest(), timeout=30).serving
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            for c in calls:
                c.cancel()
            wait_for(lambda: in_flight() == 0, timeout_s=120, what="every cancelled stream out of the gauge")
    finally:
        node.stop()
