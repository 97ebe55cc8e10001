"""The Conductor: the cluster's front door. One job per file:

* ``conductor.py``: the ``EngineClient`` the HTTP server talks to (readiness, lease renewal,
  statistics), deciding and booking each request in one synchronous step;
* ``placement.py``: the policies (pure): a placement or a refusal;
* ``ledger.py``: what was routed where, with rollback;
* ``flow.py``: one request through the instances, with its compensations;
* ``client.py``: the only HTTP to instances (typed calls, timeouts, error mapping);
* ``registry.py``: polling the instances (health, cached prefix keys).
"""

from cluster.conductor.conductor import Conductor, ConductorConfig
from cluster.conductor.placement import PlacementConfig

__all__ = ["Conductor", "ConductorConfig", "PlacementConfig"]
