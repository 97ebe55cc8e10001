"""A model's chat templates, as models ship them, rendered as transformers renders them.

Where they come from (the first found): the operator's ``--chat-template FILE`` (given to ``render``
as ``override``); ``chat_template.jinja`` in the model folder (newer uploads keep it there, as
transformers saves it); ``tokenizer_config.json``'s ``chat_template``, either one template or a
list of named ones (``[{"name": "default", "template": ...}, {"name": "tool_use", ...}]``, as
Hermes and Command-R ship them: ``tool_use`` when the request has tools, else ``default``).

The environment is transformers': a sandbox, ``trim_blocks`` / ``lstrip_blocks``, loop controls
(``{% break %}``), ``tojson`` keeping non-ASCII, ``raise_exception`` and ``strftime_now``. Any
failure while compiling or rendering is a ``ChatTemplateError`` naming the template: the request's
fault (400), never the server's.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a request's chat_template_kwargs may not set: the renderer's own.
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplateError(ValueError):
    """The chat template failed on a request (or is not there): the request's to fix (400).
    ``param``: the request field to blame."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def check_template(text: str) -> None:
    """Raises ``ChatTemplateError`` when ``text`` does not compile (an operator's template file)."""
    try:
        _environment().parse(text)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


class ChatTemplates:
    """The templates of one model folder; compiled at first use, each once."""

    def __init__(self, folder: Path, tokenizer_config: dict[str, Any]) -> None:
        jinja = folder / "chat_template.jinja"
        shipped = jinja.read_text() if jinja.is_file() else tokenizer_config.get("chat_template")
        self.named: dict[str, str] = {}
        if isinstance(shipped, list):
            for entry in shipped:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str) and isinstance(entry.get("template"), str):
                    self.named[entry["name"]] = entry["template"]
        elif isinstance(shipped, str):
            self.named["default"] = shipped
        self._env = _environment()
        self._compiled: dict[str, Any] = {}

    @property
    def default(self) -> str | None:
        """The template a request without tools gets (what /tokenizer_info shows)."""
        return self.named.get("default")

    def choose(self, tools: list | None, override: str | None = None) -> tuple[str, str]:
        """The name and text of the template to render with."""
        if override is not None:
            return "--chat-template", override
        if tools and "tool_use" in self.named:
            return "tool_use", self.named["tool_use"]
        if "default" in self.named:
            return "default", self.named["default"]
        if self.named:
            raise ChatTemplateError(f"this model ships chat templates named {sorted(self.named)} and none is "
                                    "'default'; start the server with --chat-template FILE")
        raise ChatTemplateError("this model has no chat template; use a plain completion prompt, or start the "
                                "server with --chat-template FILE")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list | None = None, override: str | None = None, bos_token: str = "", eos_token: str = "",
               kwargs: dict[str, Any] | None = None) -> str:
        """``messages`` (and ``tools``, and the request's ``chat_template_kwargs``) rendered."""
        name, text = self.choose(tools, override)
        extra = dict(kwargs or {})
        if bad := sorted(RESERVED & set(extra)):
            raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
        try:
            template = self._compiled.get(text)
            if template is None:
                template = self._compiled[text] = self._env.from_string(text)
            return template.render(messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                   bos_token=bos_token, eos_token=eos_token, **extra)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 -- a template is a program run on the request's messages
            # Whatever it raises on them (an index past the end, a division, a method a value
            # lacks) is the request's to fix, with this template: never the server's 500.
            raise ChatTemplateError(f"the chat template ({name}) failed: {type(e).__name__}: {e}") from None
