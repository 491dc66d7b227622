"""Every gRPC method of every Crescent service under seeded random requests: a store node, a conductor
(with that node and an engine registered) and an engine, each a real process, get requests whose
fields are filled from their protobuf descriptors with edge values (empty and oversized bytes and
strings, every integer type's extremes, NaN and infinities, enum numbers no version declares,
nested messages, long repeated fields; client streams of such frames). Each call must end, within
its deadline, with an answer or a precise status: never UNKNOWN or INTERNAL (a server's unhandled
exception), never a dead server or a traceback in its log, and the values stored before the
campaign read back intact. A failure names the seed, the method and the request to replay."""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F

from kvstore.client import StoreClient
from kvstore.procs import stop_process
from proto.crescent.v1 import conductor_pb2, conductor_pb2_grpc, engine_pb2, engine_pb2_grpc
from proto.crescent.v1 import kvstore_pb2, kvstore_pb2_grpc
from tests.helpers import ROOT, wait_for

SEED = int(os.environ.get("CRESCENT_FUZZ_SEED", "20261207"))
CALLS = int(os.environ.get("CRESCENT_FUZZ_CALLS", "60"))  # per method
CANARIES = {b"canary-%d" % i: random.Random(i).randbytes(n) for i, n in enumerate((1, 4096, 70000))}
BAD_STATUSES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
DEADLINE_S = 30.0

_INTS = {
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_UINT32: (0, (1 << 32) - 1), F.TYPE_FIXED32: (0, (1 << 32) - 1),
    F.TYPE_UINT64: (0, (1 << 64) - 1), F.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, -1e30, 3.4e38, math.nan, math.inf, -math.inf, 100.0, 1e300)
_STRINGS = ("", "x", "round-robin", "cache-aware", "json", "regex", "choice", "grammar", "json_object",
            "[\"a\", \"b\"]", "{\"type\": \"object\"}", "a+", "root ::= \"x\"", "\x00", "é" * 3, "../../etc/passwd",
            "node-a", "127.0.0.1:1", "x" * 5000)


# Sane values (and fields always set or left out) where a field's zero value is not a valid request: enough
# of the near-valid requests pass validation to reach what runs behind it.
_SANE = {"max_tokens": (1, 2, 4, 8), "min_tokens": (0, 1), "top_k": (0, -1, 5), "priority": (0,),
         "temperature": (0.0, 1.0), "top_p": (0.0, 0.9, 1.0), "repetition_penalty": (0.0, 1.0, 1.2),
         "logprobs": (0, 1, 3), "prompt_logprobs": (0, 2), "min_p": (0.0, 0.1)}
_ALWAYS = {"sampling", "max_tokens", "prompt_token_ids"}
_NEVER = {"structured"}


