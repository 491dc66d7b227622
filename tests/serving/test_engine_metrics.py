"""An engine's Prometheus endpoint: TTFT/ITL histograms, queue depth and KV pages, by role."""

import socket
import urllib.request

import grpc

from engine.config import EngineConfig
from engine.serve.engine_server import EngineNode
from proto.crescent.v1 import engine_pb2 as pb
from proto.crescent.v1 import engine_pb2_grpc as pb_grpc


def test_engine_metrics_split_by_role():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = EngineNode("decode", EngineConfig(model="random:tiny", kv_cache_memory=16 << 20), metrics_port=port)
    node.start()
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
