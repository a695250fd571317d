"""Chat templates: how a checkpoint turns OpenAI chat messages into the prompt text it was
trained on (API process, no torch).

A checkpoint carries its template as Hugging Face checkpoints do, found in this order:

1. a `chat_template.jinja` file in its directory;
2. `chat_template` in its `tokenizer_config.json`;
3. `chat_template` in its `config.json`.

`chat_template` is a Jinja string, or Hugging Face's list of named templates
(`[{"name": "default", "template": ...}, ...]`, of which "default" is used). It is rendered as
transformers renders it: in jinja2's sandboxed environment (a template can read its variables
but call nothing unsafe), with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
the helpers `raise_exception(message)` and `strftime_now(format)`, and the variables `messages`
(a list of {"role", "content"[, "name", "tool_calls", "tool_call_id"]}), `tools` (a chat request's
tools as OpenAI sends them, or None; server/api/structured.py), `add_generation_prompt` (True for a chat request:
the text ends where the assistant's answer begins), and `bos_token` / `eos_token` from
tokenizer_config.json (empty when it has none). A request's `chat_template_kwargs` (vLLM's) adds
further variables, such as Qwen3's `enable_thinking`; it cannot set any of these (the API
refuses their names: each has its own field or source).

An assistant message's `tool_calls` come as OpenAI sends them but with each call's `arguments`
parsed into an object, as Hugging Face tool templates (and vLLM) expect them. A template that reads
`tool_calls` (`renders_tool_calls`: its parsed source reads a field of that name) renders the
calls itself; for one that does not, the calls are also written into the message's `content` as
the blocks the model writes (server/api/structured.py `render_message`), so that no template shows
them twice.

A checkpoint that carries none of these uses the template file the `chat_template` setting names
(`xlserve serve --chat-template FILE`, XLSERVE_CHAT_TEMPLATE), as vLLM's `--chat-template` serves
checkpoints without one; a checkpoint's own template is kept. The shipped checkpoints
(weights/*-stdlib) carry a minimal one for byte-level models trained on plain text: each message
as `role: content` on its own line, then `assistant: ` (their cards say so).

A checkpoint without a template (and no setting) answers /v1/chat/completions with 400
`no_chat_template`, as vLLM does; a template that does not compile is logged at start-up and answered with 400
`chat_template_error`, with the reason (as is a template that refuses the messages).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("xlserve.server")

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(Exception):
    """The template cannot be used (it does not compile), or it refused the messages
    (`raise_exception`, an undefined name, a type error in the template)."""


def _raise_exception(message: str):
    raise ChatTemplateError(str(message))


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """`tojson` as the templates on the Hub are written for (transformers' filter): JSON as
    json.dumps writes it, keys in their order and nothing escaped for HTML, with its keyword
    arguments. Jinja's own sorts the keys, escapes <, > and & (a tool's schema reads otherwise
    than the model was trained on) and refuses `ensure_ascii`."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks what the assistant
    wrote (for training masks): templates on the Hub use it, and it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _reads_name(tree: nodes.Template, name: str) -> bool:
    """Whether the template `tree` reads a field called `name` (`message.name`, `message['name']`,
    `message.get('name')`, `'name' in message`). Read from the parsed template rather than its
    text, so that a comment or literal text that mentions the name does not count."""
    return any(isinstance(node, nodes.Getattr) and node.attr == name
               or isinstance(node, nodes.Const) and node.value == name
               for node in tree.find_all((nodes.Getattr, nodes.Const)))


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str, origin: str, bos_token: str = "", eos_token: str = "",
                 tool_use: "ChatTemplate | None" = None):
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        # a checkpoint's named "tool_use" template, rendered instead when a request gives tools
        # (as transformers and vLLM choose it: Hermes-2-Pro's, Command-R's)
        self.tool_use = tool_use
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[loopcontrols, GenerationTag])
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        environment.filters["tojson"] = _tojson
        self.error: str | None = None
        self.renders_tool_calls = False
        self.knows_developer = False
        try:
            self.template = environment.from_string(source)
            tree = environment.parse(source)
            self.renders_tool_calls = _reads_name(tree, "tool_calls")
            # OpenAI's `developer` is its newer name for `system`; a template with no branch of its
            # own for it (most on the Hub) gets it as `system` rather than dropping it unseen
            self.knows_developer = _reads_name(tree, "developer")
        except TemplateError as error:
            self.template = None
            self.error = f"the chat template in {origin} does not compile: {error}"

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               variables: dict | None = None) -> str:
        """The prompt text for `messages` (and `tools`, OpenAI's list of {"type": "function",
        "function": {...}}, for a template that describes them; and `variables`, a request's
        further variables for the template, vLLM's `chat_template_kwargs`); ChatTemplateError if
        the template cannot render them: whatever a template raises on the messages (an
        arithmetic error, a recursion too deep, a range past the sandbox's bound) is the
        template's, a 400."""
        if tools and self.tool_use is not None and self.tool_use.template is not None:
            return self.tool_use.render(messages, add_generation_prompt, tools, variables)
        if self.template is None:
            raise ChatTemplateError(self.error)
        if not self.knows_developer:
            messages = [{**message, "role": "system"} if message.get("role") == "developer" else message
                        for message in messages]
        try:
            # the request's variables first: the ones set here win (the API refuses their names)
            return self.template.render({**(variables or {}), "messages": messages,
                                         "add_generation_prompt": add_generation_prompt, "bos_token": self.bos_token,
                                         "eos_token": self.eos_token, "tools": tools})
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError, ArithmeticError,
                RecursionError) as error:
            raise ChatTemplateError(f"{type(error).__name__}: {error}") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _template_text(value, name: str = "default") -> str | None:
    """A `chat_template` value: a string, or a list of named templates (the one called `name`;
    a string is only ever the default)."""
    if isinstance(value, str) and value.strip():
        return value if name == "default" else None
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        chosen = named.get(name)
        return chosen if isinstance(chosen, str) and chosen.strip() else None
    return None


