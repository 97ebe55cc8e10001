"""The OpenAI-compatible server (``server/``) end to end, over real HTTP, with the default model.

One uvicorn thread serves three apps on loopback ports, all in one event loop:
* ``main``: the normal server (its lifespan starts the engine);
* ``keyed``: the same engine behind an API key and a small body limit;
* ``public``: the same engine behind an API key, with ``/metrics`` and ``/stats`` left open;
* ``loading``: an engine that is never started, to see the 503s of a server still loading.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from bench import harness
from bench.chaos.load import proc_status
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.session import SessionHint
from server.cli import parse_args, read_cluster_secret
from server.app import ServerSettings, build_app
from engine.async_engine import AsyncLLMEngine
from prompts import PROMPTS

API_KEY = "test-key-123"
OTHER_KEY = "another-users-key"
OPERATOR_KEY = "the-operators-key"
# One intra-op thread: on a small shared machine a second OpenMP thread that gets descheduled
# stalls every parallel region (measured 10x slower steps under load).
THREADS = int(os.environ.get("MOONCAKE_TEST_THREADS", "1"))
PROMPT = "The capital of France is"


# A Hermes-style template (as Qwen's): tools in the system turn, calls as <tool_call> JSON, results
# as <tool_response>. SmolLM2's own template knows no tools; the server takes this one as an
# operator's --chat-template.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


class Servers:
    def __init__(self):
        self.client = AsyncLLMEngine(
            EngineConfig(threads=THREADS, kv_cache_gib=0.25, max_num_batched_tokens=512, dtype="float32"), max_waiting=256
        )
        self.idle = AsyncLLMEngine(EngineConfig(threads=1))  # never started: "still loading"
        apps = {
            "main": build_app(self.client),
            "keyed": build_app(self.client, ServerSettings(api_keys=(API_KEY, OTHER_KEY), operator_key=OPERATOR_KEY,
                                                           max_body_bytes=4096), manage_engine=False),
            "public": build_app(self.client, ServerSettings(api_keys=(API_KEY,), public_metrics=True),
                                manage_engine=False),
            "shared": build_app(self.client, ServerSettings(api_keys=(API_KEY, OTHER_KEY), cache_scope="shared"),
                                manage_engine=False),
            "tools": build_app(self.client, ServerSettings(chat_template=HERMES_TEMPLATE), manage_engine=False),
            "loading": build_app(self.idle, manage_engine=False),
        }
        self.sockets = {name: _socket() for name in apps}
        self.urls = {name: "http://127.0.0.1:%d" % s.getsockname()[1] for name, s in self.sockets.items()}
        self.servers = {
            name: uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
            for name, app in apps.items()
        }
        self.thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self):
        await asyncio.gather(*(s.serve(sockets=[self.sockets[n]]) for n, s in self.servers.items()))

    def start(self):
        self.thread.start()

        def healthy() -> bool:
            try:
                return httpx.get(self.urls["main"] + "/health", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        harness.until(healthy, 300, "the in-process server to become healthy")

    def stop(self):
        for s in self.servers.values():
            s.should_exit = True
        self.thread.join(timeout=30)
        for sock in self.sockets.values():
            sock.close()


@pytest.fixture(scope="module")
def servers():
    s = Servers()
    s.start()
    yield s
    s.stop()
    assert not s.thread.is_alive()


@pytest.fixture(scope="module")
def url(servers):
    return servers.urls["main"]


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(servers):
    return servers.client.tokenizer


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = httpx.get(url + "/stats").json()
        if stats["num_used_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        if time.time() > deadline:
            raise AssertionError(f"KV blocks not released: {stats}")
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def no_leaks(request):
    url = request.getfixturevalue("url") if "servers" in request.fixturenames else None
    yield
    if url is not None:
        wait_idle(url)


def post(url: str, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (dict, list)):
        kw["json"] = body
    else:
        kw["content"] = body
    return httpx.post(url + path, timeout=120, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def error_id(message: str) -> str:
    """The id a 5xx message refers the client to (the server log has the detail under it)."""
    found = re.search(r"error id ([0-9a-f]{8})\b", message)
    assert found, message
    return found.group(1)


def sse_events(text: str) -> list[dict]:
    """The events of a whole streamed answer, which must end with ``data: [DONE]``."""
    stream = harness.sse_events(text.splitlines())
    assert stream.done
    return stream.events


# -- basics ------------------------------------------------------------------------------------------
def test_health_models_and_loading(servers, url):
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]

    loading = servers.urls["loading"]
    r = httpx.get(loading + "/health")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    assert_error(post(loading, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 503)
    assert_error(httpx.get(url + "/no/such/route"), 404)


def test_completion_nonstream_and_stream_agree(oai, tokenizer):
    full = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0)
    assert full.object == "text_completion"
    [choice] = full.choices
    assert choice.text.startswith(" Paris"), choice.text
    assert choice.finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.prompt_tokens_details.cached_tokens >= 0

    chunks = list(oai.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        logprobs=0, stream_options={"include_usage": True},
    ))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    text = "".join(c.choices[0].text for c in body)
    streamed_tokens = sum(len(c.choices[0].logprobs.tokens) for c in body if c.choices[0].logprobs)
    assert text == choice.text
    assert body[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert streamed_tokens == last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_nonstream_and_stream(oai, tokenizer):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    full = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       max_completion_tokens=10, temperature=0)
    assert full.object == "chat.completion"
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert full.usage.prompt_tokens == len(expected_prompt)

    chunks = list(oai.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == choice.message.content
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason


def test_stop_string_and_token_id_prompt(oai, tokenizer, url):
    base = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                  temperature=0).choices[0]
    assert "." in base.text, base.text
    stopped = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                     temperature=0, stop=["."]).choices[0]
    assert stopped.text == base.text.split(".")[0]
    assert stopped.finish_reason == "stop"
    # The same prompt as token ids gives the same text.
    r = post(url, "/v1/completions", {"prompt": tokenizer.encode(PROMPT), "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == base.text


def test_seed_reproducible_and_n(oai):
    def sample():
        return oai.completions.create(model="SmolLM2-135M-Instruct", prompt="My favourite animal is",
                                      max_tokens=8, temperature=1.0, seed=1234, n=2)

    a, b = sample(), sample()
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seeds 1234 and 1235
    assert 2 <= a.usage.completion_tokens <= 16
    assert a.usage.prompt_tokens == b.usage.prompt_tokens  # counted once, not per choice


def test_prompt_batch_and_streamed_n(url):
    prompts = [PROMPT, "Water boils at"]
    r = post(url, "/v1/completions", {"prompt": prompts, "max_tokens": 4, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] and choices[2]["text"] == choices[3]["text"]
    alone = post(url, "/v1/completions", {"prompt": prompts[1], "max_tokens": 4, "temperature": 0})
    assert alone.json()["choices"][0]["text"] == choices[2]["text"]

    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "seed": 7,
            "stream": True}
    events = sse_events(post(url, "/v1/chat/completions", body).text)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["finish_reason"] in ("stop", "length")
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_logprobs(oai):
    c = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4,
                               temperature=0, logprobs=2).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 1 <= len(top) <= 2
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen is the best

    chat = oai.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}],
                                       logprobs=True, top_logprobs=3).choices[0]
    content = chat.logprobs.content
    assert 1 <= len(content) <= 4
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)


SCORED = ["The capital of France is Paris", "Two plus two is four, and", "The capital of France is Rome"]


def _scored_by_the_engine(prompts: list[str]) -> list[list]:
    from engine import LLM

    llm = LLM(threads=1, kv_cache_gib=0.05, dtype="float32")
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    return [r.prompt_logprobs for r in got]


def test_echo_with_logprobs_scores_the_prompts_as_vllm_answers(url, tokenizer):
    # lm-evaluation-harness's loglikelihood request, as it sends it.
    body = {"prompt": SCORED, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    want = _scored_by_the_engine(SCORED)
    for prompt, c, engine in zip(SCORED, choices, want):
        ids = tokenizer.encode(prompt)
        lp = c["logprobs"]
        assert c["text"].startswith(prompt) and len(c["text"]) > len(prompt)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing precedes it
        assert "".join(lp["tokens"]) == c["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx([e.logprob for e in engine[1:]], abs=1e-4)
        assert all(len(top) == 1 and max(top.values()) >= value - 1e-6
                   for top, value in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
    paris, rome = (sum(c["logprobs"]["token_logprobs"][-2:-1]) for c in (choices[0], choices[2]))
    assert paris > rome  # the model knows


def test_echo_with_max_tokens_0_scores_without_generating(url, tokenizer):
    r = post(url, "/v1/completions", {"prompt": SCORED[0], "max_tokens": 0, "logprobs": 0, "echo": True, "n": 2})
    assert r.status_code == 200, r.text
    data = r.json()
    for c in data["choices"]:
        assert c["text"] == SCORED[0] and c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == len(tokenizer.encode(SCORED[0]))
        assert all(top == {} for top in c["logprobs"]["top_logprobs"][1:])  # logprobs 0: no alternatives
    assert data["usage"]["completion_tokens"] == 0
    # Echo without logprobs: the text only.
    r = post(url, "/v1/completions", {"prompt": [tokenizer.encode(SCORED[1])], "max_tokens": 2, "echo": True,
                                      "temperature": 0})
    c = r.json()["choices"][0]
    assert c["text"].startswith(SCORED[1]) and c["logprobs"] is None


def test_echo_streams_the_prompt_first_and_equals_the_whole_answer(url):
    body = {"prompt": SCORED[:2], "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0}
    whole = post(url, "/v1/completions", body).json()["choices"]
    texts, tokens, values = ["", ""], [[], []], [[], []]
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if (data := harness.sse_data(line)) is None or data == harness.DONE:
                continue
            for c in json.loads(data)["choices"]:
                texts[c["index"]] += c["text"]
                tokens[c["index"]] += c["logprobs"]["tokens"]
                values[c["index"]] += c["logprobs"]["token_logprobs"]
    for i, c in enumerate(whole):
        assert texts[i] == c["text"] and tokens[i] == c["logprobs"]["tokens"]
        assert values[i][0] is None and values[i][1:] == pytest.approx(c["logprobs"]["token_logprobs"][1:], abs=1e-6)


def test_prefix_cache_reported(oai, url):
    prompt = "Here is a long shared preamble that repeats, " * 6 + "and the question is"
    first = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2, temperature=0)
    second = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens
    metrics = httpx.get(url + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 16


def test_tokenize_round_trips_with_detokenize_in_vllms_shapes(servers, url, tokenizer):
    """Issue 53 item 4: vLLM's /tokenize (a prompt or chat messages), /detokenize and
    /tokenizer_info, which lm-eval's remote tokenizer and `vllm bench serve` look for."""
    text = "The capital of France is Paris."
    r = post(url, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == servers.client.max_model_len and len(got["token_strs"]) == got["count"]
    assert post(url, "/detokenize", {"tokens": got["tokens"]}).json() == {"prompt": text}
    plain = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["token_strs"] is None and plain["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    rendered = post(url, "/tokenize", {"messages": chat["messages"]}).json()["tokens"]
    answer = post(url, "/v1/chat/completions", chat).json()
    assert answer["usage"]["prompt_tokens"] == len(rendered)  # the same ids a chat request runs
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    for path, body, param in [("/tokenize", {"prompt": text, "messages": chat["messages"]}, "prompt"),
                              ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": text, "model": "gpt-4"}, "model"),
                              ("/detokenize", {"tokens": [1, -1]}, "tokens"), ("/detokenize", {}, "tokens")]:
        assert_error(post(url, path, body), 404 if param == "model" else 400, param)
    keyed = servers.urls["keyed"]  # a user's routes: they need a key where keys are set
    assert_error(post(keyed, "/tokenize", {"prompt": text}), 401)
    assert_error(httpx.get(keyed + "/tokenizer_info"), 401)
    assert post(keyed, "/tokenize", {"prompt": text}, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def test_lm_evals_remote_tokenizer_finds_and_uses_the_servers(url, tokenizer):
    """lm-eval's local-completions, its tokenizer_backend left to the default ("auto"), uses the
    server's tokenizer when /tokenizer_info and /tokenize answer as vLLM's do (the real lm-eval,
    the [eval] extra; skipped without it)."""
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(url + "/v1/completions")
    remote = utils.RemoteTokenizer(url + "/v1/completions")
    text = "Hello, world: a test of the remote tokenizer."
    assert remote.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text and remote.eos_token_id in tokenizer.eos_token_ids


def test_openai_defaults_stop_reason_logit_bias_and_min_tokens(url, tokenizer):
    """Issue 53 item 5: max_tokens absent on /v1/completions is 16 (OpenAI, vLLM); the choice says
    what stopped it (stop_reason: the string, the token id, None for EOS); logit_bias and
    min_tokens change what is sampled as OpenAI and vLLM define them."""
    def complete(**body) -> dict:
        r = post(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()

    assert complete(ignore_eos=True)["usage"]["completion_tokens"] == 16
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert complete(max_tokens=1)["choices"][0]["text"] == " Paris" and len(paris) == 1
    by_string = complete(max_tokens=8, stop=[" Paris"])["choices"][0]
    assert (by_string["text"], by_string["finish_reason"], by_string["stop_reason"]) == ("", "stop", " Paris")
    by_token = complete(max_tokens=8, stop_token_ids=paris)["choices"][0]
    assert (by_token["finish_reason"], by_token["stop_reason"]) == ("stop", paris[0])
    assert complete(max_tokens=2)["choices"][0]["stop_reason"] is None  # length
    # min_tokens: the stop token cannot come first, and the stop string ends nothing before it.
    held = complete(max_tokens=3, stop_token_ids=paris, min_tokens=1)["choices"][0]
    assert not held["text"].startswith(" Paris")
    late = complete(max_tokens=4, stop=[" Paris"], min_tokens=2)["choices"][0]
    assert late["text"].startswith(" Paris") and late["stop_reason"] is None
    # logit_bias: -100 takes " Paris" out; +100 on another token makes it the answer.
    assert complete(max_tokens=1, logit_bias={str(paris[0]): -100})["choices"][0]["text"] != " Paris"
    rome = tokenizer.encode(" Rome", add_special_tokens=False)[0]
    assert complete(max_tokens=1, logit_bias={str(rome): 100})["choices"][0]["text"] == " Rome"
    events = sse_events(post(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                                      "stop": [" Paris"], "stream": True}).text)
    assert events[-1]["choices"][0]["stop_reason"] == " Paris"


def test_request_ids_echoed_unknown_fields_logged_once_and_cors_only_where_allowed(url, caplog):
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "frobnicate": 1, "zork": "x"},
             headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert post(url, "/v1/completions", {"prompt": ""}, headers={"X-Request-Id": "t-43"}).headers["x-request-id"] == "t-43"
    logged = [rec.getMessage() for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(logged) == 1 and "zork" in logged[0]
    caplog.clear()
    post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "frobnicate": 2})
    assert not [rec for rec in caplog.records if "frobnicate" in rec.getMessage()]  # once per name

    async def preflights() -> list[httpx.Response]:
        out = []
        for origins in ((), ("https://ui.example",)):
            app = build_app(AsyncLLMEngine(EngineConfig(threads=1)), ServerSettings(api_keys=(API_KEY,),
                            allowed_origins=origins), manage_engine=False)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
                out.append(await http.options("/v1/chat/completions", headers={
                    "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,content-type"}))
        return out
    closed, allowed = asyncio.run(preflights())
    assert closed.status_code == 405 and "access-control-allow-origin" not in closed.headers  # off by default
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://ui.example"


def test_the_models_generation_config_gives_the_defaults_a_request_leaves_out(tmp_path, tokenizer):
    """--generation-config auto (the default, as vLLM): the sampling fields a model ships in its
    generation_config.json are what a request that leaves them out gets; a request's own win."""
    from engine.generation_config import read_generation_config
    from server.protocol import ModelLimits, parse_chat

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 9}))
    config = read_generation_config(tmp_path)
    assert config.eos_token_ids == (2, 7)
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    limits = ModelLimits("m", tokenizer, 2048, tokenizer.vocab_size, sampling_defaults=config.sampling_defaults)
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    (params,) = parse_chat(chat, limits).params[0]
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    (params,) = parse_chat({**chat, "temperature": 0, "top_k": -1}, limits).params[0]
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, -1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature"):
        read_generation_config(tmp_path)


