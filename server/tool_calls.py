"""Tool calling: a chat request's ``tools`` go to the chat template, and what the
model answers is read back into OpenAI's ``tool_calls``.

The format read is Hermes' (Qwen 2.5 and 3, Hermes 2 and 3, and the templates that copy them):
each call a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>``, text outside them the message's content. ``tool_choice``: ``auto`` (default) lets
the model choose; ``none`` reads nothing back; ``required`` and a named function are enforced, not
hoped for: the answer is held by a grammar (``engine/structured_output.py``) to one or more calls
(one of the named function) whose arguments follow the tool's JSON schema.

Streamed, content goes out as it comes (held back only while it may be the start of
``<tool_call>``), and each call as one delta once it is closed: its name and its whole arguments,
which OpenAI's clients accumulate as they would arguments sent in pieces.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128


class ToolError(ValueError):
    """A request's tools or tool_choice are malformed (``param``: which field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools(tools: Any, choice: Any) -> tuple[list[dict] | None, str | dict]:
    """The request's tools (None: none offered) and tool choice, checked; raises ``ToolError``."""
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None, "none"
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolError(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]
                and isinstance(fn.get("parameters", {}), dict) and isinstance(fn.get("description", ""), str)):
            raise ToolError(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ..., "
                            "'parameters': {JSON schema}}}}", f"tools[{i}]")
        names.add(fn["name"])
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                            "{'name': one of the tools}}", "tool_choice")
        return tools, {"name": name}
    if choice not in ("none", "auto", "required"):
        raise ToolError("'tool_choice' must be 'none', 'auto', 'required' or a named function", "tool_choice")
    return tools, choice


def forced_calls(tools: list[dict], choice: str | dict, parallel: bool = True) -> dict[str, Any] | None:
    """The structured-output spec that holds an answer to calls (``required``: one or more of any
    tool, one with ``parallel`` false; a named function: one call of it), or None when the model
    chooses."""
    if choice in ("none", "auto"):
        return None
    chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice["name"]]
    one_call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                           "properties": {"name": {"const": f["name"]},
                                          "arguments": f.get("parameters") or {"type": "object"}}}
                          for f in chosen],
                "x-guidance": {"whitespace_flexible": False}}
    calls = 'call ("\\n" call)*' if choice == "required" and parallel else "call"
    return {"grammar": f'start: {calls}\ncall: "{OPEN}\\n" args "\\n{CLOSE}"\nargs: %json {json.dumps(one_call)}\n'}


def for_template(messages: list[dict]) -> list[dict]:
    """Assistant turns' ``tool_calls`` as chat templates read them: arguments as an object (the
    API sends a JSON string; templates write ``arguments | tojson``), as vLLM passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # a template that prints it as it is gets the client's text
    return {**call, "function": fn}


def _call(text: str) -> dict | None:
    """One ``{"name", "arguments"}`` object as an OpenAI tool call (None: not one)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallReader:
    """Reads one choice's text as it streams: ``feed`` returns the content that may go out now and
    the calls completed; ``finish`` the rest (an unclosed or malformed call stays content)."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet given out as content or a call
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._pending += text
        content, calls = "", []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                # Hold back a tail that may be the start of "<tool_call>".
                keep = next((k for k in range(min(len(OPEN) - 1, len(self._pending)), 0, -1)
                             if OPEN.startswith(self._pending[-k:])), 0)
                cut = len(self._pending) - keep
                content += self._pending[:cut]
                self._pending = self._pending[cut:]
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:
                content += self._pending[:start]
                self._pending = self._pending[start:]
                break
            call = _call(self._pending[start + len(OPEN):end].strip())
            if call is None:  # not a call after all: it is text
                content += self._pending[:end + len(CLOSE)]
            else:
                content += self._pending[:start]
                calls.append(call)
            self._pending = self._pending[end + len(CLOSE):]
        self.calls += calls
        return content, calls

    def finish(self) -> str:
        rest, self._pending = self._pending, ""
        return rest


def read_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's content (None when only calls) and its tool calls."""
    reader = ToolCallReader()
    content, _ = reader.feed(text)
    content += reader.finish()
    return (content.strip() or None) if reader.calls else content, reader.calls
