"""Reading sequences' KV out of the paged cache (shared by the attention twins).

Cache layout (one layer): ``[num_blocks, Hkv, block_size, D]``; ``block_tables [S, max_blocks]``
int32 rows padded with any valid block id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Sequences whose contexts differ by more than this factor are read in different groups.
LENGTH_GROUP_FACTOR = 2


def context_tiles(block_tables: torch.Tensor, num_kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The (block, head) tiles holding each sequence's first ``num_blocks`` blocks, flat, in
    the order attention reads them: ``[S * Hkv * num_blocks]`` indices into a cache viewed as
    ``[blocks * Hkv, block_size, D]``."""
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    return (block_tables[:, None, :num_blocks].long() * num_kv_heads + heads[None, :, None]).view(-1)


def gather_tiles(cache: torch.Tensor, tiles: torch.Tensor, num_seqs: int, max_len: int) -> torch.Tensor:
    """``[S, Hkv, max_len, D]`` contiguous copy of the ``tiles`` (:func:`context_tiles`)."""
    num_blocks, h, bs, d = cache.shape
    # (block, head) pairs are contiguous [bs, D] tiles: one index_select over them lands
    # every head's context contiguously, in the order attention reads it. Rows of whole tiles
    # (a 2-D view) copy 3x faster on CPU than [bs, D] slices of a 3-D one (measured, bfloat16).
    out = torch.index_select(cache.view(num_blocks * h, bs * d), 0, tiles)
    return out.view(num_seqs, h, -1, d)[:, :, :max_len]


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """``[S, Hkv, max_len, D]`` contiguous copy of each sequence's first ``max_len`` slots."""
    nb = -(-max_len // cache.shape[2])
    return gather_tiles(cache, context_tiles(block_tables, cache.shape[1], nb), block_tables.shape[0], max_len)


@dataclass(frozen=True)
class ContextGroup:
    """Sequences of a batch whose contexts are read together, padded to the longest of them.

    ``rows``: their indices in the batch (None: the whole batch, in order); ``tiles``: what
    :func:`gather_tiles` reads for them; ``beyond [n, 1, 1, max_len]``: the padded slots (None
    when every context of the group is ``max_len`` long, as a lone sequence's is)."""

    rows: torch.Tensor | None
    max_len: int
    tiles: torch.Tensor
    beyond: torch.Tensor | None


@dataclass(frozen=True)
class DecodeContext:
    """How decode attention's torch twin reads a batch's contexts, worked out once per step and
    shared by every layer.

    Invariant: each sequence is in exactly one group, and within a group the longest context is
    at most ``LENGTH_GROUP_FACTOR`` times the shortest, so no layer copies a short context
    padded to a much longer one (a batch of similar lengths is one group)."""

    groups: list[ContextGroup]

    @classmethod
    def build(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
              block_size: int) -> DecodeContext:
        device = block_tables.device
        lengths = seq_lens.tolist()
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        runs: list[list[int]] = []
        for i in order:
            if runs and lengths[i] <= LENGTH_GROUP_FACTOR * lengths[runs[-1][0]]:
                runs[-1].append(i)
            else:
                runs.append([i])
        groups = []
        for run in runs:
            max_len = max(lengths[i] for i in run)
            whole = len(runs) == 1
            rows = None if whole else torch.tensor(run, device=device)
            tables, lens = (block_tables, seq_lens) if whole else (block_tables[rows], seq_lens[rows])
            beyond = None
            if any(lengths[i] != max_len for i in run):
                beyond = (torch.arange(max_len, device=device)[None, :] >= lens[:, None])[:, None, None, :]
            tiles = context_tiles(tables, num_kv_heads, -(-max_len // block_size))
            groups.append(ContextGroup(rows, max_len, tiles, beyond))
        return cls(groups)