def _token_text(value) -> str:
    """bos_token / eos_token as tokenizer_config.json gives them: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def read_template_file(path: str | Path) -> str:
    """The text of a chat template file; ChatTemplateError saying why in one line when it cannot
    be read (missing, a directory, not UTF-8)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise ChatTemplateError(f"cannot read the chat template file {path}: {reason}") from None


def check_template_file(path: str | Path) -> None:
    """ChatTemplateError, in one line, when the file cannot serve as a template (unreadable, or
    Jinja that does not compile): `xlserve serve` refuses to start with it."""
    template = ChatTemplate(read_template_file(path), str(path))
    if template.error:
        raise ChatTemplateError(template.error.splitlines()[0])


def load_chat_template(config: dict, directory: str | Path | None,
                       default_file: str | Path | None = None) -> ChatTemplate | None:
    """The chat template of the checkpoint with config.json `config` in `directory`; else the one
    in `default_file` (the chat_template setting); else None."""
    directory = Path(directory) if directory is not None else None
    tokenizer_config = _read_json(directory / TOKENIZER_CONFIG) if directory is not None else {}
    special = {"bos_token": _token_text(tokenizer_config.get("bos_token")),
               "eos_token": _token_text(tokenizer_config.get("eos_token"))}
    found: tuple[str, str] | None = None
    named = None  # the `chat_template` value the template came from, which may name a tool_use one too
    if directory is not None and (directory / TEMPLATE_FILE).is_file():
        try:
            found = ((directory / TEMPLATE_FILE).read_text(encoding="utf-8"), str(directory / TEMPLATE_FILE))
        except (OSError, UnicodeDecodeError) as error:
            log.warning("cannot read %s: %s", directory / TEMPLATE_FILE, error)
    if found is None and _template_text(tokenizer_config.get("chat_template")) is not None:
        named = tokenizer_config["chat_template"]
        found = (_template_text(named), f"{directory / TOKENIZER_CONFIG}")
    if found is None and _template_text(config.get("chat_template")) is not None:
        named = config["chat_template"]
        found = (_template_text(named), "config.json")
    if found is None and default_file is not None:
        try:
            found = (read_template_file(default_file), str(default_file))
        except ChatTemplateError as error:  # `xlserve serve` checked it; it may have gone since
            log.warning("%s; /v1/chat/completions will refuse requests for this model", error)
            unusable = ChatTemplate("", str(default_file), **special)
            unusable.template, unusable.error = None, str(error)  # answered as one that does not compile
            return unusable
    if found is None:
        return None
    tool_use, tool_use_text = None, _template_text(named, "tool_use")  # the same value's named variant
    if tool_use_text is not None:
        tool_use = ChatTemplate(tool_use_text, f"{found[1]} (tool_use)", **special)
        if tool_use.error:
            log.warning("%s; requests with tools use the default template", tool_use.error)
    template = ChatTemplate(found[0], found[1], **special, tool_use=tool_use)
    if template.error:
        log.warning("%s; /v1/chat/completions will refuse requests for this model", template.error)
    return template
