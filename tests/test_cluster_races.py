"""Regression tests for the cluster races fixed in issue 11 §3, against real processes.

One cluster (`python -m server`: a Conductor over 2 prefill + 2 decode instances, a
``tests/clusters.py`` cluster with 2048-token engine steps, so that a ~1100-token prompt is one
engine step of seconds) serves the module. Instances are frozen with SIGSTOP to
make calls hang; every test thaws what it froze (and the fixture thaws everything on the way
out). After each scenario every instance must hold no blocks, reservations or staging.

The test that bumps an instance's Conductor epoch runs last: afterwards that instance refuses
the cluster's own (older) Conductor.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from bench.harness import free_port, sse_events, until
from cluster.conductor.conductor import Conductor, ConductorConfig
from cluster.conductor.routes import registration_route
from cluster.conductor.placement import PlacementConfig
from clusters import CONTROL_AUTH, RELEASE_S, SECRET, Cluster, words as _words
from server.app import build_app

pytestmark = pytest.mark.processes  # starts real server / instance / peer processes

# A request to a frozen instance must end well before the Conductor's 600 s request timeout: it
# ends when the registry's polls (control timeout 10 s) mark the instance down.
BOUND_S = 60

_frozen: set[int] = set()


def _freeze(pid: int) -> None:
    _frozen.add(pid)
    os.kill(pid, signal.SIGSTOP)


def _thaw(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    _frozen.discard(pid)


# As tests/test_cluster.py's cluster, with instances that take up to 2048 prompt tokens in one
# engine step: a ~1100-token prompt is one step of seconds. (The engine settings equal
# tests/test_pool_cluster.py's, so the instances load the profile its instances calibrated, or
# the other way round.)
FLAGS = ("--prefill-instances", "2", "--decode-instances", "2", "--no-pool", "--max-num-batched-tokens", "2048")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster(FLAGS, 4, tmp_path_factory.mktemp("races"))
    try:
        yield c
    finally:
        for pid in list(_frozen):
            _thaw(pid)
        c.close()


def _conductor_stats(cluster: Cluster) -> dict:
    return cluster.http.get("/stats").json()


def _instance(cluster: Cluster, url: str) -> dict:
    (inst,) = [i for i in cluster.instances() if i["url"] == url]
    return inst


def _fence(cluster: Cluster, newer_by: int = 0) -> str:
    """The cluster's Conductor's fence (``ID/EPOCH``), or a later incarnation's."""
    stats = _conductor_stats(cluster)
    return f"{stats['conductor_id']}/{stats['epoch'] + newer_by}"


def _signed(fence: str) -> dict:
    return {"auth": CONTROL_AUTH, "headers": {"X-Conductor-Epoch": fence}}


def _wait_up(cluster: Cluster, url: str, within_s: float = 60) -> None:
    until(lambda: _instance(cluster, url)["up"], within_s, f"{url} to come back up")


async def _until(predicate, within_s: float, what: str, every_s: float = 0.02):
    """Poll ``predicate`` (sync, may do HTTP) in a thread until it returns something truthy."""
    deadline = time.monotonic() + within_s
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every_s)


def _computing(cluster: Cluster) -> list[dict]:
    """The prefill instances computing a prompt now: the Conductor sent it, and the instance's
    engine has not answered it yet (``num_unstarted`` is live; the step snapshot is not)."""
    return [i for i in cluster.instances("prefill") if i["prefilling"]
            and cluster.instance_stats(i["url"])["num_unstarted"]]


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


# -- 1. the burst ---------------------------------------------------------------------------------------

def test_a_burst_is_spread_over_both_prefill_instances(cluster):
    """8 distinct prompts at once: each placement is booked before the next is decided, so both
    prefill instances compute (the old polled queue lengths sent the whole burst to one)."""
    prefills = [i["url"] for i in cluster.instances("prefill")]
    before = {u: cluster.instance_stats(u)["num_prompt_tokens_computed"] for u in prefills}

    async def burst():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": _words(f"burst{k}x", 40), "max_tokens": 2, "temperature": 0}) for k in range(8)))

    rs = asyncio.run(burst())
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs if r.status_code != 200]
    delta = {u: cluster.instance_stats(u)["num_prompt_tokens_computed"] - before[u] for u in prefills}
    assert all(d > 0 for d in delta.values()), f"the burst piled onto one prefill instance: {delta}"
    cluster.assert_clean()


