"""Turns one step's logits into next tokens, batched across sequences.

Order of operations for each row (vLLM conventions):
  1. penalties on the raw logits: repetition (prompt + output tokens), then frequency and
     presence (output tokens only);
  2. greedy rows (temperature 0) take the argmax of the penalized logits;
  3. other rows: divide by temperature, then top-k, top-p, min-p, then draw a sample.

Requested logprobs are the log-softmax of the logits after step 1 and the temperature
division of step 3 (greedy rows: after penalties only, i.e. temperature 1), before any
top-k/top-p/min-p truncation, so alternatives outside the truncated set still get a value.
Prompt tokens are scored raw instead (``score_tokens``: no penalties, no temperature), as vLLM
reports prompt logprobs.

Sampling draws q ~ Exp(1) per vocabulary entry and takes argmax(probs / q), which picks token
i with probability probs[i]. The noise of a seeded row comes only from that request's own
generator, one [V] draw per step, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import llguidance
import numpy as np

import torch

from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams
from engine.structured_output import Matcher

# Dividing by a temperature this small can overflow float32 while the result is already
# indistinguishable from argmax, so such rows are treated as greedy.
_MIN_TEMPERATURE = 1e-5
# Top-p without top-k looks at this many most likely tokens first (see ``_top_k_top_p``).
_TOP_P_CANDIDATES = 1024
# exponential_ may return exactly 0; probs / 0 would be NaN for excluded (zero-probability)
# tokens and argmax treats NaN as the maximum, so the noise is clamped away from 0.
_TINY = torch.finfo(torch.float32).tiny


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `seed` on the device the logits live on (None if unseeded)."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingState:
    """What the sampler needs to know about one sequence; the engine keeps it for the
    request's lifetime and appends every sampled token to `output_token_ids`."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    # Tokens that may not be sampled before ``params.min_tokens`` outputs: the model's EOS ids
    # (unless ignore_eos) and the request's stop_token_ids.
    stop_ids: tuple[int, ...] = ()
    # What the request's structured output allows next (``params.structured_outputs``).
    matcher: Matcher | None = None
    # The prompt never changes, so its [V] presence mask is built once instead of turning a
    # possibly long token list into a tensor on every decode step.
    _prompt_mask: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def for_request(
        cls, params: SamplingParams, prompt_token_ids: list[int], device: torch.device | str = "cpu",
        eos_token_ids: frozenset[int] = frozenset(), matcher: Matcher | None = None,
    ) -> SamplingState:
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        return cls(params, list(prompt_token_ids), [], make_generator(params.seed, device),
                   tuple(sorted(stop_ids)) if params.min_tokens else (), matcher)

    def append(self, token_id: int) -> None:
        """The request got ``token_id`` (sampled here, or by the prefill instance it came from)."""
        self.output_token_ids.append(token_id)
        if self.matcher is not None:
            self.matcher.accept(token_id)

    def prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Bool [vocab_size] tensor, True for token ids that occur in the prompt."""
        mask = self._prompt_mask
        if mask is None or mask.shape[0] != vocab_size or mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if self.prompt_token_ids:
                ids = torch.tensor(self.prompt_token_ids, dtype=torch.int64, device=device)
                mask[ids] = True
            self._prompt_mask = mask
        return mask


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[Logprobs | None]  # one per row; None where the row did not ask for them


# Rows sampled in one pass. A pass holds a few float32 copies of its rows' logits over the whole
# vocabulary (the penalised logits, their tempered copy, probabilities, noise): at 256 rows of a
# 49k vocabulary ~250 MB at once, which the allocator then keeps, and which made most of a decode
# instance's private memory growth under overload (+280 MiB above its
# baseline at 10x the sustainable load). In passes of this many rows the sampler's temporaries
# stay ~30 MB at any batch; a row's token does not depend on the pass it is in.
ROWS_PER_PASS = 32


class Sampler:
    """Stateless apart from `generator`, the shared source of noise for unseeded rows
    (None: torch's default generator for the logits' device)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: list[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(
                f"logits must be [len(batch)={len(batch)}, vocab], got {tuple(logits.shape)}"
            )
        if not batch:
            return SamplerOutput([], [])
        if len(batch) <= ROWS_PER_PASS:
            return self._pass(logits, batch)
        passes = [self._pass(logits[i : i + ROWS_PER_PASS], batch[i : i + ROWS_PER_PASS])
                  for i in range(0, len(batch), ROWS_PER_PASS)]
        return SamplerOutput([t for p in passes for t in p.token_ids], [r for p in passes for r in p.logprobs])

    def _pass(self, logits: torch.Tensor, batch: list[SamplingState]) -> SamplerOutput:
        params = [state.params for state in batch]
        greedy = [p.temperature < _MIN_TEMPERATURE for p in params]

        # Every stage below is out-of-place until x is a tensor this call owns: .float() is a
        # no-op on float32 input and the caller's logits must not be modified.
        x = _apply_penalties(logits.float(), batch)
        x = _bias_and_bans(x, batch)
        constrained = [i for i, state in enumerate(batch) if state.matcher is not None]
        if constrained:
            x = apply_masks(x, constrained, [batch[i].matcher for i in constrained])
        if not all(greedy):
            temperatures = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
            x = x / torch.tensor(temperatures, device=x.device).unsqueeze(1)

        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = _rows(x, logprob_rows).log_softmax(-1) if logprob_rows else None

        if all(greedy):
            tokens = x.argmax(-1)
        else:
            tokens = self._sample(x, batch, greedy)

        token_ids = tokens.tolist()
        records: list[Logprobs | None] = [None] * len(batch)
        if logprobs is not None:
            _fill_logprobs(records, logprobs, tokens, token_ids, logprob_rows, params)
        return SamplerOutput(token_ids, records)

    def _sample(self, x: torch.Tensor, batch: list[SamplingState], greedy: list[bool]) -> torch.Tensor:
        params = [state.params for state in batch]
        x = _top_k_top_p(x, params, greedy)
        probs = x.softmax(-1)
        _min_p(probs, params, greedy)

        noise = torch.empty_like(probs)
        # Greedy rows' noise is left unset: their tokens are replaced by the argmax below.
        if any(not g and s.generator is None for g, s in zip(greedy, batch)):
            noise.exponential_(generator=self.generator)
        for row, (g, state) in enumerate(zip(greedy, batch)):
            if not g and state.generator is not None:
                noise[row].exponential_(generator=state.generator)
        tokens = probs.div_(noise.clamp_(min=_TINY)).argmax(-1)

        greedy_rows = [i for i, g in enumerate(greedy) if g]
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=x.device)
            tokens[index] = x[index].argmax(-1)
        return tokens


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x restricted to `rows`, without a gather when that is every row."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def _apply_penalties(x: torch.Tensor, batch: list[SamplingState]) -> torch.Tensor:
    params = [state.params for state in batch]
    uses_repetition = [p.repetition_penalty != 1.0 for p in params]
    uses_output = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(uses_repetition) and not any(uses_output):
        return x
    num_rows, vocab = x.shape
    device = x.device

    # Output-token counts via one scatter_add over a padded [S, L] tensor; padding points at
    # an extra column `vocab` that is dropped afterwards. Rows without penalties contribute
    # no tokens at all.
    outputs = [
        state.output_token_ids if rep or out else []
        for state, rep, out in zip(batch, uses_repetition, uses_output)
    ]
    width = max(len(ids) for ids in outputs)
    padded = torch.tensor(
        [ids + [vocab] * (width - len(ids)) for ids in outputs], dtype=torch.int64, device=device
    ).view(num_rows, width)
    counts = torch.zeros(num_rows, vocab + 1, dtype=x.dtype, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=x.dtype))
    counts = counts[:, :vocab]
    seen_in_output = counts > 0

    if any(uses_repetition):
        no_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = torch.stack(
            [
                state.prompt_mask(vocab, device) if rep else no_prompt
                for state, rep in zip(batch, uses_repetition)
            ]
        )
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        penalized = torch.where(x > 0, x / penalty, x * penalty)
        x = torch.where(prompt | seen_in_output, penalized, x)

    if any(uses_output):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        x = x - frequency * counts - presence * seen_in_output
    return x


