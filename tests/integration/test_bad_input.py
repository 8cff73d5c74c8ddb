"""The public gRPC API under bad input, overload and deadlines, against a running stack of a tiny model.

Every case gets a clean status (never INTERNAL or UNKNOWN), no service restarts, no KV block is left held,
and the services' logs stay short. The property-based part runs a bounded number of examples in the
default test run; PAGEDSERVE_FUZZ_EXAMPLES=2000 (say) runs a longer one.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.client import GenerateClient, build_request
from pagedserve.config import PagedServeConfig
from pagedserve.entrypoints.launcher import Stack
from pagedserve.v1 import common_pb2, generate_pb2
from tests.support.tiny_stack import kv_stats, wait_until_idle, write_tiny_model_with_tokenizer

FUZZ_EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "60"))
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
         grpc.StatusCode.RESOURCE_EXHAUSTED}
VOCAB = 160  # tests.conftest.tiny_hf_config
MAX_WAITING = 2
# What the services may write to stderr over this whole module: a handful of warnings, no traceback per request.
LOG_BUDGET_BYTES = 20_000


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = write_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tiny-llama-fuzz"))
    config = PagedServeConfig.from_kwargs(
        model=str(model), device="cpu", port=0, log_level="WARNING", kv_cache_memory=16 << 20,
        max_num_seqs=2, max_waiting=MAX_WAITING,
    )
    # The services inherit this stderr, so their logs can be measured.
    log = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(log.fileno(), 2)
    try:
        running = Stack(config).start()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    running.log = log
    running.pids = [process.pid for process in running.processes.values()]
    running.log_at_start = os.fstat(log.fileno()).st_size
    yield running
    running.stop()
    log.close()


@pytest.fixture(scope="module")
def client(stack):
    with GenerateClient(stack.address) as c:
        yield c


@pytest.fixture(scope="module")
def raw_generate(stack):
    """Generate taking the request as raw bytes: what a client that is not ours can send."""
    with grpc.insecure_channel(stack.address) as ch:
        yield ch.unary_stream("/pagedserve.v1.Generation/Generate", request_serializer=None,
                              response_deserializer=generate_pb2.GenerateResponse.FromString)


def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        for _ in call():
            pass
    except grpc.RpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


def _assert_clean(code: grpc.StatusCode, details: str) -> None:
    assert code in CLEAN, (code, details)


# ------------------------------------------------------------------------------------------ wire level
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: how strings and sub-messages travel (appending one merges it in)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


INVALID_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xe2\x82"]


@pytest.mark.parametrize("bad", INVALID_UTF8)
def test_invalid_utf8_in_a_prompt_or_stop_string_is_invalid_argument(raw_generate, bad):
    prompt = _field(2, b"Hello " + bad)
    stop = _field(5, _field(11, bad))
    for request in (prompt, _field(2, b"Hello") + stop, _field(1, bad) + _field(2, b"Hi")):
        code, details = _status(lambda: raw_generate(request, timeout=20))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details, (request, code, details)


def test_bytes_that_are_no_message_and_unknown_fields(raw_generate):
    code, details = _status(lambda: raw_generate(b"\x0a\xff\xff\xff\xff\x0f", timeout=20))  # a length past the end
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    # An unknown field is skipped, as protobuf does: the rest of the request is served.
    known = build_request(prompt_token_ids=[1, 2, 3], max_tokens=2, temperature=0).SerializeToString()
    code, details = _status(lambda: raw_generate(known + _field(999, b"whatever") + _varint(1000 << 3) + b"\x05",
                                                 timeout=20))
    assert code == grpc.StatusCode.OK, details


WEIRD_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 1e-38, 1e-46, 5e-324, 1e-5, 1.0, 2.0, 1e308]),
)
INT32 = st.integers(-(2 ** 31), 2 ** 31 - 1)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """Usually an acceptable value, so that the cases reach the back end and not only validation."""
    return st.integers(0, 4).flatmap(lambda i: good if i else bad)


@st.composite
def requests(draw) -> bytes:
    request = generate_pb2.GenerateRequest(
        request_id=draw(mostly(st.sampled_from(["", "a", "b"]), st.sampled_from(["x" * 257, "é" * 300]))),
        cache_salt=draw(st.sampled_from(["", "s1", "s2"])),
    )
    kind = draw(st.sampled_from(["prompt", "ids", "ids", "messages"]))
    if kind == "prompt":
        request.prompt = draw(st.text(max_size=40))
    elif kind == "ids":
        token = draw(mostly(st.integers(0, VOCAB - 1), st.one_of(st.integers(-2, VOCAB + 2), INT32)))
        request.prompt_token_ids.ids[:] = draw(st.lists(st.just(token), max_size=3)) + draw(
            st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=30))
    else:
        for _ in range(draw(st.integers(0, 3))):
            request.messages.messages.add(
                role=draw(mostly(st.sampled_from(["user", "system"]), st.sampled_from(["robot", ""]))),
                content=draw(st.text(max_size=20)))
    sampling = request.sampling
    for name, good in (("temperature", st.floats(0, 2)), ("top_p", st.floats(0.01, 1)), ("min_p", st.floats(0, 1))):
        if draw(st.booleans()):
            setattr(sampling, name, draw(mostly(good, WEIRD_FLOATS)))
    for name, good in (("top_k", st.integers(-1, 40)), ("max_tokens", st.integers(1, 8)), ("logprobs", st.integers(0, 5))):
        if draw(st.booleans()):
            setattr(sampling, name, draw(mostly(good, INT32)))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(-(2 ** 63), 2 ** 63 - 1))
    sampling.min_tokens = draw(mostly(st.just(0), st.integers(-3, 40)))
    sampling.stop_token_ids[:] = draw(st.lists(mostly(st.integers(0, VOCAB - 1), INT32), max_size=2))
    sampling.stop[:] = draw(st.lists(mostly(st.text(min_size=1, max_size=5), st.just("")), max_size=2))
    sampling.ignore_eos = draw(st.booleans())
    wire = request.SerializeToString()
    # Damage at the wire level, now and then: invalid UTF-8, an unknown field, or a truncated message.
    damage = draw(mostly(st.just("none"), st.sampled_from(["utf8", "unknown", "truncate"])))
    if damage == "utf8":
        wire += _field(draw(st.sampled_from([1, 2, 6])), draw(st.sampled_from(INVALID_UTF8)))
    elif damage == "unknown":
        wire += _field(draw(st.integers(100, 2 ** 20)), draw(st.binary(max_size=8)))
    elif damage == "truncate" and wire:
        wire = wire[: draw(st.integers(0, len(wire) - 1))]
    return wire


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire=st.one_of(requests(), requests(), requests(), st.binary(max_size=64)))
def test_fuzzed_requests_get_a_clean_status(raw_generate, wire):
    code, details = _status(lambda: raw_generate(wire, timeout=60))
    event(code.name)  # --hypothesis-show-statistics reports how the cases ended
    _assert_clean(code, details)


# ------------------------------------------------------------------------------------------ sizes, time
def test_a_message_over_the_public_limit_is_refused_by_grpc(client):
    request = build_request(prompt="x" * (5 << 20))
    code, _ = _status(lambda: client.stream(request, timeout=20))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_prompt_of_megabytes_is_refused_at_once_by_its_length_in_characters(client):
    request = build_request(prompt="lorem ipsum " * (300 << 10))  # 3.6 MB: under the message limit
    started = time.monotonic()
    code, details = _status(lambda: client.stream(request, timeout=20))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "characters" in details, details
    assert time.monotonic() - started < 2.0  # tokenizing it would take seconds


def test_a_deadline_ends_the_request_and_frees_its_blocks(stack, client):
    # 470 decode steps cannot fit in half a second (each step is two RPCs), while the first token does.
    request = build_request(prompt_token_ids=list(range(1, 40)), max_tokens=470, ignore_eos=True, temperature=0)
    stream = client.stream(request, timeout=0.5)
    held = None
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            if held is None:
                held = kv_stats(stack).num_in_use
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert held and held > 0  # it was running, with blocks, when the deadline came
    stats = wait_until_idle(stack)
    assert (stats.num_requests, stats.num_in_use) == (0, 0)


def test_beyond_max_waiting_a_request_is_refused_at_once(stack, client):
    # Two run (max_num_seqs), two may wait; a burst of eight leaves some refused, none failed otherwise.
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        request = build_request(prompt_token_ids=[1 + i, 2, 3], max_tokens=60, ignore_eos=True, temperature=0)
        code, details = _status(lambda: client.stream(request, timeout=60))
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 8 - 2 - MAX_WAITING, codes
    assert codes.count(grpc.StatusCode.OK) >= 2, codes
    stats = wait_until_idle(stack)
    assert (stats.num_requests, stats.num_in_use) == (0, 0)


# ------------------------------------------------------------------------------------------ request ids
def test_a_duplicate_in_flight_id_is_already_exists_and_free_again_when_it_ends(client):
    long = build_request(prompt_token_ids=[5, 6, 7], max_tokens=400, ignore_eos=True, request_id="dup")
    stream = client.stream(long, timeout=60)
    next(stream)
    code, details = _status(lambda: client.stream(build_request(prompt_token_ids=[1], request_id="dup"), timeout=20))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "dup" in details
    stream.cancel()
    time.sleep(0.1)  # the frontend sees the cancel
    completion = client.generate(build_request(prompt_token_ids=[1], request_id="dup", max_tokens=2), timeout=20)
    assert completion.request_id == "dup" and completion.finish_reason == "length"


def test_an_id_is_reusable_right_after_a_stop_string_finish(client):
    base = client.generate(build_request(prompt_token_ids=[20, 21, 22], max_tokens=12, ignore_eos=True,
                                         temperature=0), timeout=20)
    assert len(base.text) >= 6, base.text  # the stop string below comes from it
    stop = base.text[3:5]
    for _ in range(5):
        request = build_request(prompt_token_ids=[20, 21, 22], max_tokens=12, ignore_eos=True, temperature=0,
                                stop=[stop], request_id="again")
        completion = client.generate(request, timeout=20)
        assert completion.finish_reason == "stop" and completion.request_id == "again"


# ------------------------------------------------------------------------------------------ cache_salt
def test_a_salt_never_hits_blocks_cached_under_another(stack, client):
    prompt = list(range(30, 30 + 3 * 16 + 5))  # three full blocks and a bit

    def run(salt: str) -> tuple[list[int], int]:
        before = kv_stats(stack).prefix_cache_hits
        out = client.generate(build_request(prompt_token_ids=prompt, max_tokens=4, temperature=0,
                                            cache_salt=salt), timeout=20)
        wait_until_idle(stack)
        return out.token_ids, kv_stats(stack).prefix_cache_hits - before

    first_a, _ = run("tenant-a")
    again_a, hits_a = run("tenant-a")
    assert hits_a >= 3 * 16 and again_a == first_a  # the salt's own blocks are found
    b, hits_b = run("tenant-b")
    unsalted, hits_none = run("")
    assert hits_b == 0 and hits_none == 0
    assert b == unsalted == first_a  # computed afresh, the same tokens


# ------------------------------------------------------------------------------------------ afterwards
def test_zz_no_restart_no_leak_no_log_flood(stack):
    """Runs last (by name within this module): what all of the above left behind."""
    assert [process.pid for process in stack.processes.values()] == stack.pids
    assert all(process.poll() is None for process in stack.processes.values())
    stats = wait_until_idle(stack)
    assert (stats.num_requests, stats.num_in_use) == (0, 0)
    stack.log.seek(stack.log_at_start)
    written = stack.log.read()
    assert b"Traceback" not in written, written[-4000:]
    assert len(written) < LOG_BUDGET_BYTES, written[-4000:]
