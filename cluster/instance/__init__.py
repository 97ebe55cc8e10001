"""A prefill, decode or colocated ("both") instance: one engine process the Conductor drives.

``python -m server --role prefill|decode|both --conductor URL`` runs this. One job per file:

* ``service.py``: bring-up (engine, Messenger, staging, calibration), registration, and the
  snapshots polls are answered from (``cache_mirror.py``: the prefix keys as changes);
* ``calibration.py``: the cost models measured on this instance's engine at start;
* ``receiver.py``: reservations (leases the Conductors renew, fenced per Conductor, staging held back);
* ``epochs.py``: which epoch of each Conductor is taken (the one its claim in etcd carries);
* ``prefill.py``: serve a prefill and stream its KV into a decode instance's reservation
  (``cluster/kv_stream/``, below the instances: a pipeline stage streams too);
* ``decode.py``: continue decoding from received KV, and whole (colocated) requests;
* ``replication.py``: hot-prefix push and adopt;
* ``roles.py``: an elastic instance's role and its switch between prefill and decode (drain, then
  change);
* ``routes.py``: the ``/instance/*`` control routes over all of these.
"""
