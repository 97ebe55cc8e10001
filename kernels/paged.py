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


# Tokens of room past a group's longest context when its kept buffers are (re)allocated: the
# group then decodes this many steps before its contexts are gathered again.
CONTEXT_HEADROOM = 64


@dataclass
class KeptContext:
    """One layer's gathered K and V of a group, ``[n, Hkv, capacity, D]`` each, kept from step
    to step; ``step``: the step whose contexts it holds (``DecodeContext.step``)."""

    k: torch.Tensor
    v: torch.Tensor
    step: int


@dataclass
class ContextGroup:
    """Sequences of a batch whose contexts are read together, padded to the longest of them.

    ``rows``: their indices in the batch (None: the whole batch, in order); ``tiles``: what
    :func:`gather_tiles` reads for them; ``beyond [n, 1, 1, max_len]``: the padded slots (None
    when every context of the group is ``max_len`` long, as a lone sequence's is).

    ``kept`` (None: nothing is kept, every layer gathers its contexts anew): each layer's
    gathered contexts by the address of its cache, carried over from the previous step's group
    of the same sequences; ``appends``: when they are carried over, where each sequence's new
    token sits in the cache (block, offset) and goes in the kept buffers (position), so a layer
    copies one token per sequence instead of the whole context."""

    rows: torch.Tensor | None
    max_len: int
    tiles: torch.Tensor
    beyond: torch.Tensor | None
    lengths: list[int]
    ids: tuple | None = None  # the sequences (any objects, by identity), when their contexts are kept
    capacity: int = 0
    fill_tiles: torch.Tensor | None = None  # the tiles of ``capacity`` tokens (past a table's end: tile 0)
    kept: dict[int, KeptContext] | None = None
    appends: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def read(self, k_cache: torch.Tensor, v_cache: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[n, Hkv, max_len, D]`` K and V of the group's contexts from one layer's cache (this
        step's tokens already stored): a fresh copy, or views of the kept buffers brought up to
        date."""
        n = len(self.lengths)
        if self.kept is None:
            return gather_tiles(k_cache, self.tiles, n, self.max_len), gather_tiles(v_cache, self.tiles, n, self.max_len)
        layer = self.kept.get(k_cache.data_ptr())
        if layer is not None and layer.step == step - 1 and self.appends is not None:
            rows, pos, block, offset = self.appends
            layer.k[rows, :, pos] = k_cache[block, :, offset]
            layer.v[rows, :, pos] = v_cache[block, :, offset]
            layer.step = step
        elif layer is None or layer.step != step:
            # First use, or a layer that missed a step: gather the whole contexts once more,
            # straight into buffers with room for the steps to come.
            layer = KeptContext(gather_tiles(k_cache, self.fill_tiles, n, self.capacity),
                                gather_tiles(v_cache, self.fill_tiles, n, self.capacity), step)
            self.kept[k_cache.data_ptr()] = layer
        return layer.k[:, :, : self.max_len], layer.v[:, :, : self.max_len]


@dataclass(frozen=True)
class DecodeContext:
    """How decode attention's torch twin reads a batch's contexts, worked out once per step and
    shared by every layer.

    Invariants: each sequence is in exactly one group, and within a group the longest context
    is at most ``LENGTH_GROUP_FACTOR`` times the shortest, so no layer copies a short context
    padded to a much longer one (a batch of similar lengths is one group). A group keeps its
    gathered contexts only when built with ``seq_ids``; it carries over the previous step's only
    for the same sequences in the same order, each one token longer, which is all a decode step
    can change of a context (a sequence's earlier tokens are never rewritten while it decodes,
    and one that was preempted prefills again before it decodes)."""

    groups: list[ContextGroup]
    step: int = 0

    @classmethod
    def build(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
              block_size: int, seq_ids: list | None = None, previous: DecodeContext | None = None) -> DecodeContext:
        """``seq_ids`` (one per row): keep each group's gathered contexts for the next step,
        which passes this context as ``previous``."""
        device = block_tables.device
        lengths = seq_lens.tolist()
        # Sequences are told apart by identity: the groups hold them (``ContextGroup.ids``), so
        # no identity is reused while a kept context could still be carried over.
        keys = None if seq_ids is None else [id(x) for x in seq_ids]
        before = {} if previous is None or seq_ids is None else {
            tuple(map(id, g.ids)): g for g in previous.groups if g.kept is not None}
        runs: list[list[int]] = []
        if before and sum(len(ids) for ids in before) == len(lengths):
            # The same sequences as the last step, each one token longer: the same groups. (The
            # ratio of a group's longest to its shortest context only shrinks; regrouping by the
            # lengths alone would move sequences across groups, and gather them all again.)
            where = {key: i for i, key in enumerate(keys)}
            for g in before.values():
                run = [where.get(id(x)) for x in g.ids]
                if None in run or any(lengths[i] != n + 1 for i, n in zip(run, g.lengths)):
                    runs = []
                    break
                runs.append(run)
        if not runs:
            for i in sorted(range(len(lengths)), key=lengths.__getitem__):
                if runs and lengths[i] <= LENGTH_GROUP_FACTOR * lengths[runs[-1][0]]:
                    runs[-1].append(i)
                else:
                    runs.append([i])
        if len(runs) == 1:  # one group: read in the batch's own order
            runs = [list(range(len(lengths)))]
        step = 0 if previous is None else previous.step + 1
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
            group = ContextGroup(rows, max_len, tiles, beyond, [lengths[i] for i in run])
            if seq_ids is not None:
                group.ids = tuple(seq_ids[i] for i in run)
                old = before.get(tuple(keys[i] for i in run))
                if (old is not None and max_len <= old.capacity
                        and all(a == b + 1 for a, b in zip(group.lengths, old.lengths))):
                    pos = lens.long() - 1
                    block = tables.gather(1, (pos // block_size)[:, None]).squeeze(1).long()
                    group.capacity, group.kept = old.capacity, old.kept
                    group.appends = (torch.arange(len(run), device=device), pos, block, pos % block_size)
                else:
                    group.capacity = -(-(max_len + CONTEXT_HEADROOM) // block_size) * block_size
                    group.kept = {}
                blocks = group.capacity // block_size
                wide = torch.nn.functional.pad(tables, (0, max(0, blocks - tables.shape[1])))
                group.fill_tiles = context_tiles(wide, num_kv_heads, blocks)
            groups.append(group)
        return cls(groups, step)

    def kept_bytes(self, num_kv_heads: int, head_dim: int, element_size: int, num_layers: int) -> int:
        """What this step's kept contexts hold once every layer has read them."""
        tokens = sum(len(g.lengths) * g.capacity for g in self.groups if g.kept is not None)
        return 2 * tokens * num_kv_heads * head_dim * element_size * num_layers
