"""The Conductor: the cluster's front door. One job per file:

* ``conductor.py``: the ``EngineClient`` the HTTP server talks to (readiness, lease renewal,
  statistics), deciding and booking each request in one synchronous step;
* ``placement.py``: the policies (pure): a placement or a refusal;
* ``ledger.py``: what was routed where, with rollback;
* ``flow.py``: one request through the instances, with its compensations;
* ``client.py``: the only HTTP to instances (typed calls, timeouts, error mapping);
* ``registry.py``: polling the instances (health, cached prefix keys);
* ``elastic.py``: elastic roles (``--elastic-roles``): the policy asked every
  interval with what placement predicted, and the switch of one instance between prefill and decode;
* ``supervisor.py``: starting and restarting the instance processes of a cluster on this machine.

The policies it applies are pure code in ``cluster/policies/``, shared with the simulator.
"""
