"""The cluster's membership in the metadata store (``cluster.metadata.membership``): instances
announce themselves under leases, Conductors claim their ids and take their epochs from the
claim's revision; a record not signed with the membership key is refused. On ``LocalMetadata`` with short TTLs (the etcd backend's ``create`` is checked by
tests/test_pool_metadata.py; the whole, over a real etcd, by tests/test_across_hosts.py)."""

from __future__ import annotations

import json
import time

import pytest

from cluster.metadata.local import LocalMetadata
from cluster.metadata.membership import (
    CONDUCTORS, ConductorIdTaken, Member, announce, claim_conductor, list_instances)
from cluster.protocol import MEMBERSHIP, derive_key

TTL_S = 0.3
KEY = derive_key(b"s" * 32, MEMBERSHIP)


def _until(condition, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_announced_instance_is_listed_until_it_leaves_and_vanishes_when_it_dies():
    store = LocalMetadata()
    a = announce(store, KEY, "id-a", "http://10.0.0.1:8100", "prefill", ttl_s=TTL_S)
    b = announce(store, KEY, "id-b", "http://10.0.0.2:8100", "decode", ttl_s=TTL_S)
    try:
        time.sleep(3 * TTL_S)  # kept alive past several TTLs
        assert sorted(list_instances(store, KEY).members, key=lambda m: m.instance_id) == [
            Member("id-a", "http://10.0.0.1:8100", "prefill"), Member("id-b", "http://10.0.0.2:8100", "decode")]
        a.close()  # leaving: gone at once
        assert [m.instance_id for m in list_instances(store, KEY).members] == ["id-b"]
        # A death: nobody renews (the thread stops, the lease is not revoked), gone within the TTL.
        b._stop.set()
        b._thread.join()
        _until(lambda: not list_instances(store, KEY).members, 3 * TTL_S)
    finally:
        a.close()
        b.close()


def test_a_record_without_a_valid_mac_is_refused_and_counted():
    store = LocalMetadata()
    good = announce(store, KEY, "good", "http://x:2", "decode", ttl_s=TTL_S)
    try:
        signed = store.get("members/instances/good")
        store.put("members/instances/bad", "not json")
        store.put("members/instances/partial", '{"url": "http://x:1"}')
        # One unsigned write, as the fake instance of issue 40 was put in.
        store.put("members/instances/fake", '{"url": "http://evil:1", "role": "prefill"}')
        # A real record under another id, or with its URL or role changed, or another cluster's key.
        store.put("members/instances/moved", signed)
        store.put("members/instances/redirected", signed.replace("http://x:2", "http://evil:2"))
        store.put("members/instances/promoted", signed.replace('"decode"', '"prefill"'))
        store.put("members/instances/foreign", '{"url": "http://y:3", "role": "decode", "mac": "' + "0" * 64 + '"}')
        listing = list_instances(store, KEY)
        assert listing.members == [Member("good", "http://x:2", "decode")]
        assert sorted(listing.refused) == sorted(f"members/instances/{n}" for n in (
            "bad", "partial", "fake", "moved", "redirected", "promoted", "foreign"))
        assert list_instances(store, derive_key(b"t" * 32, MEMBERSHIP)).members == []  # another cluster's key
    finally:
        good.close()


def test_an_announcement_whose_lease_ran_out_is_written_again():
    store = LocalMetadata()
    a = announce(store, KEY, "id-a", "http://10.0.0.1:8100", "prefill", ttl_s=TTL_S)
    try:
        store.revoke(a._lease)  # as if the process had been paused past its TTL
        assert list_instances(store, KEY).members == []
        _until(lambda: len(list_instances(store, KEY).members) == 1, 3 * TTL_S)
    finally:
        a.close()


def test_a_conductor_id_is_claimed_once_and_a_restart_gets_a_larger_epoch():
    store = LocalMetadata()
    first, epoch1 = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    other, epoch_other = claim_conductor(store, KEY, "c2", "http://h:8001", ttl_s=TTL_S)
    try:
        # A second Conductor with a live one's id is refused once the wait is over.
        start = time.monotonic()
        with pytest.raises(ConductorIdTaken, match="c1"):
            claim_conductor(store, KEY, "c1", "http://h2:8000", ttl_s=TTL_S, wait_s=0.5)
        assert time.monotonic() - start >= 0.5
        # The first dies (no revoke): its successor waits out the lease and claims anew, newer.
        first._stop.set()
        first._thread.join()
        second, epoch2 = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
        assert epoch2 > max(epoch1, epoch_other)
        # A clean stop frees the id at once.
        second.close()
        assert store.get(CONDUCTORS + "c1") is None
        third, epoch3 = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S, wait_s=0)
        assert epoch3 > epoch2
        third.close()
    finally:
        first.close()
        other.close()


