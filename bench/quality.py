"""A small fixed quality check of the engine in each precision: multiple choice and perplexity.

Run with ``python -m bench.quality`` (``--help`` for the flags). Needs no download: both sets
were written for this project and live in ``bench/quality_data/``:

* ``multiple_choice.jsonl``: 32 everyday-knowledge questions with four answers each. Each answer
  is scored as lm-evaluation-harness scores a multiple-choice task: the sum of the logprobs of
  its tokens after ``Question: ...\\nAnswer:``; ``acc`` takes the best sum, ``acc_norm`` the best
  sum per byte of the answer.
* ``held_text.txt``: about 500 words of plain prose; perplexity = exp(-mean token logprob).

It also asks each question greedily twice in one engine, as a chat prompt one token past a
whole number of KV blocks: cold (every prompt computed in one batch) and warm (all but the last
token from the prefix cache), and counts the questions whose two answers differ: a greedy answer should not depend on what the cache held
(``deterministic``, the engine's deterministic mode, promises it does not).

Every logprob is the engine's prompt logprob (``SamplingParams.prompt_logprobs``, as ``echo`` +
``logprobs`` serve them), so this also exercises that path. Each precision loads the model
anew; float32 is the reference the others are compared with: how often they pick the same
answer, and how far their token logprobs on the held text are from its. It takes seconds per
precision on a CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from bench.precision import precision_kwargs
from bench.transfer import format_table
from engine import LLM, SamplingParams

DATA = Path(__file__).parent / "quality_data"


@dataclass
class Quality:
    dtype: str
    choices: list[int]  # the answer picked per question (by acc)
    acc: float
    acc_norm: float
    perplexity: float
    text_logprobs: list[float]  # the held text's token logprobs (every token after the first)
    seconds: float
    cold_warm_differ: int = 0  # questions whose greedy answer differed cold and warm (cold_and_warm)


def load_questions(path: Path = DATA / "multiple_choice.jsonl") -> list[dict]:
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for i, q in enumerate(questions):
        if len(q["choices"]) < 2 or not 0 <= q["answer"] < len(q["choices"]):
            raise ValueError(f"{path}: question {i} is malformed")
    return questions


def evaluate(llm: LLM, dtype: str, questions: list[dict], text: str) -> Quality:
    """Score every answer of every question and the held text in one batch."""
    tok = llm.tokenizer
    prompts, spans = [], []  # spans[i]: (question, where the answer's tokens start, answer bytes)
    for qi, q in enumerate(questions):
        context = tok.encode(f"Question: {q['question']}\nAnswer:")
        for choice in q["choices"]:
            answer = tok.encode(" " + choice, add_special_tokens=False)
            prompts.append(context + answer)
            spans.append((qi, len(context), len((" " + choice).encode())))
    held = tok.encode(text)
    started = time.perf_counter()
    results = llm.generate(prompts + [held], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    seconds = time.perf_counter() - started
    sums: list[list[tuple[float, float]]] = [[] for _ in questions]
    for r, (qi, start, nbytes) in zip(results, spans):
        total = sum(lp.logprob for lp in r.prompt_logprobs[start:])
        sums[qi].append((total, total / nbytes))
    picked = [max(range(len(s)), key=lambda j: s[j][0]) for s in sums]
    picked_norm = [max(range(len(s)), key=lambda j: s[j][1]) for s in sums]
    text_lps = [lp.logprob for lp in results[-1].prompt_logprobs[1:]]
    return Quality(
        dtype, picked,
        acc=sum(p == q["answer"] for p, q in zip(picked, questions)) / len(questions),
        acc_norm=sum(p == q["answer"] for p, q in zip(picked_norm, questions)) / len(questions),
        perplexity=math.exp(-sum(text_lps) / len(text_lps)), text_logprobs=text_lps, seconds=seconds)


def one_row_prompts(llm: LLM, questions: list[dict]) -> list[list[int]]:
    """Each question as a chat prompt whose length is one past a whole number of KV blocks (a
    system line padded word by word to get there): asked again, everything but its last token
    comes from the prefix cache, so the warm answer is computed from one row, the cold one from
    the whole prompt, the two paths furthest apart (the chat question of issue 40)."""
    bs = llm.engine.config.block_size
    prompts = []
    for q in questions:
        for pad in range(4 * bs):
            system = "Answer briefly." + " please" * pad
            ids = llm.engine.tokenize(llm.tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": q["question"]}]))
            if len(ids) % bs == 1:
                prompts.append(ids)
                break
        else:
            raise RuntimeError(f"no padding puts {q['question']!r} one token past a block")
    return prompts


def cold_and_warm(llm: LLM, questions: list[dict], max_tokens: int = 16) -> int:
    """Greedy answers to every question (:func:`one_row_prompts`), asked cold and then warm in the
    same engine: how many differ. The engine must be fresh (nothing of these prompts cached)."""
    prompts = one_row_prompts(llm, questions)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    cold = llm.generate(prompts, params)
    warm = llm.generate(prompts, params)
    # Cold, a prompt may find the blocks of a system line that one before it in the batch shares.
    if (any(r.num_cached_tokens >= len(p) - 1 for r, p in zip(cold, prompts))
            or any(r.num_cached_tokens != len(p) - 1 for r, p in zip(warm, prompts))):
        raise RuntimeError("cold_and_warm needs a fresh engine with prefix caching on")
    return sum(c.token_ids != w.token_ids for c, w in zip(cold, warm))


def report(results: list[Quality]) -> str:
    ref = results[0]
    rows = []
    for q in results:
        agree = sum(a == b for a, b in zip(q.choices, ref.choices)) / len(ref.choices)
        drift = sum(abs(a - b) for a, b in zip(q.text_logprobs, ref.text_logprobs)) / len(ref.text_logprobs)
        rows.append([q.dtype, f"{q.acc:.3f}", f"{q.acc_norm:.3f}", f"{q.perplexity:.3f}",
                     f"{q.perplexity / ref.perplexity:.4f}", f"{agree:.3f}", f"{drift:.4f}",
                     f"{q.cold_warm_differ}/{len(q.choices)}", f"{q.seconds:.1f}"])
    return format_table(["precision", "MC acc", "MC acc_norm", "perplexity", f"ppl / {ref.dtype}",
                         f"same answers as {ref.dtype}", f"mean |Δ logprob| vs {ref.dtype}",
                         "cold/warm answers differ", "seconds"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model folder or .gguf (default: the default model)")
    parser.add_argument("--dtypes", default="float32,bfloat16,bfloat16:int8,default",
                        help="precisions, comma-separated, each default, DTYPE or DTYPE:QUANT (int8 or int4 "
                             "weight-only), deterministic or nondeterministic; the first is the reference "
                             "(float32,bfloat16,bfloat16:int8,default)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = parser.parse_args(argv)
    questions = load_questions()
    text = (DATA / "held_text.txt").read_text()
    results = []
    for dtype in args.dtypes.split(","):
        llm = LLM(args.model, **precision_kwargs(dtype), threads=args.threads, kv_cache_gib=0.25)
        # First, while the engine's cache is empty; evaluate's prompts share no full block with these.
        differ = cold_and_warm(llm, questions)
        results.append(evaluate(llm, dtype, questions, text))
        results[-1].cold_warm_differ = differ
        print(f"  {dtype}: acc {results[-1].acc:.3f}, perplexity {results[-1].perplexity:.3f}, "
              f"{differ} answers differ cold/warm", flush=True)
        del llm
    print(f"{len(questions)} questions x 4 answers, {len(results[0].text_logprobs) + 1}-token held text")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
