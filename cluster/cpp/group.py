"""A pipeline group's later stages, as the first stage gets and watches them, and their processes.

The first stage (a prefill instance) gets its later stages in one of two ways:

* ``StageGroup.spawn`` (``python -m server --cpp-stages X``): it starts them as its own child
  processes (``python -m cluster.cpp.group --spec ...``); each prints its peer, takes its
  links on stdin and exits when stdin closes. A child that exits is a dead stage.
* ``StageGroup.join`` (by hand, on any hosts: ``python -m server --role prefill --stage i/X
  --group NAME``, with ``--first URL`` for i > 0): each later stage asks the first stage's
  ``/instance/stage/join`` for its ``StageSpec``, loads its layers, and joins with its peer; once
  every stage has joined, each gets its links in the answer (``StageRendezvous``). The first
  stage pings every stage each second over the Messenger and every stage pings the first; three
  missed pings in a row and the other end counts as dead.

A dead stage ends the group: the first stage's instance exits (its Supervisor, or whoever
started it, starts it again), and a stage whose first stage is gone exits too.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from cluster.protocol import INSTANCE, MESSENGER, ControlAuth, StageJoin, StageLinks, StagePing, StageSpec
from cluster.protocol import AnswerAuthError, StageSpecReply, check_answer, derive_key
from cluster.kv_stream import KVSender
from cluster.pool.config import model_identity
from cluster.pool.objects import PoolGeometry
from cluster.cpp.stage import StageLink, StagePeer, StageWorker
from cluster.cpp.pool_share import StagePool
from cluster.messenger.staging import StagingArea
from cluster.messenger import RegionHandle, MessengerConfig, Messenger, TransferError
from cluster.messenger.wire import Status
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.cpu_runtime import configure_cpu_runtime
from engine.default_model import resolve_model
from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

PING_S = 1.0
MISSED_PINGS = 3  # in a row: the other end is dead


class StageRendezvous:
    """Where the later stages of a group started by hand meet their first stage. Thread-safe;
    the join calls block (run them off the event loop)."""

    def __init__(self, group: str, stages: int) -> None:
        if not group:
            raise ValueError("a pipeline group needs a name")
        if stages < 2:
            raise ValueError(f"a pipeline group has at least 2 stages, got {stages}")
        self.group, self.stages = group, stages
        self._cond = threading.Condition()
        self._spec: StageSpec | None = None
        self._peers: dict[int, StagePeer] = {}
        self._links: dict[int, StageLinks] | None = None

    def _check(self, group: str, stage: int) -> None:
        if group != self.group:
            raise ValueError(f"this first stage leads group {self.group!r}, not {group!r}")
        if not 1 <= stage < self.stages:
            raise ValueError(f"group {self.group!r} has stages 1 to {self.stages - 1} to join, not {stage}")

    # -- a later stage's calls (the first stage's /instance/stage/join) ------------------------------
    def spec(self, group: str, stage: int, timeout_s: float) -> StageSpec:
        """The stage's ``StageSpec``, once the first stage has one (its engine is up)."""
        self._check(group, stage)
        with self._cond:
            if not self._cond.wait_for(lambda: self._spec is not None, timeout_s):
                raise TimeoutError("the first stage is still starting")
            return self._spec.for_stage(stage)

    def join(self, group: str, stage: int, peer: StagePeer, timeout_s: float) -> StageLinks:
        """Join with ``peer``; once every stage has, its links. Raises ValueError once the group has formed (a stage that restarts needs its
        first stage restarted too), TimeoutError while stages are missing."""
        self._check(group, stage)
        with self._cond:
            if self._links is not None:
                raise ValueError(f"group {self.group!r} has formed already: restart its first stage")
            self._peers[stage] = peer  # a stage that restarted before the group formed joins anew
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._links is not None and self._peers.get(stage) is peer, timeout_s):
                raise TimeoutError(f"group {self.group!r}: stages {self.missing()} have not joined")
            return self._links[stage]

    def missing(self) -> list[int]:
        return [i for i in range(1, self.stages) if i not in self._peers]

    # -- the first stage's side -----------------------------------------------------------------------
    def offer(self, spec: StageSpec) -> None:
        with self._cond:
            self._spec = spec
            self._cond.notify_all()

    def peers(self, timeout_s: float) -> list[StagePeer]:
        """Every later stage's peer, in stage order, once all have joined."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self.missing(), timeout_s):
                raise TimeoutError(f"group {self.group!r}: stages {self.missing()} did not join in {timeout_s:g} s")
            return [self._peers[i] for i in range(1, self.stages)]

    def link(self, links: list[StageLinks]) -> None:
        """Hand each joined stage its links (``links[i - 1]``: stage ``i``'s)."""
        with self._cond:
            self._links = {i + 1: links[i] for i in range(len(links))}
            self._cond.notify_all()


class StageGroup:
    """The first stage's view of its later stages: its ``link`` to them, and a watcher that
    calls ``on_death(reason)`` (on its own thread) once one is gone."""

    def __init__(self, transfer: Messenger, buffer_bytes: int, timeout_s: float) -> None:
        self.link = StageLink(transfer, buffer_bytes, timeout_s)
        self.processes: list[subprocess.Popen] = []
        self._transfer = transfer
        self._closing = threading.Event()

    def _wire(self, peers: list[StagePeer]) -> list[StageLinks]:
        """Chain the stages: this one's link sends to the second, each to the next, the last back
        here; each later stage's links."""
        self.link.next, self.link.followers = peers[0], peers
        first = peer_dict(self.link.peer)
        return [StageLinks(first, peer_dict(peers[i + 1]) if i + 1 < len(peers) else None)
                for i in range(len(peers))]

    @classmethod
    def spawn(cls, spec: StageSpec, transfer: Messenger, secret: bytes, host: str,
              on_death: Callable[[str], None], startup_s: float = 300.0) -> StageGroup:
        """Start stages 1 to X - 1 as child processes of this one."""
        group = cls(transfer, spec.buffer_bytes, spec.timeout_s)
        stages = spec.engine["stage"][1]
        peers: list[StagePeer] = []
        try:
            for i in range(1, stages):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "cluster.cpp.group", "--spec", json.dumps(spec.for_stage(i).to_dict()),
                     "--host", host],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    env={**os.environ, "MOONCAKE_CLUSTER_SECRET": secret.decode()})
                group.processes.append(proc)
                # A stage loading its weights takes a while; one that dies says so by EOF.
                timer = threading.Timer(startup_s, proc.kill)
                timer.start()
                try:
                    line = proc.stdout.readline()
                finally:
                    timer.cancel()
                if not line.startswith("stage ready "):
                    raise RuntimeError(f"pipeline stage {i} of {stages} did not start (exit {proc.poll()})")
                peers.append(peer_from(json.loads(line[len("stage ready "):])))
            for proc, links in zip(group.processes, group._wire(peers)):
                proc.stdin.write(json.dumps(links.to_dict()) + "\n")
                proc.stdin.flush()
        except BaseException:
            group.close()
            raise
        group._watch(group._dead_process, on_death)
        return group

    @classmethod
    def join(cls, spec: StageSpec, transfer: Messenger, rendezvous: StageRendezvous,
             on_death: Callable[[str], None], startup_s: float = 600.0) -> StageGroup:
        """Offer ``spec`` to the stages started by hand and wait until every one has joined."""
        group = cls(transfer, spec.buffer_bytes, spec.timeout_s)
        rendezvous.offer(spec)
        log.info("waiting for stages %s of group %r to join", rendezvous.missing(), rendezvous.group)
        peers = rendezvous.peers(startup_s)
        rendezvous.link(group._wire(peers))
        log.info("group %r formed: %d stages", rendezvous.group, rendezvous.stages)
        missed = [0] * len(peers)

        def dead_peer() -> str | None:
            for i, peer in enumerate(peers):
                missed[i] = 0 if ping(transfer, peer.address) else missed[i] + 1
                if missed[i] >= MISSED_PINGS:
                    return f"pipeline stage {i + 1} stopped answering ({MISSED_PINGS} pings missed)"
            return None

        group._watch(dead_peer, on_death, every_s=PING_S)
        return group

    def _dead_process(self) -> str | None:
        for i, proc in enumerate(self.processes):
            if proc.poll() is not None:
                return f"pipeline stage {i + 1} exited with {proc.returncode}"
        return None

    def _watch(self, dead: Callable[[], str | None], on_death: Callable[[str], None], every_s: float = 0.5) -> None:
        def watch() -> None:
            while not self._closing.wait(every_s):
                reason = dead()
                if reason is not None:
                    self.link.fail(reason)
                    on_death(reason)
                    return

        threading.Thread(target=watch, name="stage watcher", daemon=True).start()

    def close(self) -> None:
        """Stop watching; child stages see their stdin close and exit (stages that joined see
        their pings go unanswered once this process is gone)."""
        self._closing.set()
        for proc in self.processes:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.processes:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def ping(transfer: Messenger, address: str) -> bool:
    try:
        status, _ = transfer.call(address, StagePing().to_dict())
    except TransferError:
        return False
    return status == Status.OK