# -- 4. polls are answered while the engine thread is busy -------------------------------------------------

def test_polls_answer_quickly_during_a_long_prefill_and_nothing_is_marked_down(cluster):
    fence = _fence(cluster)
    prompt = _words("longpoll", 300)  # > 1000 tokens: several long engine steps on one thread

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            task = asyncio.create_task(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}))
            busy = await _until(lambda: [i for i in cluster.instances("prefill") if i["prefilling"]], 60,
                                "the prefill to start")
            url = busy[0]["url"]
            latencies, busy_seen, downs = [], 0, []
            steps: list[tuple[float, int]] = []  # (when, the engine's step count) per poll
            async with httpx.AsyncClient(timeout=30) as poller:
                while not task.done():
                    t = time.monotonic()
                    r = await poller.get(url + "/instance/state", **_signed(fence))
                    latencies.append(time.monotonic() - t)
                    assert r.status_code == 200, r.text
                    state = r.json()
                    steps.append((t, state["num_steps"]))
                    busy_seen += bool(state["num_unstarted"])
                    stats = (await http.get("/stats")).json()
                    downs += [(i["url"], i["last_error"]) for i in stats["instances"] if not i["up"]]
                    await asyncio.sleep(0.1)
            return await task, latencies, busy_seen, downs, steps

    r, latencies, busy_seen, downs, steps = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    assert busy_seen >= 3, f"polled only {busy_seen} times while the prefill ran"
    # The longest time the step count stood still: an engine step the polls did not wait for.
    longest, since = 0.0, steps[0]
    for t, n in steps[1:]:
        if n != since[1]:
            since = (t, n)
        longest = max(longest, t - since[0])
    assert longest > 1.5, f"no engine step was long enough to tell (longest {longest:.2f} s)"
    assert max(latencies) < 1.0, f"a poll waited for the engine thread: {max(latencies):.2f} s"
    assert not downs, f"the Conductor marked instances down during a long prefill: {downs}"
    cluster.assert_clean()


# -- 2. a client that leaves at any point leaks nothing ------------------------------------------------------

def test_a_client_leaving_during_the_reserve_leaks_nothing(cluster):
    """The decode instances are frozen, so the reserve hangs; the client leaves; the abort the
    Conductor sends may overtake the reserve there (a tombstone) or follow it."""
    decodes = cluster.instances("decode")

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as http:
            for d in decodes:
                _freeze(d["pid"])
            try:
                task = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": _words("reserveleak", 30), "max_tokens": 4}))
                await _until(lambda: any(i["reserved"] for i in cluster.instances("decode")), 20,
                             "the Conductor to call reserve")
                await _cancel(task)
                # The Conductor notices the disconnect and rolls the booking back (aborts on the way).
                await _until(lambda: not any(i["reserved"] or i["prefilling"] for i in cluster.instances()), 5,
                             "the Conductor to roll the request back")
            finally:
                for d in decodes:
                    _thaw(d["pid"])

    asyncio.run(scenario())
    cluster.assert_clean()
    assert all(i["up"] for i in cluster.instances()), "a short freeze must not mark instances down"
    cluster.complete("The capital of France is", temperature=0, max_tokens=4)
    cluster.assert_clean()


def test_a_client_leaving_during_the_prefill_leaks_nothing(cluster):
    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            task = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": _words("prefillleak", 300), "max_tokens": 4}))
            await _until(lambda: _computing(cluster), 60, "the prefill instance to compute the prompt")
            assert not task.done(), "the prefill finished before the client could leave"
            await _cancel(task)

    asyncio.run(scenario())
    cluster.assert_clean()


