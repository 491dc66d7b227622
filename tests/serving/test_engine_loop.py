"""The engine loop between gRPC handlers and the engine: every request handed to it ends with an
event its handler is waiting for, however it ends (a handler that waits forever holds a server
thread, and a server's stop, with it)."""

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.serve.loop import EngineLoop


def _loop() -> EngineLoop:
    return EngineLoop(LLMEngine(EngineConfig(model="random:tiny", dtype="float32", num_pages=64)))


def test_a_request_aborted_before_the_loop_added_it_still_ends():
    loop = _loop()  # (not started: the abort comes before the loop takes the request in)
    h = loop.submit([5, 6, 7], SamplingParams(max_tokens=4))
    loop.abort(h)
    loop.start()
    try:
        assert h.events.get(timeout=60) == ("done", "abort")
    finally:
        loop.stop()


def test_requests_still_in_a_stopped_loop_end_as_failed():
    loop = _loop().start()
    running = loop.submit([5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True))
    assert running.events.get(timeout=60)[0] == "token"
    loop.stop()
    while (e := running.events.get(timeout=60))[0] == "token":
        pass
    assert e == ("failed", "the engine stopped")