def test_structured_output_through_the_openai_client(oai, url):
    """Issue 53 item 1: what `client.chat.completions.parse(response_format=Model)` and LangChain's
    with_structured_output() send (json_schema), json_object, and vLLM's structured_outputs (regex,
    choice, grammar), each held by the sampler's mask; a schema that does not compile is a 400."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=12)
        country: str = Field(max_length=12)
        population_millions: int = Field(ge=0, le=99)  # unbounded, the small model writes digits for ever

    done = oai.chat.completions.parse(model="SmolLM2-135M-Instruct", response_format=City, temperature=0,
                                      max_tokens=48, messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(done.choices[0].message.parsed, City), done.choices[0].message.content
    # 20 prompts of 20 answer with JSON that validates against the schema (as strict as the client
    # makes it: no other properties, or the small model invents keys for ever).
    strict = {**City.model_json_schema(), "additionalProperties": False}
    topics = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Quito", "Seoul", "Accra", "Hanoi", "Kyiv",
              "Doha", "Riga", "Bern", "Baku", "Lagos", "Perth", "Porto", "Dakar"]
    r = post(url, "/v1/completions", {
        "prompt": [f"A JSON description of the city of {t}: " for t in topics], "temperature": 0, "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "City", "schema": strict,
                                                                   "strict": True}}})
    assert r.status_code == 200, r.text
    answers = [c["text"] for c in r.json()["choices"]]
    assert all(City.model_validate_json(a) for a in answers), answers
    obj = oai.chat.completions.create(model="SmolLM2-135M-Instruct", response_format={"type": "json_object"},
                                      temperature=0, max_tokens=60, messages=[
                                          {"role": "user", "content": "Give me a JSON object with a name and an age."}])
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    def constrained(spec: dict, **body) -> str:
        r = post(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 12,
                                          "structured_outputs": spec, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    assert constrained({"choice": ["Lyon", "Nice"]}) in ("Lyon", "Nice")
    assert re.fullmatch(r"[0-9]{2}-[a-z]{3}", constrained({"regex": r"[0-9]{2}-[a-z]{3}"}, temperature=1.0, seed=3))
    assert constrained({"grammar": 'start: "yes" | "no"'}) in ("yes", "no")
    streamed = sse_events(post(url, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 12,
                                                        "stream": True, "structured_outputs": {"choice": ["Lyon", "Nice"]}}).text)
    assert "".join(e["choices"][0]["text"] for e in streamed) in ("Lyon", "Nice")
    for body, param in [({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
                         "response_format"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
                        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                         "structured_outputs")]:
        assert_error(post(url, "/v1/completions", {"prompt": PROMPT, **body}), 400, param)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 20}}}}}]


def test_a_tool_call_round_trip_through_the_openai_client(servers, tokenizer):
    """Issue 53 item 2: tools go to the chat template, a required (or named) call is held to the
    tool's schema, the answer comes back as tool_calls (streamed as deltas too), and the call and
    its result in the history are rendered for the next turn, not dropped."""
    url = servers.urls["tools"]
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, tools=WEATHER,
                                        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    history = question + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    rendered = tokenizer.decode(post(url, "/tokenize", {"messages": history}).json()["tokens"],
                                skip_special_tokens=False)
    assert "<tool_call>" in rendered and '"get_weather"' in rendered and "18 C and sunny" in rendered
    final = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=history, tools=WEATHER,
                                        temperature=0, max_tokens=24)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls

    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = oai.chat.completions.create(model="SmolLM2-135M-Instruct", messages=question, tools=WEATHER,
                                         tool_choice=named, temperature=0, max_tokens=60, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and deltas[-1].finish_reason == "tool_calls"
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)  # greedy: the same call
    for body, param in [({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
                        ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": WEATHER, "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"functions": [{"name": "f"}]}, "functions")]:
        assert_error(post(url, "/v1/chat/completions", {"messages": question, **body}), 400, param)


def test_tool_calls_are_read_from_text_streamed_in_any_pieces():
    from server.tool_calls import ToolCallReader, read_calls

    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
           '<tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>not json</tool_call>'
    content, calls = read_calls(text)
    assert content == "Let me check. <tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("f", {})]
    for size in (1, 3, 7):
        reader, got, streamed = ToolCallReader(), "", []
        for i in range(0, len(text), size):
            piece, new = reader.feed(text[i:i + size])
            assert "<tool_call>" not in piece or "not json" in got + piece  # a call never leaks as content
            got, streamed = got + piece, streamed + new
        got += reader.finish()
        assert got == "Let me check. <tool_call>not json</tool_call>" and len(streamed) == 2
    assert read_calls("no calls here") == ("no calls here", [])


# -- bad input ---------------------------------------------------------------------------------------
BAD_BODIES = [
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": PROMPT, "stop": 7}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "seed": "1"}, "seed"),
    ("/v1/completions", {"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "model": 3}, "model"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": 4, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"10": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"10000000": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
]


def test_bad_requests_are_400(url):
    for path, body, param in BAD_BODIES:
        assert_error(post(url, path, body), 400, param)
    assert_error(post(url, "/v1/completions", b"{not json"), 400)
    assert_error(post(url, "/v1/completions", b"\xff\xfe\x00garbage"), 400)
    assert_error(post(url, "/v1/completions", b"[1, 2]"), 400)
    assert_error(post(url, "/v1/completions", b""), 400)
    assert_error(post(url, "/v1/chat/completions", b"[" * 100000), 400)
    assert_error(post(url, "/v1/chat/completions", {"messages": [{"role": {"a": 1}, "content": "x"}]}), 400,
                 "messages[0].role")
    # A lone surrogate is no text (the tokenizer cannot take it); a huge integer is no float.
    assert_error(post(url, "/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'), 400)
    assert_error(post(url, "/v1/chat/completions",
                      b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'), 400)
    assert_error(post(url, "/v1/completions", b'{"prompt": "Hi", "temperature": 1' + b"0" * 400 + b"}"), 400,
                 "temperature")
    # Unknown keys are ignored.
    r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "frobnicate": {"x": 1}, "user": "u"})
    assert r.status_code == 200, r.text


def test_context_limits_and_unknown_model(url, servers):
    max_len = servers.client.max_model_len
    capacity = servers.client.stats()["num_blocks"] * servers.client.stats()["block_size"]
    limit = min(max_len, capacity)
    err = assert_error(post(url, "/v1/completions", {"prompt": [1] * limit, "max_tokens": 1}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert_error(post(url, "/v1/completions", {"prompt": [1] * 10, "max_tokens": limit}), 400, "max_tokens")
    assert_error(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "max_completion_tokens": max_len}),
                 400, "max_completion_tokens")
    err = assert_error(post(url, "/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}), 404, "model")
    assert err["code"] == "model_not_found"


def test_body_limit_413(url, servers):
    big = json.dumps({"prompt": "x" * (1 << 20), "max_tokens": 1}).encode()
    assert_error(post(url, "/v1/completions", big), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 1024

    keyed = servers.urls["keyed"]
    r = httpx.post(keyed + "/v1/completions", content=chunked(), headers={"Authorization": f"Bearer {API_KEY}"})
    assert_error(r, 413)


def test_api_key(servers):
    keyed = servers.urls["keyed"]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert_error(post(keyed, "/v1/completions", body), 401)
    assert_error(post(keyed, "/v1/completions", body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(keyed + "/v1/models"), 401)
    assert httpx.get(keyed + "/health").status_code == 200
    for key in (API_KEY, OTHER_KEY, OPERATOR_KEY):  # every user's key, and the operator's
        good = openai.OpenAI(base_url=keyed + "/v1", api_key=key, max_retries=0)
        assert good.completions.create(model="SmolLM2-135M-Instruct", **body).choices[0].text
    bad = openai.OpenAI(base_url=keyed + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_stats_and_metrics_need_the_operator_key_unless_public(servers):
    """Issue 52: /stats and /metrics are the operator's (they name instances, load, what is
    cached): a user's key gets 403; without an operator key they take a user's key."""
    auth = {"Authorization": f"Bearer {OPERATOR_KEY}"}
    keyed, public = servers.urls["keyed"], servers.urls["public"]
    for path in ("/stats", "/metrics"):
        err = assert_error(httpx.get(keyed + path), 401)
        assert err["code"] == "invalid_api_key"
        assert_error(httpx.get(keyed + path, headers={"Authorization": "Bearer wrong"}), 401)
        err = assert_error(httpx.get(keyed + path, headers={"Authorization": f"Bearer {API_KEY}"}), 403)
        assert "--operator-key" in err["message"]
        assert httpx.get(keyed + path, headers=auth).status_code == 200
        assert httpx.get(public + path).status_code == 200
    stats = httpx.get(keyed + "/stats", headers=auth).json()
    assert "num_blocks" in stats and stats["kernels"] == "native CPU"  # which kernels run, on this CPU
    assert "vllm:num_requests_running" in httpx.get(public + "/metrics").text
    # Opening the metrics opens nothing else.
    assert_error(httpx.get(public + "/v1/models"), 401)
    assert httpx.get(public + "/health").status_code == 200


def test_overload_429(servers, url):
    client = servers.client
    old = client.max_waiting
    client.max_waiting = 0
    try:
        r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "stream": True})
        assert_error(r, 429)
        assert int(r.headers["retry-after"]) >= 1
    finally:
        client.max_waiting = old


def test_an_abort_that_overtakes_its_request_is_remembered(servers):
    """An abort for an id the engine does not hold yet (the caller gave up while the request was
    on its way): the request, when it comes, is answered as aborted without computing anything;
    another id is served as usual."""
    client = servers.client

    async def run() -> tuple[list, list]:
        computed = client.stats()["num_prompt_tokens_computed"]
        await client.abort("overtaken")
        late = [out async for out in client.generate("overtaken", PROMPT, SamplingParams(max_tokens=4))]
        assert client.stats()["num_prompt_tokens_computed"] == computed
        other = [out async for out in client.generate("served", PROMPT, SamplingParams(max_tokens=2))]
        return late, other

    late, other = asyncio.run(run())
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in late] == [(True, "abort", [])]
    assert other[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in other) == 2


def _rss_anon_kib() -> int:
    return proc_status(os.getpid(), ("RssAnon",))["RssAnon"]


def test_freed_memory_goes_back_to_the_os_once_the_engine_is_idle(servers, monkeypatch):
    """The engine keeps freed activation memory for the next step (``configure_cpu_runtime``), so
    a burst's high-water mark would stay resident: idle for ``IDLE_TRIM_S`` after a step, the engine
    thread returns it (``return_freed_memory``), and only once per idle spell."""
    import engine.async_engine as async_engine
    from engine.cpu_runtime import return_freed_memory

    # The engine thread's trims are recorded from here on, not done: none lands in the middle of
    # the measurement below.
    trims = []
    monkeypatch.setattr(async_engine, "IDLE_TRIM_S", 1.0)
    monkeypatch.setattr(async_engine, "return_freed_memory", lambda: trims.append(time.monotonic()))

    # What the trim does: 400 MB freed into the tuned heap stays resident until it is returned.
    return_freed_memory()  # from a trimmed heap, so the block below takes fresh pages
    before = _rss_anon_kib()
    block = b"x" * (400 << 20)  # written, so resident (calloc'd pages might not be)
    del block
    assert _rss_anon_kib() - before > 300 << 10
    return_freed_memory()
    assert _rss_anon_kib() - before < 100 << 10

    # That the engine thread calls it: after its steps, once, when it has been idle a while.
    async def generate() -> None:
        async for _ in servers.client.generate("trim", PROMPT, SamplingParams(max_tokens=2)):
            pass

    asyncio.run(generate())  # wakes the engine thread, whose next idle wait is the short one
    finished = time.monotonic()
    deadline = finished + 10
    while not [t for t in trims if t > finished] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)
    # One trim since (an earlier test's steps may have owed one before: not counted).
    assert len([t for t in trims if t > finished]) == 1


def _parse_workers() -> list[int]:
    """Pids of this process's tokenizer processes (``server/parse_worker.py``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"server.parse_worker" in cmdline and ppid == os.getpid():
            found.append(int(pid))
    return found


