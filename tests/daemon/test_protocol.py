"""The wire layer without a daemon: codec limits, strict request models, events, sentences,
settings layering and the pid lock."""
from __future__ import annotations

import os

import msgpack
import pytest

from llmd.protocol import Ack, Done, Error, Keepalive, Reply, Sentence, Token, from_wire
from llmd.sentences import SentenceSplitter
from llmd import codec, protocol
from llmd.daemon import settings as settings_mod
from llmd.daemon.paths import AlreadyRunning, PidLock
from llmd.protocol import default_socket_path


def test_codec_round_trip_and_limits():
    msg = {"type": "generate", "id": "a", "token_ids": [1, 2, 3], "params": {"temperature": 0.5}}
    assert codec.unpack(codec.pack(msg)) == msg
    with pytest.raises(codec.CodecError, match="map"):
        codec.unpack(msgpack.packb([1, 2]))
    with pytest.raises(codec.CodecError, match="extension"):
        codec.unpack(msgpack.packb({"x": msgpack.ExtType(5, b"")}))
    with pytest.raises(codec.CodecError, match="deeper"):
        codec.unpack(msgpack.packb({"a": [[[[[[[[[1]]]]]]]]]}))
    with pytest.raises(codec.CodecError, match="exceeds"):
        codec.unpack(b"\x80" * 100, max_bytes=10)
    with pytest.raises(codec.CodecError):
        codec.unpack(msgpack.packb({1: 2}))
    with pytest.raises(codec.CodecError):
        codec.unpack(b"\x80\x80")                       # extra data after the map
    with pytest.raises(codec.CodecError):
        codec.unpack(msgpack.packb({"m": {str(i): i for i in range(codec.MAX_MAP_LEN + 1)}}))


