"""bench.chaos: its accounting on made-up outcomes, and its quick run against a real cluster.

The quick run (one ``python -m server`` cluster, started and stopped by the benchmark) is shared by
the cluster tests; each asserts one part of the report, so a failure names the part that broke.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from bench import chaos
from bench.chaos.faults import HUGE_BODY_RSS_SLACK_MIB
from bench.harness import ServerProcess
from bench.chaos import COMPLETED, HTTP_ERROR, HUNG, PROMPTS, STREAM_ERROR, UNCLEAR, Outcome


# --------------------------------------------------------------------------- no cluster


def test_sse_bodies_are_classified():
    done = ['data: {"choices": [{"text": " Paris"}]}', "", 'data: {"choices": [{"text": "."}]}', "data: [DONE]"]
    assert chaos.parse_sse(done, chaos.COMPLETIONS) == (COMPLETED, " Paris.", "")
    chat = ['data: {"choices": [{"delta": {"role": "assistant", "content": ""}}]}',
            'data: {"choices": [{"delta": {"content": "Hi"}}]}', "data: [DONE]"]
    assert chaos.parse_sse(chat, chaos.CHAT) == (COMPLETED, "Hi", "")
    failed = ['data: {"choices": [{"text": "A"}]}', 'data: {"error": {"message": "boom"}}', "data: [DONE]"]
    result, text, error = chaos.parse_sse(failed, chaos.COMPLETIONS)
    assert (result, text) == (STREAM_ERROR, "A") and "boom" in error
    assert chaos.parse_sse(['data: {"choices": [{"text": "A"}]}'], chaos.COMPLETIONS)[0] == UNCLEAR
    assert chaos.parse_sse(["data: {not json"], chaos.COMPLETIONS)[0] == UNCLEAR


def test_fuzz_bodies_are_reproducible_and_bounded():
    a, b = chaos.generated_cases(30, seed=5), chaos.generated_cases(30, seed=5)
    assert len(a) == 30 and [c.body for c in a] == [c.body for c in b]
    assert [c.body for c in a] != [c.body for c in chaos.generated_cases(30, seed=6)]
    assert {c.path for c in a} <= {chaos.COMPLETIONS, chaos.CHAT}
    for case in a:  # a body that parses never asks for more than a few tokens
        try:
            body = json.loads(case.body)
        except ValueError:
            continue
        if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and not isinstance(
                body["max_tokens"], bool):
            assert body["max_tokens"] <= 4 or body["max_tokens"] >= 10**6
    labels = {c.label for c in chaos.handmade_cases()}
    assert {"10k nested lists as prompt", "invalid UTF-8 bytes in prompt", "5000 prompts in one body",
            "body over the size limit (2 MiB)", "truncated JSON", "max_tokens 1e999"} <= labels


def _run_with(outcomes: list[Outcome], expected: dict[int, str]) -> chaos.Run:
    run = chaos.Run(chaos.ChaosConfig.quick(), cluster=None, client=None)  # type: ignore[arg-type]
    run.outcomes = outcomes
    run.expected = expected
    run.faults = [{"kind": "kill -9", "role": "decode", "old_pid": 1, "new_pid": 2, "recovered": True,
                   "restart_s": 10.0, "served_after_s": 1.0}]
    return run


def test_the_report_counts_what_must_be_zero(tmp_path):
    expected = {0: " Paris", 4: "Banana"}
    outs = [Outcome("steady", 0, True, COMPLETED, 200, " Paris"),
            Outcome("steady", 4, False, HTTP_ERROR, 429, error="too many queued", retry_after=True),
            Outcome("burst", 0, False, HTTP_ERROR, 429, retry_after=False),
            Outcome("kill decode", -1, False, COMPLETED, 200, " long answer", long_key="0.0"),
            Outcome("kill decode", -1, True, COMPLETED, 200, " long answer", long_key="0.0")]
    clean = chaos.build_report(chaos.ChaosConfig.quick(log_path=tmp_path / "none.log"), _run_with(outs, expected),
                               {}, {"held": {}, "down": {}})
    assert clean["ok"] and not any(clean["must_be_zero"].values())
    assert clean["requests"] == {"sent": 5, COMPLETED: 3, "http 429": 2}
    assert clean["missing_retry_after"] == 1
    assert clean["long_prompts"] == {"sent": 2, "completed": 2, "prompts": 1, "latency_p50_s": 0.0}
    table = chaos.format_table(clean)
    assert "RESULT: OK" in table and "lost while a healthy instance of their role was up" in table

    bad = outs + [Outcome("burst", 4, True, COMPLETED, 200, "Cherry"), Outcome("fuzz", 0, False, HUNG),
                  Outcome("steady", 0, True, UNCLEAR, 200, error="stream ended without [DONE]"),
                  Outcome("SIGSTOP decode", 4, False, HTTP_ERROR, 500, error="internal error"),
                  Outcome("SIGSTOP decode", 0, True, STREAM_ERROR, 200, error="instance lost"),
                  Outcome("SIGSTOP decode", -1, False, COMPLETED, 200, " other answer", long_key="0.0")]
    fuzz = [chaos.FuzzOutcome("lone surrogate", chaos.COMPLETIONS, "b'{}'", 2, 500, "answered", "internal error"),
            chaos.FuzzOutcome("valid", chaos.COMPLETIONS, "b'{}'", 2, 500, "answered", f"x {chaos.ENGINE_FAILED} y"),
            chaos.FuzzOutcome("down", chaos.COMPLETIONS, "b'{}'", 2, 503, "answered", "no decode instance is up")]
    run = _run_with(bad, expected)
    run.monitor.marked_down.append({"url": "http://p2", "role": "prefill", "phase": "SIGSTOP decode",
                                    "last_error": "timed out"})
    huge = {"bytes": 1 << 30, "status": 200, "sent_before_refusal_mib": 1024.0, "vmhwm_before_mib": 500,
            "vmhwm_after_mib": 1600, "refused": False}
    stale = {"instance": "http://d1", "calls": {"the same poll replayed": 200}, "accepted": 1}
    report = chaos.build_report(chaos.ChaosConfig.quick(log_path=tmp_path / "none.log"), run,
                                {"fuzz": fuzz, "huge_body": huge, "stale_epoch": stale},
                                {"held": {"http://x": {"num_used_blocks": 3, "staging_send_ranges": 1}}, "down": {},
                                 "holders": {"http://x": {"staging_send_holders": [["cmpl-7", 61.5]]}}})
    must = report["must_be_zero"]
    assert (must["completed with a different text"], must["hung requests"], must["requests with no clear answer"],
            must["5xx answers to malformed input"], must["resources held at the end"]) == (2, 1, 1, 1, 4)
    assert (must[chaos.LOST], must[chaos.MARKED_DOWN], must[chaos.HUGE], must[chaos.STALE]) == (2, 1, 1, 1)
    assert report["lost_by_phase"] == {"SIGSTOP decode": 2}
    assert (report["fuzz"]["unavailable"], report["fuzz"]["engine_failed"]) == (1, 1)
    assert not report["ok"]
    table = chaos.format_table(report)
    assert "<-- FAIL" in table and "RESULT: FAIL" in table and "lone surrogate" in table
    assert "staging held by (owner, seconds held) on http://x: {'staging_send_holders': [['cmpl-7', 61.5]]}" in table


def test_the_rows_of_issue_31s_scenarios_count_what_they_measured(tmp_path):
    """Ten restarts, a mass disconnect, a corrupt SSD object and a frozen pool node: each row is
    computed from what the scenario measured, and shows a failure when there is one."""
    run = _run_with([Outcome("steady", 0, True, COMPLETED, 200, " Paris")], {0: " Paris"})
    run.faults.append({"kind": "SIGSTOP then kill -9", "role": "pool node", "old_pid": 3, "recovered": True,
                       "summary": "served", "frozen_node": {"baseline_s": [2.0], "frozen_s": [9.0], "bound_s": 5.0,
                                                            "slowed": 1, "node_never_asked": 0,
                                                            "segment_timeouts": 1, "segments_passed_over": 4}})
    figures = dict.fromkeys(("rss_mib", "anon_mib", "shmem_mib", "threads", "fds", "memfds", "memfd_maps"), [10, 10])
    extra = {"restarts": {"restarts": 10, "killed_busy": 9, "restart_s": [5.0], "totals": figures,
                          "grown": ["prefill http://p shmem_mib 2000 -> 3000"], "survivors_lost": []},
             "disconnect": {"streams": 32, "prompts": 6, "streams_dropped_mid_decode": 32,
                            "prompts_abandoned_before_first_token": 6, "released_s": None, "held_after_within": 4,
                            "prompt_tokens_after_release": 700, "watched_s": 10.0},
             "corrupt_ssd": {"files_corrupted": 4, "status": 200, "latency_s": 1.0, "same_text": False,
                             "corrupt_ssd_reads": 0, "served_wrong": 1, "not_counted": 1}}
    report = chaos.build_report(chaos.ChaosConfig(log_path=tmp_path / "none.log"), run, extra,
                                {"held": {}, "down": {}})
    must = report["must_be_zero"]
    assert [must[k] for k in (chaos.RESTART_GROWTH, chaos.DISCONNECT_HELD, chaos.DISCONNECT_TOKENS, chaos.SSD_WRONG,
                              chaos.SSD_UNCOUNTED, chaos.FROZEN_SLOW, chaos.FROZEN_UNASKED)] == [1, 4, 700, 1, 1, 1, 0]
    table = chaos.format_table(report)
    assert "RESULT: FAIL" in table and "grown: prefill http://p shmem_mib 2000 -> 3000" in table
    for label in ("survivors' memfds mapped (summed), before -> after", "still held 5 s after they left",
                  "corrupt read not counted", "prompts slower than the bound"):
        assert label in table and table.split(label)[1].split("\n")[0].endswith("<-- FAIL") == (
            not label.startswith("survivors'")), label


def test_owns_only_processes_started_for_its_conductor(tmp_path):
    server = ServerProcess("x", [], None, tmp_path / "log", "http://127.0.0.1:1")  # type: ignore[arg-type]
    cluster = chaos.Cluster(server)
    assert not cluster.owns(os.getpid()) and not cluster.owns(2**22 + 12345)


def test_raw_request_reads_a_status():
    """The raw-socket client the slow-client checks rely on, against a throwaway server."""
    async def serve_once() -> chaos.RawOutcome:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 418 I'm a teapot\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, chaos.HOST, 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await chaos.raw_request(port, "teapot", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                                           byte_gap_s=0.001, deadline_s=10)

    out = asyncio.run(serve_once())
    assert out.status == 418 and out.closed and not out.hung


# --------------------------------------------------------------------------- a real cluster


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("chaos")
    cfg = chaos.ChaosConfig.quick(log_path=out / "server.log")
    rep = chaos.run_chaos(cfg)
    print(chaos.format_table(rep))
    return rep


@pytest.mark.processes
def test_each_kill_is_followed_by_a_restart_by_the_conductor(report):
    kills = [f for f in report["faults"] if f["kind"] == "kill -9" and f["role"] in ("decode", "prefill")]
    assert [k["role"] for k in kills] == ["decode"], report["scenario_errors"]
    for k in kills:
        assert k["restarted"], k
        assert k["new_pid"] != k["old_pid"] and k["restarts"] >= 1 and k["last_exit"] == "signal SIGKILL", k
        assert k["served"], f"nothing served after the {k['role']} kill: {k}"
    stopped = [f for f in report["faults"] if f["kind"] == "SIGSTOP" and f["role"] in ("decode", "prefill")]
    assert [f["role"] for f in stopped] == ["decode"], report["scenario_errors"]
    for f in stopped:
        assert f["up_again"] and f["served"], f
    supervised = report["conductor"]["supervised"]
    assert sorted(s["role"] for s in supervised if s["restarts"] >= 1) == ["decode"]


@pytest.mark.processes
def test_no_request_hangs_or_changes_its_answer(report):
    must = report["must_be_zero"]
    assert must["hung requests"] == 0
    assert must["requests with no clear answer"] == 0, report["error_samples"]
    assert must["completed with a different text"] == 0, report["wrong_texts"]
    assert len(report["expected"]) == len(PROMPTS) and report["requests"][COMPLETED] > 20
    burst = report["burst"]["results"]
    assert sum(burst.values()) == report["config"]["burst"] and set(burst) <= {COMPLETED, "http 429", "http 503"}


@pytest.mark.processes
def test_faults_of_one_instance_lose_no_request_and_mark_no_healthy_one_down(report):
    must = report["must_be_zero"]
    assert must[chaos.LOST] == 0, report["lost"]
    assert must[chaos.MARKED_DOWN] == 0, report["marked_down"]
    assert report["monitor_samples"] > 50 and report["long_prompts"]["completed"] > 10, report["long_prompts"]
    assert all(f["recovered"] for f in report["faults"]), report["faults"]


@pytest.mark.processes
def test_stale_replayed_and_unsigned_control_calls_are_refused(report):
    stale = report["stale_epoch"]
    assert list(stale["calls"].values()) == [200, 401, 401, 409], stale
    assert stale["epoch_replaced_log_lines"] == 0 and report["must_be_zero"][chaos.STALE] == 0
    huge = report["huge_body"]
    assert huge["status"] == 401 and huge["refused"], huge
    assert huge["vmhwm_growth_mib"] < HUGE_BODY_RSS_SLACK_MIB, huge


@pytest.mark.processes
def test_malformed_input_gets_a_4xx_not_a_5xx(report):
    must = report["must_be_zero"]
    assert must["5xx answers to malformed input"] == 0, report["fuzz"]["failures"]
    assert must["malformed requests dropped unanswered"] == 0, report["fuzz"]["failures"]
    fuzz = report["fuzz"]
    assert fuzz["sent"] == len(chaos.handmade_cases()) + report["config"]["fuzz_examples"]
    # Bodies that are not JSON at all are refused before anything else, whatever the cluster's state.
    for label in ("empty body", "truncated JSON", "not JSON at all", "10k nested lists as prompt",
                  "100k nested lists at the top", "invalid UTF-8 bytes in prompt", "max_tokens with 5000 digits"):
        assert fuzz["statuses"][label] == 400, label
    assert fuzz["statuses"]["body over the size limit (2 MiB)"] == 413
    assert all(r["status"] == 400 for r in report["framing"] if r["label"] != "body shorter than Content-Length, then EOF")


@pytest.mark.processes
def test_slow_clients_are_served_and_do_not_block_others(report):
    slow = report["slow_clients"]
    assert [s["status"] for s in slow["byte_by_byte"]] == [200, 200]
    assert all(s["text_as_expected"] for s in slow["byte_by_byte"])
    assert slow["served_while_stalled"]["served"]
    assert report["must_be_zero"]["slow-client checks failed"] == 0


@pytest.mark.processes
def test_nothing_is_held_once_the_cluster_is_quiet(report):
    assert report["must_be_zero"]["instances not up at the end"] == 0, report["down_at_end"]
    assert report["must_be_zero"]["resources held at the end"] == 0, (report["held_at_end"],
                                                                      report["staging_holders_at_end"])
    assert report["must_be_zero"]["scenarios that failed to run"] == 0, report["scenario_errors"]


@pytest.mark.processes
def test_every_must_be_zero_row_is_zero(report):
    assert report["ok"], chaos.format_table(report)


@pytest.mark.processes
def test_every_process_is_gone_after_the_run(report):
    assert len(report["instance_pids"]) >= 5  # four instances, one of them started twice
    for pid in report["instance_pids"]:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert report["url"].encode() not in cmdline, f"instance {pid} outlived the run"


@pytest.mark.processes
def test_the_json_report_has_the_table_figures(report, tmp_path):
    path = tmp_path / "chaos.json"
    chaos.write_json(path, report)
    again = json.loads(path.read_text())
    assert again["must_be_zero"] == report["must_be_zero"] and again["requests"] == report["requests"]
    for label in ("hung (no answer within the deadline)", "5xx to malformed input",
                  "blocks/reservations/staging held at the end"):
        assert label in again["table"]
