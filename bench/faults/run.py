"""bench.faults: one run of the matrix against a ``python -m server`` cluster the bench starts."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import secrets
import signal
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from bench.faults.matrix import (BENCH_FENCE, DECODE, EVERY, FRESH, NONE, PREFILL, ROWS, SHARED_SESSIONS, ControlCall,
                                 Row, bench_reservation, hostile_control, pause_conductor, plant_foreign_objects,
                                 restarted_peer)
from bench.faults.control_fuzz import cases, drive
from bench.faults.traffic import (DIFFERS, ERROR, HUNG, IDENTICAL, Ask, Outcome, fresh_asks, send_all, session_firsts,
                                  session_seconds)
from bench.harness import ServerProcess, launch_server
from cluster.failpoints import ENV as FAILPOINTS_ENV
from cluster.protocol import CONTROL, EPOCH_HEADER, MESSENGER, ControlAuth, derive_key
from engine.kv_layout import KVLayout

# The second turns' questions (``SHARED_SESSIONS`` asks both at once).
QUESTIONS = (" Why?", " And then what happened?")
PRECISIONS = {"deterministic": (["--deterministic"], {"deterministic": True}),
              "float32": (["--dtype", "float32"], {"dtype": "float32"})}
# The shipped reservation lease (``--reservation-lease-s``) and transfer timeout: the Conductor
# is paused past the first; abandoned receive staging is reused after twice the second.
LEASE_S, TRANSFER_TIMEOUT_S = 10.0, 30.0


@dataclass
class FaultsConfig:
    workdir: Path
    quick: bool = False
    precision: str = "deterministic"
    requests: int = 6  # per row of fresh prompts
    sessions: int = 2  # per pool row
    max_tokens: int = 16
    deadline_s: float = 240.0
    only: tuple[str, ...] = ()
    json_path: Path | None = None

    def rows(self) -> list[Row]:
        rows = [r for r in ROWS if (not self.quick or r.quick) and (not self.only or r.name in self.only)]
        if self.only and len(rows) != len(self.only):
            known = ", ".join(r.name for r in ROWS)
            raise ValueError(f"--only names rows that are not in the matrix (known: {known})")
        return rows


@dataclass
class RowResult:
    name: str
    fault: str
    fired: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)  # Conductor counters that moved during the row
    calls: list[ControlCall] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why the row failed, besides differing 200s

    def count(self, result: str) -> int:
        return sum(o.result == result for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.count(DIFFERS) and not self.count(HUNG)

    def errors(self) -> Counter:
        return Counter(f"{o.status} {o.error[:90]}" for o in self.outcomes if o.result == ERROR)


# --------------------------------------------------------------------------- references


def references(cfg: FaultsConfig, rows: Sequence[Row]) -> dict[str, list[Ask] | list[tuple[Ask, list[Ask]]]]:
    """Every row's requests with their greedy reference texts, from an engine in this process at
    the cluster's precision (the cluster is not started yet: nothing else computes)."""
    from engine import LLM, SamplingParams

    llm = LLM(**PRECISIONS[cfg.precision][1])

    def generated(asks: list[Ask]) -> list[tuple[Ask, list[int]]]:
        """Each ask with its reference text, and the reference's token ids."""
        out: list[Any] = list(asks)
        for m in sorted({a.max_tokens for a in asks}):
            idx = [i for i, a in enumerate(asks) if a.max_tokens == m]
            got = llm.generate([asks[i].prompt for i in idx], SamplingParams(temperature=0, max_tokens=m,
                                                                                 ignore_eos=True))
            for i, g in zip(idx, got, strict=True):
                out[i] = (replace(asks[i], want=g.text), g.prompt_token_ids + g.token_ids)
        return out

    questions = [llm.engine.tokenize(q) for q in QUESTIONS]
    refs: dict[str, Any] = {}
    for row in rows:
        if row.traffic == FRESH:
            refs[row.name] = [a for a, _ in generated(fresh_asks(row.name, cfg.requests, cfg.max_tokens))]
        elif row.traffic != NONE:
            asked = questions[: 2 if row.traffic == SHARED_SESSIONS else 1]
            refs[row.name] = [(first, [a for a, _ in generated(session_seconds(first, turn, asked, cfg.max_tokens))])
                              for first, turn in generated(session_firsts(row.name, cfg.sessions))]
    del llm
    gc.collect()
    return refs


