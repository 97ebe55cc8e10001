"""OpenAI request bodies in, validated engine requests out; OpenAI response shapes back.

Validation rules: unknown keys are ignored (clients send many optional fields), but a known key
with the wrong type or an out-of-range value is a 400 naming the field (``param``). ``null``
means "default" for every optional field. Types are checked strictly: JSON ``true`` is not a
number and ``1.5`` is not an integer.

A request becomes ``len(prompts) * n`` engine requests; choice ``i * n + j`` is prompt ``i``,
sample ``j`` (seeded requests use seed + j so that the n samples differ but stay reproducible).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any


from engine.chat_template import ChatTemplateError
from engine.outputs import RequestOutput
from engine.outputs import Logprobs
from engine.sampling_params import MAX_CACHE_SALT_CHARS, SamplingParams
from engine.session import PRIORITY_RANGE, SessionHint
from engine.tokenizer import Tokenizer
from server.tool_calls import ToolError, check_tools, for_template, forced_calls

MAX_N = 16  # choices per prompt
MAX_CHOICES = 128  # prompts * n per request
MAX_LOGPROBS = 20
MAX_STOP = 16
log = logging.getLogger(__name__)

# The fields each endpoint reads (or refuses by name). Others are accepted and ignored, as clients
# send many optional ones, and each new name is logged once (vLLM logs them too).
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stream", "stream_options", "stop",
    "stop_token_ids", "ignore_eos", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "skip_special_tokens", "logprobs", "best_of", "logit_bias", "min_tokens", "user", "session_id", "priority",
    "cache_salt", "response_format", "structured_outputs"})
_FIELDS = {"completion": _COMMON_FIELDS | {"prompt", "echo", "suffix"},
           "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools",
                                     "functions", "add_generation_prompt", "add_special_tokens", "echo",
                                     "chat_template_kwargs", "tool_choice", "parallel_tool_calls"}}
_MAX_LOGGED_FIELDS = 256  # names remembered as logged: a client inventing names costs a bounded set
_logged_fields: set[str] = set()


def _note_unknown_fields(body: dict, kind: str) -> None:
    # Names as logged (and remembered): cut to 64 characters, so that a long one is logged once too.
    names = {str(k)[:64] for k in body if k not in _FIELDS[kind]}
    new = sorted(names - _logged_fields)[: max(0, _MAX_LOGGED_FIELDS - len(_logged_fields))]
    if new:
        _logged_fields.update(new)
        log.warning("ignoring field(s) this server does not use in /v1/%s requests: %s (each name is logged once)",
                    "chat/completions" if kind == "chat" else "completions", ", ".join(new))


COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when the body has none (OpenAI, vLLM)
# Half the engine's bound: under --cache-scope per-key the server puts the caller's name before it.
MAX_BODY_CACHE_SALT_CHARS = MAX_CACHE_SALT_CHARS // 2
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ProtocolError(Exception):
    """A request the server refuses; rendered as OpenAI's error JSON with ``status``."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- field readers -----------------------------------------------------------------------------------
def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def _number(body: dict, key: str, default: float, lo: float | None = None, hi: float | None = None,
            lo_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"'{key}' must be a number, got {_type_name(value)}", key)
    try:
        value = float(value)
    except OverflowError:  # an integer with hundreds of digits
        raise ProtocolError(f"'{key}' must be finite", key) from None
    if not math.isfinite(value):
        raise ProtocolError(f"'{key}' must be finite", key)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ProtocolError(f"'{key}' must be {'>' if lo_open else '>='} {lo:g}, got {value:g}", key)
    if hi is not None and value > hi:
        raise ProtocolError(f"'{key}' must be <= {hi:g}, got {value:g}", key)
    return value


