"""The heap's free memory is bounded while the engine is busy (``engine.cpu_runtime.HeapBound``,
issue 40 item 5): the engine keeps freed step memory for reuse and trims it when idle, but under
steady overload it never idles, and the heap fragmented to 4-5 times the live growth."""

from __future__ import annotations

import os

import pytest
import torch

import engine.cpu_runtime as cpu_runtime
from engine import LLM, SamplingParams
from engine.cpu_runtime import HeapBound, configure_cpu_runtime, heap_free_bytes, return_freed_memory
from tiny_models import make_tiny_model

GLIBC = heap_free_bytes() is not None


def test_a_check_at_most_every_interval_trims_only_past_the_budget(monkeypatch):
    now, free, trims = [0.0], [0], []
    monkeypatch.setattr(cpu_runtime, "heap_free_bytes", lambda: free[0])
    monkeypatch.setattr(cpu_runtime, "return_freed_memory", lambda: trims.append(now[0]))
    bound = HeapBound(budget=100, every_s=1.0, clock=lambda: now[0])
    free[0] = 500
    for t in (0.2, 0.5, 0.9):  # within the first interval: not even measured
        now[0] = t
        bound.after_step()
    assert trims == []
    now[0] = 1.0
    bound.after_step()
    now[0] = 1.5
    bound.after_step()  # still over, but checked 0.5 s ago
    assert trims == [1.0] and bound.trims == 1
    free[0] = 100  # at the budget: kept
    now[0] = 2.1
    bound.after_step()
    assert trims == [1.0]
    monkeypatch.setattr(cpu_runtime, "heap_free_bytes", lambda: None)  # not glibc: nothing to go by
    now[0] = 5.0
    bound.after_step()
    assert trims == [1.0]


@pytest.mark.skipif(not GLIBC or not os.path.exists("/proc/self/status"), reason="glibc >= 2.33 and /proc")
def test_free_memory_past_the_budget_goes_back():
    threads = torch.get_num_threads()
    configure_cpu_runtime(threads)  # the heap keeps what is freed, as in the engine
    return_freed_memory()
    block = b"x" * (256 << 20)
    del block
    assert heap_free_bytes() >= 200 << 20
    HeapBound(budget=64 << 20, every_s=0.0).after_step()
    assert heap_free_bytes() < 64 << 20


def test_the_engine_checks_the_heap_after_each_step(tmp_path, monkeypatch):
    checks = []
    monkeypatch.setattr(HeapBound, "after_step", lambda self: checks.append(1))
    llm = LLM(str(make_tiny_model(tmp_path / "m", "LlamaForCausalLM", tie=True, seed=1)), threads=1,
              kv_cache_gib=0.01, dtype="float32")
    assert isinstance(llm.engine.heap, HeapBound) and llm.engine.heap.budget == 64 << 20
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(checks) >= 4  # a step for the prompt, then one per token
    off = LLM(str(tmp_path / "m"), threads=1, kv_cache_gib=0.01, dtype="float32", busy_heap_free_mib=None)
    assert off.engine.heap is None  # kept until idle, as before
    with pytest.raises(ValueError, match="busy_heap_free_mib"):
        LLM(str(tmp_path / "m"), threads=1, kv_cache_gib=0.01, dtype="float32", busy_heap_free_mib=-1)