def test_a_claim_taken_while_its_holder_was_cut_off_is_given_up():
    store = LocalMetadata()
    claim, _ = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    try:
        store.revoke(claim._lease)  # its lease ran out while it was paused ...
        intruder, _ = claim_conductor(store, KEY, "c1", "http://other:8000", ttl_s=TTL_S, wait_s=0)  # ... and it was taken
        # Given up once held by the other for longer than a claim waits (a restored record would
        # have lapsed by then).
        start = time.monotonic()
        _until(claim.lost.is_set, 2 * TTL_S + 1 + 3 * TTL_S)
        assert time.monotonic() - start >= 2 * TTL_S + 1 - TTL_S
        assert json.loads(store.get(CONDUCTORS + "c1"))["url"] == "http://other:8000"
        intruder.close()
    finally:
        claim.close()


def test_records_unchanged_since_the_last_listing_are_not_checked_again(monkeypatch):
    """Issue 52: 20,000 records written without the secret were parsed and MAC-checked every
    second (a Conductor at 0.27 core). With the caller's verdicts kept, a record is checked when
    it appears or changes; a change of its value is checked anew; a deleted one is forgotten."""
    from cluster.metadata import membership

    store = LocalMetadata()
    good = announce(store, KEY, "good", "http://x:2", "decode", TTL_S * 10)
    try:
        for i in range(50):
            store.put(f"members/instances/fake{i}", '{"url": "http://evil:1", "role": "prefill", "mac": "00"}')
        checked = []
        real = membership._verified
        monkeypatch.setattr(membership, "_verified", lambda *a: checked.append(a[0]) or real(*a))
        verdicts: dict = {}
        first = list_instances(store, KEY, verdicts)
        assert first.members == [Member("good", "http://x:2", "decode")] and len(first.refused) == 50
        assert len(checked) == 51
        checked.clear()
        again = list_instances(store, KEY, verdicts)
        assert again.members == first.members and sorted(again.refused) == sorted(first.refused) and not checked
        signed = store.get("members/instances/good")
        store.put("members/instances/good", signed.replace("http://x:2", "http://evil:2"))  # altered: refused
        store.delete("members/instances/fake0")
        listing = list_instances(store, KEY, verdicts)
        assert checked == ["good"] and listing.members == [] and len(listing.refused) == 50
        assert "members/instances/fake0" not in verdicts
    finally:
        good.close()


def test_a_signed_record_is_signed_again_while_kept_and_a_replayed_one_expires(monkeypatch):
    """Issue 52 item 7: a signed record copied out of etcd and written back after its instance
    died (outside any lease: it would stay for good) was listed for ever. Each record's MAC now
    covers when it expires; its keeper signs it again in time, and a replay is refused once it
    has expired (the instance's record, a Conductor's claim, the elastic decider's)."""
    from cluster.metadata import membership

    monkeypatch.setattr(membership, "SIGNED_LIFETIME_S", 3.0)  # in whole seconds: good for 2 to 3 s
    monkeypatch.setattr(membership, "CLOCK_SKEW_S", 0.0)
    store = LocalMetadata()
    member = announce(store, KEY, "i1", "http://x:1", "prefill", TTL_S)
    claim, epoch = claim_conductor(store, KEY, "c1", "http://h:8000", ttl_s=TTL_S)
    decides = membership.hold_decider(store, KEY, "c1", TTL_S)
    try:
        first = store.get("members/instances/i1")
        time.sleep(3.5)  # past the first signature's expiry: kept records were signed again
        assert store.get("members/instances/i1") != first
        assert list_instances(store, KEY).members == [Member("i1", "http://x:1", "prefill")]
        assert membership.conductor_epoch(store, KEY, "c1") == epoch and membership.decider(store, KEY) == "c1"
        records = {k: store.get(k) for k in ("members/instances/i1", CONDUCTORS + "c1", membership.ELASTIC_DECIDER)}
    finally:
        member.close()
        claim.close()
        decides.close()
    for k, v in records.items():
        store.put(k, v)  # written back by someone without the secret, outside any lease
    assert list_instances(store, KEY).members == [Member("i1", "http://x:1", "prefill")]  # still in its lifetime
    time.sleep(3.5)
    listing = list_instances(store, KEY)
    assert listing.members == [] and listing.refused == ["members/instances/i1"]
    assert membership.conductor_epoch(store, KEY, "c1") is None and membership.decider(store, KEY) is None
