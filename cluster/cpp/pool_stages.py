"""The stages that hold a prefill instance's layers, as its KVCache pool traffic sees them.

A prefill instance's ``PoolIO`` (``cluster/instance/pool_io.py``) leases a prompt's prefix and
reserves the objects the prompt will complete for all of its stages, and reads and writes its
own layers' parts of them. ``PoolStages`` is what it asks of the stages around that:

* ``OneStage``: an instance that holds every layer. Nothing to share: a load is read layer by
  layer while the prompt computes, and a prompt the layer-wise store cannot take is stored from
  the prefix cache after it (``PoolIO.store_later``).
* ``LaterStages``: the first stage of a pipeline group has every later stage read and write its
  own layers through the ``StageLink`` (``pool_load``, ``pool_store``, ``pool_store_end``; a
  later stage's side is ``cluster.cpp.pool_share.StagePool``). A group's load is read and
  verified by every stage before the prompt runs, so that all stages agree on the prefix and
  none can fail mid-step; it costs the read of the group's parts (tens of milliseconds for
  thousands of tokens) against a step of seconds, so it is read in one transfer rather than
  layer by layer. A group stores only layer by layer: the store from the prefix cache would
  have to pack every stage's blocks in step with their engines, so a prompt the pool cannot
  take whole at planning is not stored (``PoolIO.stores_skipped``).

The calls block (the later stages are a Messenger call away): ``PoolIO`` runs them on its pool
threads.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from cluster.cpp.stage import StageLink
from cluster.messenger import TransferError
from cluster.pool.client import PoolRead, PoolWrite

log = logging.getLogger(__name__)


class PoolStages(ABC):
    """What a prefill instance's ``PoolIO`` asks of the stages that hold its layers, around each
    load and store (see the module doc). The calls block."""

    # Whether a load is read layer by layer, each layer taken by the engine as it arrives,
    # rather than in one transfer before the prompt runs.
    reads_layerwise: bool
    # Whether a prompt the layer-wise store could not take is stored from the prefix cache after it.
    stores_from_cache: bool

    @abstractmethod
    def load(self, request_id: str, read: PoolRead, parts: range) -> int:
        """How many of ``read``'s objects, from the first, every stage loads for the request
        (``parts``: this instance's own layers of them); 0: none."""

    @abstractmethod
    def unload(self, request_id: str) -> None:
        """Every stage lets go of the request's load (not waited for)."""

    @abstractmethod
    def store(self, request_id: str, write: PoolWrite, first_blocks: list[int]) -> bool:
        """Whether every stage takes its layers of ``write``'s objects, to be written as the
        prompt's last step computes them (``first_blocks``: each object's first block)."""

    @abstractmethod
    def store_end(self, request_id: str, commit: bool, sums: list[list[int]] | None) -> list[list[int]] | None:
        """End the request's layer-wise store on every stage, once their writes have settled: the
        checksums to seal the objects with (``sums``: this instance's parts' of each object, or
        None when not all were written or no ``commit``), or None to abort them."""


class OneStage(PoolStages):
    """An instance that holds every layer: nothing to share."""

    reads_layerwise = True
    stores_from_cache = True

    def load(self, request_id: str, read: PoolRead, parts: range) -> int:
        return read.num_objects  # verified layer by layer as the engine takes them

    def unload(self, request_id: str) -> None:
        pass

    def store(self, request_id: str, write: PoolWrite, first_blocks: list[int]) -> bool:
        return True

    def store_end(self, request_id: str, commit: bool, sums: list[list[int]] | None) -> list[list[int]] | None:
        return sums


class LaterStages(PoolStages):
    """A first pipeline stage's later stages, through its ``link`` (see the module doc)."""

    reads_layerwise = False
    stores_from_cache = False

    def __init__(self, link: StageLink) -> None:
        self._link = link

    def load(self, request_id: str, read: PoolRead, parts: range) -> int:
        """The later stages read their layers under ``read``'s leases while this stage reads its
        own; the objects, from the first, that every stage holds verified."""
        if not read.num_objects:
            return 0
        try:
            counts = self._link.pool_load(request_id, read.leases())
        except TransferError as exc:
            log.warning("pool: a pipeline stage could not load %s: %s", request_id, exc)
            return 0
        for part in parts:
            read.wait_part(part)
        return min([read.good, *counts])

    def unload(self, request_id: str) -> None:
        self._link.pool_unload(request_id)

    def store(self, request_id: str, write: PoolWrite, first_blocks: list[int]) -> bool:
        try:
            self._link.pool_store(request_id, write.reservation(), first_blocks)
        except TransferError as exc:
            log.warning("pool: a pipeline stage cannot store %s layer by layer: %s", request_id, exc)
            self._link.pool_store_end(request_id, False)
            return False
        return True

    def store_end(self, request_id: str, commit: bool, sums: list[list[int]] | None) -> list[list[int]] | None:
        # Asked even without sums: the later stages' writes must have settled before the seal,
        # or the abort that would hand their ranges of the segments to other objects.
        theirs = self._link.pool_store_end(request_id, commit)
        if sums is None or any(t is None for t in theirs):
            return None
        # Each object's checksums, part by part: this stage's layers, then each later stage's.
        return [sum((t[i] for t in theirs), mine) for i, mine in enumerate(sums)]
