"""The Conductor's policies: pure functions of plain snapshots, shared by the live Conductor and
the simulator (``bench/sim``), so both decide identically. Nothing here does I/O.

* ``snapshot.py``: what the policies see of a request and of each instance;
* ``prefix_index.py``: which instance holds which prefix blocks (the Conductor's view);
* ``scheduling.py``: the prefill choice (Algorithm 1, beside the paper's baselines) and the
  decode load balancer;
* ``early_rejection.py``: admission under overload (§7: early rejection and its prediction);
* ``elastic_roles.py``: when to move one instance between prefill and decode, and which
  (elastic roles instead of refusals);
* ``cost_model.py``: predicted prefill time and decode step time, fitted at an instance's start.
"""