def test_a_large_body_is_tokenized_in_the_tokenizer_process(url, tokenizer):
    """A body over 32 KiB (here a 40 kB "user" field) is parsed by the tokenizer process, and
    answered as any other; its errors are the client's, as inline."""
    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "user": "u" * 40000}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(" Paris")
    assert len(_parse_workers()) == 1
    r = post(url, "/v1/chat/completions", {**body, "prompt": None, "messages": [{"role": "user", "content": 5}]})
    assert_error(r, 400, "messages[0].content")


PLANTED = "http://10.1.2.3:7001"


def test_engine_failure_fails_requests(servers, url, caplog):
    engine = servers.client._engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError(f"injected step failure: {PLANTED} replied 'boom'")
        return real_step()

    def logged(id_: str) -> str:
        lines = [r.getMessage() for r in caplog.records if id_ in r.getMessage()]
        assert lines, f"error id {id_} is not in the log"
        return lines[0]

    engine.step = flaky_step
    try:
        with caplog.at_level(logging.WARNING, logger="server.app"):
            # After streaming started: the SSE error event.
            r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "stream": True})
            assert r.status_code == 200
            events = sse_events(r.text)
            assert len(events) >= 2 and "choices" in events[0]  # the failure came mid-stream
            err = events[-1]["error"]
            assert err["type"] == "internal_server_error"
            assert PLANTED not in err["message"] and "boom" not in err["message"]
            assert "injected" not in err["message"]
            assert PLANTED in logged(error_id(err["message"]))

            # Before any output: a 500.
            engine.step = lambda: (_ for _ in ()).throw(RuntimeError(f"injected again at {PLANTED}"))
            r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
            err = assert_error(r, 500)
            assert PLANTED not in r.text and "injected" not in r.text
            assert "injected again" in logged(error_id(err["message"]))
    finally:
        engine.step = real_step
    assert post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


