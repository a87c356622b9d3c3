"""The kernels' switches (EngineConfig's kernels, amx, kernel_cache): what an engine sets wins, an unset one
comes from its LLMD_* variable, bad values are errors that name their source, and the first load fixes
them for the process. Each case that loads (or refuses) a library runs in a fresh interpreter."""
import json
import os
import subprocess
import sys

import pytest

from llmd.runtime.errors import InvalidRequest
from llmd.runtime.kernels.switches import Switches, from_environment


def run(code: str, *argv: str, **env) -> list:
    """``code``'s last printed line (JSON), run with ``argv`` in a fresh interpreter with ``env`` added (a
    value of None removes the variable)."""
    merged = dict(os.environ)
    for k, v in env.items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = v
    done = subprocess.run([sys.executable, "-c", code, *argv], env=merged, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


UNSET = {"LLMD_KERNELS": None, "LLMD_AMX": None, "LLMD_KERNEL_CACHE": None}


def test_unset_switches_come_from_their_variables_and_given_ones_win():
    assert from_environment(env={}) == Switches("auto", True, None)
    env = {"LLMD_KERNELS": "avx2", "LLMD_AMX": "off", "LLMD_KERNEL_CACHE": "/srv/kernels"}
    assert from_environment(env=env) == Switches("avx2", False, "/srv/kernels")
    given = from_environment(env=env, kernels="off", amx=True, kernel_cache=None)
    assert given == Switches("off", True, "/srv/kernels")
    assert from_environment(env={"LLMD_AMX": "1", "LLMD_KERNEL_CACHE": ""}) == Switches("auto", True, None)


@pytest.mark.parametrize("env,message", [
    ({"LLMD_KERNELS": "0"}, "LLMD_KERNELS: kernels must be one of auto, avx512, avx2, off, got '0'"),
    ({"LLMD_KERNELS": "AVX2"}, "LLMD_KERNELS: kernels must be one of"),
    ({"LLMD_AMX": "maybe"}, "LLMD_AMX: amx must be bool or none, got 'maybe'"),
])
def test_a_bad_variable_is_an_error_that_names_it(env, message):
    with pytest.raises(InvalidRequest, match=message):
        from_environment(env=env)
    with pytest.raises(InvalidRequest, match="kernels must be one of"):
        Switches(kernels="sse")


@pytest.mark.heavy
def test_configure_chooses_before_the_first_load_and_refuses_another_choice_after_it():
    out = run("""
import json
from llmd.runtime import kernels
from llmd.runtime.errors import InvalidRequest
kernels.configure(kernels="off")
said = [kernels.available(), kernels.why()]
kernels.configure(kernels="off", amx=True)            # the values in force: accepted
for asked in ({"kernels": "auto"}, {"amx": False}):
    try:
        kernels.configure(**asked)
        said.append("accepted")
    except InvalidRequest as e:
        said.append(str(e))
print(json.dumps(said))
""", **UNSET)
    assert out[0] is False and "kernels = off" in out[1]
    assert "set up in this process with kernels = off; kernels = auto takes effect only in a new process" in out[2]
    assert "with amx = true; amx = false takes effect only in a new process" in out[3]


@pytest.mark.heavy
def test_a_library_asked_for_by_name_that_cannot_load_is_refused():
    from llmd.runtime import kernels
    if not kernels.available() or kernels.load("avx512") is not None:
        pytest.skip("this CPU runs every library (or none)")
    out = run("""
import json
from llmd.runtime import kernels
from llmd.runtime.errors import InvalidRequest
try:
    kernels.configure(kernels="avx512")
    print(json.dumps("accepted"))
except InvalidRequest as e:
    print(json.dumps(str(e)))
""", **UNSET)
    assert out.startswith("kernels = avx512 cannot be honoured: the avx512 library (kernels = avx512) does not run")
    assert out.endswith("set kernels = auto to load the library this CPU runs")


@pytest.mark.heavy
def test_the_kernels_variable_still_turns_them_off_without_an_engine():
    out = run("import json; from llmd.runtime import kernels; print(json.dumps([kernels.available(), kernels.why()]))",
              **{**UNSET, "LLMD_KERNELS": "off"})
    assert out == [False, "turned off (kernels = off: the --kernels flag, llmd.toml or LLMD_KERNELS)"]


@pytest.mark.heavy
def test_an_engine_setting_reaches_the_kernels_and_wins_over_the_variable(tiny_model_dir):
    code = """
import json, sys
from llmd.runtime import kernels
from llmd.runtime.llm import LLM
from llmd.runtime.request import SamplingParams
llm = LLM(sys.argv[1], kv_memory="16MiB", draft="none", kernels=sys.argv[2])
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
print(json.dumps([kernels.switches().kernels, kernels.variant(), llm.stats().get("cpu_kernels")]))
"""
    assert run(code, str(tiny_model_dir), "off", **{**UNSET, "LLMD_KERNELS": "auto"}) == ["off", "", "none"]
    from llmd.runtime import kernels
    if kernels.available():
        auto = run(code, str(tiny_model_dir), "auto", **{**UNSET, "LLMD_KERNELS": "off"})
        assert auto[0] == "auto" and auto[1] in kernels.VARIANTS and auto[2] == auto[1]
