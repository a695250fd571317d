"""Structured output at the API (API process, no torch): which constraint a request asks for,
and chat's tool calls, written into the output and read back out of it.

A request names at most one constraint, in any of these forms (each becomes the engine's
(kind, text), compiled and enforced per row in the engine, server/engine/constraints.py):

- OpenAI's `response_format`: {"type": "json_object"}, or {"type": "json_schema", "json_schema":
  {"name": ..., "schema": {...}}}; {"type": "text"} is no constraint;
- vLLM's `guided_json` (a schema, as an object or its JSON text), `guided_regex`, `guided_choice`
  (a list of strings) and `guided_grammar` (a Lark grammar, llguidance's dialect), or the same in
  vLLM's newer `structured_outputs` object (`json`, `regex`, `choice`, `grammar`);
- on /v1/chat/completions, `tools` with `tool_choice` "auto", "required" or a named function.

A JSON schema (response_format's, a tool's `parameters`) is enforced as OpenAI's API enforces
it: with `"strict": true` every keyword must be one the engine implements (a refusal names the
one that is not) and an object that does not say `additionalProperties` may hold no other
properties (OpenAI's strict mode requires `additionalProperties: false`; vLLM takes it as that);
otherwise keywords and formats the engine does not implement (`uniqueItems`, `not`, `if`,
`"format": "uri-reference"`, ...) are ignored rather than refused, as JSON Schema treats unknown
formats (`enforced_schema`; vLLM's guided_json has no `strict`: always so).

Tool calls are text the model writes, in the form Hermes-style templates use:
`<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`, one block per
call, nothing between them. The constraint is a grammar that allows exactly those blocks with
each function's `parameters` schema for its arguments ("required"; exactly one block for a named
function), or either those blocks or text that does not start with "<" ("auto": the first
character decides). The answer carries the calls as OpenAI's `tool_calls` (finish_reason
"tool_calls"); a stream sends each call's id and name once its name is complete and then its
arguments as they are generated (`ToolCallStream`); an answer that starts a call is never
content, even where it ends before the call's name is whole. The chat template gets `tools` (as
Hugging Face templates do) to describe them to the model. An assistant message's `tool_calls` go
to the template with their arguments parsed; a template that does not render `tool_calls` itself
gets them as the same blocks, appended to the message's content (`render_message`).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from xlserve.server.api.errors import InvalidRequest
from xlserve.server.api.protocol import json_depth_exceeded, too_deep

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
CALL_END = "}" + TOOL_CLOSE  # what follows a call's arguments: the call object's brace, the closing tag
# how the engine lays out JSON (server/engine/constraints.py JSON_OPTIONS), for schemas embedded in a grammar
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CALL_HEAD = re.compile(r'<tool_call>\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs")
# vLLM's structured_outputs object: its fields and the guided_* field each stands for
STRUCTURED_OUTPUTS = {"json_": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar"}


def _too_large(text: str, param: str, limit: int) -> None:
    size = len(text.encode("utf-8"))
    if size > limit:
        raise InvalidRequest(f"{param} is {size} bytes as a constraint; the limit is {limit} "
                             "(XLSERVE_STRUCTURED_MAX_BYTES)", param=param, code="grammar_too_large")


def requested_constraint(body, limit: int) -> tuple[str, str, str] | None:
    """(kind, text, the field it came from) of the one constraint `body` asks for, or None;
    400 for two at once, a json_schema format without its schema, or a text over `limit` bytes."""
    given = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None and response_format.type != "json_schema" and response_format.json_schema is not None:
        # a schema that would be ignored: no parameter is (the client meant type "json_schema")
        raise InvalidRequest(f'response_format of type "{response_format.type}" takes no json_schema; give type '
                             '"json_schema" to constrain the output to it', param="response_format.json_schema",
                             code="invalid_response_format")
    if response_format is not None and response_format.type != "text":
        given.append("response_format")
    given += [name for name in CONSTRAINT_FIELDS[1:-1] if getattr(body, name, None) is not None]
    values = {name: getattr(body, name, None) for name in STRUCTURED_OUTPUTS.values()}
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:  # vLLM's newer form: each of its fields as the guided_* field it stands for
        inner = [field for field in STRUCTURED_OUTPUTS if getattr(structured, field) is not None]
        given += [f"structured_outputs.{field.rstrip('_')}" for field in inner]
        values.update({STRUCTURED_OUTPUTS[field]: getattr(structured, field) for field in inner})
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"{' and '.join(given)} both constrain the output; give one", param=given[1],
                             code="invalid_response_format")
    param = given[0]
    # the guided_* field the constraint is, whichever form named it
    form = {f"structured_outputs.{field.rstrip('_')}": guided for field, guided in STRUCTURED_OUTPUTS.items()
            }.get(param, param)
    if form == "response_format":
        if response_format.type == "json_object":
            kind, text = "json_object", ""
        else:
            spec = response_format.json_schema
            if spec is None:
                raise InvalidRequest('response_format of type "json_schema" needs json_schema: {"name": ..., '
                                     '"schema": {...}}', param="response_format", code="invalid_response_format")
            kind, text = (("json_object", "") if spec.schema_ is None else
                          ("json_schema", json.dumps(enforced_schema(spec.schema_, strict=spec.strict is True))))
    elif form == "guided_json":
        value = values["guided_json"]
        if isinstance(value, str):
            if json_depth_exceeded(value):  # the body's own depth check cannot see inside a string
                raise too_deep(param, code="invalid_response_format", param=param)
            try:
                value = json.loads(value)
            except ValueError as error:
                raise InvalidRequest(f"guided_json is not JSON: {error}", param=param,
                                     code="invalid_response_format") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest("guided_json must be a JSON schema (an object)", param=param,
                                 code="invalid_response_format")
        kind, text = "json_schema", json.dumps(enforced_schema(value, strict=False))  # vLLM's field has no strict
    elif form == "guided_regex":
        kind, text = "regex", values["guided_regex"]
    elif form == "guided_choice":
        kind, text = "choice", json.dumps(values["guided_choice"])
    else:
        kind, text = "grammar", values["guided_grammar"]
    _too_large(text, param, limit)
    return kind, text, param


# -- tools ---------------------------------------------------------------------------------------


def called_functions(tools: list, tool_choice) -> list | None:
    """The functions a chat request may call (its `tools`, or the one `tool_choice` names), or
    None when it calls none ("none", no tools); 400 for a tool_choice that does not fit."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if tool_choice == "none":
        return None
    if tool_choice in (None, "auto", "required"):
        return [tool.function for tool in tools]
    chosen = [tool.function for tool in tools if tool.function.name == tool_choice.function.name]
    if not chosen:
        raise InvalidRequest(f"tool_choice names function '{tool_choice.function.name}', which is not among the "
                             f"tools: {[tool.function.name for tool in tools][:10]}", param="tool_choice")
    return chosen