class _FailedToLoad(AsyncLLMEngine):
    """An engine whose loading failed with a message that names an internal address."""

    @property
    def load_error(self) -> str:
        return f"instance {PLANTED} (prefill): model failed to load"


def test_load_error_stays_in_the_log():
    engine = _FailedToLoad(EngineConfig(threads=1))  # never started

    async def calls(settings: ServerSettings, headers: dict[str, str]) -> tuple[httpx.Response, httpx.Response]:
        app = build_app(engine, settings, manage_engine=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server",
                                     headers=headers) as client:
            return (await client.get("/health"),
                    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))

    auth = {"Authorization": f"Bearer {API_KEY}"}
    for settings, headers, health_detail in [
        (ServerSettings(api_keys=(API_KEY,)), {}, False),   # anyone: no detail
        (ServerSettings(api_keys=(API_KEY,)), auth, True),  # with the key (no operator key: it reads /stats)
        (ServerSettings(), {}, True),                       # no key: /stats is open anyway
    ]:
        health, completion = asyncio.run(calls(settings, headers))
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert (PLANTED in health.json()["error"]) is health_detail
        if settings.api_keys and not headers:
            assert_error(completion, 401)
            continue
        err = assert_error(completion, 503)
        assert PLANTED not in completion.text and error_id(err["message"])


