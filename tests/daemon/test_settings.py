"""One source of settings: every EngineConfig field (and every daemon setting) is reachable through a
settings file, an LLMD_* variable, a `serve` flag and LLM(...), with one default, and reads back
from `llmd serve --print-config` and from the engine built with it."""
from __future__ import annotations

import dataclasses
import grp
import os
import tomllib

import pytest

from llmd.cli import build_parser, main
from llmd.daemon import settings as settings_mod
from llmd.daemon.serve import engine_factory
from llmd.daemon.settings import DaemonSettings, Settings
from llmd.options import env_name, flag_name, given
from llmd.runtime.config import EngineConfig
from llmd.runtime import kernels
from llmd.runtime.errors import InvalidRequest
from llmd.runtime.llm import LLM

# A value other than the default for every engine setting, all valid together on the tiny model.
ENGINE_SAMPLE = dict(dtype="bfloat16", kv_memory="48MiB", block_size=32, max_batch_tokens=200, batch_prompt_chunk=9, batch_quiet_ms=7.5, max_num_seqs=5,
                     max_model_len=100, max_waiting=7, prefix_cache=False, head_screen=False, kv_dtype="int8", kv_disk="/nonexistent/llmd-kv",
                     kv_disk_size="3GiB", shift_max_stale=5, attention="reference",
                     threads=int(os.environ.get("LLMD_TEST_THREADS", "2")), device="cpu", cuda_graphs=False, execution="reference", draft="ngram",
                     num_speculative_tokens=3, adaptive_speculation=False, ngram_n=2, seed=11,
                     # the kernels' switches serve the whole process: the ones it runs with (set, not unset)
                     kernels=kernels.switches().kernels, amx=kernels.switches().amx,
                     kernel_cache=str(kernels.cache_dir()))


def daemon_sample(tmp_path) -> dict:
    return dict(socket=str(tmp_path / "d" / "llmd.sock"), group=grp.getgrgid(os.getgid()).gr_name,
                tcp="tcp://127.0.0.1:5999", http="127.0.0.1:8089", http_allow_remote=True,
                http_api_key_file=str(tmp_path / "http.key"), max_queue=9, max_message_bytes=4096, send_hwm=10, send_buffer_bytes=8192,
                heartbeat_ivl_ms=300, heartbeat_timeout_ms=900, keepalive_s=0.5, drain_grace_s=1.5, warmup=False,
                log_level="debug", warm=str(tmp_path / "warm.jsonl"))


def toml_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str) else repr(value)


def flag_args(values: dict) -> list[str]:
    out = []
    for name, v in values.items():
        out += [f"--no-{flag_name(name)[2:]}"] if v is False else [flag_name(name)] if v is True else [flag_name(name), str(v)]
    return out


def print_config(capsys, argv: list[str]) -> dict[str, tuple[object, str]]:
    """`llmd serve ... --print-config`, read back: name -> (value, source)."""
    assert main(["serve", *argv, "--print-config"]) == 0
    out = {}
    for line in capsys.readouterr().out.splitlines():
        setting, _, source = line.rpartition(" # ")
        name, _, text = setting.partition("=")
        text = text.strip()
        out[name.strip()] = (None if text.startswith("#") else tomllib.loads(f"v = {text}")["v"], source.strip())
    return out


@pytest.fixture
def quiet_env(monkeypatch, tmp_path):
    """No settings from the machine running the tests: no LLMD_* variables but the suite's, no user file."""
    for k in list(os.environ):
        if k.startswith("LLMD_") and k != "LLMD_TEST_THREADS":
            monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def test_samples_cover_every_setting(tmp_path):
    assert set(ENGINE_SAMPLE) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert set(daemon_sample(tmp_path)) == {f.name for f in dataclasses.fields(DaemonSettings)}
    for f in dataclasses.fields(EngineConfig):
        assert f.metadata.get("help"), f"{f.name} has no help text"
        if f.name != "model":
            assert ENGINE_SAMPLE[f.name] != f.default, f.name


