"""The cluster across hosts (issue 23 §7): every process in a network namespace of its own on a
bridge (``tests/netns.py``), so nothing reaches another process over loopback or shared memory.

One network (10.23.0.0/24; the root namespace is .1) serves the module: the Conductor and etcd
share host ``ctl`` (.2), the prefill instances are ``p0`` / ``p1`` (.11 / .12), the decode
instances ``d0`` / ``d1`` (.21 / .22) and a pool node ``pool`` (.31), each started by hand as
docs/serving.md's "Across hosts" recipe says: ``--host`` and ``--url`` its own bridge address,
``--conductor`` and ``--etcd`` the ``ctl`` host's. The checks: a prompt completes with the
colocated engine's greedy text and its KV crossed the bridge over TCP between the instances'
bridge addresses (the kernel's counters on their links, their sockets); the pool node joined and
stores arrive there; a decode instance cut off mid-stream (its link taken down) loses the request
to the other one, which finishes it with the same text, and is up again once its link is; the
Conductor's embedded metadata server, on ``--host 0.0.0.0``, is reached by a pool node on
another host at the address it advertises. Last, a second Conductor on host ``ctl2`` (.3) finds the
instances in etcd, and the first is killed under load and started again
(docs/serving.md's "Several Conductors").

Without root or network namespaces the module is skipped with the reason, except under
``CI=true`` as root, where failing to build the network is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.harness import ServerProcess, sse_events, start_etcd, start_server, until
from clusters import INSTANCE_FLAGS, LAPSED_S, PROCESS_ENV, RELEASE_S, STARTUP_S, TEST_FLAGS, words
from engine import LLM, SamplingParams
from engine.default_model import resolve_model
from netns import Hosts, NetnsUnavailable, probe

pytestmark = pytest.mark.processes  # starts real server / instance / pool processes

SUBNET = "10.23.0"
HOSTS = {"ctl": 2, "ctl2": 3, "p0": 11, "p1": 12, "d0": 21, "d1": 22, "pool": 31}
CONDUCTOR_PORT, INSTANCE_PORT, ETCD_PORT, ETCD_PEER_PORT = 8000, 8100, 2379, 2380
POOL_BLOCK_TOKENS = 64


def _in_ci_as_root() -> bool:
    return os.environ.get("CI", "").lower() == "true" and os.geteuid() == 0


class AcrossHosts:
    """The processes on the hosts, and views of them from the root namespace."""

    def __init__(self, hosts: Hosts, workdir: Path) -> None:
        self.hosts, self.workdir = hosts, workdir
        self.procs: dict[str, ServerProcess] = {}
        ctl = hosts.address("ctl")
        self.etcd = f"http://{ctl}:{ETCD_PORT}"
        self.url = f"http://{ctl}:{CONDUCTOR_PORT}"
        self.instance_urls = {h: f"http://{hosts.address(h)}:{INSTANCE_PORT}" for h in ("p0", "p1", "d0", "d1")}
        self.http = httpx.Client(base_url=self.url, timeout=300, trust_env=False)

    def start(self, host: str, name: str, cmd: list[str], url: str) -> ServerProcess:
        proc = start_server(name, self.hosts.run(host, cmd), url, self.workdir / f"{name}.log", PROCESS_ENV)
        self.procs[name] = proc
        return proc

    def start_all(self) -> None:
        ctl = self.hosts.address("ctl")
        python = sys.executable
        # etcd on host ctl, at its bridge address (reached from the root namespace for its health).
        self.procs["etcd"] = start_etcd(self.workdir / "etcd", host=ctl, name="ctl", client_port=ETCD_PORT,
                                        peer_port=ETCD_PEER_PORT, prefix=self.hosts.run("ctl", []))
        self.start("ctl", "conductor", [
            python, "-m", "server", "--host", ctl, "--port", str(CONDUCTOR_PORT), *TEST_FLAGS,
            "--prefill-instances", "0", "--decode-instances", "0", "--etcd", self.etcd], self.url)
        for host, url in self.instance_urls.items():
            role = "prefill" if host.startswith("p") else "decode"
            address = self.hosts.address(host)
            self.start(host, host, [
                python, "-m", "server", "--role", role, "--host", address, "--port", str(INSTANCE_PORT),
                "--url", url, "--conductor", self.url, "--etcd", self.etcd, *INSTANCE_FLAGS,
                # Every pool object lives on the pool node: its DRAM is the pool's.
                "--pool-dram-gib", "0", "--pool-block-tokens", str(POOL_BLOCK_TOKENS)], url)
        self.start("pool", "pool", [
            python, "-m", "cluster.pool", "--etcd", self.etcd, "--host", self.hosts.address("pool"),
            "--dram-gib", "0.25", "--transfer-timeout-s", "3", "--log-level", "warning"], "")

    def wait_up(self) -> None:
        conductor = self.procs["conductor"]
        self.pool_segment = pool_node_ready(self.procs["pool"], 60)
        conductor.wait_instances(4, STARTUP_S)
        until(lambda: self.pool_segment in self.stats()["pool"]["segments"], 30, "the Conductor to see the pool node")

    def stats(self) -> dict:
        return self.http.get("/stats").json()

    def instances(self, role: str | None = None) -> list[dict]:
        return [i for i in self.stats()["instances"] if role is None or i["role"] == role]

    def computed(self) -> dict[str, int]:
        return {i["url"]: self.procs["conductor"].instance_stats(i["url"])["num_prompt_tokens_computed"]
                for i in self.instances("prefill")}

    def host_of(self, url: str) -> str:
        (host,) = [h for h, u in self.instance_urls.items() if u == url]
        return host

    def close(self) -> None:
        self.http.close()
        # Instances first (they unregister from the pool), etcd last.
        for name in ("pool", "p0", "p1", "d0", "d1", "conductor", "conductor2", "etcd"):
            if name in self.procs:
                self.procs[name].stop(20.0)


def pool_node_ready(proc: ServerProcess, within_s: float) -> str:
    """The segment id a pool node prints once it serves."""
    def ready() -> str | None:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"the pool node exited with {proc.proc.returncode}:\n{proc.log_tail()}")
        found = re.search(r"pool node ready: (\S+)", proc.log())
        return found.group(1) if found else None

    return until(ready, within_s, "the pool node to start")


def _cannot(reason: str) -> None:
    """Skip, or fail where CI runs as root and must run this module."""
    if _in_ci_as_root():
        pytest.fail(f"CI=true and root, yet {reason}")
    pytest.skip(f"{reason} (CI=true as root makes this a failure)")


@pytest.fixture(scope="module")
def hosts():
    try:
        probe("mc23")
    except NetnsUnavailable as e:
        _cannot(f"no network namespaces to simulate hosts with: {e}")
    for tool in ("etcd", "ss"):
        if shutil.which(tool) is None:
            _cannot(f"no {tool} binary (apt-get install {'etcd-server' if tool == 'etcd' else 'iproute2'})")
    net = Hosts("mc23", SUBNET, HOSTS)
    try:
        try:
            net.build()
        except RuntimeError as e:
            _cannot(f"the bridge and namespaces could not be built: {e}")
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def cluster(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory):
    c = AcrossHosts(hosts, tmp_path_factory.mktemp("across-hosts"))
    try:
        c.start_all()
        c.wait_up()
        yield c
    finally:
        c.close()


def _kv_bytes_per_token() -> int:
    config = json.loads((resolve_model(None) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4  # float32 K and V


def test_a_prompt_crosses_hosts_over_tcp(cluster: AcrossHosts, colocated: LLM):
    """The greedy text of the colocated engine; the KV left the prefill host and reached the decode
    host over the bridge, on a TCP connection between their bridge addresses; the prompt's pool
    objects reached the pool node's host."""
    hosts = cluster.hosts
    prompt = "The capital of France is Paris. " + words("crosshost", 60) + " The capital of France is"
    before = {h: hosts.counters(h) for h in HOSTS}
    computed = cluster.computed()
    objects = cluster.stats()["pool"]["segments"][cluster.pool_segment]["objects"]
    r = cluster.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    out = r.json()
    (want,) = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    assert out["choices"][0]["text"] == want.text

    after_computed = cluster.computed()
    (prefill_url,) = [u for u in after_computed if after_computed[u] > computed[u]]
    prefill = cluster.host_of(prefill_url)
    kv = out["usage"]["prompt_tokens"] * _kv_bytes_per_token()
    # Which decode instance held it: the one whose link received the KV.
    sent = {h: hosts.counters(h)[0] - before[h][0] for h in HOSTS}
    received = {h: hosts.counters(h)[1] - before[h][1] for h in HOSTS}
    decodes = [h for h in ("d0", "d1") if received[h] >= kv]
    assert len(decodes) == 1 and sent[prefill] >= kv, (
        f"the prompt's {kv} bytes of KV did not cross the bridge from {prefill} to one decode host "
        f"(shared memory or loopback instead?): bytes sent {sent}, received {received}")
    (decode,) = decodes
    # The Messenger's connection: from the prefill host's address to the decode host's, nothing
    # on loopback (each is a host of its own: no loopback or shared memory reaches the other).
    prefill_addr, decode_addr = hosts.address(prefill), hosts.address(decode)
    links = hosts.connections(decode)
    assert any(local.startswith(decode_addr + ":") and peer.startswith(prefill_addr + ":")
               and local.rsplit(":", 1)[1] != str(INSTANCE_PORT) for local, peer in links), links
    assert not any(peer.startswith("127.") for _, peer in links), links

    # Stores run after the response: the prompt's whole objects go to the pool node's host.
    until(lambda: cluster.stats()["pool"]["segments"][cluster.pool_segment]["objects"] > objects, 30,
          "the prompt's pool objects on the pool node")
    assert hosts.counters("pool")[1] - before["pool"][1] >= POOL_BLOCK_TOKENS * _kv_bytes_per_token()
    cluster.procs["conductor"].assert_clean(15.0)


