"""The Responses API's kept responses (engine/serve/responses.py ``ResponseStore``): at most
``max_items`` and at most ``max_bytes``, the least recently used going first, exactly accounted."""

import json

import pytest

from engine.serve.openai_protocol import BadRequest
from engine.serve.responses import ResponseStore


def _put(store: ResponseStore, rid: str, text: str, parent: str | None = None, owner=None) -> int:
    """Keeps a response whose input is ``text``; returns the bytes it counts for."""
    resp = {"id": rid, "output": []}
    store.put(resp, owner, parent, {"input": text})
    return len(json.dumps(resp)) + len(json.dumps([{"role": "user", "content": text}]))


def test_responses_past_the_byte_budget_go_least_recently_used_first():
    one = len(json.dumps({"id": "r0", "output": []})) + len(json.dumps([{"role": "user", "content": "x" * 1000}]))
    store = ResponseStore(max_items=100, max_bytes=3 * one)
    for i in range(3):
        assert _put(store, f"r{i}", "x" * 1000, parent=f"r{i - 1}" if i else None) == one
    assert len(store) == 3 and store.num_bytes == 3 * one
    assert store.get("r0", None) is not None  # used: r1 is now the least recently used
    _put(store, "r3", "x" * 1000)
    assert store.get("r1", None) is None and store.get("r0", None) is not None and store.num_bytes == 3 * one
    with pytest.raises(BadRequest, match="no longer kept"):
        store.history("r2", None)  # it continues r1, gone
    assert store.delete("r3", None) and store.num_bytes == 2 * one and len(store) == 2
    # one response larger than the whole budget is not kept, and takes nothing from the others
    _put(store, "big", "y" * (4 * one))
    assert store.get("big", None) is None and len(store) == 2 and store.num_bytes == 2 * one


def test_the_item_limit_still_holds_and_bad_limits_are_refused():
    store = ResponseStore(max_items=2, max_bytes=1 << 20)
    sizes = [_put(store, f"r{i}", "hi") for i in range(3)]
    assert len(store) == 2 and store.num_bytes == sum(sizes[1:])
    for kw in ({"max_items": -1}, {"max_items": 1, "max_bytes": 0}):
        with pytest.raises(ValueError):
            ResponseStore(**kw)