@pytest.mark.parametrize("layer", ["file", "environment", "flag"])
@pytest.mark.heavy
def test_every_setting_through_each_layer_reads_back(layer, tiny_model_dir, tmp_path, monkeypatch, capsys, quiet_env):
    values = {"model": str(tiny_model_dir), **ENGINE_SAMPLE, **daemon_sample(tmp_path)}
    argv = []
    if layer == "file":
        conf = tmp_path / "llmd.toml"
        conf.write_text("".join(f"{k} = {toml_text(v)}\n" for k, v in values.items()))
        argv, where = ["--config", str(conf)], str(conf)
    elif layer == "environment":
        for k, v in values.items():
            monkeypatch.setenv(env_name(k), toml_text(v).strip('"'))
        where = "environment"
    else:
        argv, where = flag_args(values), "command line"
    shown = print_config(capsys, argv)
    assert set(shown) == set(settings_mod.FIELDS)
    for name, value in values.items():
        assert shown[name] == (value, where), name

    s, _ = settings_mod.load(given(build_parser().parse_args(["serve", *argv]), Settings),
                             user_file=tmp_path / "llmd.toml" if layer == "file" else None)
    engine = engine_factory(s)()
    for name, value in ENGINE_SAMPLE.items():
        assert getattr(engine.config, name) == value, name
    assert engine.block_manager.block_size == 32 and engine.max_model_len == 100


def test_every_setting_through_llm_and_the_other_commands(tiny_model_dir):
    llm = LLM(tiny_model_dir, **ENGINE_SAMPLE)
    assert {k: getattr(llm.engine.config, k) for k in ENGINE_SAMPLE} == ENGINE_SAMPLE
    parser = build_parser()
    for command in (["generate", str(tiny_model_dir), "hi"], ["bench", "--shape", "tiny"]):
        assert given(parser.parse_args(command + flag_args(ENGINE_SAMPLE)), EngineConfig, skip=("model",)) == ENGINE_SAMPLE
        assert given(parser.parse_args(command), EngineConfig, skip=("model",)) == {}, "an unset flag leaves EngineConfig's default"


def test_one_default_everywhere(tmp_path, quiet_env):
    s, source = settings_mod.load({}, env={}, system_file=None, user_file=tmp_path / "none.toml")
    for f in dataclasses.fields(EngineConfig):
        if f.name != "model":
            assert getattr(s, f.name) == f.default and source[f.name] == "default", f.name


@pytest.mark.heavy
def test_unknown_keys_are_errors_that_name_them(tmp_path, quiet_env, monkeypatch, capsys):
    conf = tmp_path / "llmd.toml"
    conf.write_text('kv_memory = "64MiB"\nmax_num_seq = 4\n')
    assert main(["serve", "--config", str(conf), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert str(conf) in err and "max_num_seq" in err
    conf.write_text('max_num_seqs = "four"\n')
    with pytest.raises(settings_mod.SettingsError, match=f"{conf}: max_num_seqs must be int"):
        settings_mod.load({}, env={}, system_file=None, user_file=conf)
    with pytest.raises(settings_mod.SettingsError, match="environment: unknown setting variable.*LLMD_KV_MEMROY"):
        settings_mod.load({}, env={"LLMD_KV_MEMROY": "1GiB"}, system_file=None, user_file=tmp_path / "none.toml")
    with pytest.raises(settings_mod.SettingsError, match="LLMD_MAX_NUM_SEQS"):
        settings_mod.load({}, env={"LLMD_MAX_NUM_SEQS": "many"}, system_file=None, user_file=tmp_path / "none.toml")
    with pytest.raises(InvalidRequest, match="unknown engine option.*kv_mem"):
        LLM("unused", kv_mem="1GiB")


def test_the_kernel_switches_are_settings_and_their_old_variable_is_refused(tmp_path, quiet_env):
    env = {"LLMD_KERNELS": "avx2", "LLMD_AMX": "0", "LLMD_KERNEL_CACHE": str(tmp_path / "k")}
    s, source = settings_mod.load({}, env=env, system_file=None, user_file=tmp_path / "none.toml")
    assert (s.kernels, s.amx, s.kernel_cache) == ("avx2", False, str(tmp_path / "k"))
    assert {source[n] for n in ("kernels", "amx", "kernel_cache")} == {"environment"}
    assert s.engine_config(model="m").kernels == "avx2"
    with pytest.raises(settings_mod.SettingsError, match="kernels must be one of auto, avx512, avx2, off, got '0'"):
        settings_mod.load({}, env={"LLMD_KERNELS": "0"}, system_file=None, user_file=tmp_path / "none.toml")
    with pytest.raises(settings_mod.SettingsError, match="unknown setting variable.*LLMD_CACHE"):
        settings_mod.load({}, env={"LLMD_CACHE": "/x"}, system_file=None, user_file=tmp_path / "none.toml")
    args = build_parser().parse_args(["serve", "--kernels", "off", "--no-amx", "--kernel-cache", "/k"])
    assert given(args, Settings) == {"kernels": "off", "amx": False, "kernel_cache": "/k"}
