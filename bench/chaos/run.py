"""bench.chaos: one run against a started cluster: the load, each fault in turn, what was observed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

import httpx
import numpy as np

from bench.chaos import conductors, connections, corrupt_ssd, disconnect, faults, load, overload, pool_node, restarts
from bench.chaos.cluster import Cluster, all_up, conductor_stats, signal_pid, wait_until
from bench.chaos.config import (COMPLETED, COMPLETIONS, CONDUCTOR_HELD, FAMILIES, HOST, HTTP_ERROR, PROMPTS, ChaosConfig,
                                progress)
from bench.chaos.fuzz import FuzzCase, FuzzOutcome, RawOutcome, framing_cases, http_request, raw_request, send_fuzz
from bench.chaos.report import build_report
from bench.chaos.traffic import Outcome, choice_text, request_body, send
from bench.harness import INSTANCE_HELD, staging_holders
from bench.serving import arrival_times

SLOW_CLIENT_RETRIES = 3  # how many times a byte-by-byte client tries again after a 429


class Run:
    """One chaos run against a started cluster: the load, the faults, and everything observed."""

    def __init__(self, cfg: ChaosConfig, cluster: Cluster, client: httpx.AsyncClient):
        self.cfg = cfg
        self.cluster = cluster
        self.client = client
        self.phase = "expected"
        self.outcomes: list[Outcome] = []
        self.expected: dict[int, str] = {}
        self.faults: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.errors: list[str] = []  # scenarios that could not run
        self.faulted: set[str] = set()  # URLs of the instances being faulted now
        self.monitor = load.Monitor()
        self.rng = np.random.default_rng([cfg.seed, 11])
        self.t0 = time.monotonic()
        self.traffic = asyncio.Event()  # cleared: the steady stream and the long prompts hold off
        self.traffic.set()

    def _elapsed(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    async def request(self, prompt: int, stream: bool) -> Outcome:
        out = Outcome(self.phase, prompt, stream)
        self.outcomes.append(out)
        return await send(self.client, self.cluster.url, out, self.cfg.max_tokens, self.cfg.deadline_s)

    def _random_request(self) -> Awaitable[Outcome]:
        return self.request(int(self.rng.integers(len(PROMPTS))), bool(self.rng.integers(2)))

    # -- load ----------------------------------------------------------------------------------------
    async def expected_texts(self) -> None:
        """Each prompt once, alone, before any fault: the answer every later one must repeat."""
        for i in range(len(PROMPTS)):
            out = await self.request(i, False)
            if out.result != COMPLETED:
                raise RuntimeError(f"the fault-free answer to prompt {i} failed: {out.error or out.status}")
            self.expected[i] = out.text

    async def steady(self, stop: asyncio.Event, tasks: list[asyncio.Task]) -> None:
        """Poisson arrivals until ``stop``; at most an hour's worth of them (none while the
        traffic is paused)."""
        offsets = arrival_times(max(1, int(self.cfg.rate * 3600)), self.cfg.rate, seed=self.cfg.seed)
        start = time.monotonic()
        for offset in offsets:
            delay = start + offset - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if stop.is_set():
                return
            if self.traffic.is_set():
                tasks.append(asyncio.create_task(self._random_request()))

    async def probe(self) -> dict[str, Any]:
        """Requests until one completes with the expected text (bounded): is the cluster serving?"""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.probe_timeout_s
        attempts = 0
        while time.monotonic() < deadline and attempts < 200:
            attempts += 1
            out = await self.request(attempts % len(PROMPTS), bool(attempts % 2))
            if out.result == COMPLETED and out.text == self.expected[out.prompt]:
                return {"served": True, "served_after_s": round(time.monotonic() - t0, 1), "attempts": attempts}
            await asyncio.sleep(1.0)
        return {"served": False, "served_after_s": None, "attempts": attempts}

    # -- faults --------------------------------------------------------------------------------------
    async def _instance(self, role: str) -> dict[str, Any]:
        stats = await conductor_stats(self.client, self.cluster)
        if not stats:
            raise RuntimeError("the Conductor's /stats did not answer")
        up = [i for i in stats["instances"] if i["role"] == role and i["up"] and self.cluster.owns(i["pid"])]
        if not up:
            raise RuntimeError(f"no {role} instance of this cluster is up: {stats['instances']}")
        restarts = [s["restarts"] for s in stats.get("supervised", []) if s["url"] == up[0]["url"]]
        return {**up[0], "restarts": restarts[0] if restarts else 0}

    async def kill(self, role: str) -> None:
        await self._fault(role, "kill -9", self._kill)

    async def _fault(self, role: str, kind: str,
                     run: Callable[[str, dict[str, Any], dict[str, Any]], Awaitable[None]]) -> None:
        """Record a fault of ``kind`` against an instance of ``role`` that is up and ``run`` it
        there; the instance counts as faulted (the monitor expects its failures) until it ends."""
        victim = await self._instance(role)
        fault: dict[str, Any] = {"kind": kind, "role": role, "url": victim["url"], "old_pid": victim["pid"],
                                 "at_s": self._elapsed()}
        self.faults.append(fault)
        self.faulted.add(victim["url"])
        try:
            await run(role, victim, fault)
        finally:
            self.faulted.discard(victim["url"])

    async def _kill(self, role: str, victim: dict[str, Any], fault: dict[str, Any]) -> None:
        fault["restarts_before"] = victim["restarts"]
        progress(f"kill -9 {role} instance pid {victim['pid']} ({victim['url']})")
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)

        async def back() -> dict[str, Any] | None:
            stats = await conductor_stats(self.client, self.cluster)
            if not stats:
                return None
            inst = [i for i in stats["instances"] if i["url"] == victim["url"] and i["up"]
                    and i["pid"] != victim["pid"]]
            sup = [s for s in stats.get("supervised", []) if s["url"] == victim["url"]]
            if inst and sup and sup[0]["restarts"] > victim["restarts"]:
                return {"inst": inst[0], "sup": sup[0]}
            return None

        found = await wait_until(back, self.cfg.restart_timeout_s)
        fault["restarted"] = found is not None
        if found:
            fault.update(new_pid=found["inst"]["pid"], restart_s=round(time.monotonic() - t0, 1),
                         restarts=found["sup"]["restarts"], last_exit=found["sup"]["last_exit"],
                         new_instance_id=found["inst"]["instance_id"])
            progress(f"{role} instance back as pid {fault['new_pid']} after {fault['restart_s']} s "
                      f"(restarts {fault['restarts']}, last exit {fault['last_exit']})")
        else:
            progress(f"{role} instance NOT back within {self.cfg.restart_timeout_s:g} s")
        fault.update(await self.probe())
        fault["recovered"] = bool(fault["restarted"] and fault["served"])
        progress(f"after the {role} kill: served again: {fault['served']} ({fault['served_after_s']} s)")

    async def stop_and_continue(self, role: str) -> None:
        await self._fault(role, "SIGSTOP", self._stop_and_continue)

    async def _stop_and_continue(self, role: str, victim: dict[str, Any], fault: dict[str, Any]) -> None:
        fault["stopped_s"] = self.cfg.stop_s
        progress(f"SIGSTOP {role} instance pid {victim['pid']} for {self.cfg.stop_s:g} s")
        marked_down = False
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            end = time.monotonic() + self.cfg.stop_s
            while time.monotonic() < end:
                stats = await conductor_stats(self.client, self.cluster)
                marked_down |= bool(stats) and any(i["url"] == victim["url"] and not i["up"]
                                                   for i in stats["instances"])
                await asyncio.sleep(min(0.5, max(0.0, end - time.monotonic())))
        finally:
            signal_pid(victim["pid"], signal.SIGCONT)
        fault["marked_down_while_stopped"] = marked_down
        t0 = time.monotonic()
        up = await wait_until(lambda: all_up(self.client, self.cluster), self.cfg.restart_timeout_s)
        fault["up_again"] = up is not None
        fault["up_again_s"] = round(time.monotonic() - t0, 1) if up else None
        if up:
            (inst,) = [i for i in up["instances"] if i["url"] == victim["url"]]
            fault["new_pid"] = inst["pid"]
        fault.update(await self.probe())
        fault["recovered"] = bool(fault["up_again"] and fault["served"])
        progress(f"SIGCONT sent; marked down meanwhile: {marked_down}; up again: {fault['up_again']}; "
                  f"served again: {fault['served']}")

    async def burst(self) -> dict[str, Any]:
        progress(f"burst of {self.cfg.burst} requests at once")
        t0 = time.monotonic()
        outs = await asyncio.gather(*(self._random_request() for _ in range(self.cfg.burst)))
        counts = Counter(o.result if o.result != HTTP_ERROR else f"http {o.status}" for o in outs)
        progress(f"burst answered in {time.monotonic() - t0:.1f} s: {dict(counts)}")
        return {"size": self.cfg.burst, "duration_s": round(time.monotonic() - t0, 1), "results": dict(counts)}

    # -- fuzz ----------------------------------------------------------------------------------------
    async def fuzz(self, cases: list[FuzzCase]) -> list[FuzzOutcome]:
        progress(f"fuzz: {len(cases)} malformed bodies, {self.cfg.fuzz_concurrency} at a time")
        sem = asyncio.Semaphore(self.cfg.fuzz_concurrency)
        # A fresh connection per body: the server may close one after an error, and a reused one
        # would then fail on the client side for reasons that are not the next body's.
        async with httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                                     timeout=httpx.Timeout(self.cfg.deadline_s, connect=10)) as fresh:
            async def one(case: FuzzCase) -> FuzzOutcome:
                async with sem:
                    return await send_fuzz(fresh, self.cluster.url, case, self.cfg.deadline_s)

            outs = await asyncio.gather(*(one(c) for c in cases))
        by_class = Counter(f"{o.status // 100}xx" if o.status else o.result for o in outs)
        progress(f"fuzz answered: {dict(by_class)}")
        return list(outs)

    async def framing(self) -> list[RawOutcome]:
        outs = []
        for label, data, half_close, _ in framing_cases():
            outs.append(await raw_request(self.cluster.port, label, data, half_close=half_close,
                                          deadline_s=self.cfg.deadline_s))
        return outs

    async def slow_clients(self) -> dict[str, Any]:
        """Byte-by-byte requests (must be answered), then stalled connections while a well-formed
        request must still be served."""
        port = self.cluster.port
        progress(f"slow clients: byte-by-byte requests, {self.cfg.stall_connections} stalled connections")

        async def byte_by_byte(prompt: int) -> dict[str, Any]:
            path = PROMPTS[prompt][0]
            data = http_request(path, json.dumps(request_body(prompt, False, self.cfg.max_tokens)).encode())
            # The steady traffic and what is left of the burst go on meanwhile: a 429 is a right
            # answer to a slow client too, and it does what a client should (waits Retry-After, tries
            # again), a bounded number of times.
            refused = 0
            while True:
                out = await raw_request(port, f"byte by byte ({path})", data,
                                        byte_gap_s=self.cfg.slow_request_s / len(data), deadline_s=self.cfg.deadline_s)
                retry_after = re.search(r"(?im)^retry-after:\s*(\d+)", out.detail) if out.status == 429 else None
                if retry_after is None or refused >= SLOW_CLIENT_RETRIES:
                    break
                refused += 1
                await asyncio.sleep(min(int(retry_after.group(1)), 10))
            body = out.detail.split("\r\n\r\n", 1)[-1] if out.status == 200 else ""
            try:
                text = choice_text(json.loads(body), path) if body else None
            except ValueError:
                text = None
            return {**asdict(out), "text_as_expected": text == self.expected[prompt], "refused_429": refused}

        slow = list(await asyncio.gather(*(byte_by_byte(prompt) for prompt in (0, 4))))  # one per API, side by side
        body = json.dumps(request_body(0, False, 2)).encode()
        partial = [
            b"",  # connected, says nothing
            f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {HOST}\r\nContent-".encode(),  # half the headers
            http_request(COMPLETIONS, body)[:-len(body) // 2],  # the headers, half the body
        ]
        conns: list[asyncio.StreamWriter] = []
        try:
            for i in range(self.cfg.stall_connections):
                _, writer = await asyncio.open_connection(HOST, port)
                conns.append(writer)
                writer.write(partial[i % len(partial)])
                await writer.drain()
            t0 = time.monotonic()
            served = await self.probe()
            await asyncio.sleep(max(0.0, self.cfg.stall_s - (time.monotonic() - t0)))
        finally:
            for w in conns:
                w.close()
        progress(f"slow clients: byte-by-byte answered {[s['status'] for s in slow]}; "
                  f"served while stalled: {served['served']}")
        return {"byte_by_byte": slow, "stalled_connections": len(conns), "served_while_stalled": served}

    # -- quiet ---------------------------------------------------------------------------------------
    async def held(self) -> dict[str, Any]:
        """What the cluster holds now: ``held`` (by instance URL, the Conductor's books about it and
        what the instance itself counts, non-zero figures only), ``down`` (instances not up),
        ``instance_stats`` (each up instance's ``/stats``), ``holders`` (by URL, who holds the
        staging ranges counted in ``held``, ``staging_holders``) and the Conductor's ``stats``; only
        ``conductor_stats`` when the Conductor does not answer."""
        stats = await conductor_stats(self.client, self.cluster)
        if not stats:
            return {"conductor_stats": "no answer"}
        held: dict[str, dict[str, int]] = {}
        own_stats: dict[str, dict[str, Any]] = {}
        down = {f"{i['url']} ({i['role']})": i.get("last_error") for i in stats["instances"] if not i["up"]}
        for inst in stats["instances"]:
            books = {f"conductor.{k}": inst.get(k, 0) for k in CONDUCTOR_HELD if inst.get(k)}
            own: dict[str, int] = {}
            if inst["up"]:
                try:
                    s = own_stats[inst["url"]] = (await self.client.get(inst["url"] + "/stats", timeout=10)).json()
                    own = {k: s[k] for k in INSTANCE_HELD if s.get(k)}
                except (httpx.HTTPError, ValueError) as e:
                    own = {f"stats error: {type(e).__name__}": 1}
            if books or own:
                held[inst["url"]] = {**books, **own}
        holders = {url: h for url, s in own_stats.items() if (h := staging_holders(s))}
        return {"held": held, "down": down, "instance_stats": own_stats, "holders": holders, "stats": stats}

    async def held_at_end(self) -> dict[str, Any]:
        """Poll until nothing is held anywhere or ``drain_s`` passes; the last observation."""
        last: dict[str, Any] = {}

        async def clean() -> bool:
            nonlocal last
            last = await self.held()
            return "stats" in last and not last["held"] and not last["down"]

        await wait_until(clean, self.cfg.drain_s, interval_s=0.5)
        return last

    @contextlib.asynccontextmanager
    async def paused_traffic(self) -> AsyncIterator[dict[str, Any]]:
        """The steady stream and the long prompts hold off for the block (the arrivals due
        meanwhile are skipped); it starts once their requests in flight have ended and the cluster
        holds nothing, or after ``drain_s``, with what it held then (``held``)."""
        self.traffic.clear()
        try:
            last: dict[str, Any] = {}

            async def quiet() -> bool:
                nonlocal last
                last = await self.held()
                return "stats" in last and not last["held"]

            await wait_until(quiet, self.cfg.drain_s, interval_s=0.5)
            yield last
        finally:
            self.traffic.set()

    async def pause(self) -> None:
        await asyncio.sleep(self.cfg.pause_s)

    def begin(self, name: str) -> None:
        self.phase = name
        self.phases.append({"name": name, "start_s": self._elapsed()})
        progress(f"phase: {name}")


async def run_scenarios(cfg: ChaosConfig, cluster: Cluster, fuzz_cases: list[FuzzCase]) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=cfg.burst + 1000, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.deadline_s, connect=10)) as client:
        up = await wait_until(lambda: all_up(client, cluster), cfg.health_timeout_s, interval_s=1.0)
        if not up:
            raise RuntimeError("the cluster's instances did not all come up")
        run = Run(cfg, cluster, client)
        run.begin("expected")
        await run.expected_texts()
        progress(f"expected texts: {run.expected}")

        stop, tasks = asyncio.Event(), []
        run.begin("steady")
        feeder = asyncio.create_task(run.steady(stop, tasks))
        long_load = asyncio.create_task(load.long_clients(run, stop))
        watcher = asyncio.create_task(load.monitor(run, stop))
        extra: dict[str, Any] = {"partition": faults.partition_support(), "late_writer": faults.LATE_WRITER}
        stop_roles = ["decode", "prefill"] if cfg.stop_role == "both" else [cfg.stop_role]
        Scenario = tuple[str, Callable[[], Awaitable[Any]], str | None]  # name, run it, its key in the report
        by_family: dict[str, list[Scenario]] = {
            "kill": [(f"kill {role}", lambda role=role: run.kill(role), None) for role in cfg.kill_roles],
            "sigstop": [(f"SIGSTOP {role}", lambda role=role: run.stop_and_continue(role), None) for role in stop_roles],
            "etcd": [("etcd stopped", lambda: faults.stop_etcd(run), None)] if cluster.etcd is not None else [],
            "pool-node": [("pool node stopped", lambda: pool_node.stop_pool_node(run), None)] if cfg.pool_node else [],
            "second-conductor": [("second Conductor killed", lambda: conductors.second_conductor_killed(run), None)]
            if cluster.etcd is not None and cfg.second_conductor else [],
            "connections": [("idle and slow-header connections", lambda: connections.idle_and_slow_connections(run),
                             None)],
            "disconnect": [("mass client disconnect", lambda: disconnect.mass_disconnect(run), "disconnect")],
            "corrupt-ssd": [("corrupt SSD object", lambda: corrupt_ssd.corrupt_ssd_object(run), "corrupt_ssd")],
            "restarts": [(f"{cfg.restarts} restarts of one instance", lambda: restarts.restart_one_instance(run),
                          "restarts")],
            "overload": [("ten times the sustainable load", lambda: overload.overload(run), "overload")],
            "stale-epoch": [("stale epoch", lambda: faults.stale_epoch(run), "stale_epoch")],
            "huge-body": [("huge control body", lambda: faults.huge_body(run), "huge_body")],
            "burst": [("burst", run.burst, "burst")],
            "fuzz": [("fuzz", lambda: run.fuzz(fuzz_cases), "fuzz")],
            "framing": [("bad framing", run.framing, "framing")],
            "slow-clients": [("slow clients", run.slow_clients, "slow_clients")],
        }
        scenarios = [sc for family in FAMILIES if family in cfg.families for sc in by_family[family]]
        try:
            for name, scenario, key in scenarios:
                await run.pause()
                run.begin(name)
                try:
                    result = await scenario()
                except (RuntimeError, OSError, httpx.HTTPError, ValueError, KeyError, TimeoutError) as e:
                    # One scenario that cannot run must not hide what the others find.
                    run.errors.append(f"{name}: {type(e).__name__}: {e}")
                    progress(f"{name} FAILED to run: {type(e).__name__}: {e}")
                    continue
                if key is not None:
                    extra[key] = result
            await run.pause()
        finally:
            stop.set()
            await feeder
            run.begin("drain")
            progress(f"waiting for {sum(not t.done() for t in tasks)} requests still in flight")
            await asyncio.gather(*tasks, long_load, watcher)  # each bounded by its deadline
        end = await run.held_at_end()
        extra["front_memory"] = {"pid": cluster.server.proc.pid, **load.memory_kib(cluster.server.proc.pid)}
        return build_report(cfg, run, extra, end)


# --------------------------------------------------------------------------- report