def peer_dict(peer: StagePeer | None) -> dict | None:
    return None if peer is None else {"address": peer.address, "region": peer.region.to_dict()}


def peer_from(data: dict | None) -> StagePeer | None:
    return None if data is None else StagePeer(str(data["address"]), RegionHandle.from_dict(data["region"]))


# -- a later stage's process ----------------------------------------------------------------------------
def start_worker(spec: StageSpec, host: str, secret: bytes) -> tuple[StageWorker, Messenger]:
    """Load the stage's layers and serve them (links not set yet)."""
    fields = dict(spec.engine)
    fields["stage"] = tuple(fields["stage"])
    config = EngineConfig(**fields)
    if config.device == "cpu":
        configure_cpu_runtime(config.threads)
    path = resolve_model(config.model)
    max_len = config.max_model_len or ModelConfig.from_folder(path).max_position_embeddings
    runner = ModelRunner(config, path, max_len)
    transfer = Messenger(MessengerConfig(secret=derive_key(secret, MESSENGER), host=host, timeout_s=spec.timeout_s))
    sender = KVSender(transfer, StagingArea(transfer, spec.staging_bytes), runner.wire_layout,
                      write_window_s=spec.timeout_s, layers=runner.model.layer_range)
    pool = None
    if spec.pool is not None:
        geometry = PoolGeometry(runner.wire_layout, spec.pool[0],
                                model_identity(str(path), config.dtype, config.quantization,
                                               config.deterministic))
        pool = StagePool(transfer, StagingArea(transfer, spec.pool[1]), geometry, runner.model.layer_range,
                         spec.timeout_s)
    return StageWorker(runner, transfer, spec.buffer_bytes, spec.timeout_s, sender, pool), transfer


