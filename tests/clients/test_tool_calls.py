"""Tool calling: calls read from both forms models write (Hermes-style ``<tool_call>`` blocks and
Llama 3's JSON), streamed as they complete; tools and calls placed by the chat template (or written
into the messages where it has no tool section); and a forced call, a round trip and refusals
through the real `openai` and `ollama` clients against a real daemon."""
from __future__ import annotations

import json
from pathlib import Path

import ollama
import pytest

from http_fixtures import call
from optional import need
from tool_output_fixtures import MODEL, oai, served  # noqa: F401 (fixtures)
from llmd.bench.structured_schemas import valid
from llmd.clients.http_tools import ToolError, ToolStream, call_grammar, parse_calls, wire_tools
from llmd.runtime.chat_template import ChatTemplate
from llmd.runtime.errors import InvalidRequest

openai = need("openai")

LIGHT = {"type": "object", "properties": {"room": {"enum": ["kitchen", "hall", "bedroom"]},
                                          "brightness": {"type": "integer", "minimum": 0, "maximum": 100}},
         "required": ["room", "brightness"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "turn_on", "description": "Switch a light on", "parameters": LIGHT}},
         {"type": "function", "function": {"name": "turn_off", "description": "Switch a light off",
                                           "parameters": {"type": "object", "properties": {"room": {"type": "string",
                                                                                                    "maxLength": 12}},
                                                          "required": ["room"], "additionalProperties": False}}}]
NAMES = {"turn_on", "turn_off"}
ASK = [{"role": "user", "content": "Switch the kitchen light on."}]


# -- reading calls ---------------------------------------------------------------------------------

def test_hermes_blocks_and_llama_json_are_read_as_calls():
    text = 'Sure.\n<tool_call>\n{"name": "turn_on", "arguments": {"room": "hall"}}\n</tool_call>\n' \
           '<tool_call>{"name": "turn_off", "arguments": "{\\"room\\": \\"kitchen\\"}"}</tool_call>'
    content, calls = parse_calls(text, NAMES)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("turn_on", {"room": "hall"}), ("turn_off", {"room": "kitchen"})]
    content, calls = parse_calls(' {"name": "turn_on", "parameters": {"room": "hall"}}', NAMES)
    assert content == "" and calls[0].arguments == {"room": "hall"}


@pytest.mark.parametrize("text", ['{"name": "unlock_door", "arguments": {}}', "<tool_call>not json</tool_call>",
                                  '{"name": "turn_on", "arguments": [1]}', "plain text {", ""])
def test_what_is_no_call_to_an_offered_function_stays_text(text):
    assert parse_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "turn_on", "arguments": {"room": "hall"}}\n</tool_call> done <tool',
    '{"name": "turn_off", "arguments": {"room": "hall"}}', "no calls here < tool_call", '{"a": 1}',
    'x<tool_call>{"name": "turn_on", "arguments": {}}'])
def test_streaming_releases_the_same_text_and_calls_as_the_whole(text):
    s, parts, calls = ToolStream(NAMES), [], []
    for ch in text:
        got, found = s.feed(ch)
        parts.append(got)
        calls += found
        assert "<tool_call>" not in got
    got, found = s.finish()
    whole_text, whole_calls = parse_calls(text, NAMES)
    assert [(c.name, c.arguments) for c in calls + found] == [(c.name, c.arguments) for c in whole_calls]
    assert "".join(parts + [got]).strip() == whole_text.strip()


def test_text_before_a_call_streams_before_the_call_ends():
    s = ToolStream(NAMES)
    assert s.feed("Switching it on. <tool") == ("Switching it on. ", [])
    assert s.feed('_call>{"name": "turn_on", ') == ("", [])
    text, calls = s.feed('"arguments": {"room": "hall"}}</tool_call>')
    assert text == "" and calls[0].name == "turn_on"


def test_tool_choice_builds_a_grammar_for_a_valid_call():
    tools = wire_tools(TOOLS)
    assert call_grammar(tools, None) == (None, True) and call_grammar(tools, "none") == (None, False)
    grammar, offered = call_grammar(tools, "required")
    assert offered and len(json.loads(grammar["text"])["anyOf"]) == 2
    grammar, _ = call_grammar(tools, {"type": "function", "function": {"name": "turn_off"}})
    assert json.loads(grammar["text"])["properties"]["name"] == {"const": "turn_off"}
    for bad in ({"type": "function", "function": {"name": "unlock"}}, "always", 3):
        with pytest.raises(ToolError, match="tool_choice"):
            call_grammar(tools, bad)
    with pytest.raises(ToolError, match="needs tools"):
        call_grammar([], "required")


# -- the chat template -----------------------------------------------------------------------------

# a template of the shape Qwen2.5's has: tools in the system turn, calls as <tool_call> JSON
WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "\n</tools><|im_end|>\n{%- endif %}{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for c in message.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
PLAIN = "{% for m in messages %}# {{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}"
ROUND_TRIP = ASK + [{"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_1", "name": "turn_on", "arguments": '{"room": "kitchen", "brightness": 80}'}]},
    {"role": "tool", "content": "ok", "tool_call_id": "call_1", "name": "turn_on"}]


def _template(source: str) -> ChatTemplate:
    return ChatTemplate(source, Path("."), "", "<|im_end|>", ["<|im_start|>", "<|im_end|>"], True)


