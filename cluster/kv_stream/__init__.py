"""A prefill's KV, layer by layer, into a decode instance's reservation (FAST'25 §4.1, Fig. 4).

Below the instances and the pipeline stages, which both stream (``cluster/instance/`` a whole
model's layers, ``cluster/cpp/`` a stage's); above the Messenger, which carries the bytes. One
job per file:

* ``destination.py``: ``KVDestination``, where the decode instance takes a request's KV;
* ``checksums.py``: the checksum trailer of each layer, written by the sender, verified by the receiver;
* ``sink.py``: ``PrefillSink``, what a prompt's KV sinks share around the stream: expect, then
  finish or abort (the decode stream, the later pipeline stages' streams, the pool's store);
* ``sender.py``: ``KVSender``, the prefill engine's ``KVSink`` that packs and writes each layer,
  and ``DecodeStream``, a prompt's stream through it as a ``PrefillSink``.
"""

from cluster.kv_stream.destination import KVDestination
from cluster.kv_stream.checksums import layer_checksum, layer_checksums, layer_seed, sums_bytes, verify_layers
from cluster.kv_stream.sink import PrefillSink, PrefillSinks
from cluster.kv_stream.sender import DecodeStream, KVSender, SendReport, settle

__all__ = ["DecodeStream", "KVDestination", "KVSender", "PrefillSink", "PrefillSinks", "SendReport", "layer_checksum",
           "layer_checksums", "layer_seed", "settle", "sums_bytes", "verify_layers"]