# -- disconnects and concurrency ---------------------------------------------------------------------
def test_client_disconnect_frees_kv(url):
    body = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if harness.sse_data(line) is not None:
                got += 1
                if got == 3:
                    break
        assert httpx.get(url + "/stats").json()["num_used_blocks"] > 0
    stats = wait_idle(url)
    assert stats["num_free_blocks"] == stats["num_blocks"]

    # A non-streaming client that gives up (timeout) is aborted too.
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=1.5)
    wait_idle(url)
    metrics = httpx.get(url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort"' in metrics


async def _stream_text(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, str]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        text = await r.aread()
    events = sse_events(text.decode())
    return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]


def test_64_concurrent_streams_match_sequential(url):
    alone = {}
    with httpx.Client(timeout=120) as c:
        for p in PROMPTS:
            r = c.post(url + "/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0})
            alone[p] = r.json()["choices"][0]["text"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    before = httpx.get(url + "/stats").json()

    async def run_all():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_stream_text(client, url, p) for p in prompts))

    t0 = time.time()
    results = asyncio.run(run_all())
    elapsed = time.time() - t0
    for p, (text, reason) in zip(prompts, results):
        assert text == alone[p], (p, text, alone[p])
        assert reason in ("stop", "length")
    after = httpx.get(url + "/stats").json()
    assert after["max_num_running_seen"] > 8, after
    assert after["num_generated_tokens"] - before["num_generated_tokens"] >= 64
    # Batched: far fewer engine steps than tokens generated.
    assert after["num_steps"] - before["num_steps"] < (after["num_generated_tokens"] - before["num_generated_tokens"]) / 4
    # The steps that computed no prompt token, counted apart with their cost (elastic roles sets
    # them against the calibrated step model): some, each of 1 to 64 sequences of a few tokens.
    delta = {k: after[k] - before[k] for k in ("decode_steps", "decode_step_seconds", "decode_step_seqs",
                                               "decode_step_context_tokens")}
    assert 0 < delta["decode_steps"] <= after["num_steps"] - before["num_steps"], delta
    assert delta["decode_steps"] <= delta["decode_step_seqs"] <= 64 * delta["decode_steps"], delta
    assert delta["decode_step_seqs"] * 2 <= delta["decode_step_context_tokens"] <= delta["decode_step_seqs"] * 200, delta
    assert 0 < delta["decode_step_seconds"] < elapsed + 1, delta
    print(f"64 concurrent streams in {elapsed:.1f}s")


