"""vLLM's ``priority`` through the gateway, over real engines on loopback: served by engines that
schedule by priority, a 400 saying why from engines that do not."""

import json

import pytest

from tests.serving.test_gateway import MODEL, Setup, request

openai = pytest.importorskip("openai")


def _post(url: str, body: dict):
    status, data = request(url, "POST", "/v1/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})
    return status, json.loads(data)


@pytest.mark.parametrize("prefill", [True, False])
def test_engines_that_schedule_by_priority_serve_it_with_the_same_tokens(prefill):
    s = Setup(with_store=False, prefill=False, scheduling_policy="priority") if not prefill else None
    fcfs = Setup(with_store=False, prefill=prefill)
    try:
        body = {"model": MODEL, "prompt": "priority", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        if s is not None:
            status, urgent = _post(s.url, {**body, "priority": -7})
            status2, plain = _post(s.url, body)
            assert status == status2 == 200 and urgent["choices"][0]["text"] == plain["choices"][0]["text"]
        status, err = _post(fcfs.url, {**body, "priority": 1})
        assert status == 400 and "--scheduling-policy priority" in err["error"]["message"]
        status, _ = _post(fcfs.url, {**body, "priority": 0})
        assert status == 200
    finally:
        for x in (s, fcfs):
            if x is not None:
                x.close()


@pytest.mark.parametrize("bad", [1.5, "1", 1 << 31, True])
def test_a_priority_that_is_not_a_32_bit_integer_is_a_400_naming_it(bad):
    from engine.serve.openai_protocol import BadRequest, parse_request

    with pytest.raises(BadRequest) as e:
        parse_request({"model": MODEL, "prompt": "x", "priority": bad}, False, MODEL)
    assert e.value.param == "priority"