def _integer(body: dict, key: str, default: int | None, lo: int | None = None,
             hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{key}' must be an integer, got {_type_name(value)}", key)
    if lo is not None and value < lo:
        raise ProtocolError(f"'{key}' must be >= {lo}, got {value}", key)
    if hi is not None and value > hi:
        raise ProtocolError(f"'{key}' must be <= {hi}, got {value}", key)
    return value


def _boolean(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{key}' must be a boolean, got {_type_name(value)}", key)
    return value


def _string(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ProtocolError(f"'{key}' must be a string, got {_type_name(value)}", key)
    return value


def _cache_salt(body: dict) -> str | None:
    """vLLM's ``cache_salt``: the prompt's KV is reused only by requests with the same salt."""
    salt = _string(body, "cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_BODY_CACHE_SALT_CHARS:
        raise ProtocolError(f"'cache_salt' must be a non-empty string of at most {MAX_BODY_CACHE_SALT_CHARS} "
                            "characters", "cache_salt")
    return salt


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ProtocolError("'stop' must be a string or an array of strings", "stop")
    if len(items) > MAX_STOP:
        raise ProtocolError(f"'stop' may hold at most {MAX_STOP} strings", "stop")
    return [s for s in items if s]  # OpenAI ignores empty stop strings


def _token_list(value: Any, key: str, vocab_size: int) -> list[int]:
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ProtocolError(f"'{key}' token ids must be integers, got {_type_name(t)}", key)
        if not 0 <= t < vocab_size:
            raise ProtocolError(f"'{key}' token id {t} is outside the vocabulary [0, {vocab_size})", key)
    return list(value)


# -- parsed request ----------------------------------------------------------------------------------
@dataclass
class ParsedRequest:
    """One validated OpenAI request, ready to become engine requests."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[list[int]]  # token ids of each prompt
    params: list[list[SamplingParams]]  # [prompt][sample]
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token (0: only the chosen one); None: off
    extra: dict[str, Any] = field(default_factory=dict)
    # Completions with ``echo``: each choice's text (and logprobs) start with its prompt's.
    echo_texts: list[str] | None = None
    score_only: bool = False  # ``max_tokens`` 0: the prompt is scored, nothing is generated
    session_id: str | None = None  # the body's session hint (``session_hint`` adds the header's)
    priority: int = 0
    reads_tool_calls: bool = False  # a chat answer's tool calls are read back (``server/tool_calls.py``)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def session_hint(self, header: str | None) -> SessionHint | None:
        """The request's session hint: ``session_id`` in the body (``extra_body`` of OpenAI's
        clients) or the ``X-Session-Id`` header (for proxies; the two must agree), with the
        body's ``priority``. None without either: the request is served as any other."""
        if header is not None and self.session_id is not None and self.session_id != header:
            raise ProtocolError("'session_id' and the X-Session-Id header name different sessions", "session_id")
        session_id = self.session_id if self.session_id is not None else header
        if session_id is None:
            if self.priority:
                raise ProtocolError("'priority' needs a session: give 'session_id' or the X-Session-Id header",
                                    "priority")
            return None
        try:
            return SessionHint(session_id, self.priority)
        except ValueError as e:  # its id (the priority was checked with the body): the body's or the header's
            raise ProtocolError(str(e), "session_id") from None


@dataclass
class ModelLimits:
    """What validation needs to know about the served model."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int | None = None
    # The model's generation_config sampling fields, for those a request leaves out (empty:
    # ``--generation-config vllm``, the OpenAI defaults below).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    chat_template: str | None = None  # the operator's --chat-template, in place of the model's


def check_model(body: dict, served: str) -> str:
    model = _string(body, "model")
    if model is not None and model != served:
        raise ProtocolError(
            f"The model '{model}' does not exist; this server serves '{served}'",
            "model", status=404, code="model_not_found",
        )
    return served


def _session(body: dict) -> dict[str, Any]:
    """The body's session hint fields, their types and the priority's range checked (the id's
    length is ``SessionHint``'s to check: ``ParsedRequest.session_hint``)."""
    return {"session_id": _string(body, "session_id"), "priority": _integer(body, "priority", 0, *PRIORITY_RANGE)}


def _common(body: dict, kind: str, limits: ModelLimits) -> tuple[dict[str, Any], int, bool, bool]:
    """Sampling fields shared by both endpoints (max_tokens and logprobs handled by callers)."""
    model = limits.sampling_defaults
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _note_unknown_fields(body, kind)
    _string(body, "user")  # the end user, for abuse tracking: not a session
    n = _integer(body, "n", 1, 1, MAX_N)
    stream = _boolean(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise ProtocolError("'stream_options' must be an object", "stream_options")
        if not stream:
            raise ProtocolError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = _boolean(options, "include_usage", False)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise ProtocolError("'stop_token_ids' must be an array of integers", "stop_token_ids")
    fields = dict(
        temperature=_number(body, "temperature", model.get("temperature", 1.0), 0.0, 2.0),
        top_p=_number(body, "top_p", model.get("top_p", 1.0), 0.0, 1.0, lo_open=True),
        top_k=_integer(body, "top_k", model.get("top_k", -1), -1),
        min_p=_number(body, "min_p", model.get("min_p", 0.0), 0.0, 1.0),
        stop=_stop(body),
        stop_token_ids=_token_list(stop_token_ids or [], "stop_token_ids", 2**31),
        ignore_eos=_boolean(body, "ignore_eos", False),
        seed=_integer(body, "seed", None, _SEED_MIN, _SEED_MAX - MAX_N),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", model.get("repetition_penalty", 1.0), 0.0, 2.0,
                                   lo_open=True),
        skip_special_tokens=_boolean(body, "skip_special_tokens", True),
        cache_salt=_cache_salt(body),
    )
    best_of = _integer(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise ProtocolError("'best_of' other than n is not supported", "best_of")
    fields["min_tokens"] = _integer(body, "min_tokens", 0, 0)
    fields["logit_bias"] = _logit_bias(body)
    fields["structured_outputs"] = _structured_outputs(body, limits)
    return fields, n, stream, include_usage


def _structured_outputs(body: dict, limits: ModelLimits) -> dict[str, Any] | None:
    """The spec (``engine.structured_output``) of OpenAI's ``response_format`` (``json_object``,
    ``json_schema``: what ``client.chat.completions.parse(response_format=Model)`` sends) or
    vLLM's ``structured_outputs`` (json, json_object, regex, choice, grammar), compiled here so
    that a bad one is a 400 naming the field."""
    fmt, vllm = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and vllm is not None:
        raise ProtocolError("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    param, spec = "structured_outputs", vllm
    if fmt is not None:
        param = "response_format"
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            spec = {"json_object": True}
        elif kind == "json_schema":
            js = fmt.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise ProtocolError("'response_format.json_schema' must be an object with a 'schema' object",
                                    "response_format")
            spec = {"json": js.get("schema", {})}  # no schema: any JSON value, as OpenAI
        else:
            raise ProtocolError("'response_format.type' must be 'text', 'json_object' or 'json_schema'",
                                "response_format")
    if spec is None:
        return None
    return _compiled(spec, limits, param)


def _compiled(spec: dict[str, Any], limits: ModelLimits, param: str, what: str = "") -> dict[str, Any]:
    """``spec`` once it compiles (the engine compiles it again from the cache), else a 400 naming
    ``param`` (``what``: what the spec was made of, before the compiler's message)."""
    try:
        limits.tokenizer.grammars.grammar(spec)
    except ValueError as e:
        raise ProtocolError(f"{what}{e}", param) from None
    return spec


def _logit_bias(body: dict) -> dict[str, float] | None:
    """OpenAI's ``logit_bias``: token id (a string key) -> bias in [-100, 100]. The ids are checked
    against the vocabulary with the other token ids (``_build_params``)."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ProtocolError("'logit_bias' must be an object of token id -> bias", "logit_bias")
    try:
        return SamplingParams(logit_bias=bias).logit_bias
    except ValueError as e:
        raise ProtocolError(str(e), "logit_bias") from None


def _build_params(
    prompts: list[list[int]], fields: dict, max_tokens: int | None, logprobs: int | None,
    n: int, limits: ModelLimits, max_tokens_key: str, prompt_logprobs: int | None = None,
    default_max_tokens: int | None = None,
) -> list[list[SamplingParams]]:
    """``max_tokens`` None: ``default_max_tokens`` where the context leaves room for that many,
    else (or without a default) the rest of the context."""
    if fields["logit_bias"] and max(fields["logit_bias"]) >= limits.vocab_size:
        raise ProtocolError(f"'logit_bias' token id {max(fields['logit_bias'])} is outside the vocabulary "
                            f"[0, {limits.vocab_size})", "logit_bias")
    limit = limits.max_model_len
    if limits.kv_capacity_tokens is not None:
        limit = min(limit, limits.kv_capacity_tokens)
    out = []
    for ids in prompts:
        if len(ids) >= limit:
            raise ProtocolError(
                f"the prompt has {len(ids)} tokens; this model's context is {limits.max_model_len} "
                f"tokens (KV capacity {limits.kv_capacity_tokens}) and at least one must be left "
                "for the output", "messages" if max_tokens_key == "max_completion_tokens" else "prompt",
                code="context_length_exceeded",
            )
        tokens = max_tokens if max_tokens is not None else min(default_max_tokens or limit, limit - len(ids))
        if fields["min_tokens"] > tokens:
            raise ProtocolError(f"'min_tokens' ({fields['min_tokens']}) is more than {max_tokens_key} ({tokens})",
                                "min_tokens")
        if len(ids) + tokens > limit:
            raise ProtocolError(
                f"the prompt ({len(ids)} tokens) plus {max_tokens_key} ({tokens}) exceeds the limit "
                f"of {limit} tokens (context {limits.max_model_len}, KV capacity "
                f"{limits.kv_capacity_tokens})", max_tokens_key, code="context_length_exceeded",
            )
        row = []
        for j in range(n):
            f = dict(fields)
            if f["seed"] is not None:
                f["seed"] += j
            try:
                row.append(SamplingParams(max_tokens=tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **f))
            except ValueError as e:  # defence in depth: the engine's own checks
                raise ProtocolError(str(e)) from None
        out.append(row)
    return out


def parse_completion(body: Any, limits: ModelLimits) -> ParsedRequest:
    fields, n, stream, include_usage = _common(body, "completion", limits)
    model = check_model(body, limits.name)
    echo = _boolean(body, "echo", False)
    if _string(body, "suffix"):
        raise ProtocolError("'suffix' is not supported", "suffix")
    logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    max_tokens = _integer(body, "max_tokens", None, 0)
    # Absent: 16, as OpenAI's and vLLM's completions; an explicit null: the rest of the context (vLLM).
    default = COMPLETION_MAX_TOKENS if "max_tokens" not in body else None
    if max_tokens == 0 and not echo:
        raise ProtocolError("'max_tokens' must be at least 1 (0 only with 'echo', to score the prompt)", "max_tokens")
    prompt = body.get("prompt")
    if prompt is None:
        raise ProtocolError("'prompt' is required", "prompt")
    tok = limits.tokenizer
    if isinstance(prompt, str):
        raw = [prompt]
    elif isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            raw = list(prompt)
        elif all(isinstance(p, list) for p in prompt):
            raw = [_token_list(p, "prompt", limits.vocab_size) for p in prompt]
        else:
            raw = [_token_list(prompt, "prompt", limits.vocab_size)]
    else:
        raise ProtocolError(
            "'prompt' must be a string, an array of strings, an array of token ids or an array of "
            "token-id arrays" + (" (it is empty)" if isinstance(prompt, list) else ""), "prompt")
    prompts = []
    for p in raw:
        ids = tok.encode(p) if isinstance(p, str) else p
        if not ids:
            raise ProtocolError("'prompt' must not be empty", "prompt")
        prompts.append(ids)
    if len(prompts) * n > MAX_CHOICES:
        raise ProtocolError(f"at most {MAX_CHOICES} choices (prompts x n) per request", "n")
    # Scoring only still samples one token (its logits are computed anyway), which the answer leaves out.
    params = _build_params(prompts, fields, max_tokens or (None if max_tokens is None else 1), logprobs, n, limits,
                           "max_tokens", logprobs if echo else None, default)
    echo_texts = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in raw] if echo else None
    return ParsedRequest("completion", model, prompts, params, n, stream, include_usage, logprobs,
                         echo_texts=echo_texts, score_only=max_tokens == 0, **_session(body))


def _message_content(msg: dict, i: int) -> str | None:
    content = msg.get("content")
    key = f"messages[{i}].content"
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError("only text content parts ({'type': 'text', 'text': ...}) are supported", key)
            texts.append(part["text"])
        return "\n".join(texts)
    raise ProtocolError(f"'{key}' must be a string or an array of content parts", key)


def parse_chat(body: Any, limits: ModelLimits) -> ParsedRequest:
    fields, n, stream, include_usage = _common(body, "chat", limits)
    model = check_model(body, limits.name)
    if _boolean(body, "echo", False):
        raise ProtocolError("'echo' is only supported on /v1/completions", "echo")
    want_logprobs = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = _integer(body, "max_tokens", None, 1)
    mct = _integer(body, "max_completion_tokens", None, 1)
    key = "max_completion_tokens" if mct is not None else "max_tokens"
    max_tokens = mct if mct is not None else max_tokens
    if body.get("functions"):
        raise ProtocolError("'functions' (deprecated by OpenAI) is not supported: send 'tools'", "functions")
    try:
        tools, choice = check_tools(body.get("tools"), body.get("tool_choice"))
    except ToolError as e:
        raise ProtocolError(str(e), e.param) from None
    parallel = _boolean(body, "parallel_tool_calls", True)
    if (forced := forced_calls(tools, choice, parallel) if tools else None) is not None:
        if fields["structured_outputs"] is not None:
            raise ProtocolError("a required or named 'tool_choice' is a constraint of its own: it cannot be combined "
                                "with 'response_format' or 'structured_outputs'", "tool_choice")
        # A tool's parameters may not be a schema llguidance takes.
        fields["structured_outputs"] = _compiled(forced, limits, "tools", "the tools' parameters do not compile: ")
    ids = _chat_prompt(body, limits, tools)
    params = _build_params([ids], fields, max_tokens, logprobs, n, limits, key)
    return ParsedRequest("chat", model, [ids], params, n, stream, include_usage, logprobs,
                         reads_tool_calls=tools is not None and choice != "none", **_session(body))


def _chat_prompt(body: dict, limits: ModelLimits, tools: list[dict] | None = None) -> list[int]:
    """The token ids of a body's ``messages`` (and ``tools``) rendered by the model's chat template."""
    add_generation_prompt = _boolean(body, "add_generation_prompt", True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty array", "messages")
    rendered = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ProtocolError(f"'messages[{i}]' must be an object", f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _CHAT_ROLES:  # a list or object is not hashable
            raise ProtocolError(
                f"'messages[{i}].role' must be one of {sorted(_CHAT_ROLES)}, got {role!r}", f"messages[{i}].role")
        content = _message_content(msg, i)
        if content is None and role != "assistant":
            raise ProtocolError(f"'messages[{i}].content' is required", f"messages[{i}].content")
        out = {"role": role, "content": content or ""}
        for field_name in ("name", "tool_call_id"):
            value = msg.get(field_name)
            if value is not None:
                if not isinstance(value, str):
                    raise ProtocolError(f"'messages[{i}].{field_name}' must be a string", f"messages[{i}].{field_name}")
                out[field_name] = value
        calls = msg.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise ProtocolError(f"'messages[{i}].tool_calls' must be an assistant's array of "
                                    "{'function': {'name', 'arguments'}}", f"messages[{i}].tool_calls")
            out["tool_calls"] = calls
        rendered.append(out)
    rendered = for_template(rendered)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
        raise ProtocolError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    try:
        text = limits.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                    tools=tools, override=limits.chat_template, kwargs=kwargs)
    except ChatTemplateError as e:
        raise ProtocolError(str(e), e.param) from None
    # The template already holds any BOS / special tokens the model wants.
    ids = limits.tokenizer.encode(text, add_special_tokens=_boolean(body, "add_special_tokens", False))
    if not ids:
        raise ProtocolError("the rendered prompt is empty", "messages")
    return ids


# -- vLLM's tokenizer endpoints (what lm-eval's remote tokenizer and ``vllm bench serve`` call) ------
@dataclass
class Tokenized:
    """``POST /tokenize``'s answer, in vLLM's shape (``to_dict``)."""

    tokens: list[int]
    max_model_len: int
    token_strs: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"count": len(self.tokens), "max_model_len": self.max_model_len, "tokens": self.tokens,
                "token_strs": self.token_strs}


def parse_tokenize(body: Any, limits: ModelLimits) -> Tokenized:
    """``{"prompt": str, "add_special_tokens": true}`` or ``{"messages": [...], "add_generation_prompt":
    true, "add_special_tokens": false}`` (vLLM's defaults for each), ``return_token_strs``."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    check_model(body, limits.name)
    if ("prompt" in body) == ("messages" in body):
        raise ProtocolError("give exactly one of 'prompt' (a string) and 'messages' (a chat)", "prompt")
    if "messages" in body:
        ids = _chat_prompt(body, limits)
    else:
        prompt = _string(body, "prompt")
        if prompt is None:
            raise ProtocolError("'prompt' must be a string", "prompt")
        ids = limits.tokenizer.encode(prompt, add_special_tokens=_boolean(body, "add_special_tokens", True))
    strs = None
    if _boolean(body, "return_token_strs", False):
        strs = [limits.tokenizer.hf.id_to_token(t) for t in ids]
    return Tokenized(ids, limits.max_model_len, strs)


def parse_detokenize(body: Any, limits: ModelLimits) -> str:
    """``{"tokens": [...]}``: their text, special tokens included (as vLLM decodes them)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    check_model(body, limits.name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ProtocolError("'tokens' must be an array of token ids", "tokens")
    return limits.tokenizer.decode(_token_list(tokens, "tokens", limits.vocab_size),
                                   skip_special_tokens=False)


# -- responses ---------------------------------------------------------------------------------------
class Choice:
    """Accumulates one choice's deltas (text, tokens, logprobs, finish reason)."""

    __slots__ = ("index", "text", "num_tokens", "logprobs", "prompt_logprobs", "finish_reason", "stop_reason",
                 "num_prompt_tokens", "num_cached_tokens", "keep_output", "echoed")

    def __init__(self, index: int, keep_output: bool = True):
        """``keep_output`` False: the prompt is only scored (``max_tokens`` 0), and the token the
        engine sampled after it is left out of the answer."""
        self.index = index
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[Logprobs] = []
        self.prompt_logprobs: list[Logprobs | None] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.keep_output = keep_output
        self.echoed = False  # streaming: the prompt text went out already (``echo``)

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if self.keep_output:
            self.text += out.new_text
            self.num_tokens = out.num_output_tokens
            self.logprobs.extend(out.logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason if self.keep_output else "length"
            self.stop_reason = out.stop_reason if self.keep_output else None


def usage(choices: list[Choice], n: int, prompt_lens: list[int]) -> dict[str, Any]:
    """Prompt tokens count each prompt once (not once per sample), as OpenAI does."""
    prompt = sum(prompt_lens)
    completion = sum(c.num_tokens for c in choices)
    cached = 0
    for i in range(len(prompt_lens)):
        group = choices[i * n:(i + 1) * n]
        cached += min((c.num_cached_tokens for c in group), default=0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, lps: list[Logprobs], offset: int = 0,
                        prompt: list[Logprobs | None] | None = None, prompt_ids: list[int] | None = None,
                        after_prompt: int = 0) -> dict[str, Any]:
    """OpenAI's completion ``logprobs`` of ``lps`` (generated tokens; their text starts at
    ``offset``). With ``echo``, the prompt's tokens first (``prompt``: their logprobs, None for
    the first token; ``prompt_ids``: the tokens), from offset 0, and the generated ones from
    ``after_prompt`` (the echoed prompt text's length)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    if prompt is not None:
        at = 0
        for token_id, lp in zip(prompt_ids, prompt):
            text = token_text(tok, token_id)
            tokens.append(text)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else _top(tok, lp))
            offsets.append(at)
            at += len(text)
        offset = after_prompt
    for lp in lps:
        text = token_text(tok, lp.token_id)
        tokens.append(text)
        token_lps.append(lp.logprob)
        tops.append(_top(tok, lp))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _top(tok: Tokenizer, lp: Logprobs) -> dict[str, float]:
    top: dict[str, float] = {}
    for tid, value in lp.top:
        top.setdefault(token_text(tok, tid), value)
    return top


def chat_logprobs(tok: Tokenizer, lps: list[Logprobs]) -> dict[str, Any]:
    def entry(tid: int, value: float) -> dict[str, Any]:
        text = token_text(tok, tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    content = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(tid, value) for tid, value in lp.top]
        content.append(item)
    return {"content": content}