def test_metrics_names(url):
    text = httpx.get(url + "/metrics").text
    for name in [
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total", 'vllm:request_success_total{finished_reason="length"',
    ]:
        assert name in text, name


def test_cli_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "server", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for flag in ("--host", "--port", "--model", "--kv-cache-gib", "--api-key", "--threads",
                 "--max-num-seqs", "--max-num-batched-tokens", "--max-waiting", "--max-body-bytes",
                 "--served-model-name", "MOONCAKE_API_KEY", "--public-metrics", "--cluster-secret-file",
                 "MOONCAKE_CLUSTER_SECRET"):
        assert flag in out, flag


def test_the_instances_a_conductor_starts_inherit_its_engine_pool_and_front_door_flags():
    """``instance_args`` renders every flag declared ``passed_on`` (server/cli.py): an instance
    started with them parses the Conductor's values back; the rest stay the Conductor's own."""
    from server.cli import instance_args

    conductor = parse_args([
        "--model", "/m/model.gguf", "--kv-cache-gib", "0.5", "--dtype", "float32", "--quantization", "int8",
        "--kv-cache-dtype", "bfloat16", "--max-model-len", "4096", "--device", "cpu", "--max-num-seqs", "7",
        "--max-num-batched-tokens", "1024", "--max-waiting", "9", "--max-connections", "99",
        "--header-timeout-s", "4", "--body-timeout-s", "8", "--staging-gib", "0.25", "--transfer-timeout-s", "6",
        "--reservation-lease-s", "40", "--cpp-stages", "2", "--cpp-chunk-tokens", "256", "--cpp-min-tokens", "64",
        "--pool-dram-gib", "0.5", "--pool-ssd-dir", "/ssd", "--pool-ssd-gib", "2", "--pool-block-tokens", "512",
        "--etcd", "http://etcd:2379", "--log-level", "debug", "--api-key", "k", "--port", "9000", "--threads", "3"])
    flags = instance_args(conductor)
    instance = parse_args(["--role", "decode", *flags])
    for name in ("model", "kv_cache_gib", "dtype", "quantization", "kv_cache_dtype", "max_model_len", "device",
                 "max_num_seqs", "max_num_batched_tokens", "max_waiting", "max_connections", "header_timeout_s",
                 "body_timeout_s", "staging_gib", "transfer_timeout_s", "reservation_lease_s", "cpp_stages",
                 "cpp_chunk_tokens", "cpp_min_tokens", "pool_dram_gib", "pool_ssd_dir", "pool_ssd_gib",
                 "pool_block_tokens", "etcd", "log_level"):
        assert getattr(instance, name) == getattr(conductor, name), name
    assert not {"--api-key", "--port", "--threads", "--no-pool"} & set(flags)  # the Conductor's own
    # Without the pool, none of its settings: only --no-pool.
    bare = instance_args(parse_args(["--no-pool", "--pool-ssd-dir", "/ssd"]))
    assert "--no-pool" in bare and not [f for f in bare if f.startswith("--pool-")]


