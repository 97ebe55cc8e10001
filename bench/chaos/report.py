"""bench.chaos: the report, its rows that must be zero, and the table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.chaos.config import (COMPLETED, DISCONNECT_HELD, DISCONNECT_TOKENS, ENGINE_FAILED, FROZEN_SLOW,
                                FROZEN_UNASKED, HTTP_ERROR, HUGE, HUNG, LOST, MARKED_DOWN, OVERLOAD_MEMORY,
                                OVERLOAD_UNCLEAR, PROMPTS, RESTART_GROWTH, SSD_UNCOUNTED, SSD_WRONG, STALE, STREAM_ERROR,
                                UNCLEAR, ChaosConfig)
from bench.chaos.fuzz import FuzzOutcome, RawOutcome, framing_cases
from bench.chaos.restarts import LABELS

if TYPE_CHECKING:
    from bench.chaos.load import Monitor
    from bench.chaos.run import Run

def build_report(cfg: ChaosConfig, run: Run, extra: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    outs = run.outcomes
    requests = Counter()
    for o in outs:
        requests["sent"] += 1
        requests[o.result if o.result != HTTP_ERROR else f"http {o.status}"] += 1
    # A long prompt's answers must all be the first completed one's (cold and warm; moved or not).
    long_first: dict[str, str] = {}
    for o in outs:
        if o.long_key and o.result == COMPLETED:
            long_first.setdefault(o.long_key, o.text)
    wrong = [o for o in outs if o.result == COMPLETED
             and o.text != (long_first[o.long_key] if o.long_key else run.expected.get(o.prompt))]
    # With two instances of each role and one faulted at a time, every role always had an instance
    # up: a 5xx or an error event is a request lost although a healthy instance could serve it.
    lost = [o for o in outs if (o.result == HTTP_ERROR and (o.status or 0) >= 500) or o.result == STREAM_ERROR]
    no_retry_after = sum(o.retry_after is False for o in outs)
    by_phase: dict[str, Counter] = {}
    for o in outs:
        by_phase.setdefault(o.phase, Counter())[o.result if o.result != HTTP_ERROR else f"http {o.status}"] += 1

    fuzz: list[FuzzOutcome] = extra.get("fuzz", [])
    # A 503 says the cluster was not serving (the "instances not up" row tells why); a 500 from the
    # engine says the body was valid. Any other 5xx is the server failing on the input itself.
    fuzz_unavailable = [f for f in fuzz if f.status == 503]
    fuzz_engine = [f for f in fuzz if f.status == 500 and ENGINE_FAILED in f.reply]
    fuzz_5xx = [f for f in fuzz if (f.status or 0) >= 500 and f.status != 503
                and not (f.status == 500 and ENGINE_FAILED in f.reply)]
    fuzz_no_answer = [f for f in fuzz if f.result != "answered"]
    framing: list[RawOutcome] = extra.get("framing", [])
    expects_answer = {label: answer for label, _, _, answer in framing_cases()}
    slow = extra.get("slow_clients", {})
    slow_failed = sum(not (s["status"] == 200 and s["text_as_expected"]) for s in slow.get("byte_by_byte", []))
    if slow and not slow["served_while_stalled"]["served"]:
        slow_failed += 1
    held = end.get("held", {})
    held_total = sum(v for per in held.values() for v in per.values())
    mon: Monitor = run.monitor
    stale = extra.get("stale_epoch") or {}
    huge = extra.get("huge_body") or {}
    front = extra.get("front_memory") or {}
    restarts = extra.get("restarts") or {}
    disconnect = extra.get("disconnect") or {}
    ssd = extra.get("corrupt_ssd") or {}
    overloaded = extra.get("overload") or {}
    frozen = [f["frozen_node"] for f in run.faults if "frozen_node" in f]
    peak_mib = max(mon.peak_hwm_kib, front.get("VmHWM", 0)) // 1024

    must_be_zero = {
        "hung requests": requests[HUNG] + sum(f.result == HUNG for f in fuzz) + sum(r.hung for r in framing),
        "requests with no clear answer": requests[UNCLEAR],
        "completed with a different text": len(wrong),
        "requests lost while a healthy instance of their role was up": len(lost),
        "healthy instances marked down": len(mon.marked_down),
        "stale, replayed or altered control calls accepted": stale.get("accepted", 0),
        "unsigned huge control body not refused": int(bool(huge) and not huge.get("refused")),
        "5xx answers to malformed input": len(fuzz_5xx) + sum((r.status or 0) >= 500 for r in framing),
        "malformed requests dropped unanswered": len(fuzz_no_answer) - sum(f.result == HUNG for f in fuzz)
        + sum(bool(expects_answer.get(r.label)) and r.status is None and not r.hung for r in framing),
        "faults not recovered": sum(not f.get("recovered") for f in run.faults),
        "scenarios that failed to run": len(run.errors),
        "slow-client checks failed": slow_failed,
        RESTART_GROWTH: len(restarts.get("grown", [])) + len(restarts.get("survivors_lost", [])),
        DISCONNECT_HELD: disconnect.get("held_after_within", 0),
        DISCONNECT_TOKENS: disconnect.get("prompt_tokens_after_release", 0),
        SSD_WRONG: ssd.get("served_wrong", 0),
        SSD_UNCOUNTED: ssd.get("not_counted", 0),
        FROZEN_SLOW: sum(f["slowed"] for f in frozen),
        FROZEN_UNASKED: sum(f["node_never_asked"] for f in frozen),
        OVERLOAD_MEMORY: len(overloaded.get("over_bound", [])),
        OVERLOAD_UNCLEAR: overloaded.get("unclear_answers", 0),
        "resources held at the end": held_total,
        "instances not up at the end": len(end.get("down", [])) + ("conductor_stats" in end),
    }
    stats = end.get("stats") or {}
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "expected": {PROMPTS[i][1]: t for i, t in run.expected.items()},
        "phases": run.phases,
        "requests": dict(requests),
        "missing_retry_after": no_retry_after,
        "by_phase": {k: dict(v) for k, v in by_phase.items()},
        "wrong_texts": [{"phase": o.phase, "prompt": f"long prompt {o.long_key}" if o.long_key else PROMPTS[o.prompt][1],
                         "stream": o.stream, "got": o.text,
                         "expected": long_first[o.long_key] if o.long_key else run.expected.get(o.prompt)}
                        for o in wrong[:20]],
        "long_prompts": {"sent": sum(bool(o.long_key) for o in outs),
                         "completed": sum(bool(o.long_key) and o.result == COMPLETED for o in outs),
                         "prompts": len({o.long_key for o in outs if o.long_key}),
                         "latency_p50_s": _p50([o.latency_s for o in outs if o.long_key and o.result == COMPLETED])},
        "lost": [{"phase": o.phase, "status": o.status, "result": o.result, "long": bool(o.long_key),
                  "stream": o.stream, "error": o.error[:200]} for o in lost[:30]],
        "lost_by_phase": dict(Counter(o.phase for o in lost)),
        "marked_down": mon.marked_down,
        "monitor_samples": mon.samples,
        "requests_moved": stats.get("requests_moved"),
        "front_memory": {"pid": front.get("pid"), "peak_mib": peak_mib, "rss_end_mib": front.get("VmRSS", 0) // 1024,
                         "rss_samples": mon.rss_kib[::max(1, len(mon.rss_kib) // 50)]},
        "stale_epoch": stale,
        "huge_body": huge,
        "partition": extra.get("partition"),
        "late_writer": extra.get("late_writer"),
        "error_samples": sorted({f"{o.phase}: {o.status} {o.error[:160]}" for o in outs if o.error})[:30],
        "faults": run.faults,
        "scenario_errors": run.errors,
        "burst": extra.get("burst"),
        "fuzz": {"sent": len(fuzz), "by_status": dict(Counter(str(f.status) for f in fuzz)),
                 "unavailable": len(fuzz_unavailable), "engine_failed": len(fuzz_engine),
                 "statuses": {f.label: f.status for f in fuzz if not f.label.startswith("hypothesis")},
                 "failures": [asdict(f) for f in fuzz_5xx + fuzz_no_answer][:30]},
        "framing": [asdict(r) for r in framing],
        "slow_clients": slow,
        "restarts": restarts,
        "disconnect": disconnect,
        "corrupt_ssd": ssd,
        "overload": overloaded,
        "held_at_end": held,
        "staging_holders_at_end": end.get("holders", {}),
        "down_at_end": end.get("down", {}),
        "server_log": scan_log(cfg.log_path),
        "conductor": {k: stats.get(k) for k in ("requests_accepted", "requests_rejected", "requests_failed",
                                                "requests_moved", "rejections_by_reason", "supervised", "pool")},
        "must_be_zero": must_be_zero,
        "ok": not any(must_be_zero.values()),
    }


def _new_rows(report: dict[str, Any], row: Callable[..., str]) -> list[str]:
    """The rows of issue 31's scenarios that ran: ten restarts, a mass disconnect, a corrupt SSD
    object, a frozen pool node."""
    lines = []
    if restarts := report.get("restarts"):
        lines.append(f"fault: {restarts['restarts']} kill -9 restarts of a decode instance, after "
                     f"{restarts.get('warmup_restarts', 0)} to warm up ({restarts['killed_busy']} killed holding a "
                     f"request), each back in {restarts['restart_s']} s")
        lines += [row(f"  survivors' {LABELS[fig]} (summed), before -> after", f"{b} -> {a}")
                  for fig, (b, a) in restarts["totals"].items()]
        lines.append(row("  survivor figures grown beyond tolerance", report["must_be_zero"][RESTART_GROWTH],
                         RESTART_GROWTH))
        lines += [f"    grown: {g}" for g in restarts["grown"]] + [f"    survivor lost: {s}" for s in
                                                                      restarts["survivors_lost"]]
    if disconnect := report.get("disconnect"):
        lines.append(f"fault: mass disconnect of {disconnect['streams']} streams and {disconnect['prompts']} prompts "
                     f"of a few thousand tokens: {disconnect['streams_dropped_mid_decode']} streams dropped "
                     f"mid-decode, {disconnect['prompts_abandoned_before_first_token']} prompts before their "
                     f"first token")
        lines.append(row("  everything held back to before, s after they left", disconnect["released_s"]))
        lines.append(row("  still held 5 s after they left", report["must_be_zero"][DISCONNECT_HELD], DISCONNECT_HELD))
        lines.append(row(f"  prompt tokens computed in the {disconnect['watched_s']:g} s after that",
                         report["must_be_zero"][DISCONNECT_TOKENS], DISCONNECT_TOKENS))
    if ssd := report.get("corrupt_ssd"):
        lines.append(f"fault: corrupt SSD object ({ssd['files_corrupted']} object files with a flipped byte): its "
                     f"prompt again: HTTP {ssd['status']} in {ssd['latency_s']} s, same text: {ssd['same_text']}")
        lines.append(row("  corrupt SSD reads counted (corrupt_ssd_reads)", ssd["corrupt_ssd_reads"]))
        lines.append(row("  its prompt served wrong (not 200, another text)", report["must_be_zero"][SSD_WRONG],
                         SSD_WRONG))
        lines.append(row("  corrupt read not counted", report["must_be_zero"][SSD_UNCOUNTED], SSD_UNCOUNTED))
    if over := report.get("overload"):
        lines.append(f"fault: {over['offered_rps']} req/s for {over['seconds']:g} s, ten times the "
                     f"{over['sustainable_rps']} the cluster sustains ({over['sent']} sent: {over['statuses']})")
        lines += [row(f"  private memory (RssAnon) of {name}, rest -> peak MiB",
                      f"{over['rest_mib'][name]} -> {over['peak_mib'][name]} (+{above})")
                  for name, above in over["above_rest_mib"].items()]
        lines.append(row(f"  processes more than {over['bound_mib']} MiB above rest",
                         report["must_be_zero"][OVERLOAD_MEMORY], OVERLOAD_MEMORY))
        lines.append(row("  answers neither 200 nor 429 with Retry-After", report["must_be_zero"][OVERLOAD_UNCLEAR],
                         OVERLOAD_UNCLEAR))
    for f in report["faults"]:
        if frozen := f.get("frozen_node"):
            lines.append(f"fault: frozen pool node: fresh long prompts {frozen['baseline_s']} s before, "
                         f"{frozen['frozen_s']} s while frozen (bound {frozen['bound_s']} s)")
            lines.append(row("  segment timeouts / segments passed over",
                             f"{frozen['segment_timeouts']}/{frozen['segments_passed_over']}"))
            lines.append(row("  prompts slower than the bound", frozen["slowed"], FROZEN_SLOW))
            lines.append(row("  frozen, and no pool call ran into it", frozen["node_never_asked"], FROZEN_UNASKED))
    return lines


def _p50(values: list[float]) -> float | None:
    return round(float(np.median(values)), 2) if values else None


def scan_log(path: Path) -> dict[str, Any]:
    """Unhandled exceptions the server logged (some reach no client: one that left mid-body), with
    the first few messages."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {"unhandled": 0, "samples": []}
    hits = [line for line in lines if "unhandled error on" in line]
    return {"unhandled": len(hits), "samples": hits[:10]}


