"""Single-stream speed: prefill and decode tokens per second at batch 1, per precision, beside
llama.cpp on the same GGUF file.

Run with ``python -m bench.single`` (``--help`` for the flags). One prompt of ``--prompt-len``
random tokens, then ``--decode-len`` greedy tokens (EOS ignored), with ``--threads`` threads, the
best of ``--rounds``, the configurations' rounds taken in turn (one engine each, loaded first):

* prefill tok/s: the prompt's tokens over the time to its first token;
* decode tok/s: the tokens after the first over the time they took.

Our configurations (``--configs``): ``DTYPE`` or ``DTYPE:QUANT`` (``int8`` or ``int4``
weight-only), or ``default`` (what ``python -m server`` runs on CPU: int4 weights, with bfloat16
activations where the CPU has bfloat16 units and float32 ones where it has not).
llama.cpp
(``llama-cpp-python``, an optional extra: ``pip install -e ".[llamacpp]"``, which builds it from
source) runs the default model's own Q4_1 GGUF, the file our float weights were dequantized
from; without it installed its row is left out and the ratios are against our first
configuration. Targets (issue 15): decode at least llama.cpp's in the default precision,
prefill at least 3x.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch

from bench import isa
from bench.precision import precision_kwargs
from bench.transfer import format_table
from engine import SamplingParams
from engine.config import EngineConfig
from engine.default_model import default_gguf_path
from engine.llm_engine import LLMEngine


@dataclass
class Speed:
    name: str
    prefill_tok_s: float
    decode_tok_s: float
    profile: str = ""


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def ours(configs: list[str], prompt_len: int, decode_len: int, threads: int, rounds: int,
         model: str | None = None) -> list[Speed]:
    """Each configuration's best prefill and decode over ``rounds`` timed rounds (after one untimed),
    the configurations' rounds taken in turn, so that a shared machine's slow spells fall on all
    of them alike rather than on whichever ran then."""
    engines = []
    for config in configs:
        engine_cfg = EngineConfig(**precision_kwargs(config), model=model, threads=threads, kv_cache_gib=0.25,
                                  max_num_batched_tokens=max(512, prompt_len))
        name = f"default ({engine_cfg.dtype}:{engine_cfg.quantization})" if config == "default" else config
        engines.append((name, LLMEngine(engine_cfg)))
    best = {name: [0.0, 0.0] for name, _ in engines}
    for r in range(rounds + 1):  # the first round warms up, untimed
        for name, engine in engines:
            prompt = _prompt(prompt_len, engine.model_config.vocab_size, seed=r)
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=decode_len + 1, ignore_eos=True),
                               request_id=f"r{r}")
            started = time.perf_counter()
            first = None
            while engine.has_unfinished():
                engine.step()
                if first is None:
                    first = time.perf_counter()
            done = time.perf_counter()
            if r:
                best[name][0] = max(best[name][0], prompt_len / (first - started))
                best[name][1] = max(best[name][1], decode_len / (done - first))
    return [Speed(name, *best[name], decode_profile(engine, prompt_len)) for name, engine in engines]


def decode_profile(engine: LLMEngine, prompt_len: int, steps: int = 32) -> str:
    """Where a batch-1 decode step's time goes: ATen calls per step (torch's profiler), and the
    milliseconds per step of the model's forward without its LM head, the LM head, and the rest
    of the step (scheduling, metadata, sampling), timed around those calls."""
    engine.add_request(_prompt(prompt_len, engine.model_config.vocab_size, seed=99),
                       SamplingParams(temperature=0, max_tokens=2 * steps + 2, ignore_eos=True), request_id="profile")
    engine.step()  # the prefill
    model = engine.runner.model
    head = model.lm_head
    # A quantized head is a callable of its own, timed by standing a timed one in its place; a
    # float head (a tensor, or the tied embedding) is one matmul inside the forward.
    timed_head = head is not None and not isinstance(head, torch.Tensor)
    spent = {"forward": 0.0, "head": 0.0}
    forward = model.forward

    def timed(key: str, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - t
        return run

    model.forward = timed("forward", forward)
    if timed_head:
        model.lm_head = timed("head", head)
    try:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - started) / steps
    finally:
        del model.forward
        if timed_head:
            model.lm_head = head
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    calls = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) / steps
    per = {k: v / steps * 1e3 for k, v in spent.items()}
    parts = (f"decoder layers {per['forward'] - per['head']:.2f}, LM head {per['head']:.2f}" if timed_head
             else f"decoder layers and the (float) LM head {per['forward']:.2f}")
    return (f"{calls:.0f} ATen calls a decode step; per step {step_s * 1e3:.2f} ms: {parts}, "
            f"the rest (scheduling, metadata, sampling) {step_s * 1e3 - per['forward']:.2f}")


def llama_cpp(prompt_len: int, decode_len: int, threads: int, rounds: int) -> Speed | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(default_gguf_path()), n_ctx=prompt_len + decode_len + 16, n_threads=threads,
                n_threads_batch=threads, n_batch=max(512, prompt_len), verbose=False)
    best_prefill = best_decode = 0.0
    for r in range(rounds + 1):
        prompt = _prompt(prompt_len, llm.n_vocab(), seed=r)
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        first = time.perf_counter()
        for _ in range(decode_len):
            token = int(llm.scores[llm.n_tokens - 1].argmax())  # greedy, as ours
            llm.eval([token])
        done = time.perf_counter()
        if r:
            best_prefill = max(best_prefill, prompt_len / (first - started))
            best_decode = max(best_decode, decode_len / (done - first))
    return Speed("llama.cpp (Q4_1 GGUF)", best_prefill, best_decode)


def report(speeds: list[Speed], baseline: Speed) -> str:
    rows = [[s.name, f"{s.prefill_tok_s:.0f}", f"{s.decode_tok_s:.1f}",
             f"{s.prefill_tok_s / baseline.prefill_tok_s:.2f}x", f"{s.decode_tok_s / baseline.decode_tok_s:.2f}x"]
            for s in speeds]
    return format_table(["configuration", "prefill tok/s", "decode tok/s", f"prefill / {baseline.name}",
                         f"decode / {baseline.name}"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.single", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="float32,bfloat16,bfloat16:int8,default,nondeterministic",
                        help="ours, comma-separated: default, nondeterministic, DTYPE or DTYPE:QUANT")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per configuration, best kept (2)")
    isa.add_argument(parser)
    args = parser.parse_args(argv)
    isa.apply(args)
    torch.set_num_threads(args.threads)
    print(f"batch 1, {args.prompt_len}-token prompt, {args.decode_len} greedy tokens, {args.threads} threads; "
          f"{isa.describe()}", flush=True)
    speeds = []
    reference = llama_cpp(args.prompt_len, args.decode_len, args.threads, args.rounds)
    if reference is None:
        print("llama-cpp-python is not installed: no llama.cpp row", flush=True)
    else:
        speeds.append(reference)
        print(f"  {reference.name}: {reference.prefill_tok_s:.0f} / {reference.decode_tok_s:.1f} tok/s", flush=True)
    for speed in ours(args.configs.split(","), args.prompt_len, args.decode_len, args.threads, args.rounds):
        speeds.append(speed)
        print(f"  {speed.name}: {speed.prefill_tok_s:.0f} / {speed.decode_tok_s:.1f} tok/s", flush=True)
    print(report(speeds, speeds[0]))
    for speed in speeds:
        if speed.profile:
            print(f"{speed.name}: {speed.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