# -- the cluster secret ------------------------------------------------------------------------------
GOOD_SECRET = "s3cret-of-twenty-chars"


def test_cluster_secret_from_env_or_file(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("MOONCAKE_CLUSTER_SECRET", raising=False)
    assert read_cluster_secret(parse_args([])) is None

    monkeypatch.setenv("MOONCAKE_CLUSTER_SECRET", f"  {GOOD_SECRET}\n")
    with caplog.at_level(logging.WARNING):
        assert read_cluster_secret(parse_args([])) == GOOD_SECRET
    assert not caplog.records  # the environment is the recommended way: no warning

    path = tmp_path / "secret"
    path.write_text(f"other-{GOOD_SECRET}\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        # The file wins over the environment: it was asked for explicitly.
        assert read_cluster_secret(parse_args(["--cluster-secret-file", str(path)])) == f"other-{GOOD_SECRET}"
    assert not caplog.records

    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        read_cluster_secret(parse_args(["--cluster-secret-file", str(path)]))
    assert any("chmod 600" in r.getMessage() for r in caplog.records)


def test_cluster_secret_errors_and_command_line_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("MOONCAKE_CLUSTER_SECRET", raising=False)
    with pytest.raises(ValueError, match="cannot read the cluster secret"):
        read_cluster_secret(parse_args(["--cluster-secret-file", str(tmp_path / "missing")]))
    short = tmp_path / "short"
    short.write_text("  too-short  \n")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="at least 16 characters .got 9."):
        read_cluster_secret(parse_args(["--cluster-secret-file", str(short)]))
    monkeypatch.setenv("MOONCAKE_CLUSTER_SECRET", "x" * 15)
    with pytest.raises(ValueError, match="MOONCAKE_CLUSTER_SECRET must be at least 16"):
        read_cluster_secret(parse_args([]))
    with pytest.raises(SystemExit):  # one source or the other, not both
        parse_args(["--cluster-secret", GOOD_SECRET, "--cluster-secret-file", str(short)])

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert read_cluster_secret(parse_args(["--cluster-secret", GOOD_SECRET])) == GOOD_SECRET
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "visible to other users" in warning.getMessage() and "MOONCAKE_CLUSTER_SECRET" in warning.getMessage()
    assert GOOD_SECRET not in warning.getMessage()


# -- session hints (issue 42) --------------------------------------------------------------------------------
def test_bad_session_hints_are_400_naming_the_field(url):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for extra, param in [({"session_id": ["a"]}, "session_id"), ({"session_id": {"id": 1}}, "session_id"),
                         ({"session_id": "x" * 257}, "session_id"), ({"session_id": ""}, "session_id"),
                         ({"session_id": "s", "priority": 1.5}, "priority"),
                         ({"session_id": "s", "priority": True}, "priority"),
                         ({"session_id": "s", "priority": 10**6}, "priority"),
                         ({"priority": 3}, "priority")]:  # a priority of nothing
        assert_error(post(url, "/v1/chat/completions", {**chat, **extra}), 400, param)
    assert_error(post(url, "/v1/completions", {"prompt": PROMPT, "session_id": 7}), 400, "session_id")
    assert_error(post(url, "/v1/completions", {"prompt": PROMPT, "session_id": "a"},
                      headers={"X-Session-Id": "b"}), 400, "session_id")
    assert_error(post(url, "/v1/completions", {"prompt": PROMPT}, headers={"X-Session-Id": "y" * 300}), 400,
                 "session_id")


def test_a_session_hint_retains_its_kv_and_changes_no_output(url, oai):
    before = httpx.get(url + "/stats").json()["num_retained_blocks"]
    prompt = PROMPT + " Tell me more about the city, its history and its museums."
    plain = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=4, temperature=0)
    assert httpx.get(url + "/stats").json()["num_retained_blocks"] == before  # no hint: nothing changes
    hinted = oai.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt + " And", max_tokens=4, temperature=0,
                                    extra_body={"session_id": "chat-42", "priority": 2})
    assert hinted.choices[0].text  # served as any request
    stats = wait_idle(url)
    assert stats["num_retained_blocks"] > before
    by_header = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0},
                     headers={"X-Session-Id": "chat-43"})
    assert by_header.status_code == 200 and by_header.json()["choices"][0]["text"] == plain.choices[0].text