def test_a_partitioned_decode_instance_loses_its_request_to_the_other(cluster: AcrossHosts, colocated: LLM):
    """Its link down mid-stream: the Conductor stops hearing from it, places the request again
    (its prompt plus the tokens already streamed) on the other decode instance, and the client's
    stream goes on to the colocated engine's greedy text; the link up again, the instance is up."""
    hosts = cluster.hosts
    prompt = "Tell me a long story about a dragon."
    params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    moved = cluster.stats()["requests_moved"]
    victim = None
    try:
        with cluster.http.stream("POST", "/v1/completions", json={"prompt": prompt, **params, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            received = [next(lines) for _ in range(4)]  # under way on one decode instance
            (victim,) = [i for i in cluster.instances("decode") if i["running"]]
            hosts.set_link(cluster.host_of(victim["url"]), up=False)
            t0 = time.monotonic()
            rest = list(lines)
        stream = sse_events(received + rest)
        assert stream.done and stream.error is None, stream.error
        text = stream.text
        (want,) = colocated.generate([prompt], SamplingParams(**params))
        assert text == want.text
        stats = cluster.stats()
        assert stats["requests_moved"] == moved + 1 and stats["requests_failed"] == 0
        (lost,) = [i for i in stats["instances"] if i["url"] == victim["url"]]
        assert not lost["up"], lost
        print(f"moved and finished {time.monotonic() - t0:.1f} s after the partition")
    finally:
        if victim is not None:
            hosts.set_link(cluster.host_of(victim["url"]), up=True)
    # Back: the same incarnation answers polls again, and nothing stays held anywhere.
    until(lambda: [i for i in cluster.instances("decode") if i["url"] == victim["url"] and i["up"]], 30,
          "the partitioned decode instance to be up again")
    (back,) = [i for i in cluster.instances("decode") if i["url"] == victim["url"]]
    assert back["instance_id"] == victim["instance_id"]
    out = cluster.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                      "temperature": 0})
    assert out.status_code == 200 and out.json()["choices"][0]["text"].startswith(" Paris"), out.text
    cluster.procs["conductor"].assert_clean(LAPSED_S)


