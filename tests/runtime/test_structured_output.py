"""Structured output: grammar masks in the batched sampler (free rows untouched, constrained rows
independent of their neighbours), the engine's constrained requests, and ``response_format`` and
Ollama's ``format`` through the real `openai` and `ollama` clients against a real daemon."""
from __future__ import annotations

import json

import ollama
import pytest
import torch

from http_fixtures import call
from tool_output_fixtures import MODEL, oai, served  # noqa: F401 (fixtures)
from llmd.bench.structured_schemas import schemas, valid
from llmd.runtime.errors import InvalidRequest
from llmd.runtime.grammar import NUMBER_DIGITS, GrammarCompiler, GrammarError, NumberRun
from llmd.runtime.llm import LLM
from llmd.runtime.request import Grammar, SamplingParams
from llmd.runtime.sampler import SamplingRow, make_generator, sample
from llmd.runtime.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


# -- the sampler -----------------------------------------------------------------------------------

def _rows(params: list[SamplingParams], masks: list, seed: int = 7) -> list[SamplingRow]:
    return [SamplingRow(p, None if p.greedy else make_generator(seed + i), [1, 2, 3, 2], 2, m)
            for i, (p, m) in enumerate(zip(params, masks))]


PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=50), SamplingParams(temperature=1.0, top_p=0.8),
          SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.7, min_p=0.05, presence_penalty=0.5),
          SamplingParams(logprobs=3)]


@pytest.mark.parametrize("constrained", [[0], [1, 2], [0, 3, 5], [4], [0, 1, 2, 3, 4, 5]])
def test_free_rows_draw_the_same_tokens_beside_constrained_ones(constrained):
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), 512) * 3
    masks = []
    for i in range(len(PARAMS)):
        m = torch.zeros(512, dtype=torch.bool)
        m[torch.randperm(512)[:7]] = True
        masks.append(m if i in constrained else None)
    free = sample(logits, _rows(PARAMS, [None] * len(PARAMS)), 3)
    mixed = sample(logits, _rows(PARAMS, masks), 3)
    for i in range(len(PARAMS)):
        if i in constrained:
            assert masks[i][mixed.token_ids[i]], f"row {i} drew a token its mask forbids"
            assert all(masks[i][t] for t, _ in mixed.logprobs[i]["top"] if mixed.logprobs[i]["top"][0][1] > -1e30)
        else:
            assert mixed.token_ids[i] == free.token_ids[i]
            assert mixed.logprobs[i] == free.logprobs[i]


def test_a_constrained_row_draws_the_same_alone_and_in_any_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 300) * 2
    mask = torch.zeros(300, dtype=torch.bool)
    mask[[5, 17, 99, 200]] = True
    p = SamplingParams(temperature=1.0, seed=3)
    alone = [sample(logits[2:3], [SamplingRow(p, make_generator(3), None, 0, mask)]).token_ids[0] for _ in range(1)]
    batch_rows = [SamplingRow(SamplingParams(), None, None, 0, None),
                  SamplingRow(SamplingParams(temperature=0.5), make_generator(9), None, 0, mask),
                  SamplingRow(p, make_generator(3), None, 0, mask),
                  SamplingRow(SamplingParams(top_k=2, temperature=2.0), make_generator(1), None, 0, None)]
    assert sample(logits, batch_rows).token_ids[2] == alone[0]


def test_a_greedy_constrained_row_takes_the_best_allowed_token():
    logits = torch.tensor([[0.0, 5.0, 1.0, 3.0], [0.0, 5.0, 1.0, 3.0]])
    mask = torch.tensor([True, False, True, True])
    out = sample(logits, [SamplingRow(SamplingParams(), allowed=mask), SamplingRow(SamplingParams())])
    assert out.token_ids.tolist() == [3, 1]


def test_a_mask_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="mask"):
        sample(torch.zeros(1, 8), [SamplingRow(SamplingParams(), allowed=torch.ones(9, dtype=torch.bool))])