class Filler:
    """Random protobuf messages of a descriptor's shape: with edge values everywhere (``fill``), or sane
    values with an edge value or two in them (``near_valid``), which reach past the first validation."""

    def __init__(self, rng: random.Random, keys: list[bytes]) -> None:
        self.rng, self.keys = rng, keys
        self.edge = True

    def sane(self, field):
        rng, t = self.rng, field.type
        if field.name in _SANE:
            return rng.choice(_SANE[field.name])
        if t in _INTS:
            if "token" in field.name:
                return rng.randrange(1, 200)
            return rng.choice((0, 1, 2, 4, 8, 16)) if _INTS[t][0] == 0 else rng.choice((-1, 0, 1, 2, 8))
        if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            return rng.choice((0.0, 0.5, 1.0))
        if t == F.TYPE_BOOL:
            return rng.random() < 0.5
        if t == F.TYPE_STRING:
            return rng.choice(("", "x", "fuzz", "round-robin", "cache-aware", "json_object"))
        if t == F.TYPE_BYTES:
            return rng.choice(self.keys)
        if t == F.TYPE_ENUM:
            return rng.choice([v.number for v in field.enum_type.values])
        raise AssertionError(f"no filler for {field.full_name} (type {t})")

    def scalar(self, field):
        if not self.edge:
            return self.sane(field)
        rng, t = self.rng, field.type
        if t in _INTS:
            lo, hi = _INTS[t]
            return rng.choice((0, 1, 2, 3, 7, 16, 64, 1000, lo, hi, hi - 1, lo + 1, rng.randint(lo, hi),
                               rng.randint(0, min(hi, 50_000))))
        if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            v = rng.choice(_FLOATS)
            return max(-3.4e38, min(3.4e38, v)) if t == F.TYPE_FLOAT and math.isfinite(v) else v
        if t == F.TYPE_BOOL:
            return rng.random() < 0.5
        if t == F.TYPE_STRING:
            return rng.choice(_STRINGS) if rng.random() < 0.8 else "".join(
                chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(40)))
        if t == F.TYPE_BYTES:
            r = rng.random()
            return rng.choice(self.keys) if r < 0.5 else b"" if r < 0.6 else b"k" * rng.choice((1, 255, 256, 4096)) \
                if r < 0.75 else rng.randbytes(rng.choice((1, 8, 16, 17, 70000)))
        if t == F.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            return rng.choice(values) if rng.random() < 0.8 else rng.choice((-1, 99, (1 << 31) - 1))
        raise AssertionError(f"no filler for {field.full_name} (type {t})")

    def fill(self, msg, depth: int = 0):
        rng = self.rng
        chosen_oneofs = {o.name: rng.choice(o.fields) for o in msg.DESCRIPTOR.oneofs if not o.name.startswith("_")}
        for field in msg.DESCRIPTOR.fields:
            oneof = field.containing_oneof
            if oneof is not None and not oneof.name.startswith("_") and chosen_oneofs[oneof.name] is not field:
                continue
            if self.edge and rng.random() < 0.25 or not self.edge and field.name not in _ALWAYS and (
                    field.name in _NEVER or rng.random() < 0.6):  # left unset
                continue
            is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
            if is_map:
                key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
                target = getattr(msg, field.name)
                for _ in range(rng.choice((0, 1, 3))):
                    k = self.scalar(key_f)
                    if val_f.message_type is not None:
                        self.fill(target[k], depth + 1)
                    else:
                        target[k] = self.scalar(val_f)
            elif field.is_repeated:
                n = rng.choice((0, 1, 2, 5, 40)) if depth < 2 else rng.choice((0, 1))
                if not self.edge:
                    n = rng.randrange(1, 48) if "token" in field.name else rng.choice((0, 1, 2))
                target = getattr(msg, field.name)
                for _ in range(n):
                    if field.message_type is not None:
                        if depth < 3:
                            self.fill(target.add(), depth + 1)
                    else:
                        target.append(self.scalar(field))
            elif field.message_type is not None:
                if depth < 3:
                    self.fill(getattr(msg, field.name), depth + 1)
            else:
                setattr(msg, field.name, self.scalar(field))
        return msg


    def near_valid(self, msg):
        """Sane fields, then one or two set to an edge value (a singular field anywhere, or one more element of
        a repeated one)."""
        self.edge = False
        try:
            self.fill(msg)
        finally:
            self.edge = True
        for _ in range(self.rng.choice((0, 1, 1, 2))):
            self._mutate(msg, 0)
        return msg

    def _mutate(self, msg, depth: int) -> None:
        fields = [f for f in msg.DESCRIPTOR.fields
                  if not (f.message_type is not None and f.message_type.GetOptions().map_entry)]
        if not fields:
            return
        field = self.rng.choice(fields)
        if field.message_type is not None:
            if field.is_repeated:
                target = getattr(msg, field.name)
                if len(target) == 0 or depth >= 2:
                    return
                self._mutate(target[self.rng.randrange(len(target))], depth + 1)
            elif depth < 2:
                self._mutate(getattr(msg, field.name), depth + 1)
        elif field.is_repeated:
            getattr(msg, field.name).append(self.scalar(field))
        elif field.containing_oneof is None or field.containing_oneof.name.startswith("_"):
            setattr(msg, field.name, self.scalar(field))