def test_the_embedded_metadata_server_is_reached_from_another_host(cluster: AcrossHosts):
    """A Conductor on every address (``--host 0.0.0.0``, advertised by ``--url``) serves the pool's
    metadata there too: a pool node on another host joins it by the address it logs."""
    hosts, ctl = cluster.hosts, cluster.hosts.address("ctl")
    url = f"http://{ctl}:{CONDUCTOR_PORT + 1}"
    python = sys.executable
    conductor = cluster.start("ctl", "embedded", [
        python, "-m", "server", "--host", "0.0.0.0", "--port", str(CONDUCTOR_PORT + 1), "--url", url,
        *TEST_FLAGS, "--prefill-instances", "0", "--decode-instances", "0"], url)
    found = until(lambda: re.search(r"KVCache pool metadata at (\S+)", conductor.log()), 60,
                  "the Conductor to log its metadata server")
    metadata = found.group(1)
    assert re.fullmatch(rf"http://{re.escape(ctl)}:\d+", metadata), metadata
    node = cluster.start("pool", "embedded-pool", [
        python, "-m", "cluster.pool", "--metadata", metadata, "--host", hosts.address("pool"),
        "--dram-gib", "0.05", "--log-level", "warning"], "")
    segment = pool_node_ready(node, 60)

    def listed() -> bool:
        r = httpx.get(url + "/stats", timeout=10, trust_env=False)
        return r.status_code == 200 and segment in r.json()["pool"]["segments"]

    until(listed, 30, "the Conductor to list the pool node of another host")
    node.stop(20.0)
    conductor.stop(20.0)


