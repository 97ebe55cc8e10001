"""Chaos benchmark: faults against a running cluster, and whether every request still gets a clear answer.

Run with ``python -m bench.chaos`` (``--help`` for flags; ``--quick`` for a shorter run). It starts
a ``python -m server`` cluster at the shipped lease and timeout defaults (a Conductor plus two
prefill and two decode instances, on an etcd the bench starts itself when there is an etcd
binary; ``--server-arg`` / ``--server-args`` add flags such as ``--instance-threads 1``) on a free
loopback port, in its own session, with a cluster secret in its environment, and waits until every
instance is up. Then:

0. the **expected texts**: each prompt of a small fixed set (completions and chat) is sent once,
   alone, greedy (temperature 0) before any fault; the server (in float32 here, where batching
   does not change the rounding) is deterministic for greedy decoding, so every later answer
   that completes normally must repeat that text exactly;
1. a **steady stream** starts: Poisson arrivals (``bench.serving.arrival_times``) at ``--rate``
   req/s, each request one of those prompts, streamed (SSE) or not, ``--max-tokens`` tokens; and
   the **long-prompt load** of ``load.py`` (``--long-clients`` clients sending
   prompts of ``--long-words`` words, each twice: both answers must be the same text); both
   run under all the faults below, one after another with ``--pause-s`` between them, while a
   monitor watches the Conductor's view of every instance that is not being faulted;
2. ``kill -9`` of one of the two **decode** instances (its pid from the Conductor's ``/stats``); the
   benchmark only watches: the Conductor's supervisor must start it again (a new pid, ``up``) and
   a request must then complete with the expected text;
3. the same for one **prefill** instance;
4. **SIGSTOP** of one instance of each role (``--stop-role``) for ``--stop-s`` seconds, then SIGCONT;
   it must be up again and serve;
5. the faults of ``faults.py``: the metadata store (etcd) stopped, a replayed / stale-epoch
   control call, an unsigned 1 GiB control body (a partition is not run here:
   tests/test_across_hosts.py; a late KV writer: tests/test_late_write.py); a pool node frozen
   then killed (``pool_node.py``: fresh long prompts before and while it is frozen may each cost
   at most about the pool's 1 s call timeout more); one of two Conductors killed
   (``conductors.py``); 1,000 idle and 300 slow-header connections (``connections.py``); and,
   not in ``--quick``: a mass client disconnect (``disconnect.py``: what the clients held is free
   within seconds, and no prompt token is computed afterwards), a corrupt object on a pool SSD
   tier (``corrupt_ssd.py``, on a small cluster of its own: its prompt is served right and the
   read is counted), ten kill -9 restarts of one instance (``restarts.py``: the survivors' memory,
   threads and descriptors before and after), a minute at ten times the sustainable load
   (``overload.py``: no process's private memory more than 300 MiB above its rest);
6. a **burst** of ``--burst`` requests at once, far above what two cores serve;
7. a **fuzz** of the HTTP API: handmade bodies (malformed and truncated JSON, wrong types, huge
   numbers, 10k-deep nesting, invalid UTF-8, lone surrogates, thousands of prompts, a body over
   the size limit, ...), ``--fuzz-examples`` bodies that ``hypothesis`` generates with a fixed
   seed (structured requests with bad fields, arbitrary JSON, raw bytes, then truncated or with
   invalid bytes spliced in), raw-socket requests with bad framing, and slow clients: requests
   sent byte by byte, and ``--stall-connections`` connections that stall (no bytes, half the
   headers, half the body) while a well-formed request must still be served.

Every request has a deadline (``--deadline-s``): one with no answer by then is counted as hung,
not waited on. Afterwards the stream stops, the benchmark waits up to ``--drain-s`` for the
instances to hold nothing (aborts are asynchronous), prints a table and, with ``--json PATH``,
writes the same figures. Rows marked "must be 0":

* hung requests (well-formed or malformed);
* well-formed requests with no clear answer: a dropped connection, a stream that ends without
  ``[DONE]``, an error status without an OpenAI error body;
* completed answers whose text differs from the expected greedy text;
* requests lost while a healthy instance of their role was up (a 5xx or an error event: with two
  instances of each role and one faulted at a time, there always was one), and healthy instances
  the Conductor marked down;
* stale, replayed or altered control calls an instance accepted, and an unsigned huge control
  body the Conductor did not refuse from its headers (401 / 413, peak RSS growing less than 64 MiB);
* 5xx answers to malformed input, and malformed requests the server dropped without an answer
  (a 503, the cluster not serving, and a 500 for a body the engine accepted and then failed are
  shown apart: the rows above and below account for them);
* faults not recovered: a killed instance not restarted by the Conductor, a stopped one not up
  again, or no request served afterwards; slow-client checks that failed;
* survivor figures grown beyond their tolerance over the restarts; what the disconnected clients
  held still held a few seconds after they left, and prompt tokens computed once it was free;
  a corrupt SSD object's prompt served wrong, or its read not counted; prompts a frozen pool
  node slowed past their bound, and a frozen node no pool call ran into;
* blocks, reservations, running or waiting requests and staging ranges still held at the end
  (on the instances, and in the Conductor's books), and instances not up at the end.

The exit status is 0 when they all are 0, 1 otherwise, 2 when the cluster did not start.

The package, one module a part, over one harness: ``config.py`` (settings, prompts, row names),
``cluster.py`` (the cluster and the bench's own etcd and pool node), ``traffic.py`` (well-formed
requests and how answers are judged), ``load.py`` (the long-prompt load, the monitor),
``run.py`` (``Run``: the scenarios in order), the fault families ``faults.py`` (shared parts),
``pool_node.py``, ``conductors.py``, ``connections.py``, ``disconnect.py``, ``corrupt_ssd.py``,
``restarts.py``, ``overload.py`` and ``fuzz.py`` (malformed input), ``report.py`` (the rows and the table) and
``cli.py``. ``--only FAMILY`` runs some of the families alone.
"""

from __future__ import annotations

from bench.chaos.cli import main, run_chaos, write_json
from bench.chaos.cluster import Cluster
from bench.chaos.config import (CHAT, COMPLETED, COMPLETIONS, DISCONNECT_HELD, DISCONNECT_TOKENS, ENGINE_FAILED,
                                FROZEN_SLOW, FROZEN_UNASKED, HOST, HTTP_ERROR, HUGE, HUNG, LOST, MARKED_DOWN, PROMPTS,
                                RESTART_GROWTH, SSD_UNCOUNTED, SSD_WRONG, STALE, STREAM_ERROR, UNCLEAR, ChaosConfig)
from bench.chaos.fuzz import FuzzOutcome, RawOutcome, generated_cases, handmade_cases, raw_request
from bench.chaos.report import build_report, format_table
from bench.chaos.run import Run
from bench.chaos.traffic import Outcome, parse_sse

__all__ = ["CHAT", "COMPLETED", "COMPLETIONS", "DISCONNECT_HELD", "DISCONNECT_TOKENS", "ENGINE_FAILED", "FROZEN_SLOW",
           "FROZEN_UNASKED", "HOST", "HTTP_ERROR", "HUGE", "HUNG", "LOST", "MARKED_DOWN", "PROMPTS", "RESTART_GROWTH",
           "SSD_UNCOUNTED", "SSD_WRONG", "STALE", "STREAM_ERROR", "UNCLEAR", "ChaosConfig", "Cluster", "FuzzOutcome",
           "Outcome", "RawOutcome", "Run", "build_report", "format_table", "generated_cases", "handmade_cases",
           "main", "parse_sse", "raw_request", "run_chaos", "write_json"]
