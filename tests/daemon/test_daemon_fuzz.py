"""Property-based fuzzing of the daemon's socket: every bad message gets a typed error or a
disconnect, the daemon keeps answering health, and its memory stays bounded."""
from __future__ import annotations

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from daemon_fixtures import daemon_settings, running_daemon
from llmd import codec

CODES = {"bad_message", "unknown_type", "invalid_request", "unsupported_version"}
VALID = {"type": "generate", "id": "g", "prompt": "hi", "params": {"max_tokens": 2}}


@pytest.fixture(scope="module")
def daemon(tiny_model_dir, tmp_path_factory):
    with running_daemon(daemon_settings(tiny_model_dir, tmp_path_factory.mktemp("fz"), max_message_bytes=65536)) as s:
        yield s


@pytest.fixture(scope="module")
def sock(daemon):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.settings.endpoint)
    yield s
    s.close()


def ask(sock, *frames: bytes) -> dict:
    sock.send_multipart(list(frames))
    while True:
        reply = codec.unpack(sock.recv())
        if reply["type"] != "keepalive":
            return reply


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
                    st.floats(), st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = ["type", "id", "prompt", "token_ids", "params", "priority", "deadline_ms", "sentences", "replace"]


def broken_generate():
    """A generate request with exactly one field made wrong (type, size or unknown key)."""
    wrong_value = st.tuples(st.sampled_from(["id", "prompt", "priority", "deadline_ms", "sentences", "params"]),
                            values).filter(lambda kv: not _valid_for(*kv))
    unknown_key = st.tuples(st.text(min_size=1, max_size=10).filter(lambda k: k not in FIELDS + ["cache_salt"]), values)
    huge = st.tuples(st.sampled_from(["max_tokens", "top_k", "seed", "logprobs"]),
                     st.one_of(st.integers(min_value=1 << 63, max_value=(1 << 64) - 1),
                               st.integers(min_value=-(1 << 63), max_value=-1)))
    return st.one_of(
        wrong_value.map(lambda kv: {**VALID, kv[0]: kv[1]}),
        unknown_key.map(lambda kv: {**VALID, kv[0]: kv[1]}),
        huge.map(lambda kv: {**VALID, "params": {kv[0]: kv[1]}}),
    )


def _valid_for(key, value) -> bool:
    ok = {"id": lambda v: isinstance(v, str) and 0 < len(v) <= 128,
          "prompt": lambda v: isinstance(v, str),
          "priority": lambda v: v in ("interactive", "normal", "batch"),
          "deadline_ms": lambda v: v is None or (type(v) is int and 1 <= v <= 86_400_000),
          "sentences": lambda v: isinstance(v, bool),
          "params": lambda v: v == {} }
    return ok[key](value)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
@pytest.mark.heavy
def test_random_bytes_get_a_typed_error(sock, data):
    reply = ask(sock, data)
    assert reply["type"] == "error" and reply["code"] in CODES


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(values)
@pytest.mark.heavy
def test_random_msgpack_values_get_a_typed_error(sock, value):
    reply = ask(sock, msgpack.packb(value, use_bin_type=True))
    assert reply["type"] == "error" and reply["code"] in CODES


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(broken_generate())
@pytest.mark.heavy
def test_wrong_types_unknown_keys_and_huge_numbers_are_invalid(sock, message):
    reply = ask(sock, msgpack.packb(message, use_bin_type=True))
    assert reply["type"] == "error" and reply["code"] in ("invalid_request", "bad_message"), reply


@pytest.mark.parametrize("depth", [9, 100, 5000])
@pytest.mark.heavy
def test_deep_nesting_is_refused(sock, depth):
    nested = b"\x91" * depth + b"\xc0"                      # [[[...nil...]]]
    message = (b"\x83" + msgpack.packb("type") + msgpack.packb("generate") + msgpack.packb("id")
               + msgpack.packb("n") + msgpack.packb("prompt") + nested)     # {type, id, prompt: [[[...]]]}
    reply = ask(sock, message)
    assert reply["type"] == "error" and reply["code"] in ("bad_message", "invalid_request")


@pytest.mark.heavy
def test_extension_types_and_multiframe_are_refused(sock):
    ext = msgpack.packb({"type": "health", "id": msgpack.ExtType(1, b"x")})
    assert ask(sock, ext)["code"] == "bad_message"
    assert ask(sock, codec.pack({"type": "health", "id": "h"}), b"second")["code"] == "bad_message"


@pytest.mark.heavy
def test_oversize_frame_disconnects_and_the_daemon_goes_on(daemon):
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as big:
        big.setsockopt(zmq.RCVTIMEO, 500)
        big.connect(daemon.settings.endpoint)
        big.send(codec.pack({"type": "generate", "id": "big", "prompt": "x" * 100_000}))
        with pytest.raises(zmq.Again):
            big.recv()                                      # dropped, never answered
    with ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(daemon.settings.endpoint)
        assert ask(s, codec.pack({"type": "health", "id": "h"}))["state"] == "ready"


@pytest.mark.heavy
def test_after_fuzzing_health_answers_and_memory_is_bounded(sock):
    before = rss_kib()
    junk = [bytes([i % 256]) * (i % 300) for i in range(2000)]
    for data in junk:
        assert ask(sock, data)["type"] == "error"
    grown = rss_kib() - before
    assert grown < 20 * 1024, f"RSS grew by {grown} KiB over 2000 bad messages"
    reply = ask(sock, codec.pack({"type": "health", "id": "h"}))
    assert reply["type"] == "health" and reply["state"] == "ready"
    reply = ask(sock, codec.pack(VALID))
    assert reply["type"] == "token"
