"""Offline throughput benchmark: our engine vs. vLLM-CPU and Hugging Face ``generate``.

Run with ``python -m bench.offline`` (``--help`` for the flags).

Workload (fixed and seeded, so every run and both systems see the same requests):
  * ``--num-prompts`` requests (default 32);
  * each prompt is a list of random token ids in ``[100, vocab_size)`` (low ids, where the
    special tokens live, are avoided), so prompt lengths are exact, drawn uniformly from
    ``--input-len MIN MAX`` (default 32..512);
  * each request's output length is drawn uniformly from ``--output-len MIN MAX``
    (default 32..256), and every request uses ``temperature=0, ignore_eos=True,
    max_tokens=output_len``, so the number of generated tokens is fixed in advance.

Precisions (``--precisions``; by default ``float32,bfloat16,default`` where the CPU multiplies
bfloat16 in hardware and ``float32,default`` where it does not, since emulated bfloat16 runs
several times slower and would make the run take most of an hour): each is ours in that
precision (``default``: what the engine picks on its own, on CPU int4 weights with
bfloat16 or float32 activations, by the CPU;
``DTYPE:QUANT``: weight-only int8/int4) against HF in the same dtype. An HF run is shared by
every precision of its dtype. With quantized weights ours is not at equal precision (HF's
weights stay in the dtype), and the report says so.

Fairness rules:
  * both systems load the SAME converted HF checkpoint folder, with the same
    ``torch.set_num_threads`` value;
  * each system gets one tiny warm-up request first; only the main ``generate`` call(s)
    are timed (``time.perf_counter``), not model loading;
  * our engine gets all requests at once (continuous batching, chunked prefill);
  * HF runs greedy ``generate`` on batches of ``--hf-batch-size`` prompts (default: all in
    one batch), left-padded with pad = eos and an attention mask. Requests in a batch have
    different output lengths, so each batch generates ``max_new_tokens = min_new_tokens =``
    the largest output length in the batch (``min_new_tokens`` keeps EOS from cutting it
    short); only each request's own ``output_len`` tokens count as useful generated tokens,
    which is the throughput a user actually gets;
  * agreement check: the fraction of requests whose first 16 greedy tokens are identical in
    the two systems (reported, not asserted: fp32 batched kernels may differ in the last bits).
Without ``transformers`` (or with ``--skip-hf``) there are no HF figures.

vLLM-CPU (``--vllm-python``, or ``MOONCAKE_VLLM_PYTHON``: the interpreter of a virtual
environment holding ``vllm-cpu``, see bench/README.md) runs the same workload in ``--vllm-dtype``
(float32, or bfloat16 where vLLM-CPU is fastest) on the same folder and thread count, in its own
process (``bench/vllm_offline.py``); every row of ours is then also given as a ratio to it. Without it that column is left out and the report says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import sys
import time

from bench import isa

AGREE_PREFIX = 16
MIN_TOKEN_ID = 100


def agreement(ours: list[list[int]], theirs: list[list[int]], out_lens: list[int]) -> int:
    """How many requests have the same first ``AGREE_PREFIX`` tokens (or all, if fewer) in both."""
    return sum(a[:min(AGREE_PREFIX, n)] == b[:min(AGREE_PREFIX, n)] for a, b, n in zip(ours, theirs, out_lens))


def kernels_requirement(requirements: list[str]) -> str | None:
    """The unconditional requirement on PyPI's ``kernels`` among a distribution's, if any."""
    for r in requirements:
        name, rest = re.match(r"([A-Za-z0-9._-]+)\s*(.*)", r).groups()
        if name.lower() == "kernels" and "extra ==" not in rest:
            return r
    return None


def check_transformers_loads_models() -> None:
    """transformers 5 loads no model without PyPI's ``kernels`` (it asks for it), which has the
    import name of our kernels/: say so, rather than its own "Kernels are not available"."""
    import importlib.metadata

    import transformers

    needed = kernels_requirement(importlib.metadata.requires("transformers") or [])
    if needed is None:
        return
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"transformers {transformers.__version__} requires PyPI's `kernels` ({needed}), Hugging Face's "
            f"kernel hub, which this environment lacks (removed to make way for this project's kernels/?). "
            f"The two share the import name `kernels` but no longer clash: ours installs as "
            f"`mooncake_kernels` (docs/engine.md#the-name-kernels). Install it: pip install '{needed}'") from None


def build_workload(num_prompts, input_len, output_len, vocab_size, seed):
    rng = random.Random(seed)
    prompts, out_lens = [], []
    for _ in range(num_prompts):
        n_in = rng.randint(input_len[0], input_len[1])
        prompts.append([rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n_in)])
        out_lens.append(rng.randint(output_len[0], output_len[1]))
    return prompts, out_lens


def run_ours(args, precision, folder, prompts, out_lens):
    from bench.precision import precision_kwargs
    from engine import LLM, SamplingParams

    kwargs = {"threads": args.threads, **precision_kwargs(precision)}
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.kv_cache_gib is not None:
        kwargs["kv_cache_gib"] = args.kv_cache_gib
    t0 = time.perf_counter()
    llm = LLM(model=str(folder), **kwargs)
    load_s = time.perf_counter() - t0
    config = llm.engine.config
    # Warm-up: a tiny request with ids outside the workload's range of lengths.
    llm.generate([[MIN_TOKEN_ID + 1] * 4], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)])
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=n) for n in out_lens]
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    outputs = [list(r.token_ids) for r in results]
    for o, n in zip(outputs, out_lens):
        if len(o) != n:
            print(f"warning: our engine produced {len(o)} tokens for a request asking {n}", file=sys.stderr)
    del llm
    gc.collect()
    return {"load_s": load_s, "wall_s": wall, "generated": sum(len(o) for o in outputs),
            "dtype": config.dtype, "quantization": config.quantization}, outputs


def run_hf(args, dtype_name, folder, prompts, out_lens):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    dtype = getattr(torch, dtype_name)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    except TypeError:  # older transformers only know torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(folder), torch_dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    pad = eos if eos is not None else 0

    def generate(batch, n_new):
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False,
                max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=pad,
                temperature=None, top_p=None, top_k=None,
            )
        return out[:, width:].tolist()

    generate([[MIN_TOKEN_ID + 1] * 4], 2)  # warm-up
    bs = args.hf_batch_size
    outputs = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), bs):
        batch_lens = out_lens[start:start + bs]
        new = generate(prompts[start:start + bs], max(batch_lens))
        outputs.extend(row[:n] for row, n in zip(new, batch_lens))
    wall = time.perf_counter() - t0
    computed = sum(
        len(out_lens[s:s + bs]) * max(out_lens[s:s + bs]) for s in range(0, len(prompts), bs)
    )
    del model
    gc.collect()
    return {"load_s": load_s, "wall_s": wall, "generated": sum(out_lens),
            "generated_incl_padding": computed}, outputs


def run_vllm(args, folder, prompts, out_lens):
    """vLLM-CPU in ``args.vllm_dtype`` on the workload, in the interpreter ``args.vllm_python``."""
    import subprocess
    import tempfile
    from pathlib import Path

    worker = Path(__file__).with_name("vllm_offline.py")
    with tempfile.TemporaryDirectory(prefix="bench-offline-vllm-") as tmp:
        job, result = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job.write_text(json.dumps({"model": str(folder), "dtype": args.vllm_dtype, "threads": args.threads,
                                   "prompts": prompts, "out_lens": out_lens, "warmup_token": MIN_TOKEN_ID + 1}))
        # -P: no script folder on sys.path, where bench/kernels.py would shadow the package
        # `kernels` that transformers (under vLLM) imports; and run from outside the checkout:
        # vLLM inspects the model in a child Python whose path starts at its working directory,
        # where our kernels/ folder would be found as `kernels` (docs/engine.md#the-name-kernels).
        done = subprocess.run([args.vllm_python, "-P", str(worker), str(job), str(result)], capture_output=True,
                              text=True, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        out = json.loads(result.read_text())
    outputs = out.pop("outputs")
    return dict(out, generated=sum(len(o) for o in outputs)), outputs


def default_precisions() -> str:
    """Only the precisions this CPU runs fast: bfloat16 needs bfloat16 units (else emulated)."""
    from engine.cpu_runtime import fast_bfloat16

    return "float32,bfloat16,default" if fast_bfloat16() else "float32,default"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=[32, 512])
    ap.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"), default=[32, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-gib", type=float, default=None)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--precisions", default=None,
                    help="ours, comma-separated: default, nondeterministic, DTYPE or DTYPE:QUANT, each against HF in its dtype "
                         "(float32,bfloat16,default with bfloat16 units, else float32,default)")
    ap.add_argument("--vllm-python", default=os.environ.get("MOONCAKE_VLLM_PYTHON"),
                    help="the python of a venv with vllm-cpu: adds vLLM-CPU (env MOONCAKE_VLLM_PYTHON)")
    ap.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the precision vLLM-CPU computes in (its weights and activations)")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    isa.add_argument(ap)
    args = ap.parse_args(argv)
    if args.precisions is None:
        args.precisions = default_precisions()
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    for name in ("num_prompts", "threads", "hf_batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    isa.apply(args)
    from engine.model_config import ModelConfig
    from engine.default_model import resolve_model

    folder = resolve_model(args.model)
    vocab = ModelConfig.from_folder(folder).vocab_size
    prompts, out_lens = build_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    n_prompt = sum(len(p) for p in prompts)
    n_gen = sum(out_lens)
    print(f"model: {folder}")
    print(f"workload: {len(prompts)} prompts, input {args.input_len[0]}-{args.input_len[1]}, "
          f"output {args.output_len[0]}-{args.output_len[1]}, seed {args.seed}; "
          f"{n_prompt} prompt + {n_gen} generated tokens; threads {args.threads}")
    print(f"instruction sets: {isa.describe()}")

    hf_note = None
    if args.skip_hf:
        hf_note = "HF baseline skipped (--skip-hf)"
    else:
        try:
            import transformers  # noqa: F401
        except ImportError:
            hf_note = "transformers is not installed (pip install -e '.[bench]'): HF baseline skipped"
        else:
            check_transformers_loads_models()
    report = {
        "workload": {"num_prompts": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
                     "seed": args.seed, "threads": args.threads, "prompt_tokens": n_prompt,
                     "generated_tokens": n_gen, "model": str(folder)},
        "precisions": {},
    }
    hf_runs: dict[str, tuple[dict, list]] = {}
    vllm = vllm_out = None
    if args.vllm_python:
        vllm, vllm_out = run_vllm(args, folder, prompts, out_lens)
        vllm["gen_tok_s"] = vllm["generated"] / vllm["wall_s"]
        vllm["total_tok_s"] = (n_prompt + vllm["generated"]) / vllm["wall_s"]
        report[f"vllm_{args.vllm_dtype}"] = vllm
        print(f"vLLM-CPU {args.vllm_dtype}: {vllm['generated']} tokens in {vllm['wall_s']:.2f} s (loaded in {vllm['load_s']:.0f} s)",
              flush=True)
    rows = [("ours", "weights", "gen tok/s", "total tok/s", f"ours / vLLM-CPU {args.vllm_dtype}", "HF (same dtype) gen tok/s",
             "ours / HF", f"same first {AGREE_PREFIX} tokens (HF)")]
    for precision in args.precisions.split(","):
        ours, ours_out = run_ours(args, precision, folder, prompts, out_lens)
        dtype = ours["dtype"]
        weights = dtype if ours["quantization"] == "none" else ours["quantization"]
        print(f"ours {precision} ({dtype}, {weights} weights): {ours['generated']} tokens in {ours['wall_s']:.2f} s",
              flush=True)
        entry = {"ours": dict(ours, gen_tok_s=ours["generated"] / ours["wall_s"],
                              total_tok_s=(n_prompt + ours["generated"]) / ours["wall_s"])}
        hf_cells = ["", "", ""]
        if hf_note is None:
            if dtype not in hf_runs:
                hf_runs[dtype] = run_hf(args, dtype, folder, prompts, out_lens)
                hf = hf_runs[dtype][0]
                print(f"hf {dtype}: {hf['generated']} useful tokens ({hf['generated_incl_padding']} computed) "
                      f"in {hf['wall_s']:.2f} s", flush=True)
            hf, hf_out = hf_runs[dtype]
            ratio = entry["ours"]["gen_tok_s"] / (hf["generated"] / hf["wall_s"])
            agree = agreement(ours_out, hf_out, out_lens)
            entry["hf"] = dict(hf, hf_batch_size=args.hf_batch_size, gen_tok_s=hf["generated"] / hf["wall_s"],
                               total_tok_s=(n_prompt + hf["generated"]) / hf["wall_s"])
            entry["ratio_gen_tok_s"] = ratio
            entry["agreement_first16"] = agree / len(prompts)
            equal = "" if weights == dtype else " (not equal precision)"
            hf_cells = [f"{entry['hf']['gen_tok_s']:.1f} ({dtype}, batch {args.hf_batch_size})",
                        f"{ratio:.2f}x{equal}", f"{agree}/{len(prompts)}"]
        vllm_cell = ""
        if vllm is not None:
            entry[f"ratio_vllm_{args.vllm_dtype}"] = ratio_vllm = entry["ours"]["gen_tok_s"] / vllm["gen_tok_s"]
            entry["agreement_first16_vllm"] = agreement(ours_out, vllm_out, out_lens) / len(prompts)
            vllm_cell = f"{ratio_vllm:.2f}x"
        report["precisions"][precision] = entry
        rows.append((f"{precision} ({dtype})", weights, f"{entry['ours']['gen_tok_s']:.1f}",
                     f"{entry['ours']['total_tok_s']:.1f}", vllm_cell, *hf_cells))
    if vllm is not None:
        rows.append((f"vLLM-CPU ({args.vllm_dtype})", args.vllm_dtype, f"{vllm['gen_tok_s']:.1f}", f"{vllm['total_tok_s']:.1f}",
                     "1.00x", "", "", ""))

    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if hf_note is not None:
        print(hf_note)
    if vllm is None:
        print("no vLLM-CPU row: give --vllm-python (a venv with vllm-cpu; see bench/README.md)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
