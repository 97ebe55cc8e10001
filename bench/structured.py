"""``python -m bench.structured``: what structured output costs per decode step, and to compile.

* **Per step**: ``--rows`` prompts decoded ``--steps`` tokens at once, plain and held to a
  grammar that stays open the whole run (every step computes a mask for every row), alternated
  ``--repeats`` times; the median time per step of each and their ratio. Two grammars: free text
  (``[a-zA-Z ,.]+``: one lexer state, as inside a JSON string, which llguidance's mask cache
  serves), and text of a bounded length (``{1,2000}``: a new lexer state every token, each mask a
  walk of the whole vocabulary, llguidance's worst case). The issue's goal: under 10% of a
  16-row step.
* **Compile**: the llguidance tokenizer built for the model's vocabulary (once per process), a JSON
  schema compiled cold, and again from the cache; a new request's matcher.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine import LLM, SamplingParams
from engine.structured_output import GrammarCompiler

GRAMMARS = {"free text": "[a-zA-Z ,.]+", "bounded text": "[a-zA-Z ,.]{1,2000}"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "country", "population"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "country": {"type": "string"},
                         "population": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items": {
                             "type": "string", "enum": ["capital", "port", "old", "new"]}}}}


def _step_ms(llm: LLM, rows: int, steps: int, regex: str | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True,
                            structured_outputs={"regex": regex} if regex else None)
    prompts = [f"Write a sentence about the number {i}:" for i in range(rows)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == steps for o in outs), "a row ended early: the measure would be short"
    return elapsed / steps * 1e3


def _compile_ms(llm: LLM) -> dict[str, float]:
    grammars = GrammarCompiler(llm.engine.tokenizer)  # a fresh one: nothing built or cached yet
    t0 = time.perf_counter()
    grammars.grammar({"regex": "a"})
    t1 = time.perf_counter()
    grammars.grammar({"json": SCHEMA})
    t2 = time.perf_counter()
    grammars.grammar({"json": json.loads(json.dumps(SCHEMA))})
    t3 = time.perf_counter()
    grammars.matcher({"json": SCHEMA})
    t4 = time.perf_counter()
    return {"tokenizer (once per process)": (t1 - t0) * 1e3, "JSON schema, cold": (t2 - t1) * 1e3,
            "JSON schema, cached": (t3 - t2) * 1e3, "a request's matcher": (t4 - t3) * 1e3}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               "unknown CPU")
    llm = LLM(threads=args.threads)
    print(f"{cpu}, {args.threads} threads, the default model, {args.steps} decode steps, median of {args.repeats}")
    for name, ms in _compile_ms(llm).items():
        print(f"compile: {name}: {ms:.2f} ms")
    for rows in args.rows:
        for regex in GRAMMARS.values():
            _step_ms(llm, rows, 4, regex)  # warm: the native kernels, the grammar cache
        times: dict[str | None, list[float]] = {None: [], **{g: [] for g in GRAMMARS}}
        for _ in range(args.repeats):
            times[None].append(_step_ms(llm, rows, args.steps, None))
            for name, regex in GRAMMARS.items():
                times[name].append(_step_ms(llm, rows, args.steps, regex))
        plain = statistics.median(times[None])
        held = ", ".join(f"{name} {statistics.median(times[name]):.2f} ms "
                         f"(+{(statistics.median(times[name]) - plain) / plain * 100:.1f}%)" for name in GRAMMARS)
        print(f"{rows:>3} rows: step {plain:.2f} ms plain; structured: {held}")


if __name__ == "__main__":
    main()
