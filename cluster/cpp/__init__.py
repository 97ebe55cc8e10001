"""Chunked pipeline parallel prefill (CPP, FAST'25 §3.2): one prefill instance as a group of
stages, each holding a contiguous share of the layers.

* ``stage.py``: the data path between stages (``StageLink``: a chunk's hidden states forward,
  its KV streamed layer by layer like any prefill's, ``StageStreams`` as one sink of the
  first stage's prefill);
* ``group.py``: how the stages are started, found and watched (``StageGroup``; their
  ``StageSpec`` is a message of ``cluster/protocol/``;
  ``python -m cluster.cpp.group``);
* ``pool_stages.py``: the first stage's side of its group's KVCache pool traffic, as its
  ``PoolIO`` asks it (``LaterStages``; ``OneStage``: an instance that holds every layer);
* ``pool_share.py``: a later stage's share of its group's KVCache pool traffic (its layers of
  each object).
"""
