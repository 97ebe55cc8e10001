"""bench.disagg: workloads, SLO derivation, goodput / rejection accounting, report (no model)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import pytest

from bench import disagg, serving
from bench.serving import RequestResult

from tests.test_bench_serving import fake_server  # noqa: F401  (fixture)


def test_shared_prefix_workload_deterministic_and_shared():
    kw = dict(num_prefixes=3, prefix_len=40, suffix_len=(5, 9), output_len=(2, 4), rate=5.0,
              vocab_size=1000)
    a = disagg.shared_prefix_requests(30, seed=1, **kw)
    b = disagg.shared_prefix_requests(30, seed=1, **kw)
    c = disagg.shared_prefix_requests(30, seed=2, **kw)
    assert [(r.prompt, r.output_len, r.arrival_s) for r in a] == \
           [(r.prompt, r.output_len, r.arrival_s) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    prefixes = disagg.make_prefixes(3, 40, 1000, seed=1)
    assert len({tuple(p) for p in prefixes}) == 3
    heads = [tuple(r.prompt[:40]) for r in a]
    assert set(heads) == {tuple(p) for p in prefixes}  # each prefix used, nothing else
    assert max(heads.count(h) for h in set(heads)) > 1  # really shared
    suffixes = [tuple(r.prompt[40:]) for r in a]
    assert len(set(suffixes)) == len(suffixes)  # suffixes are per request
    assert all(45 <= len(r.prompt) <= 49 and 2 <= r.output_len <= 4 for r in a)
    assert all(100 <= t < 1000 for r in a for t in r.prompt)
    arr = [r.arrival_s for r in a]
    assert arr[0] == 0 and arr == sorted(arr) and arr == serving.arrival_times(30, 5.0, 1.0, 1)


def test_unloaded_requests_distinct_prompts():
    reqs = disagg.unloaded_requests(4, 16, 8, vocab_size=500, seed=0)
    assert len({tuple(r.prompt) for r in reqs}) == 4  # no prefix-cache hits between them
    assert all(len(r.prompt) == 16 and r.output_len == 8 and r.arrival_s == 0 for r in reqs)


def _res(ttft_s: float, gaps: list[float], *, ok: bool = True, status: int = 200,
         t0: float = 100.0) -> RequestResult:
    r = RequestResult(prompt_len=10, output_len=len(gaps) + 1, send_time=t0, status=status)
    if not ok:
        r.rejected = status == 429
        r.error = f"HTTP {status}"
        r.end_time = t0 + 0.01
        return r
    t = t0 + ttft_s
    r.first_token_time = t
    r.chunk_times = [t]
    for g in gaps:
        t += g
        r.chunk_times.append(t)
    r.end_time = t
    r.output_tokens = len(r.chunk_times)
    r.success = True
    return r


def test_unloaded_values_and_slo_derivation():
    results = [_res(0.10, [0.02] * 9), _res(0.30, [0.02] * 8 + [0.05]), _res(0.20, [0.03] * 9),
               _res(0, [], ok=False, status=500)]
    u = disagg.unloaded_values(results)
    assert u["n"] == 3
    assert u["ttft_ms"] == pytest.approx(200.0)
    # per-request TBT = the longest of 9 gaps (10% rounded up to 1): 20, 50, 30 -> median 30
    assert u["tbt_ms"] == pytest.approx(30.0)
    slos = disagg.derive_slos(u)
    assert (slos["ttft_ms"], slos["tbt_ms"]) == pytest.approx((2000.0, 150.0))
    assert "colocated" in slos["ttft_from"]
    over = disagg.derive_slos(u, slo_ttft_ms=500, ttft_factor=3, tbt_factor=2)
    assert (over["ttft_ms"], over["tbt_ms"]) == pytest.approx((500.0, 60.0))
    assert over["ttft_from"] == "given"
    assert disagg.derive_slos(None, slo_ttft_ms=1, slo_tbt_ms=2)["tbt_ms"] == 2
    with pytest.raises(ValueError):
        disagg.derive_slos(None, slo_ttft_ms=1)
    with pytest.raises(RuntimeError):
        disagg.unloaded_values([_res(0, [], ok=False, status=429)])


def test_goodput_and_rejection_accounting_and_table():
    slo = dict(slo_ttft_ms=500.0, slo_tbt_ms=100.0)
    colo = [_res(0.1, [0.05] * 5), _res(0.2, [0.05] * 5), _res(0.9, [0.05] * 5),  # late TTFT
            _res(0.1, [0.05] * 4 + [0.3]),  # TBT miss
            _res(0, [], ok=False, status=429), _res(0, [], ok=False, status=429),
            _res(0, [], ok=False, status=500)]
    m = serving.compute_metrics(colo, 10.0, **slo)
    s = disagg.summarize(m)
    assert (s["sent"], s["completed"], s["rejected"], s["failed"]) == (7, 4, 2, 1)
    assert s["goodput"] == pytest.approx(2 / 10.0)  # rejected and failed count as misses
    assert s["slo_attainment"] == pytest.approx(2 / 7)
    assert s["throughput"] == pytest.approx(4 / 10.0)
    assert s["tbt_p90_ms"] > 100.0 and s["ttft_p90_ms"] > s["ttft_p50_ms"]

    dis = [_res(0.1, [0.02] * 5) for _ in range(5)] + [_res(0, [], ok=False, status=429)] * 2
    sd = disagg.summarize(serving.compute_metrics(dis, 10.0, **slo))
    assert (sd["completed"], sd["rejected"], sd["failed"]) == (5, 2, 0)
    summaries = {"colocated": {"poisson": s}, "disaggregated": {"poisson": sd}}
    c = disagg.compare(summaries, "poisson")
    assert c["goodput"] == pytest.approx(2.5)
    assert c["tbt_p90"] == pytest.approx(sd["tbt_p90_ms"] / s["tbt_p90_ms"])
    assert disagg.compare(summaries, "trace") == {"goodput": None, "tbt_p90": None}
    assert disagg.ratio(1.0, 0.0) is None

    slos = disagg.derive_slos({"ttft_ms": 50.0, "tbt_ms": 20.0})
    table = disagg.format_table(summaries, slos, {"colocated": {"ttft_ms": 50.0, "tbt_ms": 20.0}})
    assert "poisson: disaggregated/colocated goodput = 2.50x, TBT p90 ratio = " in table
    assert "| poisson | colocated | 7 | 4 | 2 | 1 | 0.200 | 28.6% |" in table
    assert "TTFT <= 500.0 ms" in table and "TBT <= 100.0 ms" in table
    rows = [ln for ln in table.splitlines() if ln.startswith("| poisson")]
    header = next(ln for ln in table.splitlines() if ln.startswith("| workload"))
    assert all(r.count("|") == header.count("|") for r in rows)
    # one deployment only: no ratio line
    assert "goodput =" not in disagg.format_table({"colocated": {"poisson": s}})


def test_server_command_and_optional_flags(tmp_path):
    cmd = disagg.server_command("colocated", 1234, python="py", extra=["--max-waiting=4"])
    assert cmd[:7] == ["py", "-m", "server", "--host", "127.0.0.1", "--port", "1234"]
    assert cmd[7:] == [*disagg.DEPLOYMENTS["colocated"], "--max-waiting=4"]
    dropped = disagg.server_command("colocated", 1, drop_flags=["--mode"])
    assert "--mode" not in dropped and "colocated" not in dropped[1:]
    assert disagg.flag_listed("--mode", "  --mode {colocated,disaggregated}")
    assert not disagg.flag_listed("--mode", "  --model MODEL")
    args = disagg.build_parser().parse_args(["--workloads", "poisson", "--deployments",
                                             "disaggregated,colocated", "--disagg-args",
                                             "--admission early"])
    assert args.workloads == ["poisson"] and args.deployments == ["disaggregated", "colocated"]
    with pytest.raises(SystemExit):
        disagg.build_parser().parse_args(["--workloads", "bogus"])


def test_unloaded_and_workload_against_fake_server(fake_server):  # noqa: F811
    url, state = fake_server
    state["reject_first"] = 0
    ureqs = disagg.unloaded_requests(3, 8, 4, vocab_size=500)
    res, _, _ = asyncio.run(serving.run_benchmark(url, ureqs, max_concurrency=1, progress=False))
    u = disagg.unloaded_values(res[1:])
    assert u["n"] == 2 and u["ttft_ms"] > 0 and u["tbt_ms"] > 0
    state["reject_first"] = state["count"] + 2  # the next two requests get 429
    reqs = disagg.shared_prefix_requests(6, num_prefixes=2, prefix_len=8, suffix_len=(1, 3),
                                         output_len=(2, 3), rate=500.0, vocab_size=500)
    res, dur, _ = asyncio.run(serving.run_benchmark(url, reqs, progress=False))
    s = disagg.summarize(serving.compute_metrics(res, dur, slo_ttft_ms=60_000, slo_tbt_ms=60_000))
    assert (s["completed"], s["rejected"], s["failed"]) == (4, 2, 0)
    assert s["goodput"] == pytest.approx(4 / dur)
    json.dumps(serving.result_records(res))


def test_slo_scales_repeats_and_best_peer():
    slos = disagg.derive_slos({"ttft_ms": 50.0, "tbt_ms": 20.0})  # 500 / 100 ms
    ok, slow = _res(0.1, [0.07] * 5), _res(0.7, [0.07] * 5)  # TTFT 100 / 700 ms, TBT 70 ms
    by_scale = disagg.judge([ok, slow, _res(0, [], ok=False, status=429)], 10.0, slos, [0.5, 1.0, 2.0])
    assert [by_scale[k]["goodput"] for k in ("0.5", "1.0", "2.0")] == pytest.approx([0.0, 0.1, 0.2])

    runs = [{"1.0": {"goodput": g}} for g in (0.3, 0.1, 0.2)]
    assert disagg.goodput_spread(runs) == {"1.0": {"median": 0.2, "min": 0.1, "max": 0.3}}
    med = disagg.median_summary([by_scale["1.0"], by_scale["2.0"], by_scale["2.0"]])
    assert med["goodput"] == pytest.approx(0.2) and med["completed"] == 2
    assert isinstance(med["rejected"], int)

    spread = lambda g: {"0.5": {"median": g / 2, "min": 0.0, "max": g}, "1.0": {"median": g, "min": g, "max": g}}
    spreads = {"colocated": {"trace": spread(0.4)}, "disaggregated": {"trace": spread(0.6)},
               "vllm": {"trace": spread(0.2)}, "llama-server": {"trace": spread(0.3)}}
    v = disagg.versus_best_peer(spreads, "trace", "1.0")
    assert v["peer"] == "llama-server" and v["ratio"] == pytest.approx(2.0)
    assert disagg.versus_best_peer({"disaggregated": spreads["disaggregated"]}, "trace", "1.0") is None
    table = disagg.format_goodput_table(spreads, [0.5, 1.0], 3)
    assert "| trace | vllm | 0.100 (0.000-0.200) | 0.200 (0.200-0.200) |" in table
    assert "trace @ 1x SLOs: disaggregated / best peer (llama-server) goodput = 2.00x" in table
    assert "over 3 run(s)" in table

    parse = disagg.build_parser().parse_args
    assert parse(["--slo-scales", "2,0.5"]).slo_scales == [0.5, 1.0, 2.0]  # 1 always in
    for bad in ("0", "-1", "x", "inf"):
        with pytest.raises(SystemExit):
            parse(["--slo-scales", bad])


def test_peer_commands_and_missing_peers(tmp_path):
    from bench import peers

    v = peers.vllm_command("/v/python", 8001, model_dir=tmp_path, served_name="m", dtype="float32", threads=2)
    assert v.cmd[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert v.cmd[v.cmd.index("--port") + 1] == "8001" and v.cmd[v.cmd.index("--dtype") + 1] == "float32"
    assert v.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and v.env["HF_HUB_OFFLINE"] == "1"
    binary = tmp_path / "bin" / "llama-server"
    ls = peers.llama_server_command(binary, 8002, gguf=tmp_path / "m.gguf", served_name="m", threads=2,
                                    slots=8, ctx=65536)
    assert ls.cmd[0] == str(binary) and ls.cmd[ls.cmd.index("-np") + 1] == "8"
    assert ls.env["LD_LIBRARY_PATH"].split(":")[0] == str(binary.parent)

    args = disagg.build_parser().parse_args(["--deployments", "colocated,vllm,llama-server",
                                             "--llama-server", str(binary)])
    args.vllm_python = None
    with pytest.raises(SystemExit, match="--vllm-python.*llama-server: .* does not exist"):
        peers.check_peers(["vllm", "llama-server"], args)
    peers.check_peers([], args)  # no peer asked for: nothing to check


def test_help():
    out = subprocess.run([sys.executable, "-m", "bench.disagg", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--deployments" in out.stdout and "--slo-tbt-ms" in out.stdout


def test_shifting_workload_phases_lengths_and_judging():
    args = disagg.build_parser().parse_args(["--workloads", "shifting", "--phases", "prefill,decode,prefill",
                                             "--phase-s", "20", "--prefill-phase", "400", "4", "2",
                                             "--decode-phase", "40", "80", "3"])
    phases = disagg.build_phases(args)
    assert [(p.name, p.duration_s, p.rate, p.prompt_len, p.output_len) for p in phases] == [
        ("prefill", 20.0, 2.0, 400, 4), ("decode", 20.0, 3.0, 40, 80), ("prefill", 20.0, 2.0, 400, 4)]
    reqs = disagg.build_workloads(args)["shifting"]
    assert reqs == disagg.shifting_requests(phases, seed=0)  # deterministic
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < 60
    by_phase = [[r for r in reqs if disagg.phase_of(r.arrival_s, phases) == i] for i in range(3)]
    assert all(25 <= len(p) <= 70 for p in by_phase)  # ~40, ~60, ~40 arrivals
    for p, (plen, olen) in zip(by_phase, [(400, 4), (40, 80), (400, 4)]):
        assert all(0.75 * plen - 1 <= len(r.prompt) <= 1.25 * plen + 1 for r in p)
        assert all(0.75 * olen - 1 <= r.output_len <= 1.25 * olen + 1 for r in p)
    assert len({tuple(r.prompt[:16]) for r in reqs}) == len(reqs)  # no shared prefix
    # Judged phase by phase: the decode phase's slow requests miss, the others meet the SLOs.
    slos = disagg.derive_slos({"ttft_ms": 50.0, "tbt_ms": 20.0})  # 500 / 100 ms
    results = [_res(0.1, [0.05] * 3) if disagg.phase_of(r.arrival_s, phases) != 1 else _res(0.1, [0.3] * 3)
               for r in reqs]
    judged = disagg.judge_phases(reqs, results, phases, slos)
    assert [j["phase"] for j in judged] == ["prefill", "decode", "prefill"]
    assert [j["sent"] for j in judged] == [len(p) for p in by_phase]
    assert [j["slo_attainment"] for j in judged] == [1.0, 0.0, 1.0]
    assert judged[0]["goodput"] == pytest.approx(len(by_phase[0]) / 20)
    with pytest.raises(ValueError):
        disagg.shifting_requests([disagg.Phase("decode", 10, 0.0, 10, 10)])
    with pytest.raises(SystemExit):
        disagg.build_parser().parse_args(["--phases", "prefill,bogus"])


def test_elastic_deployments_get_the_slos_and_are_set_against_their_fixed_split():
    assert disagg.fixed_split_of("elastic-2p1d") == "split-2p1d" and disagg.fixed_split_of("split-2p1d") is None
    elastic, fixed = disagg.DEPLOYMENTS["elastic-2p1d"], disagg.DEPLOYMENTS["split-2p1d"]
    assert elastic[:len(fixed)] == fixed and "--elastic-roles" in elastic  # the same processes, moved
    assert any(f in elastic for f in disagg.NEEDS_SLOS) and not any(f in fixed for f in disagg.NEEDS_SLOS)
    s = {"sent": 10, "completed": 10, "rejected": 0, "failed": 0, "goodput": 0.5, "slo_attainment": 1.0,
         "ttft_p50_ms": 1.0, "ttft_p90_ms": 1.0, "tbt_p90_ms": 1.0, "throughput": 1.0, "output_throughput": 1.0,
         "duration_s": 1.0}
    table = disagg.format_table({"split-2p1d": {"shifting": s}, "elastic-2p1d": {"shifting": {**s, "goodput": 0.7}}})
    assert "shifting: elastic-2p1d/split-2p1d goodput = 1.40x" in table
    runs = [{"phases": [{"phase": "prefill", "sent": 4, "completed": 4, "rejected": 0, "failed": 0, "slo_attainment": 0.5,
                         "goodput": 0.1, "ttft_p90_ms": 900.0, "tbt_p90_ms": 50.0}],
             "roles": [{"t": 0.0, "prefill": 2, "decode": 1, "switching": None},
                       {"t": 31.0, "prefill": 1, "decode": 1, "switching": "http://x"}]}]
    phases = disagg.format_phase_table({"elastic-2p1d": {"workloads": {"shifting": {"runs": runs}}},
                                        "colocated": {"workloads": {"trace": {"runs": [{}]}}}})
    assert "| elastic-2p1d | 1: prefill | 4 | 0 | 50.0% | 0.100 | 900 | 50 |" in phases
    assert "2P+1D at 0 s, 1P+1D at 31 s (switching)" in phases and "colocated" not in phases
    assert disagg.format_phase_table({"colocated": {"workloads": {}}}) == ""


def test_role_poller_keeps_each_change_of_the_split(fake_server):  # noqa: F811
    url, _ = fake_server  # answers /stats without instances: nothing to keep
    with disagg.RolePoller(url) as roles:
        time.sleep(0.1)
    assert roles.changes == []
    poller = disagg.RolePoller("http://unused")
    splits = [[("prefill", True), ("prefill", True), ("decode", True)]] * 2 + [
        [("prefill", True), ("prefill", False), ("decode", True)], [("prefill", True), ("decode", True), ("decode", True)]]

    class Http:
        def __init__(self):
            self.n = 0

        def get(self, _url):
            roles = splits[min(self.n, len(splits) - 1)]
            self.n += 1
            return httpx.Response(200, json={"instances": [{"role": r, "up": u} for r, u in roles]})

    http = Http()
    poller._start = time.monotonic()
    for _ in range(5):
        poller._sample(http)
    assert [(c["prefill"], c["decode"]) for c in poller.changes] == [(2, 1), (1, 1), (1, 2)]


def test_a_deployment_that_needs_the_slos_first_is_refused_unless_they_are_given(capsys):
    with pytest.raises(SystemExit) as e:
        disagg.main(["--deployments", "elastic-2p1d", "--workloads", "shifting", "--phase-s", "1"])
    assert "needs the SLOs" in str(e.value) and "--slo-ttft-ms" in str(e.value)
    assert disagg.needs_slos("elastic-2p1d") and disagg.needs_slos("disaggregated-early")
    assert not disagg.needs_slos("split-2p1d") and not disagg.needs_slos("colocated")