# --------------------------------------------------------------------------- the run


class FaultsRun:
    def __init__(self, cfg: FaultsConfig, server: ServerProcess, secret: str) -> None:
        self.cfg = cfg
        self.server = server
        self.secret = secret
        self.http = httpx.AsyncClient(base_url=server.base_url, timeout=cfg.deadline_s + 30)
        self.control = httpx.AsyncClient(auth=ControlAuth(derive_key(secret.encode(), CONTROL)), timeout=120,
                                         headers={EPOCH_HEADER: BENCH_FENCE})

    async def close(self) -> None:
        await self.http.aclose()
        await self.control.aclose()

    def _urls(self, where: str) -> list[str]:
        return [i["url"] for i in self.server.instances() if where == EVERY or i["role"] == where]

    async def _failpoints(self, url: str, arm: dict[str, int] | None = None) -> dict[str, Any]:
        r = await (self.control.post(url + "/instance/failpoints", json={"arm": arm}) if arm is not None
                   else self.control.get(url + "/instance/failpoints"))
        if r.status_code != 200:
            raise RuntimeError(f"failpoints on {url}: {r.status_code} {r.text[:300]}")
        return r.json()

    async def _counters(self) -> dict[str, int]:
        stats = await asyncio.to_thread(self.server.stats) or {}
        pool = stats.get("pool") or {}
        return {"moved": stats.get("requests_moved", 0), "failed": stats.get("requests_failed", 0),
                **{f"pool {k}": v for k, v in pool.items() if isinstance(v, int)}}

    async def row(self, row: Row, refs: Any) -> RowResult:
        res = RowResult(row.name, row.fault)
        if row.action == "restarted_peer":
            peer = await asyncio.to_thread(restarted_peer, derive_key(self.secret.encode(), MESSENGER))
            res.fired = 1
            res.counters = {"stale writes refused": peer.stale_refused, "stale writes landed": peer.stale_landed}
            if peer.stale_landed:
                res.problems.append(f"{peer.stale_landed} writes naming the old incarnation's region landed")
            if not peer.fresh_write_intact:
                res.problems.append("a write to the new incarnation's own region did not land as sent")
            return res
        before = await self._counters()
        armed = {url: arm for where, arm in row.failpoints.items() for url in self._urls(where)}
        before_fp = {url: await self._failpoints(url) for url in armed}
        for url, arm in armed.items():
            await self._failpoints(url, arm)
        try:
            if row.traffic == FRESH:
                res.outcomes = await self._with_action(row, res, send_all(self.http, refs, self.cfg.deadline_s))
            else:
                if row.action == "foreign_objects":
                    res.fired = await self._plant(refs)
                # Where a foreign object holds the key, the decode instance stores nothing.
                res.outcomes = await self._sessions(refs, stored=not res.fired)
        finally:
            for url, arm in armed.items():
                state = await self._failpoints(url, dict.fromkeys(arm, 0))
                res.fired += sum(state["fired"].get(n, 0) - before_fp[url]["fired"].get(n, 0) for n in arm)
                for k, v in state["outcomes"].items():
                    if v != before_fp[url]["outcomes"].get(k, 0):
                        res.counters[k] = res.counters.get(k, 0) + v - before_fp[url]["outcomes"].get(k, 0)
        after = await self._counters()
        res.counters.update({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)})
        if row.action == "foreign_objects" and res.counters.get("pool foreign_objects", 0) < res.fired:
            res.problems.append(f"{res.fired} foreign objects planted, "
                                f"{res.counters.get('pool foreign_objects', 0)} refused by a reader")
        if armed and not res.fired:
            res.problems.append("the fault never fired: the row proves nothing")
        return res

    async def _with_action(self, row: Row, res: RowResult, traffic) -> list[Outcome]:
        task = asyncio.ensure_future(traffic)
        try:
            if row.action in ("hostile_control", "control_fuzz"):
                # What a row before left held for a while on purpose (a lapsed reservation's
                # staging waits out twice the transfer timeout) is not these calls' doing.
                before = await asyncio.to_thread(self.server.held)
                await asyncio.sleep(0.3)  # the traffic is under way
                prefill, decode = self._urls(PREFILL)[0], self._urls(DECODE)[0]
                async with bench_reservation(self.control, decode) as dest:
                    if row.action == "hostile_control":
                        res.calls = await hostile_control(self.control, prefill, decode, dest)
                    else:
                        res.calls = await drive(self.control, cases(prefill, decode, dest, BENCH_FENCE))
                res.fired = len(res.calls)
                res.problems += [f"{c.label}: answered {c.status} {c.answer[:120]}" for c in res.calls if not c.refused]
                outcomes = await task
                # Nothing the hostile calls touched may stay held (the traffic beside them is done).
                if held := await self.held(10.0, before):
                    res.problems.append(f"held after the hostile calls: {held}")
                return outcomes
            elif row.action == "pause_conductor":
                await pause_conductor(self.server.proc.pid, 1.0, LEASE_S + 3.0)
                res.fired = 1
            return await task
        except BaseException:
            task.cancel()
            raise

    async def _plant(self, refs: list[tuple[Ask, list[Ask]]]) -> int:
        """``plant_foreign_objects`` under the keys of the rows' second turns."""
        stats = await asyncio.to_thread(self.server.stats) or {}
        (url,) = [i["url"] for i in stats["instances"] if i["role"] == DECODE]
        info = (await self.control.get(url + "/instance/info")).json()
        layout = KVLayout.from_dict(info["layout"])
        found = re.search(r"KVCache pool metadata at (\S+)", self.server.log())
        if found is None:
            raise RuntimeError("the Conductor did not log its pool metadata server's address")
        return await asyncio.to_thread(
            plant_foreign_objects, self.secret.encode(), found.group(1), info["pool"]["namespace"],
            info["pool"]["blocks_per_object"], layout.block_size, [ss[0].prompt for _, ss in refs],
            layout.layer_bytes(info["pool"]["blocks_per_object"]))

    async def _sessions(self, refs: list[tuple[Ask, list[Ask]]], stored: bool) -> list[Outcome]:
        """The first turns, then (once the decode instance has stored them, when ``stored``) the
        second turns."""
        stores = (await self._counters()).get("pool stores", 0)
        firsts = await send_all(self.http, [f for f, _ in refs], self.cfg.deadline_s)
        if stored:
            await self._stored(stores + len(refs))
        seconds = await send_all(self.http, [s for _, ss in refs for s in ss], self.cfg.deadline_s)
        return firsts + seconds

    async def _stored(self, n: int, within_s: float = 20.0) -> None:
        """Wait (bounded) until the pool has stored ``n`` objects in all: the decode instance
        stores a turn when it ends, after the answer went out."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and (await self._counters()).get("pool stores", 0) < n:
            await asyncio.sleep(0.2)

    async def held(self, within_s: float, before: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """What the instances still hold beyond ``before`` (what they held earlier; None:
        nothing), waiting up to ``within_s`` for it to go: empty when clean."""
        deadline = time.monotonic() + within_s
        while True:
            held = await asyncio.to_thread(self.server.held)
            more = {url: extra for url, per in held.items()
                    if (extra := {k: v for k, v in per.items() if v > (before or {}).get(url, {}).get(k, 0)})}
            if not more or time.monotonic() > deadline:
                return more
            await asyncio.sleep(1.0)


# --------------------------------------------------------------------------- the table


def format_table(results: Sequence[RowResult]) -> str:
    head = ("| row | fault | fired | requests | identical | moved / pool recomputed | clear errors | "
            "differing 200s | hung | verdict |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        moved = r.counters.get("moved", 0)
        pool = r.counters.get("pool failed_reads_recomputed", 0) + r.counters.get("pool misses", 0)
        verdict = "ok" if r.ok else "FAILED"
        lines.append(f"| {r.name} | {r.fault} | {r.fired} | {len(r.outcomes)} | {r.count(IDENTICAL)} "
                     f"| {moved} / {pool} | {r.count(ERROR)} | {r.count(DIFFERS)} | {r.count(HUNG)} | {verdict} |")
    notes = []
    for r in results:
        for why, n in r.errors().items():
            notes.append(f"- {r.name}: {n} x HTTP {why}")
        if len(r.calls) <= 16:
            notes += [f"- {r.name}: {c.label}: {c.status} {c.answer[:100]}" for c in r.calls]
        elif r.calls:
            statuses = Counter(c.status for c in r.calls)
            notes.append(f"- {r.name}: {len(r.calls)} calls answered " +
                         ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items(), key=lambda x: str(x[0]))))
        for o in r.outcomes:
            if o.result in (DIFFERS, HUNG):
                notes.append(f"- {r.name}: {o.ask.label} {o.result}: got {o.text[:80]!r} want {o.ask.want[:80]!r} "
                             f"{o.error}")
        notes += [f"- {r.name}: FAILED: {p}" for p in r.problems]
        extra = {k: v for k, v in r.counters.items() if ":" in k or "stale" in k}
        if extra:
            notes.append(f"- {r.name}: {extra}")
    return "\n".join(lines + ([""] + notes if notes else []))


async def run_matrix(cfg: FaultsConfig) -> tuple[list[RowResult], dict[str, Any]]:
    rows = cfg.rows()
    print(f"bench.faults: {len(rows)} rows, precision {cfg.precision}; references first", flush=True)
    refs = await asyncio.to_thread(references, cfg, rows)
    secret = secrets.token_hex(16)
    flags = [*PRECISIONS[cfg.precision][0], "--instance-threads", "1", "--log-level", "info"]
    env = {"MOONCAKE_CLUSTER_SECRET": secret, FAILPOINTS_ENV: "1", "OMP_NUM_THREADS": "1"}
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    server = launch_server(flags, cfg.workdir / "cluster.log", name="faults cluster", env=env)
    extra: dict[str, Any] = {"log": str(cfg.workdir / "cluster.log")}
    results: list[RowResult] = []
    try:
        await asyncio.to_thread(server.wait_instances, 2, 600)
        run = FaultsRun(cfg, server, secret)
        try:
            for row in rows:
                t0 = time.monotonic()
                res = await run.row(row, refs.get(row.name))
                results.append(res)
                print(f"  {row.name}: fired {res.fired}, {res.count(IDENTICAL)}/{len(res.outcomes)} identical, "
                      f"{res.count(ERROR)} errors, {res.count(DIFFERS)} differ, {res.count(HUNG)} hung "
                      f"({time.monotonic() - t0:.1f} s){'' if res.ok else ' FAILED'}", flush=True)
            # A lapsed reservation's staging is reused only after twice the transfer timeout.
            extra["held_at_end"] = await run.held(15.0 + 2 * TRANSFER_TIMEOUT_S)
            extra["instances_down_at_end"] = [i["url"] for i in server.instances() if not i["up"]]
        finally:
            await run.close()
    finally:
        server.proc.send_signal(signal.SIGCONT)  # a row may have stopped it
        server.stop(30.0)
    return results, extra


def main_run(cfg: FaultsConfig) -> int:
    t0 = time.monotonic()
    results, extra = asyncio.run(run_matrix(cfg))
    print()
    print(format_table(results))
    ok = all(r.ok for r in results) and not extra.get("held_at_end") and not extra.get("instances_down_at_end")
    if extra.get("held_at_end"):
        print(f"\nheld at the end: {extra['held_at_end']}")
    if extra.get("instances_down_at_end"):
        print(f"\ninstances down at the end: {extra['instances_down_at_end']}")
    if cfg.json_path is not None:
        rows = [{"name": r.name, "fault": r.fault, "fired": r.fired, "ok": r.ok,
                 "counts": {k: r.count(k) for k in (IDENTICAL, ERROR, DIFFERS, HUNG)}, "counters": r.counters,
                 "problems": r.problems} for r in results]
        cfg.json_path.write_text(json.dumps({"config": {k: str(v) for k, v in asdict(cfg).items()}, "extra": extra,
                                             "rows": rows}, indent=1))
    differing = sum(r.count(DIFFERS) for r in results)
    print(f"\n{sum(len(r.outcomes) for r in results)} requests, {differing} differing 200s, "
          f"{time.monotonic() - t0:.0f} s (pid {os.getpid()})")
    print("RESULT OK" if ok else "RESULT FAILED")
    return 0 if ok else 1