def _bias_and_bans(x: torch.Tensor, batch: list[SamplingState]) -> torch.Tensor:
    """Each row's ``logit_bias`` added, and its stop tokens at -inf while it has fewer than
    ``min_tokens`` outputs. Out of place (``index_put``): x may still be the caller's logits."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, state in enumerate(batch):
        p = state.params
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            values += p.logit_bias.values()
        if state.stop_ids and len(state.output_token_ids) < p.min_tokens:
            rows += [row] * len(state.stop_ids)
            cols += state.stop_ids
            values += [-math.inf] * len(state.stop_ids)
    if not rows:
        return x
    index = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
    return x.index_put(index, torch.tensor(values, dtype=x.dtype, device=x.device), accumulate=True)


_mask_executor: llguidance.LLExecutor | None = None


def _grammar_masks(matchers: list[Matcher], words: int) -> torch.Tensor:
    """Every matcher's allowed-next bitmask, one row each; several at once on llguidance's threads
    (as many as torch's: the step is the process's only work while they run)."""
    global _mask_executor
    masks = torch.empty(len(matchers), words, dtype=torch.int32)
    if len(matchers) == 1:
        matchers[0].fill(masks[0])
        return masks
    if _mask_executor is None:
        _mask_executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
    _mask_executor.unsafe_compute_mask_ptr([(m.llguidance_matcher, i) for i, m in enumerate(matchers)],
                                           masks.data_ptr(), words * 4, len(matchers))
    return masks


def apply_masks(x: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> torch.Tensor:
    """``x`` with, in each of ``rows``, the tokens its structured-output matcher does not allow at
    -inf (out of place: x may still be the caller's logits)."""
    vocab = x.shape[1]
    masks = _grammar_masks(matchers, (vocab + 31) // 32)
    # Bit i of word w is token 32 w + i: the little-endian bytes of the words, unpacked low bit
    # first, are the tokens in order (numpy's unpackbits is one C loop; shifts in torch were 2-7 ms
    # for 16 rows of a 49k vocabulary).
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(bits).view(torch.bool).to(x.device)
    if len(rows) == x.shape[0]:
        return x.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, device=x.device)
    return x.index_put((index,), x[index].masked_fill(~allowed, float("-inf")))


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
    """Sets logits outside each row's top-k / top-p set to -inf (in place on the owned x).

    Only a row's candidates are sorted, not its whole vocabulary: its top-k, or with top-p
    alone the ``_TOP_P_CANDIDATES`` most likely tokens when they hold at least top_p of the
    mass (every token past them is cut anyway); a full sort only when some row's candidates
    fall short. The kept set and its logits are the same either way."""
    vocab = x.shape[1]
    rows = [
        i
        for i, p in enumerate(params)
        if not greedy[i] and (0 < p.top_k < vocab or p.top_p < 1.0)
    ]
    if not rows:
        return x
    sub = _rows(x, rows)
    ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    ps = [params[i].top_p for i in rows]
    p_only = torch.tensor([k == vocab for k in ks], device=x.device)
    width = max(k if k < vocab else min(vocab, _TOP_P_CANDIDATES) for k in ks)
    if width < vocab:
        sorted_logits, order = sub.topk(width, dim=-1)
        # A row without top-k measures top-p against its whole vocabulary: its candidates'
        # share of it, as softmax computes it.
        top = sorted_logits[:, :1]
        denom = (sub - top).exp().sum(-1, keepdim=True)
        share = (sorted_logits - top).exp() / denom
        limits = torch.tensor(ps, device=x.device)
        if bool((share.sum(-1) < limits)[p_only].any()):
            width = vocab  # some row's top-p reaches past its candidates: sort all of it
    if width == vocab:
        sorted_logits, order = sub.sort(dim=-1, descending=True)

    positions = torch.arange(width, device=x.device)
    k = torch.tensor([min(k, width) for k in ks], device=x.device).unsqueeze(1)
    sorted_logits.masked_fill_(positions >= k, float("-inf"))

    if any(p < 1.0 for p in ps):
        # Renormalized over what top-k kept; over the whole vocabulary without top-k. A token
        # is dropped once the tokens ranked above it already hold top_p of the mass, so the
        # first token always survives.
        sorted_probs = sorted_logits.softmax(-1)
        if width < vocab:
            sorted_probs = torch.where(p_only[:, None], share, sorted_probs)
        mass_before = sorted_probs.cumsum(-1).sub_(sorted_probs)
        # 2.0 for rows with top_p == 1: round-off can push the running mass past 1.0, which
        # must not cut the tail of a row that asked for no top-p at all.
        limit = torch.tensor([p if p < 1.0 else 2.0 for p in ps], device=x.device).unsqueeze(1)
        sorted_logits.masked_fill_(mass_before >= limit, float("-inf"))

    truncated = torch.full_like(sub, float("-inf")).scatter_(1, order, sorted_logits)
    if len(rows) == x.shape[0]:
        return truncated
    x[torch.tensor(rows, device=x.device)] = truncated
    return x


def _min_p(probs: torch.Tensor, params: list[SamplingParams], greedy: list[bool]) -> None:
    """Zeroes (in place) probabilities below min_p times the row's largest probability."""
    thresholds = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
    if not any(thresholds):
        return
    scale = torch.tensor(thresholds, device=probs.device).unsqueeze(1)
    probs.masked_fill_(probs < scale * probs.amax(-1, keepdim=True), 0.0)


def _fill_logprobs(
    records: list[Logprobs | None],
    logprobs: torch.Tensor,
    tokens: torch.Tensor,
    token_ids: list[int],
    rows: list[int],
    params: list[SamplingParams],
) -> None:
    """`logprobs` holds only `rows`, in order; fills records[row] for each of them."""
    found = _records(logprobs, _rows(tokens.unsqueeze(1), rows), [token_ids[r] for r in rows],
                     [params[r].logprobs or 0 for r in rows])
    for row, record in zip(rows, found):
        records[row] = record


def score_tokens(logits: torch.Tensor, targets: list[int], k: int) -> list[Logprobs]:
    """Raw logprobs of ``targets`` (one per row of ``logits``): the log-softmax of the model's
    logits as they are (no penalties, no temperature), each with its ``k`` most likely
    alternatives. How prompt tokens are scored."""
    logprobs = logits.float().log_softmax(-1)
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device).unsqueeze(1)
    return _records(logprobs, index, targets, [k] * len(targets))


def _records(logprobs: torch.Tensor, index: torch.Tensor, token_ids: list[int], widths: list[int]) -> list[Logprobs]:
    """Row j: the logprob of ``token_ids[j]`` (``index``: the same ids as a ``[rows, 1]``
    tensor) and the ``widths[j]`` highest alternatives."""
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    width = min(max(widths, default=0), logprobs.shape[1])
    values: list[list[float]] = [[] for _ in token_ids]
    ids: list[list[int]] = [[] for _ in token_ids]
    if width > 0:
        top_values, top_ids = logprobs.topk(width, dim=-1)  # sorted, highest first
        values, ids = top_values.tolist(), top_ids.tolist()
    return [Logprobs(t, chosen[j], list(zip(ids[j][:n], values[j][:n]))) for j, (t, n) in enumerate(zip(token_ids, widths))]