def format_table(report: dict[str, Any]) -> str:
    w, v = 58, 10
    req = report["requests"]
    fuzz = report["fuzz"]
    must = report["must_be_zero"]

    def row(label: str, value: Any, must_key: str | None = None) -> str:
        mark = ""
        if must_key is not None:
            mark = "  must be 0" + ("" if not must[must_key] else "  <-- FAIL")
        return f"{label:<{w}}{value!s:>{v}}{mark}"

    statuses = sorted((k for k in req if k.startswith("http ")), key=lambda k: int(k.split()[1]))
    lines = ["=" * (w + v + 22), f"{'Chaos benchmark':^{w + v}}", "=" * (w + v + 22),
             row("well-formed requests sent", req.get("sent", 0)),
             row("  completed", req.get(COMPLETED, 0))]
    lines += [row(f"  clear error: HTTP {k.split()[1]}", req[k]) for k in statuses]
    lines += [
        row("  clear error: stream error event", req.get(STREAM_ERROR, 0)),
        row("  429/503 without Retry-After", report["missing_retry_after"]),
        row("  no clear answer (dropped, truncated, odd body)", must["requests with no clear answer"],
            "requests with no clear answer"),
        row("hung (no answer within the deadline)", must["hung requests"], "hung requests"),
        row("completed with text != the greedy answer", must["completed with a different text"],
            "completed with a different text"),
        row("lost while a healthy instance of their role was up", must[LOST], LOST),
        row("  (a 5xx or an error event; 2 instances per role, 1 faulted)", ""),
        row("healthy instances marked down (Conductor /stats)", must[MARKED_DOWN], MARKED_DOWN),
        row("requests moved to another instance (Conductor)", report.get("requests_moved")),
        row(f"long prompts (~{report['config'].get('long_words')} words, "
            f"{report['config'].get('long_clients')} clients): sent/completed",
            f"{report['long_prompts']['sent']}/{report['long_prompts']['completed']}"),
        row("front (Conductor) process peak memory, VmHWM MiB", report["front_memory"]["peak_mib"]),
        row("malformed requests sent (fuzz + bad framing)", fuzz["sent"] + len(report["framing"])),
    ]
    lines += [row(f"  answered HTTP {s}", n) for s, n in sorted(fuzz["by_status"].items())]
    lines += [
        row("  5xx to malformed input", must["5xx answers to malformed input"], "5xx answers to malformed input"),
        row("  503: the cluster was not serving (not counted above)", fuzz["unavailable"]),
        row("  500: the engine failed on a valid body (not counted above)", fuzz["engine_failed"]),
        row("  dropped without an answer", must["malformed requests dropped unanswered"],
            "malformed requests dropped unanswered"),
    ]
    for f in report["faults"]:
        if "summary" in f:
            what = f["summary"] if f.get("recovered") else f"NOT recovered: {f['summary']}"
            lines.append(f"fault: {f['kind']} {f['role']} (pid {f['old_pid']}): {what}")
            continue
        if f["kind"] == "kill -9":
            what = (f"restarted in {f.get('restart_s')} s, served {f.get('served_after_s')} s later"
                    if f.get("recovered") else "NOT recovered")
        else:
            what = (f"up again in {f.get('up_again_s')} s, served {f.get('served_after_s')} s later"
                    if f.get("recovered") else "NOT recovered")
        lines.append(f"fault: {f['kind']} {f['role']} (pid {f['old_pid']} -> {f.get('new_pid')}): {what}")
    lines += _new_rows(report, row)
    lines.append(f"fault: partition of one instance: {report.get('partition')}")
    lines.append(f"fault: late KV writer: {report.get('late_writer')}")
    huge = report.get("huge_body") or {}
    if huge:
        lines.append(f"fault: unsigned {huge['bytes'] / 2**30:g} GiB body to /cluster/register: HTTP {huge['status']} "
                     f"after {huge['sent_before_refusal_mib']} MiB sent; Conductor VmHWM {huge['vmhwm_before_mib']} -> "
                     f"{huge['vmhwm_after_mib']} MiB")
    lines.append(row("  unsigned huge control body not refused", must[HUGE], HUGE))
    stale = report.get("stale_epoch") or {}
    if stale:
        lines.append("fault: control calls to " + stale["instance"] + ": " +
                     "; ".join(f"{label} -> {status}" for label, status in stale["calls"].items()))
    lines.append(row("  stale, replayed or altered control calls accepted", must[STALE], STALE))
    lines += [
        row("faults not recovered", must["faults not recovered"], "faults not recovered"),
        row("slow-client checks failed", must["slow-client checks failed"], "slow-client checks failed"),
        row("scenarios that failed to run", must["scenarios that failed to run"], "scenarios that failed to run"),
        row("blocks/reservations/staging held at the end", must["resources held at the end"],
            "resources held at the end"),
        row("instances not up at the end", must["instances not up at the end"], "instances not up at the end"),
        row("unhandled exceptions in the server log", report["server_log"]["unhandled"]),
        "=" * (w + v + 22),
        "RESULT: " + ("OK, every must-be-0 row is 0" if report["ok"] else
                      "FAIL: " + ", ".join(k for k, n in must.items() if n)),
    ]
    for phase, counts in report["by_phase"].items():
        lines.append(f"phase {phase}: " + ", ".join(f"{k} {n}" for k, n in sorted(counts.items())))
    for e in report["scenario_errors"]:
        lines.append(f"scenario error: {e}")
    for label, why in report["down_at_end"].items():
        lines.append(f"down at the end: {label}: {why}")
    for label, per in report["held_at_end"].items():
        lines.append(f"held at the end by {label}: {per}")
    for label, per in report["staging_holders_at_end"].items():
        lines.append(f"  staging held by (owner, seconds held) on {label}: {per}")
    for f in report["fuzz"]["failures"][:10]:
        lines.append(f"fuzz failure: {f['label']} -> {f['status'] or f['result']}: POST {f['path']} "
                     f"{f['body'][:300]}")
    for wt in report["wrong_texts"][:5]:
        lines.append(f"different text: {wt}")
    for lost in report["lost"][:10]:
        lines.append(f"lost: {lost}")
    for down in report["marked_down"][:10]:
        lines.append(f"healthy instance marked down: {down}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- entry points
