"""Issue 53 item 3: chat templates as models ship them (engine/chat_template.py), rendered in the
environment transformers gives them, and every template failure a 400 naming the template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from engine.chat_template import ChatTemplateError
from engine.default_model import resolve_model
from engine.tokenizer import Tokenizer
from server.protocol import ModelLimits, ProtocolError, parse_chat

HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _model(tmp_path: Path, config: dict, jinja: str | None = None) -> Tokenizer:
    """A model folder with the default model's tokenizer and the given templates."""
    shutil.copy(resolve_model(None) / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **config}))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return Tokenizer(tmp_path)


def _limits(tok: Tokenizer, override: str | None = None) -> ModelLimits:
    return ModelLimits("m", tok, 2048, tok.vocab_size, chat_template=override)


def test_a_named_list_picks_tool_use_with_tools_and_default_without(tmp_path):
    """Hermes and Command-R ship [{"name": "default"}, {"name": "tool_use"}]: this was a 500
    (TypeError: Can't compile non template nodes)."""
    tok = _model(tmp_path, {"chat_template": [
        {"name": "default", "template": "D:{% for m in messages %}{{ m.content }}{% endfor %}"},
        {"name": "tool_use", "template": "T:{{ tools | length }}:{{ tools[0].function.name }}"}]})
    assert tok.apply_chat_template(HI) == "D:Hi" and tok.chat_template.startswith("D:")
    assert tok.apply_chat_template(HI, tools=TOOLS) == "T:1:get_weather"
    no_default = _model(tmp_path, {"chat_template": [{"name": "rag", "template": "R"}]})
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        no_default.apply_chat_template(HI)


def test_chat_template_jinja_and_the_operators_file_and_kwargs(tmp_path):
    """Newer uploads ship chat_template.jinja (was: 400 "this model has no chat template"); the
    operator's --chat-template wins; chat_template_kwargs reach the template (Qwen3's
    enable_thinking was accepted and ignored)."""
    tok = _model(tmp_path, {}, jinja="J:{{ messages[0].content }}{% if enable_thinking is false %}/no_think{% endif %}")
    assert tok.apply_chat_template(HI) == "J:Hi"
    assert tok.apply_chat_template(HI, kwargs={"enable_thinking": False}) == "J:Hi/no_think"
    body = {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}
    (ids,) = parse_chat(body, _limits(tok)).prompts
    assert tok.decode(ids) == "J:Hi/no_think"
    (ids,) = parse_chat(body, _limits(tok, override="O:{{ messages | length }}")).prompts
    assert tok.decode(ids) == "O:1"
    for kwargs in ({"messages": []}, ["x"]):
        with pytest.raises(ProtocolError) as e:
            parse_chat({"messages": HI, "chat_template_kwargs": kwargs}, _limits(tok))
        assert e.value.param == "chat_template_kwargs"


def test_the_environment_is_transformers_and_no_template_error_is_a_500(tmp_path):
    tok = _model(tmp_path, {"chat_template": (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | tojson }}{% endfor %}"
        "|{{ strftime_now('%Y') }}{% if messages | length > 2 %}{{ raise_exception('too many turns') }}{% endif %}")})
    two = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "x"}]
    assert tok.apply_chat_template(two) == f'"héllo"|{datetime.now().year}'  # loop controls, tojson keeps non-ASCII
    for template, messages in [(None, HI * 3),  # raise_exception
                               ("{{ messages[0].content.missing() }}", HI),  # calls what is not there
                               ("{{ messages[5].content }}", HI),  # indexes past the end (undefined)
                               ("{{ 1 / 0 }}", HI)]:
        with pytest.raises(ProtocolError) as e:
            parse_chat({"messages": messages}, _limits(tok, override=template))
        assert e.value.status == 400 and "chat template" in e.value.message, e.value.message


def test_a_chat_template_file_that_does_not_compile_stops_the_server(tmp_path):
    bad = tmp_path / "t.jinja"
    bad.write_text("{% for m in messages %}")
    r = subprocess.run([sys.executable, "-m", "server", "--chat-template", str(bad), "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--chat-template" in r.stderr and "does not compile" in r.stderr