def test_a_client_leaving_during_a_migration_leaks_nothing(cluster):
    """A hot prefix on prefill instance A, A kept busy by a long prompt behind it: a request with
    the prefix goes to B and pulls the prefix from A. A is frozen during the pull (briefly: below
    the Conductor's poll timeout), the client leaves, A is thawed."""
    prefix = _words("hotprefix", 60)  # ~200 tokens: a dozen full blocks
    # The prefix is cached where it was computed; the Conductor learns it from its next poll.
    holder = cluster.complete_on_one_prefill(prefix + " Question one?", temperature=0, max_tokens=2)
    before = _conductor_stats(cluster)

    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300) as http:
            busy = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": prefix + " " + _words("busytail", 300), "max_tokens": 2, "temperature": 0}))
            (a,) = await _until(lambda: [i for i in cluster.instances("prefill") if i["prefilling"]], 60,
                                "the long prompt to start")
            assert a["url"] == holder, "the long prompt should go where its prefix is cached"
            pulled = None
            _freeze(a["pid"])
            try:
                task = asyncio.create_task(http.post("/v1/completions", json={
                    "prompt": prefix + " Question two?", "max_tokens": 8, "temperature": 0}))
                # The migration's reservation is booked on the target prefill instance.
                pulled = await _until(lambda: [i for i in cluster.instances("prefill")
                                               if i["reserved"] and i["url"] != a["url"]], 2.5,
                                      "the migration to the other prefill instance")
                # Reserved there: the Conductor's push to the frozen holder is under way.
                await _until(lambda: cluster.instance_stats(pulled[0]["url"])["num_reservations"], 2,
                             "the migration's reservation on the other prefill instance")
                await _cancel(task)
                await _until(lambda: not [i for i in cluster.instances("prefill") if i["reserved"]], 1.5,
                             "the Conductor to roll the migration back")
            finally:
                _thaw(a["pid"])
            return pulled, await busy

    pulled, busy = asyncio.run(scenario())
    assert busy.status_code == 200, busy.text
    assert pulled
    after = _conductor_stats(cluster)
    assert after["requests_failed"] == before["requests_failed"]
    assert all(i["up"] for i in cluster.instances())
    cluster.assert_clean()


# -- 7. the per-instance queue bound ------------------------------------------------------------------------

class _ServedConductor:
    """A second Conductor over the same instances (an id of its own, so neither releases what the
    other reserved), served by uvicorn in a thread on a loopback port."""

    def __init__(self, cluster: Cluster, placement: PlacementConfig) -> None:
        urls = tuple(i["url"] for i in cluster.instances())
        self.conductor = Conductor(ConductorConfig(secret=SECRET.encode(), instances=urls, placement=placement,
                                                   poll_interval_s=0.1, conductor_id="second"))
        app = build_app(self.conductor,
                        extra_routes=[registration_route(self.conductor)])
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        until(self._healthy, 120, "the second Conductor to be ready")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


def test_a_burst_beyond_the_queue_bound_gets_429_and_the_rest_complete(cluster):
    served = _ServedConductor(cluster, PlacementConfig(max_queued_prefills=1))
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=served.url, timeout=300) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json={
                    "prompt": _words(f"queue{k}x", 120), "max_tokens": 2}) for k in range(6)))

        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert set(codes) <= {200, 429}, [r.text for r in rs]
        refused = [r for r in rs if r.status_code == 429]
        assert refused and codes.count(200) >= 2, codes  # one at a time on each prefill instance
        for r in refused:
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"
        for r in rs:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 2
        stats = httpx.get(served.url + "/stats", timeout=10).json()
        assert stats["requests_rejected"] == len(refused) and stats["requests_accepted"] == codes.count(200)
    finally:
        served.close()
    cluster.assert_clean()


# -- 3. a frozen instance cannot hang a request ---------------------------------------------------------------