def serve_joined(first_url: str, group: str, stage: int, stages: int, host: str, secret: bytes,
                 startup_s: float = 600.0) -> int:
    """A later stage started by hand: join group ``group`` at its first stage (the prefill
    instance at ``first_url``), then serve until the first stage is gone. Returns the exit code."""
    key = derive_key(secret, INSTANCE)  # a stage is an instance: not the Conductors' key
    url = first_url.rstrip("/") + "/instance/stage/join"
    join = StageJoin(group, stage, stages)
    with httpx.Client(auth=ControlAuth(key), timeout=startup_s) as http:
        spec = StageSpecReply.from_dict(_ask(http, key, url, join.to_dict(), startup_s)).spec
        log.info("stage %d/%d of group %r: loading its layers", stage, stages, group)
        worker, transfer = start_worker(spec, host, secret)
        try:
            links = StageLinks.from_dict(_ask(http, key, url,
                                              StageJoin(group, stage, stages, peer_dict(worker.peer)).to_dict(),
                                              startup_s))
            worker.next, worker.first = peer_from(links.next), peer_from(links.first)
            log.info("stage %d/%d of group %r joined; serving", stage, stages, group)
            missed = 0
            while missed < MISSED_PINGS:
                time.sleep(PING_S)
                missed = 0 if ping(transfer, worker.first.address) else missed + 1
            log.error("the first stage of group %r stopped answering: exiting", group)
            return 1
        finally:
            worker.close()
            transfer.close()


def _ask(http: httpx.Client, key: bytes, url: str, body: dict, within_s: float) -> dict:
    """POST ``body``, retrying while the first stage is not up yet; raises ``RuntimeError``
    with its answer when it refuses, or when the answer is not signed with the instances' ``key``."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            r = http.post(url, json=body)
        except httpx.TransportError as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            try:
                check_answer(key, r)
            except AnswerAuthError as exc:
                raise RuntimeError(f"the first stage's answer is not to be trusted: {exc}") from None
            if r.status_code == 200:
                return r.json()
            reason = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code not in (502, 503, 504):
                raise RuntimeError(f"the first stage refused: {reason}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the first stage did not answer in {within_s:g} s: {reason}")
        time.sleep(2.0)


def main(argv: list[str] | None = None) -> int:
    """``python -m cluster.cpp.group --spec JSON``: one later stage of a prefill instance's
    pipeline, started by that instance. Prints ``stage ready {peer}``, takes ``{"next": peer |
    null, "first": peer}`` as one line on stdin, then serves until stdin closes (the instance
    stopped or died)."""
    parser = argparse.ArgumentParser(prog="python -m cluster.cpp.group", description=main.__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="the stage's StageSpec as JSON")
    parser.add_argument("--host", default="127.0.0.1", help="where its Messenger listens")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s stage: %(message)s")
    secret = os.environ.get("MOONCAKE_CLUSTER_SECRET", "").encode()
    worker, transfer = start_worker(StageSpec.from_dict(json.loads(args.spec)), args.host, secret)
    print("stage ready " + json.dumps(peer_dict(worker.peer)), flush=True)
    try:
        line = sys.stdin.readline()
        if not line:
            return 0
        links = StageLinks.from_dict(json.loads(line))
        worker.next, worker.first = peer_from(links.next), peer_from(links.first)
        sys.stdin.read()  # until the instance closes the pipe
    finally:
        worker.close()
        transfer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
