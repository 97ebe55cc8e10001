"""KV fault matrix: every fault injected on purpose, on the real paths, under concurrent traffic;
no 200 may carry other tokens than the greedy reference.

Run with ``python -m bench.faults`` (``--quick``: the rows CI runs, under a minute of faults;
``--only ROW``; ``--json PATH``). It computes every request's greedy reference with an engine in
its own process (at the cluster's precision: ``--precision deterministic``, the default, or
``float32``; the shipped bfloat16 default gives another greedy answer for a near tie when a
prompt's KV comes another way, which no oracle can tell from corruption: docs/engine.md), then
starts ``python -m server`` (a Conductor, one prefill and one decode instance, the shipped
leases, timeouts and checks, one thread per instance) with ``MOONCAKE_FAILPOINTS=1``
(``cluster.failpoints``), and runs each row of ``matrix.ROWS``: arm the row's failpoints on the
instances of a role, send the row's requests at once (fresh prompts, or two-turn sessions whose
second turn reads the pool), disarm, and judge every answer:

* **identical**: a 200 whose text is the reference's, byte for byte (after a recomputation too:
  the table shows how many requests the Conductor moved and how many pool loads were given up);
* a **clear error**: a status with an OpenAI error body, or a stream ending in an error event;
* **differing**: a 200 with other text: the failure the bench exists to find;
* **hung**: no answer by the deadline, or an answer that is neither of the above.

A row fails when any answer differs or hung, or when its fault never fired (a row that injected
nothing proves nothing); the run fails when a row does, or when an instance still holds blocks,
reservations or staging at the end, or is down. It prints one row per fault and ``RESULT OK``
(exit 0) only when nothing failed, ``RESULT FAILED`` (exit 1) otherwise. ``costs.py`` measures
what the checks cost (``--costs``).

Modules: ``traffic.py`` (prompts, references, sending and judging), ``matrix.py`` (the rows,
and the faults that are not failpoints), ``run.py`` (the cluster, a row, the table), ``costs.py``
(the checksum's share of a step, xxh3 against CRC32C), ``cli.py``.
"""

from __future__ import annotations

from bench.faults.cli import main
from bench.faults.matrix import ROWS, Row
from bench.faults.run import FaultsConfig, RowResult, format_table, run_matrix

__all__ = ["ROWS", "FaultsConfig", "Row", "RowResult", "format_table", "main", "run_matrix"]