@pytest.mark.parametrize("bad, where", [
    ({"prompt": "x", "extra": 1}, "extra"),
    ({"prompt": b"x"}, "prompt"),
    ({"token_ids": [True]}, "token_ids.0"),
    ({"token_ids": [-1]}, "token_ids.0"),
    ({"prompt": "x", "token_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"prompt": "x", "params": {"max_tokens": "3"}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"max_tokens": 1 << 40}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"temperature": float("inf")}}, "params.temperature"),
    ({"prompt": "x", "params": {"seed": 1 << 63}}, "params.seed"),
    ({"prompt": "x", "params": {"prompt_only": 1}}, "params.prompt_only"),
    ({"prompt": "x", "priority": "urgent"}, "priority"),
    ({"prompt": "x", "deadline_ms": 0}, "deadline_ms"),
    ({"prompt": "x", "id": "x" * 129}, "id"),
])
def test_generate_is_strict(bad, where):
    msg = {"type": "generate", "id": "r1", **bad}
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.parse_request(msg)
    assert e.value.code == "invalid_request" and where in e.value.message


def test_request_types_and_ids():
    assert isinstance(protocol.parse_request({"type": "health", "id": "h"}), protocol.Health)
    infill = protocol.parse_request({"type": "infill", "id": "i", "prefix": "a", "files": [{"path": "p", "text": "t"}],
                                     "replace": "buf"})
    assert infill.priority == "interactive" and infill.files[0].path == "p"
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.parse_request({"type": "shutdown", "id": "z"})
    assert e.value.code == "unknown_type" and e.value.request_id == "z"
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.parse_request({"type": "chat", "id": "c", "messages": [{"role": "root", "content": "x"}]})
    assert e.value.code == "invalid_request"


def test_version_negotiation():
    assert protocol.negotiate(protocol.parse_request({"type": "hello", "id": "h", "versions": [0, 1, 7]})) == 1
    with pytest.raises(protocol.ProtocolError) as e:
        protocol.negotiate(protocol.parse_request({"type": "hello", "id": "h", "versions": [2]}))
    assert e.value.code == "unsupported_version"


def test_events_round_trip_and_ignore_unknown_keys():
    events = [Token("a", 0, "x", [1]), Sentence("a", 0, "Hi."), Error("a", "busy", "later"), Ack("c", "a", True),
              Done("a", "stop", {"prompt_tokens": 1}, {"total_ms": 2.0}), Keepalive()]
    for ev in events:
        assert from_wire(codec.unpack(codec.pack(ev.to_wire()))) == ev
    assert from_wire({**Token("a", 1, "y", [2]).to_wire(), "future_field": 1}) == Token("a", 1, "y", [2])
    assert from_wire({"type": "health", "id": "h", "state": "ready"}) == Reply("h", "health", {"state": "ready"})
    with pytest.raises(ValueError):
        from_wire({"type": "nope"})


def split_all(text: str, chunk: int) -> list[str]:
    s = SentenceSplitter()
    out = []
    for i in range(0, len(text), chunk):
        out += s.feed(text[i:i + chunk])
    rest = s.flush()
    return out + ([rest] if rest else [])


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_sentences_do_not_depend_on_chunking(chunk):
    text = 'Hello there. Dr. Smith said "hi!" Then 3.14 is pi?\nA list:\n- one\n你好。好的 end'
    assert split_all(text, chunk) == ["Hello there.", 'Dr. Smith said "hi!"', "Then 3.14 is pi?", "A list:",
                                      "- one", "你好。", "好的 end"]


def test_settings_layers_and_validation(tmp_path):
    system, user = tmp_path / "system.toml", tmp_path / "user.toml"
    system.write_text('model = "/sys"\nmax_queue = 5\nblock_size = 32\n')
    user.write_text('max_queue = 6\n')
    s, src = settings_mod.load({"block_size": 8}, env={"LLMD_MAX_QUEUE": "7", "LLMD_PREFIX_CACHE": "off"},
                               system_file=system, user_file=user)
    assert (s.model, s.max_queue, s.block_size, s.prefix_cache) == ("/sys", 7, 8, False)
    assert src["model"] == str(system) and src["max_queue"] == "environment" and src["block_size"] == "command line"
    with pytest.raises(settings_mod.SettingsError, match="unknown setting"):
        user.write_text("max_qeueu = 3\n")
        settings_mod.load({}, env={}, system_file=None, user_file=user)
    with pytest.raises(settings_mod.SettingsError, match="LLMD_MAX_QUEUE"):
        settings_mod.load({}, env={"LLMD_MAX_QUEUE": "many"}, system_file=None, user_file=tmp_path / "none")
    with pytest.raises(settings_mod.SettingsError, match="max_queue must be int"):
        settings_mod.Settings(max_queue=True)
    with pytest.raises(settings_mod.SettingsError, match="tcp"):
        settings_mod.Settings(tcp="0.0.0.0:80")
    assert settings_mod.Settings(kv_dtype="bfloat16").kv_dtype == "bfloat16"
    with pytest.raises(settings_mod.SettingsError, match="kv_dtype must be one of auto, bfloat16, int8"):
        settings_mod.Settings(kv_dtype="float16")
    assert settings_mod.Settings().device == "auto"
    with pytest.raises(settings_mod.SettingsError, match="device must be one of auto, cpu, cuda"):
        settings_mod.Settings(device="gpu")
    with pytest.raises(AttributeError):
        s.max_queue = 1                                   # frozen


def test_default_socket_location():
    assert str(default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"})) == "/run/user/7/llmd/llmd.sock"
    assert str(default_socket_path({})) == "/run/llmd/llmd.sock"


def test_pid_lock_refuses_a_second_holder(tmp_path):
    sock = tmp_path / "llmd.sock"
    with PidLock(sock):
        assert (tmp_path / "llmd.sock.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(AlreadyRunning, match=rf"already running \(pid {os.getpid()}\)"):
            PidLock(sock).acquire()
    with PidLock(sock):                                  # free again once released
        pass


@pytest.mark.heavy
def test_protocol_modules_import_no_torch():
    import subprocess
    import sys
    code = ("import sys, llmd.clients, llmd.clients.client, llmd.protocol, llmd.sentences, "
            "llmd.protocol, llmd.codec; assert 'torch' not in sys.modules, 'torch imported'")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