def test_keys_from_flags_env_and_file_warn_on_the_command_line(monkeypatch, tmp_path, caplog):
    """Issue 52: several users' keys (flags, env, a file) and the operator's; a key given on the
    command line is warned about as the cluster secret is (other users can read it in ps)."""
    from server.cli import read_keys

    monkeypatch.delenv("MOONCAKE_API_KEY", raising=False)
    monkeypatch.delenv("MOONCAKE_OPERATOR_KEY", raising=False)
    assert read_keys(parse_args([])) == ((), None)
    keys = tmp_path / "keys"
    keys.write_text("# the users\nalice-key\n\n  bob-key \n")
    keys.chmod(0o600)
    monkeypatch.setenv("MOONCAKE_API_KEY", "env-key")
    monkeypatch.setenv("MOONCAKE_OPERATOR_KEY", "op-key")
    with caplog.at_level(logging.WARNING):
        assert read_keys(parse_args(["--api-key-file", str(keys)])) == (("env-key", "alice-key", "bob-key"), "op-key")
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert read_keys(parse_args(["--api-key", "k1", "--api-key", "k2", "--operator-key", "op2"]))[1] == "op2"
    assert {m for r in caplog.records for m in ("--api-key", "--operator-key") if m in r.getMessage()} == {
        "--api-key", "--operator-key"}
    with pytest.raises(ValueError, match="must not also be"):
        read_keys(parse_args(["--api-key", "op-key"]))
    with pytest.raises(ValueError, match="cannot read"):
        read_keys(parse_args(["--api-key-file", str(tmp_path / "missing")]))


def test_one_users_cached_prompt_tells_another_nothing_unless_the_cache_is_shared(servers):
    """Issue 52 item 3: usage.cached_tokens was an exact oracle of another user's prompt (a guessed
    diagnosis matched 48 tokens, the others 16). Under --cache-scope per-key (the default) each key
    caches apart: a second key's probe finds 0 tokens, the owner's repeat hits. A body's
    cache_salt narrows either scope (vLLM's field); under shared scope a prompt is everyone's."""
    def cached(app: str, key: str, prompt: str, **extra) -> int:
        r = post(servers.urls[app], "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra},
                 headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    note = "Clinic note, patient 4471: the biopsy confirmed a diagnosis of sarcoidosis of the lungs. Plan:"
    assert cached("keyed", API_KEY, note) == 0
    assert cached("keyed", OTHER_KEY, note) == 0  # another user's probe learns nothing
    assert cached("keyed", OPERATOR_KEY, note) == 0  # nor does the operator's key (a caller of its own)
    assert cached("keyed", API_KEY, note) >= 16  # the owner's repeat hits
    assert cached("keyed", API_KEY, note, cache_salt="tab-2") == 0  # a salt of the user's own narrows it
    assert cached("keyed", API_KEY, note, cache_salt="tab-2") >= 16
    shared = "Shared system prompt: you are a helpful assistant for the billing team; answer briefly. Q:"
    assert cached("shared", API_KEY, shared) == 0
    assert cached("shared", OTHER_KEY, shared) >= 16  # shared scope: faster, and it tells
    assert cached("shared", OTHER_KEY, shared, cache_salt="only-mine") == 0
    for salt in ("", 5, "x" * 513):
        assert_error(post(servers.urls["keyed"], "/v1/completions", {"prompt": note, "cache_salt": salt},
                          headers={"Authorization": f"Bearer {API_KEY}"}), 400, "cache_salt")


def test_under_per_key_scope_the_indexer_is_never_a_users():
    """Without an operator key the operator's routes take a user's key; the indexer's answer what
    cached prefixes began with, so under per-key scope a user gets 403 there (shared scope: as before)."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def query(request):
        return JSONResponse({"instances": {}})

    async def scenario() -> None:
        for scope, status in (("per-key", 403), ("shared", 200)):
            app = build_app(AsyncLLMEngine(EngineConfig(threads=1)), ServerSettings(api_keys=(API_KEY,), cache_scope=scope),
                            manage_engine=False, operator_routes=[Route("/query", query, methods=["POST"])])
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
                assert (await http.post("/query", json={})).status_code == 401
                r = await http.post("/query", json={}, headers={"Authorization": f"Bearer {API_KEY}"})
                assert r.status_code == status, (scope, r.text)
                if status == 403:
                    assert "--operator-key" in r.json()["error"]["message"]
    asyncio.run(scenario())


def test_a_users_sessions_are_its_own_and_its_priority_bounded(servers):
    """Issue 52: session ids were not tied to a client (anyone could take over or flush another's
    session) and one client at priority 1000 took a victim's retained blocks. Now a user's session
    id is scoped by its key, and its priority is at most --max-user-priority (0 by default); the
    operator's key may ask for any."""
    from server.app import OpenAIServer

    keyed = servers.urls["keyed"]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "session_id": "chat-1", "priority": 5}
    err = assert_error(post(keyed, "/v1/completions", body, headers={"Authorization": f"Bearer {API_KEY}"}), 403)
    assert err["param"] == "priority" and "--max-user-priority" in err["message"]
    assert post(keyed, "/v1/completions", body, headers={"Authorization": f"Bearer {OPERATOR_KEY}"}).status_code == 200
    server = OpenAIServer(None, ServerSettings(api_keys=(API_KEY, OTHER_KEY), max_user_priority=3), None)
    hint = SessionHint("chat-1", 3)
    alice, bob = (server._scoped(hint, user) for user in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"))
    assert alice.session_id != bob.session_id and alice.priority == bob.priority == 3
    assert server._scoped(hint, None) == hint  # the operator's, or no keys at all: as sent
    long = server._scoped(SessionHint("x" * 256), "aaaaaaaaaaaa")
    assert len(long.session_id) <= 256 and long.session_id.startswith("aaaaaaaaaaaa:")
