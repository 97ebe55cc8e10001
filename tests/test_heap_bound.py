"""The heap's kept memory is bounded while the engine is busy (``engine.cpu_runtime.HeapBound``,
issue 40 item 5): the engine keeps freed step memory for reuse and trims it when idle, but under
steady overload it never idles, and the heap fragmented to 4-5 times the live growth."""

from __future__ import annotations


import pytest
import torch

import engine.cpu_runtime as cpu_runtime
from engine import LLM, SamplingParams
from engine.cpu_runtime import HeapBound, configure_cpu_runtime, return_freed_memory, rss_anon_bytes
from tiny_models import make_tiny_model

MIB = 1 << 20


def test_a_check_at_most_every_interval_trims_only_past_the_budget(monkeypatch):
    now, rss, trims = [0.0], [1000 * MIB], []

    def trim() -> None:
        trims.append(now[0])
        rss[0] -= 150 * MIB  # what the trim gives back

    monkeypatch.setattr(cpu_runtime, "return_freed_memory", trim)
    bound = HeapBound(budget=100 * MIB, every_s=1.0, clock=lambda: now[0], resident=lambda: rss[0])
    for t in (0.2, 0.5, 0.9):  # within the first interval: not even measured
        now[0] = t
        bound.after_step()
    now[0] = 1.0
    bound.after_step()  # the first check: where the growth counts from
    rss[0] += 300 * MIB
    now[0] = 1.5
    bound.after_step()  # grown, but checked 0.5 s ago
    assert trims == []
    now[0] = 2.0
    bound.after_step()
    assert trims == [2.0] and bound.trims == 1
    rss[0] += 100 * MIB  # at the budget since the trim: kept
    now[0] = 3.0
    bound.after_step()
    assert trims == [2.0]
    rss[0] -= 400 * MIB  # memory went back (the idle trim): the growth counts from there
    now[0] = 4.0
    bound.after_step()
    rss[0] += 120 * MIB
    now[0] = 5.0
    bound.after_step()
    assert trims == [2.0, 5.0]
    now[0] = 7.0
    bound._resident = lambda: None  # nothing to go by
    bound.after_step()
    assert trims == [2.0, 5.0]


@pytest.mark.skipif(rss_anon_bytes() is None or not hasattr(cpu_runtime._glibc(), "malloc_trim"),
                    reason="needs /proc and glibc")
def test_memory_kept_past_the_budget_goes_back():
    threads = torch.get_num_threads()
    configure_cpu_runtime(threads)  # the heap keeps what is freed, as in the engine
    return_freed_memory()
    bound = HeapBound(budget=64 * MIB, every_s=0.0)
    bound.after_step()
    before = rss_anon_bytes()
    block = b"x" * (256 * MIB)  # written, so resident
    del block
    assert rss_anon_bytes() - before > 200 * MIB  # kept by the tuned heap
    bound.after_step()
    assert bound.trims == 1 and rss_anon_bytes() - before < 100 * MIB


def test_the_engine_checks_the_heap_after_each_step(tmp_path, monkeypatch):
    checks = []
    monkeypatch.setattr(HeapBound, "after_step", lambda self: checks.append(1))
    llm = LLM(str(make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=1)), threads=1,
              kv_cache_gib=0.01, dtype="float32")
    assert isinstance(llm.engine.heap, HeapBound) and llm.engine.heap.budget == 64 * MIB
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(checks) >= 4  # a step for the prompt, then one per token
    off = LLM(str(tmp_path / "m"), threads=1, kv_cache_gib=0.01, dtype="float32", busy_heap_free_mib=None)
    assert off.engine.heap is None  # kept until idle, as before
    with pytest.raises(ValueError, match="busy_heap_free_mib"):
        LLM(str(tmp_path / "m"), threads=1, kv_cache_gib=0.01, dtype="float32", busy_heap_free_mib=-1)