def test_tools_and_calls_reach_a_template_with_a_tool_section():
    pieces = _template(WITH_TOOLS).render_pieces(ROUND_TRIP, True, [t["function"] for t in TOOLS])
    text = "".join(t for t, _ in pieces)
    assert '"name": "turn_on", "description": "Switch a light on", "parameters": {"type": "object"' in text
    assert '<tool_call>\n{"name": "turn_on", "arguments": {"room": "kitchen", "brightness": 80}}\n</tool_call>' in text
    assert "<tool_response>\nok\n</tool_response>" in text
    assert [t for t, is_content in pieces if is_content] == ["Switch the kitchen light on.", "ok"]


def test_a_template_without_a_tool_section_gets_them_as_message_text():
    pieces = _template(PLAIN).render_pieces(ROUND_TRIP, True, TOOLS)
    contents = [t for t, is_content in pieces if is_content]
    assert contents[0].startswith("You may call functions") and '"name": "turn_off"' in contents[0]
    assert '<tool_call>\n{"name": "turn_on", "arguments": {"room": "kitchen", "brightness": 80}}\n</tool_call>' \
        in contents
    assert "# tool: ok" in "".join(t for t, _ in pieces)


def test_a_control_token_in_a_call_or_tool_is_refused():
    bad = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"name": "turn_on", "arguments": {"room": "<|im_end|>"}}]}]
    with pytest.raises(InvalidRequest, match="special token"):
        _template(WITH_TOOLS).render_pieces(bad, True)
    with pytest.raises(InvalidRequest, match="tools"):
        _template(WITH_TOOLS).render(ASK, True, [{"name": ""}])


# -- over HTTP -------------------------------------------------------------------------------------

def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    assert valid(args, schema), args
    return args


def test_a_required_call_comes_back_parsed_and_the_round_trip_answers(oai):
    r = oai.chat.completions.create(model="llmd", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    tc = choice.message.tool_calls[0]
    assert tc.type == "function" and tc.function.name in NAMES and tc.id.startswith("call_")
    _check_call(tc.function.name, tc.function.arguments)
    back = ASK + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": tc.id, "content": "the light is on"}]
    answer = oai.chat.completions.create(model="llmd", messages=back, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > r.usage.prompt_tokens


def test_a_named_call_is_streamed_as_a_tool_calls_delta(oai):
    chunks = list(oai.chat.completions.create(
        model="llmd", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "turn_off"}},
        max_tokens=60, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "turn_off"
    _check_call("turn_off", deltas[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tools_reach_the_prompt(oai):
    plain = oai.chat.completions.create(model="llmd", messages=ASK, max_tokens=1)
    offered = oai.chat.completions.create(model="llmd", messages=ASK, tools=TOOLS, max_tokens=1)
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 40


@pytest.mark.parametrize("extra, why", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "unlock"}}}, "unlock"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot both"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f",
                                                                                     "arguments": "{"}}]}]},
     "arguments")])
@pytest.mark.heavy
def test_bad_tool_requests_are_400_and_the_daemon_serves_on(served, oai, extra, why):
    status, _, raw = call(served[1] + "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra})
    assert status == 400 and why in json.loads(raw)["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="llmd", messages=ASK, tools=TOOLS, max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "unlock"}})
    assert oai.chat.completions.create(model="llmd", messages=ASK, max_tokens=2).choices[0].message.content


@pytest.mark.heavy
def test_ollama_reads_calls_and_takes_them_back(served):
    client = ollama.Client(host=served[1], timeout=60)
    call_schema = {"type": "object", "properties": {"name": {"const": "turn_on"}, "arguments": LIGHT},
                   "required": ["name", "arguments"], "additionalProperties": False}
    r = client.chat(model="llmd", messages=ASK, tools=TOOLS, format=call_schema, options={"num_predict": 60})
    assert r.message.content == "" and len(r.message.tool_calls) == 1
    tc = r.message.tool_calls[0]
    assert tc.function.name == "turn_on" and valid(dict(tc.function.arguments), LIGHT)
    streamed = [c for c in client.chat(model="llmd", messages=ASK, tools=TOOLS, format=call_schema, stream=True,
                                       options={"num_predict": 60}) if c.message.tool_calls]
    assert [c.message.tool_calls[0].function.arguments for c in streamed] == [tc.function.arguments]
    back = ASK + [{"role": "assistant", "content": "", "tool_calls": [tc.model_dump()]},
                  {"role": "tool", "content": "the light is on", "tool_name": "turn_on"}]
    answer = client.chat(model="llmd", messages=back, tools=TOOLS, options={"num_predict": 4})
    assert answer.done and answer.prompt_eval_count > r.prompt_eval_count


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ''.join(f'<tool_call>{{"name": "turn_on", "arguments": {{"room": "{r}"}}}}</tool_call>'
                   for r in ("hall", "kitchen"))
    assert [c.arguments for c in parse_calls(text, NAMES)[1]] == [{"room": "hall"}, {"room": "kitchen"}]
    assert [c.arguments for c in parse_calls(text, NAMES, 1)[1]] == [{"room": "hall"}]
    s = ToolStream(NAMES, 1)
    released = [s.feed(ch) for ch in text] + [s.finish()]
    assert [c.arguments for _, calls in released for c in calls] == [{"room": "hall"}]
