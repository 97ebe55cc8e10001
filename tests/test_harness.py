"""bench/harness.py, the process harness the tests and benchmarks share (no model)."""

from __future__ import annotations

import sys
import time

import pytest

from bench.harness import free_port, sse_events, start_server, until

pytestmark = pytest.mark.processes


def test_stop_kills_the_whole_process_group(tmp_path):
    # A leader that ignores SIGTERM, and a child of it: both must be gone afterwards.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            "print('up', flush=True); time.sleep(60)")
    sp = start_server("t", [sys.executable, "-c", code], "http://127.0.0.1:1", tmp_path / "t.log")
    until(lambda: "up" in sp.log_tail(), 10, "the leader to start its child", every_s=0.05)
    t0 = time.monotonic()
    sp.stop(timeout_s=1.0)
    assert time.monotonic() - t0 < 8
    assert sp.proc.returncode is not None
    assert not sp._group_alive()


def test_waits_fail_fast_when_the_server_dies_and_name_its_log(tmp_path):
    sp = start_server("dead", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
                      f"http://127.0.0.1:{free_port()}", tmp_path / "d.log")
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*boom"):
        sp.wait_healthy(timeout_s=30)
    with pytest.raises(RuntimeError, match="exited with 3"):
        sp.wait_instances(2, timeout_s=30)
    sp.stop(timeout_s=1)


def test_a_wait_that_runs_out_says_what_it_waited_for(tmp_path):
    sp = start_server("silent", [sys.executable, "-c", "import time; time.sleep(60)"],
                      f"http://127.0.0.1:{free_port()}", tmp_path / "s.log")
    try:
        with pytest.raises(TimeoutError, match="silent server: 3 instances up"):
            sp.wait_instances(3, timeout_s=0.5)
    finally:
        sp.stop(timeout_s=1)
    with pytest.raises(TimeoutError, match="the moon"):
        until(lambda: False, 0.1, "the moon", every_s=0.02)
    assert until(lambda: 7, 0.1, "a value") == 7


def test_sse_events():
    done = ['data: {"choices": [{"text": " Paris"}]}', "", ': a comment', 'data:{"choices": []}', "data: [DONE]"]
    stream = sse_events(done)
    assert stream.done and stream.error is None
    assert stream.events == [{"choices": [{"text": " Paris"}]}, {"choices": []}]
    cut = sse_events(['data: {"choices": []}'])
    assert not cut.done
    failed = sse_events(['data: {"choices": []}', 'data: {"error": {"message": "boom"}}', "data: [DONE]"])
    assert failed.done and failed.error == {"message": "boom"}
    with pytest.raises(ValueError, match="after data: \\[DONE\\]"):
        sse_events(["data: [DONE]", 'data: {"choices": []}'])
    with pytest.raises(ValueError):
        sse_events(["data: {not json"])


def test_held_staging_is_reported_with_its_holder(tmp_path):
    """``assert_clean``'s message names who holds a staging range, from the instance's /stats."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench.harness import ServerProcess

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    answers = {"/stats": {"instances": [{"url": url + "/i", "up": True}]},
               "/i/stats": {"staging_send_ranges": 1, "staging_send_holders": [["cmpl-42", 80.5]],
                            "staging_recv_holders": []}}

    class Stats(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Stats)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sp = ServerProcess("fake", [], None, tmp_path / "f.log", url)
        with pytest.raises(AssertionError) as e:
            sp.assert_clean(0.3)
        assert str(e.value) == (f"still held after 0.3 s: {{'{url}/i': {{'staging_send_ranges': 1}}}}; "
                                f"staging held by {{'{url}/i': {{'staging_send_holders': [['cmpl-42', 80.5]]}}}}")
    finally:
        server.shutdown()
