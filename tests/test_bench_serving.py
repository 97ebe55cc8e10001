"""bench.serving against a tiny fake OpenAI SSE server, and bench.trace prompt synthesis."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench import serving
from threaded_server import serve_in_thread
from bench.trace import (
    BenchRequest,
    TraceEntry,
    block_tokens,
    load_trace,
    synthesize_requests,
)

# The shared traces live beside the repository (../shared), never inside it.
REAL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "eval" / "traces" / "conversation_trace.jsonl"
TOKEN_SLEEP_S = 0.005


def make_app(state: dict) -> Starlette:
    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        state["payloads"].append(body)
        state["count"] += 1
        if state["count"] <= state["reject_first"]:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=429)
        n = int(body["max_tokens"])

        async def gen():
            for i in range(n):
                await asyncio.sleep(TOKEN_SLEEP_S)
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            if body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n,
                         "total_tokens": len(body["prompt"]) + n}
                yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture
def fake_server():
    state = {"count": 0, "reject_first": 0, "payloads": []}
    with serve_in_thread(make_app(state)) as port:
        yield f"http://127.0.0.1:{port}", state


def _ordered(s: dict) -> bool:
    return s["p50"] <= s["p90"] <= s["p99"]


def test_against_fake_server(fake_server, tmp_path):
    url, state = fake_server
    state["reject_first"] = 2
    reqs = serving.random_requests(8, (5, 20), (3, 6), vocab_size=1000, rate=200.0, seed=1)
    results, duration, model = asyncio.run(serving.run_benchmark(url, reqs, progress=False))
    assert model == "fake-model"
    m = serving.compute_metrics(results, duration, slo_ttft_ms=10_000, slo_tbt_ms=10_000)

    assert (m["completed"], m["rejected"], m["failed"]) == (6, 2, 0)
    assert all(r.status == 429 for r in results if r.rejected)
    # payloads: exact token-id prompts, streaming with usage, greedy, ignore_eos
    p = state["payloads"][-1]
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert p["temperature"] == 0 and p["ignore_eos"] is True
    assert sorted(len(x["prompt"]) for x in state["payloads"]) == sorted(len(r.prompt) for r in reqs)
    assert all(100 <= t < 1000 for x in state["payloads"] for t in x["prompt"])

    ok = [r for r in results if r.success]
    for r in ok:
        assert r.output_tokens == r.output_len == len(r.chunk_times)
        assert 0 < r.ttft < r.e2e
    assert m["total_output_tokens"] == sum(r.output_len for r in ok)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "tbt_ms"):
        assert _ordered(m[key]), key
        assert m[key]["mean"] > 0
    assert m["ttft_ms"]["p50"] < m["e2e_ms"]["p50"]
    assert m["p90_itl_ms"] == m["itl_ms"]["p90"]
    assert m["tbt_ms"]["p99"] >= m["itl_ms"]["p50"] * 0.5
    assert m["slo_attainment"] == pytest.approx(6 / 8)
    assert m["goodput"] == pytest.approx(6 / duration)
    assert m["request_throughput"] > 0 and m["total_token_throughput"] > m["output_throughput"]

    # a tight TTFT SLO nobody meets
    m2 = serving.compute_metrics(results, duration, slo_ttft_ms=0.0001)
    assert m2["slo_attainment"] == 0 and m2["goodput"] == 0

    js, png = tmp_path / "r.json", tmp_path / "cdf.png"
    serving.write_json(str(js), m, results)
    serving.plot_cdfs(results, str(png), m)
    data = json.loads(js.read_text())
    assert data["metrics"]["completed"] == 6 and len(data["requests"]) == 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TTFT" in serving.format_report(m)


def test_cli_main_and_all_failed_exit(fake_server, tmp_path):
    url, state = fake_server
    js = tmp_path / "out.json"
    rc = serving.main(["--base-url", url, "--num-prompts", "3", "--input-len", "4",
                       "--output-len", "2", "--vocab-size", "500", "--result-json", str(js),
                       "--no-progress", "--slo-ttft-ms", "5000"])
    assert rc == 0 and json.loads(js.read_text())["metrics"]["completed"] == 3
    state["reject_first"] = 10**9
    rc = serving.main(["--base-url", url, "--num-prompts", "2", "--input-len", "4",
                       "--output-len", "2", "--model", "x", "--no-progress"])
    assert rc == 1


def test_arrival_times():
    assert serving.arrival_times(4, float("inf")) == [0.0] * 4
    a = serving.arrival_times(2000, 10.0, 1.0, seed=3)
    assert a[0] == 0 and all(x <= y for x, y in zip(a, a[1:]))
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)
    assert a == serving.arrival_times(2000, 10.0, 1.0, seed=3)
    g = serving.arrival_times(2000, 10.0, 0.25, seed=3)  # burstier: same mean, more spread
    gaps = lambda t: [y - x for x, y in zip(t, t[1:])]  # noqa: E731
    import numpy as np

    assert np.mean(gaps(g)) == pytest.approx(0.1, rel=0.15)
    assert np.std(gaps(g)) > 1.5 * np.std(gaps(a))


def test_trace_synthesis_shared_blocks_and_lengths():
    entries = [
        TraceEntry(1000, 6758, 500, list(range(14))),
        TraceEntry(1500, 7322, 490, [0, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]),
        TraceEntry(4000, 2290, 3, [0, 1, 2, 3, 4]),
    ]
    reqs = synthesize_requests(entries, length_scale=0.02, time_scale=2.0, vocab_size=1000, seed=5)
    bs = 10  # 512 * 0.02
    assert [len(r.prompt) for r in reqs] == [135, 146, 46]
    assert [r.output_len for r in reqs] == [10, 10, 1]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 1.0, 6.0])
    a, b, c = (r.prompt for r in reqs)
    blk = lambda p, i: p[i * bs:(i + 1) * bs]  # noqa: E731
    assert blk(a, 0) == blk(b, 0) == blk(c, 0) == block_tokens(0, bs, 1000, seed=5)
    assert a[:4 * bs] == c[:4 * bs]  # shared ids 0..3 (full blocks of c)
    assert blk(a, 1) != blk(b, 1)  # different ids -> different blocks
    assert a[4 * bs:] != c[4 * bs:]  # c's partial tail is its own
    assert all(100 <= t < 1000 for p in (a, b, c) for t in p)
    # deterministic
    again = synthesize_requests(entries, length_scale=0.02, time_scale=2.0, vocab_size=1000, seed=5)
    assert [r.prompt for r in again] == [a, b, c]
    # unscaled: exact lengths, 512-token blocks
    full = synthesize_requests(entries[:1] + entries[2:], vocab_size=1000)
    assert [len(r.prompt) for r in full] == [6758, 2290]
    assert full[0].prompt[:4 * 512] == full[1].prompt[:4 * 512]
    assert isinstance(full[0], BenchRequest)


@pytest.mark.skipif(not os.path.exists(REAL_TRACE), reason="real trace not available")
def test_real_trace_first_50_lines():
    entries = load_trace(REAL_TRACE, max_requests=50)
    assert len(entries) == 50
    reqs = synthesize_requests(entries, length_scale=0.02, time_scale=0.5, vocab_size=32000)
    for e, r in zip(entries, reqs):
        assert len(r.prompt) == max(1, round(e.input_length * 0.02))
        assert r.output_len == max(1, round(e.output_length * 0.02))
        assert len(e.hash_ids) == -(-e.input_length // 512)
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(reqs, reqs[1:]))
    assert reqs[-1].arrival_s == pytest.approx(
        (entries[-1].timestamp_ms - entries[0].timestamp_ms) / 1000 * 0.5)
    # requests sharing a first hash id share their first block
    first = {}
    for e, r in zip(entries, reqs):
        if e.hash_ids and len(r.prompt) >= 10:
            first.setdefault(e.hash_ids[0], r.prompt[:10])
            assert first[e.hash_ids[0]] == r.prompt[:10]