# -- grammars --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler():
    tok = Tokenizer.from_dir(MODEL)
    return GrammarCompiler(tok.to_json(), 8192, tuple(tok.eos_token_ids)), tok


def test_a_matcher_allows_exactly_the_text_of_its_schema(compiler):
    c, tok = compiler
    m = c.compile(Grammar("json_schema", json.dumps(PERSON)))
    assert not m.allowed()[tok.encode("hello", add_special_tokens=False)[0]]
    for t in tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False):
        assert m.allowed()[t]
        assert m.advance(t)
    assert m.stopped and m.allowed().nonzero().flatten().tolist() == list(tok.eos_token_ids)


def _walk(m, tok, text: str, token_id: int, limit: int = 80) -> int:
    """Advance ``m`` over ``text``, then over ``token_id`` while the mask allows it; how many times."""
    for t in tok.encode(text, add_special_tokens=False):
        assert m.advance(t)
    n = 0
    while m.allowed()[token_id] and n < limit:
        assert m.advance(token_id)
        n += 1
    return n


def test_a_number_ends_where_its_digits_reach_the_bound(compiler):
    c, tok = compiler
    zero = tok.encode("0", add_special_tokens=False)[0]
    at_most_100 = {"type": "object", "properties": {"x": {"type": "number", "maximum": 100}}, "required": ["x"]}
    m = c.compile(Grammar("json_schema", json.dumps(at_most_100)))
    assert _walk(m, tok, '{"x": 100.', zero) == NUMBER_DIGITS["frac"]     # 100.000... was the grammar's only way on
    allowed = {tok.decode([t]) for t in m.allowed().nonzero().flatten().tolist()}
    assert allowed and not any(a[:1].isdigit() for a in allowed)
    for t in tok.encode("}", add_special_tokens=False):
        assert m.advance(t)
    assert m.stopped
    m = c.compile(Grammar("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}})))
    assert _walk(m, tok, "[7", zero) == NUMBER_DIGITS["int"] - 1


def test_the_digit_bound_yields_where_the_grammar_needs_more_digits(compiler):
    c, tok = compiler
    zero = tok.encode("0", add_special_tokens=False)[0]
    tiny = {"type": "object", "properties": {"x": {"type": "number", "exclusiveMinimum": 0, "maximum": 1e-18}}}
    m = c.compile(Grammar("json_schema", json.dumps(tiny)))
    assert _walk(m, tok, '{"x": 0.', zero, limit=30) == 30            # only digits can go on: none is masked


@pytest.mark.parametrize("text, part, digits", [("12", "int", 2), ("-0.125", "frac", 3), ("1.5e+07", "exp", 2),
                                                ('{"a": 12, "b": "', None, 0), (r'"x\\" 1', "int", 1), (r'"x\" 1', None, 0),
                                                (r'"9\"9" ', None, 0), ("[1, 22", "int", 2), ("3E", "exp", 0)])
def test_the_number_run_reads_json_text(text, part, digits):
    run = NumberRun()
    run.feed(text.encode())
    assert (run.part, run.digits if run.part else 0) == (part, digits)


@pytest.mark.parametrize("text, why", [('{"type": "strin"}', "strin"), ("[1, 2]", "JSON object"),
                                        ("{not json", "not valid JSON"), ('{"$ref": "#/defs/none"}', "none"),
                                        ('{"type": "object", "propertyNames": {"pattern": "a"}}', "propertyNames")])
def test_a_schema_the_library_cannot_honour_is_refused(compiler, text, why):
    with pytest.raises(GrammarError, match=why) as e:
        compiler[0].compile(Grammar("json_schema", text))
    assert isinstance(e.value, InvalidRequest)      # the daemon answers invalid_request: a 400 over HTTP


def test_grammar_fields_are_bounded():
    with pytest.raises(InvalidRequest, match="kind"):
        SamplingParams(grammar={"kind": "regex", "text": "a+"})
    with pytest.raises(InvalidRequest, match="schema"):
        Grammar("json_schema", "")
    with pytest.raises(InvalidRequest, match="at most"):
        Grammar("json_schema", "{" + " " * (1 << 16) + "}")


# -- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(str(MODEL), draft="none")


def _run(llm, jobs: dict) -> dict:
    e, texts = llm.engine, {}
    for rid, (prompt, params) in jobs.items():
        e.add_request(rid, prompt, params)
        texts[rid] = ""
    while e.has_unfinished():
        for out in e.step():
            assert out.error is None, out.error
            texts[out.request_id] += out.text_delta
    return texts


def test_free_requests_give_the_same_text_beside_constrained_ones(llm):
    free = {f"f{i}": (f"def f{i}(x):\n", SamplingParams(max_tokens=24, temperature=0.8 * (i % 2), seed=i))
            for i in range(4)}
    alone = _run(llm, free)
    schema = Grammar("json_schema", json.dumps(PERSON))
    mixed = _run(llm, {**free, **{f"c{i}": (f"# person {i}\np = ", SamplingParams(max_tokens=60, grammar=schema))
                                  for i in range(3)}})
    assert {k: mixed[k] for k in free} == alone
    for i in range(3):
        assert valid(json.loads(mixed[f"c{i}"]), PERSON)


def test_ten_schemas_all_give_valid_json(llm):
    cases = schemas()[::5]
    jobs = {f"s{i}": (f"# JSON for {json.dumps(s)}\nvalue = ", SamplingParams(max_tokens=160, grammar=Grammar(
        "json_schema", json.dumps(s)))) for i, s in enumerate(cases)}
    texts = _run(llm, jobs)
    for i, s in enumerate(cases):
        assert valid(json.loads(texts[f"s{i}"]), s), (s, texts[f"s{i}"])


# -- over HTTP -------------------------------------------------------------------------------------

def test_json_schema_answers_validate(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = oai.chat.completions.create(model="llmd", messages=[{"role": "user", "content": "A person, please."}],
                                    response_format=fmt, max_tokens=80)
    assert valid(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_json_object_answers_parse_as_objects_also_when_streamed(oai):
    r = oai.chat.completions.create(model="llmd", messages=[{"role": "user", "content": "A dict of options."}],
                                    response_format={"type": "json_object"}, max_tokens=120)
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    chunks = oai.chat.completions.create(model="llmd", messages=[{"role": "user", "content": "A dict of options."}],
                                         response_format={"type": "json_object"}, max_tokens=120, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content


def test_completions_take_a_response_format(oai):
    r = oai.completions.create(model="llmd", prompt="config = ", max_tokens=80,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "p", "schema": PERSON}}})
    assert valid(json.loads(r.choices[0].text), PERSON)


@pytest.mark.heavy
def test_ollama_format_json_and_schema(served):
    client = ollama.Client(host=served[1], timeout=60)
    r = client.chat(model="llmd", messages=[{"role": "user", "content": "A person."}], format=PERSON,
                    options={"num_predict": 80})
    assert valid(json.loads(r.message.content), PERSON)
    g = client.generate(model="llmd", prompt="data = ", format="json", raw=True, options={"num_predict": 120})
    assert isinstance(json.loads(g.response), dict)


@pytest.mark.parametrize("fmt, why", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "strin"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                     "propertyNames": {"pattern": "a"}}}},
     "propertyNames")])
@pytest.mark.heavy
def test_a_format_llmd_cannot_honour_is_a_400_and_the_daemon_serves_on(served, oai, fmt, why):
    status, _, raw = call(served[1] + "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "x"}], "response_format": fmt, "max_tokens": 4})
    assert status == 400 and why in json.loads(raw)["error"]["message"]
    status, _, raw = call(served[1] + "/api/chat", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    "format": 7, "stream": False})
    assert status == 400 and "format" in json.loads(raw)["error"]
    r = oai.chat.completions.create(model="llmd", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None