def _stream(url: str, prompt: str, max_tokens: int, started: threading.Event | None = None) -> dict:
    """One streamed completion through the Conductor at ``url``: its text, the error that ended it
    (an exception's name, or the stream's error event), whether it finished."""
    try:
        with httpx.stream("POST", url + "/v1/completions", timeout=120, trust_env=False, json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            if r.status_code != 200:
                return {"text": "", "error": f"HTTP {r.status_code}: {r.read()[:200]!r}", "done": False}
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if started is not None and line.startswith("data:"):
                    started.set()
            stream = sse_events(lines)
            return {"text": stream.text, "error": stream.error, "done": stream.done}
    except httpx.HTTPError as e:
        return {"text": "", "error": type(e).__name__, "done": False}


def test_two_conductors_front_the_instances_and_one_killed_costs_the_other_nothing(
        cluster: AcrossHosts, colocated: LLM):
    """A second Conductor on another host finds the four instances in etcd (none registers with
    it, no --instance names them). kill -9 of the first under load: streams through the second
    finish with the colocated engine's text, no instance restarts, and what the dead one held on
    the instances is released within one reservation lease; started again under its id, it
    claims a newer epoch, adopts the running instances and serves within seconds."""
    hosts, python = cluster.hosts, sys.executable
    ctl2 = hosts.address("ctl2")
    url2 = f"http://{ctl2}:{CONDUCTOR_PORT}"
    second = cluster.start("ctl2", "conductor2", [
        python, "-m", "server", "--host", ctl2, "--port", str(CONDUCTOR_PORT), *TEST_FLAGS,
        "--prefill-instances", "0", "--decode-instances", "0", "--etcd", cluster.etcd], url2)
    second.wait_instances(4, 60)
    first = cluster.procs["conductor"]
    before = {i["url"]: i["instance_id"] for i in first.instances()}
    epoch1 = first.stats()["epoch"]
    s2 = second.stats()
    assert s2["conductor_id"] == f"{ctl2}:{CONDUCTOR_PORT}" and first.stats()["conductor_id"] != s2["conductor_id"]
    assert {i["url"]: i["instance_id"] for i in second.instances()} == before

    prompt = "Tell me a long story about a dragon."
    (want,) = colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    results: dict[str, dict] = {}
    started = [threading.Event() for _ in range(6)]
    workers = [threading.Thread(target=lambda k=k, u=u, e=e: results.__setitem__(k, _stream(u, prompt, 48, e)))
               for (k, u), e in zip([(f"first-{i}", cluster.url) for i in range(3)]
                                    + [(f"second-{i}", url2) for i in range(3)], started)]
    for w in workers:
        w.start()
    for e in started:
        assert e.wait(60), "a stream did not start"
    first.stop(5.0, signal.SIGKILL)
    t_kill = time.monotonic()
    for w in workers:
        w.join(120)
    for k in ("second-0", "second-1", "second-2"):
        r = results[k]
        assert r["done"] and r["error"] is None and r["text"] == want.text, (k, r)
    assert all(not results[f"first-{i}"]["done"] for i in range(3))  # cut: their Conductor is gone
    # No instance restarted, and the second saw none go down.
    assert {i["url"]: i["instance_id"] for i in second.instances() if i["up"]} == before
    # What the dead one held on the instances (its streams' requests, its reservations) is gone
    # within one lease (30 s here); staging within its own bound.
    second.assert_clean(RELEASE_S)
    print(f"instances clean {time.monotonic() - t_kill:.1f} s after the kill")

    # Started again, the same command: a newer epoch from etcd, the same instances, serving.
    t0 = time.monotonic()
    again = cluster.start("ctl", "conductor", first.cmd, cluster.url)
    again.wait_instances(4, 30)
    serving_s = time.monotonic() - t0
    stats = again.stats()
    assert stats["epoch"] > epoch1 and stats["conductor_id"] == f"{hosts.address('ctl')}:{CONDUCTOR_PORT}"
    assert {i["url"]: i["instance_id"] for i in again.instances()} == before  # adopted, none started afresh
    # Both serve side by side: the restart fenced off only its own earlier incarnation.
    out = [_stream(u, prompt, 48) for u in (cluster.url, url2)]
    assert all(o["done"] and o["error"] is None and o["text"] == want.text for o in out), out
    assert second.stats()["requests_failed"] == 0
    print(f"the restarted Conductor served {serving_s:.1f} s after its start")
    assert serving_s < 20, f"the restarted Conductor took {serving_s:.1f} s to adopt the instances"
    second.stop(20.0)
