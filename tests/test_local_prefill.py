"""Local prefill through a real cluster (issue 39): with ``--local-prefill`` a request that would
queue behind a long prompt on the prefill instance is prefilled on the decode instance instead,
and answers what the colocated engine answers; one that would not queue goes to the prefill
instance as before."""

from __future__ import annotations

import threading

import pytest

from bench.harness import until
from clusters import Cluster, words
from engine import SamplingParams

pytestmark = pytest.mark.processes

# SLOs loose enough that only "sooner" decides; steps of at most 128 tokens, so the long prompt
# below keeps the prefill instance busy for several steps.
FLAGS = ("--prefill-instances", "1", "--decode-instances", "1", "--no-pool", "--max-num-batched-tokens", "128",
         "--local-prefill", "--slo-ttft-s", "600", "--slo-tbt-s", "600")


def test_a_prompt_queued_behind_a_long_one_prefills_on_the_decode_instance(tmp_path, colocated):
    cluster = Cluster(FLAGS, 2, tmp_path)
    try:
        (decode,) = cluster.instances("decode")

        def computed_on_decode() -> int:  # its calibration's prompts included
            return cluster.instance_stats(decode["url"])["num_prompt_tokens_computed"]

        greedy = dict(temperature=0, max_tokens=8)
        # Alone: the prefill instance is idle, so it is sooner there.
        before = computed_on_decode()
        first = cluster.complete("The capital of France is", **greedy)
        assert first["choices"][0]["text"].startswith(" Paris")
        assert cluster.stats()["local_prefills"] == 0 and computed_on_decode() == before

        long_prompt = words("queue", 700)
        done = threading.Event()
        threading.Thread(target=lambda: (cluster.complete(long_prompt, max_tokens=2), done.set()), daemon=True).start()
        # Once the long prompt is booked on the prefill instance, the next one would wait behind it.
        until(lambda: any(i["prefilling"] for i in cluster.instances("prefill")), 60, "the long prompt to be placed",
              every_s=0.02)
        short = "List three colors of the rainbow:"
        got = cluster.complete(short, **greedy)
        assert cluster.stats()["local_prefills"] == 1 and computed_on_decode() > before
        (want,) = colocated.generate([short], SamplingParams(**greedy))
        assert got["choices"][0]["text"] == want.text
        assert done.wait(300)
        assert cluster.stats()["requests_failed"] == 0
        cluster.assert_clean()
    finally:
        cluster.close()