def test_a_decode_instance_frozen_mid_stream_moves_the_stream_within_a_bound(cluster):
    """Frozen (SIGSTOP), the instance stops answering polls and is marked down: the stream goes on
    from the other decode instance, its pause bounded by the poll timeout and a prefill."""
    body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=cluster.url, timeout=httpx.Timeout(10, read=BOUND_S * 2)) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = [next(lines) for _ in range(6)]
            (victim,) = [i for i in cluster.instances("decode") if i["running"]]
            _freeze(victim["pid"])
            try:
                frozen_at = time.monotonic()
                rest = list(lines)
                took = time.monotonic() - frozen_at
            finally:
                _thaw(victim["pid"])
    stream = sse_events(received + rest)
    assert took < BOUND_S, f"the stream from a frozen decode instance hung for {took:.0f} s"
    assert stream.done and stream.error is None, stream.error
    assert stream.events[-1]["choices"][0]["finish_reason"] == "length"  # all 100 tokens, across the move
    _wait_up(cluster, victim["url"])
    assert _instance(cluster, victim["url"])["instance_id"] == victim["instance_id"]  # thawed, not restarted
    for _ in range(2):
        assert cluster.complete("The capital of France is", temperature=0, max_tokens=4)["choices"][0]["text"]
    cluster.assert_clean()


def test_a_prefill_instance_frozen_mid_prefill_moves_the_request_within_a_bound(cluster):
    async def scenario():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=BOUND_S * 2) as http:
            task = asyncio.create_task(http.post("/v1/completions", json={
                "prompt": _words("frozenprefill", 300), "max_tokens": 4}))
            (victim,) = await _until(lambda: _computing(cluster), 60, "the prefill instance to compute the prompt")
            assert not task.done()
            _freeze(victim["pid"])
            try:
                frozen_at = time.monotonic()
                r = await asyncio.wait_for(task, BOUND_S * 2)
                took = time.monotonic() - frozen_at
            finally:
                _thaw(victim["pid"])
            return victim, r, took

    victim, r, took = asyncio.run(scenario())
    assert took < BOUND_S, f"a request to a frozen prefill instance hung for {took:.0f} s"
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    _wait_up(cluster, victim["url"])
    for _ in range(2):
        assert cluster.complete("The capital of France is", temperature=0, max_tokens=4)["choices"][0]["text"]
    cluster.assert_clean()


# -- 6. a newer Conductor epoch releases the older one's reservations (last: it changes the instance) ---------

def test_a_newer_conductor_epoch_releases_reservations_of_the_older_one(cluster):
    cluster.assert_clean()  # what earlier scenarios cut off is released (its staging is held back a while)
    (decode, other) = cluster.instances("decode")
    url = decode["url"]
    fence, newer = _fence(cluster), _fence(cluster, newer_by=1)
    ids = [(i * 7) % 5000 + 10 for i in range(100)]
    r = httpx.post(url + "/instance/reserve", timeout=30, **_signed(fence),
                   json={"request_id": "old-epoch", "prompt_token_ids": ids, "params": {"max_tokens": 1}})
    assert r.status_code == 200, r.text
    s = cluster.instance_stats(url)
    assert s["num_reservations"] == 1 and s["staging_recv_ranges"] == 1
    # Any signed call from a newer Conductor (here a poll) releases what the older one reserved.
    assert httpx.get(url + "/instance/state", timeout=30, **_signed(newer)).status_code == 200
    # The staging is held back twice the transfer timeout.
    until(lambda: not any(cluster.instance_stats(url)[k] for k in ("num_reservations", "num_used_blocks",
                                                                   "staging_recv_ranges")),
          RELEASE_S, "the older epoch's reservation to be released", every_s=0.1)
    # The older Conductor is refused from now on (409), and holds nothing there.
    r = httpx.post(url + "/instance/reserve", timeout=30, **_signed(fence),
                   json={"request_id": "old-epoch-2", "prompt_token_ids": ids, "params": {"max_tokens": 1}})
    assert r.status_code == 409, r.text
    assert cluster.instance_stats(url)["num_reservations"] == 0
    # The cluster's Conductor (the older one) keeps serving through the other decode instance.
    for k in range(2):
        out = cluster.complete(f"Count to {k + 3}:", temperature=0, max_tokens=4)
        assert out["usage"]["completion_tokens"] == 4
    cluster.assert_clean()
