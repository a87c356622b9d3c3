"""Each sampling parameter is declared once (llmd.sampling_fields) and every layer derives from it:
the wire's Sampling model, the runtime's SamplingParams, the Python client's keys, the HTTP fronts'
bodies, and the table in docs/protocol.md. These tests walk the declarations, so a new parameter is
checked here without a line added."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from llmd import protocol
from llmd.clients import client, http_api, http_llamacpp, http_ollama_api
from llmd.clients.http_api import HttpError
from llmd.clients.http_knobs import chained, knobs
from llmd.runtime.errors import InvalidRequest
from llmd.runtime.request import SamplingParams
from llmd.sampling_fields import (BY_NAME, LLAMA, OPENAI, PARAMS, PENALTIES, PENALTY, WIRE, Param, for_front,
                                  markdown_table)

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
NUMBERS = [p for p in WIRE if p.kind in ("int", "float")]


def probes(p: Param) -> list:
    """Values at, inside and just past each bound of a numeric parameter."""
    step = 1 if p.kind == "int" else 1e-6
    values = [p.default] if p.default is not None else []
    for bound in (p.low, p.high):
        if bound is not None:
            values += [bound, bound - step, bound + step]
    values = [int(v) if p.kind == "int" else float(v) for v in values]
    return values + ([math.nan, math.inf] if p.kind == "float" else [True, 1.5])


def wire_ok(name: str, value) -> bool:
    try:
        protocol.parse_request({"type": "generate", "id": "r", "prompt": "x", "params": {name: value}})
        return True
    except protocol.ProtocolError as e:
        assert e.code == protocol.INVALID_REQUEST and f"params.{name}" in e.message, e.message
        return False


def runtime_ok(name: str, value) -> bool:
    try:
        SamplingParams(**{name: value})
        return True
    except InvalidRequest as e:
        assert str(e).startswith(name), e
        return False


@pytest.mark.parametrize("p", NUMBERS, ids=lambda p: p.name)
def test_the_wire_and_the_runtime_take_the_same_values(p):
    for value in probes(p):
        expected = p.kind == "float" and isinstance(value, float) and math.isfinite(value) and p.in_range(value) \
            or p.kind == "int" and type(value) is int and p.in_range(value)
        assert wire_ok(p.name, value) == runtime_ok(p.name, value) == expected, value


def test_every_declared_field_is_on_the_wire_in_the_runtime_and_in_the_client():
    assert list(protocol.Sampling.model_fields) == [p.name for p in WIRE]
    assert [f.name for f in dataclasses.fields(SamplingParams)] == [p.name for p in PARAMS]
    assert client.SAMPLING_KEYS == tuple(p.name for p in WIRE)
    defaults = SamplingParams()
    for p in WIRE:
        assert protocol.Sampling().model_dump()[p.name] == (list(p.default) if isinstance(p.default, tuple)
                                                            else p.default)
        assert getattr(defaults, p.name) == p.default
    wire = protocol.parse_request({"type": "generate", "id": "r", "prompt": "x"}).params.model_dump()
    assert SamplingParams(**wire) == defaults                     # as the daemon builds them


def test_runtime_only_fields_are_refused_on_the_wire_and_by_the_client():
    for p in PARAMS:
        if not p.wire:
            assert not wire_ok(p.name, p.default)
            with pytest.raises(TypeError, match="unknown sampling"):
                client.work_message("generate", "r", {p.name: p.default}, None, None, False, prompt="x")


def test_sampling_params_take_keywords_only_and_stay_frozen():
    with pytest.raises(TypeError):
        SamplingParams(64)
    params = SamplingParams(stop="end", stop_token_ids=[7])
    assert params.stop == ("end",) and params.stop_token_ids == (7,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0


def test_penalties_and_knobs_on_follow_the_declared_off_values():
    assert not SamplingParams().needs_penalties and SamplingParams().knobs_on == frozenset()
    for p in PENALTIES:
        on = p.high if p.high != p.default else p.low
        assert SamplingParams(**{p.name: on}).needs_penalties, p.name
    for p in [p for p in PARAMS if p.stage and p.stage != PENALTY]:
        on = (p.low + p.high) / 2 if p.kind == "float" else 1
        params = SamplingParams(**{p.name: on})
        assert params.knobs_on == {p.name} and not params.needs_penalties, p.name


# the bodies of each HTTP front that take the knobs as they are, and where the knobs sit in them
FRONT_BODIES = {
    OPENAI: [(http_api.CompletionBody, {"prompt": "x"}, ""), (http_api.ChatBody,
                                                              {"messages": [{"role": "user", "content": "x"}]}, "")],
    LLAMA: [(http_llamacpp.CompletionBody, {"prompt": "x"}, ""), (http_ollama_api.GenerateBody, {}, "options."),
            (http_api.InfillBody, {}, "")],
}


def body_with(model, base: dict, where: str, fields: dict):
    body = {**base, "options": fields} if where else {**base, **fields}
    return http_api.parse(model, json.dumps(body).encode())


def sampled(model, body) -> dict:
    if model is http_ollama_api.GenerateBody:
        return knobs(body.options, LLAMA)
    return knobs(body, OPENAI if model in (http_api.CompletionBody, http_api.ChatBody) else LLAMA,
                 penalties=model is not http_api.InfillBody)


@pytest.mark.parametrize("front", [OPENAI, LLAMA])
def test_each_front_takes_its_knobs_in_its_spelling_with_llmds_bounds(front):
    for model, base, where in FRONT_BODIES[front]:
        for p, spelling in for_front(front):
            if model is http_api.InfillBody and p.stage == PENALTY:
                continue                                  # /infill cannot say the penalties' window
            inside = p.high if p.kind == "int" else (p.low + p.high) / 2
            assert sampled(model, body_with(model, base, where, {spelling.name: inside})) == {p.name: inside}
            past = (spelling.high or p.high) + 1
            with pytest.raises(HttpError) as e:
                body_with(model, base, where, {spelling.name: past})
            assert e.value.status == 400 and e.value.param == where + spelling.name


def test_a_fronts_wider_bound_means_the_parameters_bound():
    wide = [(p, s) for p, s in for_front(LLAMA) if s.high is not None]
    assert wide, "typical_p: llama.cpp's values of 1 and more are off"
    for p, s in wide:
        body = body_with(http_llamacpp.CompletionBody, {"prompt": "x"}, "", {s.name: s.high})
        assert knobs(body, LLAMA)[p.name] == p.high


def test_a_samplers_chain_drops_the_filters_it_leaves_out():
    sampling = {p.name: p.default for p in PARAMS if p.stage or p.name == "temperature"}
    kept = chained(sampling, ["typ_p", "temperature"])
    assert set(kept) == {"typical_p", "temperature"} | {p.name for p in PENALTIES}
    assert chained(sampling, []) == sampling


def test_the_docs_table_is_the_declarations():
    table = markdown_table()
    assert table in DOC.read_text(), "regenerate the params table: python -m llmd.sampling_fields"
    assert all(f"| `{p.name}` |" in table for p in WIRE) and "skip_special_tokens" not in table


def test_a_bad_declaration_is_refused():
    with pytest.raises(ValueError, match="kind"):
        Param("x", "complex", 0, "")
    with pytest.raises(ValueError, match="x must be"):
        Param("x", "float", 2.0, "", low=0, high=1)
    assert BY_NAME["typical_p"].stage and BY_NAME["typical_p"].chain == "typ_p"