def _proc(args: list[str], log_path, banner: str):
    log = open(log_path, "w")
    p = subprocess.Popen([sys.executable, "-m", "kvstore.cli", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=log,
                         text=True, start_new_session=True)
    log.close()
    while True:
        line = p.stdout.readline()
        if banner in line or not line:
            break
    if banner not in line:
        stop_process(p, 60)
        raise AssertionError(f"{args[0]} did not start: {open(log_path).read()[-3000:]}")
    return p, re.search(r"listening on ([^\s,]+)", line).group(1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpc_fuzz")
    procs = {}
    try:
        procs["conductor"] = _proc(["conductor", "--listen", "127.0.0.1:0"], tmp / "conductor.log", "listening on")
        conductor = procs["conductor"][1]
        procs["store"] = _proc(["store", "--listen", "127.0.0.1:0", "--dram", "32MiB", "--transport", "auto",
                                "--conductor", conductor, "--node-id", "fuzz-node"], tmp / "store.log", "listening on")
        procs["engine"] = _proc(["engine", "both", "--listen", "127.0.0.1:0", "--model", "random:tiny",
                                 "--store", procs["store"][1], "--conductor", conductor, "--num-pages", "256"],
                                tmp / "engine.log", "listening on")
        with StoreClient(procs["store"][1], timeout_s=60) as c:
            for key, value in CANARIES.items():
                c.put(key, value)
        yield {name: (p, address, tmp / f"{name}.log") for name, (p, address) in procs.items()}
    finally:
        for p, _ in procs.values():
            stop_process(p, 60)
            p.stdout.close()


SERVICES = {
    "store": (kvstore_pb2, kvstore_pb2_grpc.KVStoreStub, "KVStore"),
    "conductor": (conductor_pb2, conductor_pb2_grpc.ConductorStub, "Conductor"),
    "engine": (engine_pb2, engine_pb2_grpc.EngineStub, "Engine"),
}
# Methods that would end the campaign rather than test input: the store's Clear (a wipe, whatever the request)
# and the conductor's Deregister/Drain of the members the campaign runs beside.
SPARED = {("store", "Clear"), ("conductor", "Deregister"), ("conductor", "Drain")}


def _methods(service: str):
    module, _, name = SERVICES[service]
    svc = module.DESCRIPTOR.services_by_name[name]
    return [(service, m.name) for m in svc.methods if (service, m.name) not in SPARED]


ALL = [m for s in SERVICES for m in _methods(s)]


@pytest.mark.parametrize(("service", "method"), ALL, ids=[f"{s}.{m}" for s, m in ALL])
def test_a_method_answers_random_requests_with_a_precise_status(servers, service, method):
    module, stub_class, name = SERVICES[service]
    proc, address, log_path = servers[service]
    desc = module.DESCRIPTOR.services_by_name[name].methods_by_name[method]
    request_class = getattr(module, desc.input_type.name)
    rng = random.Random(f"{SEED}/{service}.{method}")
    writes = method in ("Put", "Delete", "ReserveWrite", "CommitWrite", "EvictChunks", "PinChunks")
    keys = [b"fuzz-%d" % i for i in range(8)] + ([] if writes else list(CANARIES))
    filler = Filler(rng, keys)
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        call = getattr(stub_class(ch), method)
        for i in range(CALLS):
            make = filler.fill if rng.random() < 0.3 else filler.near_valid
            if desc.client_streaming:
                request = [make(request_class()) for _ in range(rng.choice((0, 1, 2, 5)))]
                shown = request[:2]
                send = iter(request)
            else:
                request = send = make(request_class())
                shown = request
            try:
                answer = call(send, timeout=DEADLINE_S)
                if desc.server_streaming:
                    for _ in answer:
                        pass
            except grpc.RpcError as exc:
                code = exc.code()
                assert code not in BAD_STATUSES, (f"seed {SEED}, {service}.{method} call {i}: {code.name} "
                                                  f"{exc.details()}\nrequest: {shown}")
            assert proc.poll() is None, f"{service} died on {method} call {i} (seed {SEED}): {shown}"
    with StoreClient(servers["store"][1], timeout_s=60, transport="grpc") as c:
        assert [c.get(k) for k in CANARIES] == list(CANARIES.values())
    text = open(log_path).read()
    assert "Traceback" not in text, text[-4000:]


def test_generate_with_chunk_keys_checks_the_prompt_before_keying_it(servers):
    """Found by the campaign: a token id past int32 with chunk keys given failed inside the keying (UNKNOWN)."""
    with grpc.insecure_channel(servers["engine"][1]) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        for prompt in ([1, (1 << 32) - 1], [1, 1 << 31], [5] * 3 + [1 << 20]):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(engine_pb2.GenerateRequest(
                    prompt_token_ids=prompt, chunk_keys=[bytes(16)],
                    sampling=engine_pb2.SamplingOptions(max_tokens=2)), timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt token ids" in err.value.details()


def test_the_servers_still_serve_after_the_campaign(servers):
    """Last (the methods' tests run first): the engine and conductor still do real work."""
    from kvstore.conductor.client import ConductorClient

    _, engine, _ = servers["engine"]
    with grpc.insecure_channel(engine) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        wait_for(lambda: stub.Health(engine_pb2.EngineHealthRequest(), timeout=30).serving, what="the engine")
        out = [t for r in stub.Generate(engine_pb2.GenerateRequest(
            request_id="after", prompt_token_ids=list(range(1, 40)),
            sampling=engine_pb2.SamplingOptions(max_tokens=4, ignore_eos=True)), timeout=120) for t in r.token_ids]
        assert len(out) == 4
    with ConductorClient(servers["conductor"][1]) as c:
        assert "fuzz-node" in {m.member_id for m in c.members()}