# keywords whose value is a subschema, a list of subschemas, or a map of names to subschemas
SUBSCHEMA_KEYWORDS = frozenset({"items", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
                                "else", "propertyNames", "unevaluatedItems", "unevaluatedProperties"})
SUBSCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
# keywords whose values are JSON data, not schemas: nothing inside them is a keyword
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` in each object schema that says nothing of
    other properties (neither `additionalProperties` nor `unevaluatedProperties`): what OpenAI's
    strict mode requires of every object, and what vLLM makes of one that leaves it out. Without
    it a model may add any key it likes ({"name": "c", "age": 23, "": 10})."""
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(subschema) for name, subschema in value.items()}
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            closed[key] = [closed_objects(subschema) for subschema in value]
        elif key in SUBSCHEMA_KEYWORDS:
            closed[key] = closed_objects(value)
        else:  # data (const, enum, default), annotations, a keyword unknown here
            closed[key] = value
    types = schema.get("type")
    describes_objects = types == "object" or (isinstance(types, list) and "object" in types) or "properties" in schema
    if describes_objects and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def combines_objects(schema: Any) -> bool:
    """Whether `schema` somewhere says an object is several schemas at once (an allOf of two or
    more: `allOf: [{"$ref": "#/$defs/Base"}, {"properties": {"extra": ...}}]`). Their branches,
    and the definitions they refer to, describe one object together: closed one by one, no object
    could hold the properties of two, so such a schema is enforced as it is written. (An allOf
    of one, pydantic's wrapper of a `$ref` with a description, is no combination.)"""
    if isinstance(schema, list):
        return any(combines_objects(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return True
    return any(combines_objects(value) for key, value in schema.items() if key not in DATA_KEYWORDS)


def enforced_schema(schema: Any, strict: bool, layout: dict | None = None) -> Any:
    """`schema` as the engine is to enforce it: with `strict`, objects closed (`closed_objects`;
    not in a schema that `combines_objects`) and every keyword enforced (a refusal names one the engine does not implement); without,
    compiled leniently (llguidance's `x-guidance: {"lenient": true}`), so that keywords and formats
    it does not implement are ignored, as OpenAI accepts them where `strict` is not true. `layout`:
    how JSON is laid out, for a schema embedded in a grammar (where the engine's defaults do not
    reach). What the schema's own `x-guidance` says stays, but for the layout's keys, which are the
    server's: a client's separators (`"item_separator": ";"`) would make the output no JSON, and
    a tool call's arguments that the answer's parser never sees end."""
    if not isinstance(schema, dict):  # true, false: nothing to close or to ignore
        return schema
    if strict:
        schema = schema if combines_objects(schema) else closed_objects(schema)
    options = {**(layout or {}), **({} if strict else {"lenient": True})}
    given = schema.get("x-guidance", {})
    if not options or not isinstance(given, dict):  # one that is no object: llguidance refuses it, naming it
        return schema
    return {**schema, "x-guidance": {**options, **given, **(layout or {})}}


def tool_grammar(functions: list, auto: bool, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of an answer that calls `functions`: one call
    block (or, with `parallel`, one or more), or with `auto` also text that does not start
    with "<". Each call is its function's name, written out, and arguments that fit its parameters.

    Each function's arguments are a JSON schema of their own (`%json`, rule `arguments_<index>`),
    so references within its `parameters` ("#/$defs/Addr", "#/definitions/Addr", "#" for a
    recursive schema, as `pydantic_function_tool` writes nested models) resolve in that schema
    whatever its `$id`, and each function's `strict` applies to its schema alone."""
    calls = [f"call_{index}" for index in range(len(functions))]
    lines = [f"start: calls{' | TEXT' if auto else ''}",
             f"calls: call{'+' if parallel else ''}",
             f"call: {' | '.join(calls)}"]
    for index, function in enumerate(functions):
        head = TOOL_OPEN + '{"name": ' + json.dumps(function.name) + ', "arguments": '
        lines.append(f"{calls[index]}: {json.dumps(head)} arguments_{index} {json.dumps(CALL_END)}")
    for index, function in enumerate(functions):
        parameters = function.parameters if function.parameters is not None else {"type": "object"}
        schema = enforced_schema(parameters, strict=function.strict is True, layout=JSON_LAYOUT)
        lines.append(f"arguments_{index}: %json {json.dumps(schema)}")
    if auto:
        lines.append(r"TEXT: /[^<][\s\S]*/")
    return "\n".join(lines) + "\n"


# where the engine's refusal of a grammar points: its line, then llguidance's reason
_REFUSED_AT = re.compile(r"at (\d+)\(\d+\): (?:failed to compile JSON schema: )?([^\n]*)")
_ARGUMENTS_RULE = re.compile(r"arguments_(\d+): %json ")


def tool_refusal(message: str, grammar: str, functions: list) -> str:
    """The engine's refusal of `tool_grammar(functions, ...)` (`grammar`) in the client's terms:
    the function whose `parameters` it is about, and why, without the grammar, which the client
    never wrote. A message that points nowhere in it stays as it is."""
    refused = _REFUSED_AT.search(message)
    if refused is None:
        return message
    lines = grammar.splitlines()
    line = int(refused.group(1))
    rule = _ARGUMENTS_RULE.match(lines[line - 1]) if 0 < line <= len(lines) else None
    if rule is None:
        return f"the tools cannot be enforced: {refused.group(2)}"
    name = functions[int(rule.group(1))].name
    return f"the parameters of function '{name}' cannot be enforced: {refused.group(2)}"


def parsed_arguments(arguments: str) -> Any:
    """A sent call's `arguments` (JSON text, as OpenAI sends them) as the value they encode, for a
    template; text that is not JSON stays the text it came as (a client may send back whatever a
    model wrote), and so do arguments nested past the depth a body may have (parsing those once
    raised RecursionError: a 500)."""
    if json_depth_exceeded(arguments):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def tool_call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (an assistant message's tool_calls rendered for the template)."""
    return TOOL_OPEN + json.dumps({"name": name, "arguments": parsed_arguments(arguments)}) + TOOL_CLOSE


class ToolCallStream:
    """Reads one choice's text as it is generated: plain text (content), or tool call blocks.
    `push` returns the deltas to send: {"content": text} or {"tool_calls": [delta]} in OpenAI's
    streamed shape (a call's first delta has its index, id, type and name with empty arguments;
    the following ones add to its arguments)."""

    def __init__(self, named: bool = False):
        # a request whose tool_choice names the function: its call is the answer asked for, which
        # OpenAI (and vLLM) finish with "stop", not "tool_calls"
        self.named = named
        self.mode: str | None = None  # None until the first character: "text" or "tools"
        self.buffer = ""  # text of the call being read, not yet sent
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}, as sent so far
        self.open = False  # a call's arguments are being read
        self.content = ""

    @property
    def complete(self) -> bool:
        """Tool calls were read, every one whole."""
        return self.mode == "tools" and bool(self.calls) and not self.open and not self.buffer

    def push(self, text: str) -> list[dict]:
        if self.mode == "text":
            self.content += text
            return [{"content": text}] if text else []
        self.buffer += text
        if self.mode is None:
            if not self.buffer:
                return []
            if not self.buffer.startswith("<"):
                self.mode, released, self.buffer = "text", self.buffer, ""
                self.content += released
                return [{"content": released}]
            self.mode = "tools"
        deltas = []
        while True:  # bounded: each turn consumes a head or a whole call from the buffer
            if not self.open:
                head = _CALL_HEAD.match(self.buffer)
                if head is None:
                    return deltas
                self.buffer = self.buffer[head.end():]
                self.open = True
                call = {"id": "call_" + secrets.token_hex(12), "type": "function",
                        "function": {"name": head.group(1), "arguments": ""}}
                self.calls.append(call)
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, **call,
                                               "function": {"name": head.group(1), "arguments": ""}}]})
            sent = self.calls[-1]["function"]["arguments"]
            end = _arguments_end(sent + self.buffer)
            if end is None:  # hold back what may be the call's end, send the rest
                released = self.buffer[: max(0, len(self.buffer) - len(CALL_END))]
                self._add_arguments(deltas, released)
                self.buffer = self.buffer[len(released):]
                return deltas
            self._add_arguments(deltas, self.buffer[: end - len(sent)])
            self.buffer = self.buffer[end - len(sent) + len(CALL_END):]
            self.open = False

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """At the end of the text: the deltas of what is held back, and the finish reason to send
        ("tool_calls" for whole calls that stopped, unless the request named the function;
        otherwise `finish_reason`). Held back when the
        text ends short of a whole call (max_tokens, a stop string): inside a call's arguments, the
        rest of those arguments, cut as they are (OpenAI's "length" answer has such arguments
        too), less any start of the call's closing markup after whole arguments; before a call's
        name is whole, nothing: the text is a call's markup, never content."""
        if self.complete and finish_reason == "stop" and not self.named:
            finish_reason = "tool_calls"
        held, self.buffer = self.buffer, ""
        deltas: list[dict] = []
        if self.open:
            self._add_arguments(deltas, held[: _arguments_cut(self.calls[-1]["function"]["arguments"], held)])
        elif held and self.mode == "text":
            self.content += held
            deltas.append({"content": held})
        return deltas, finish_reason

    def _add_arguments(self, deltas: list[dict], text: str) -> None:
        if not text:
            return
        self.calls[-1]["function"]["arguments"] += text
        deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})


# where a JSON value ends, its numbers never converted: an integer past Python's 4,300 digits
# (which a constraint allows) would raise ValueError, and a call's end would never be found
_SPANNING = json.JSONDecoder(parse_int=lambda text: 0, parse_float=lambda text: 0.0)


def _arguments_end(buffer: str) -> int | None:
    """Where a call's arguments end in `buffer` (which starts with them): the end of the JSON
    value, once the call's closing brace and tag follow it; None before then. Parsed only once the
    closing tag has come (a parse at every token would cost the arguments' length squared), and
    arguments nested past what the parser can follow never end: they are sent as they come, and
    cut where the text ends, as a call's arguments cut by max_tokens are."""
    if CALL_END not in buffer:
        return None
    try:
        _, end = _SPANNING.raw_decode(buffer)
    except (ValueError, RecursionError):
        return None
    return end if buffer.startswith(CALL_END, end) else None


def _arguments_cut(sent: str, held: str) -> int:
    """How much of `held`, the text after a call's arguments so far (`sent`) where the text ended,
    belongs to the arguments: all of it, but where whole arguments are followed by the start of
    the call's closing markup ("}</tool_c"), only what comes before that markup."""
    try:
        _, end = _SPANNING.raw_decode(sent + held)
    except (ValueError, RecursionError):  # cut inside the arguments: all of it is theirs
        return len(held)
    end = max(end - len(sent), 0)
    return end if CALL_END.startswith(held[end:]) else len(held)


def render_message(message, template_renders_tool_calls: bool = False) -> dict[str, Any]:
    """A chat message for the template: its role and text, its name, a tool message's
    tool_call_id, and an assistant's `tool_calls` with each call's arguments parsed (Hugging Face
    tool templates write them with `| tojson`, which would quote JSON text a second time). A
    template that renders `tool_calls` itself gets the calls only there; for one that does not
    (the shipped minimal templates), they are also appended to the text as the blocks the model
    writes, so the model sees its earlier calls either way, and never twice."""
    content = message.text()
    if message.tool_calls and not template_renders_tool_calls:
        content += "".join(tool_call_text(call.function.name, call.function.arguments) for call in message.tool_calls)
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": parsed_arguments(call.function.arguments)}}
                                  for call in message.tool_calls]
    return rendered
