"""Who is in the cluster, kept in etcd so that any number of Conductors can front one set of
instances (Mooncake runs Kimi with many front ends; no home-made consensus: etcd's leases). The
metadata store's second user, beside the pool's index: the same contract, other keys.

* An instance **announces** itself (``announce``): ``members/instances/<instance id>`` holds its
  URL and role under a lease it keeps alive. When it dies the lease runs out and the key is gone.
  The record carries a MAC under the cluster's membership key (``derive_key(secret,
  MEMBERSHIP)``) over its id, URL and role: whoever can write to etcd but holds no secret cannot
  add an instance (one such write once sent a fake instance 14 of 20 requests).
* Every Conductor **lists** the announced instances (``list_instances``) every second or so and
  polls each it finds (``cluster.conductor.registry``); a record whose MAC fails is not listed
  but counted (``Listing.refused``, the Conductor's /metrics). Instances named by hand
  (``--instance``, or registering with ``--conductor``: a signed call) are polled as well, so a
  cluster without etcd still works.
* A Conductor **claims** its id (``claim_conductor``): ``members/conductors/<id>`` is created
  under its own lease, and the store's revision at the creation is its epoch
  (``cluster.protocol.Fence``). A Conductor started again under the same id claims anew once its
  dead predecessor's lease has run out, at a larger revision: instances then release what the
  predecessor reserved, whatever the clocks say. While a live Conductor holds the id, a second
  one with the same id is refused (two Conductors with one id would fence each other off).
  The claim's record carries the epoch, under a MAC like an instance's record; an instance with
  the store takes a Conductor's epoch only if its claim says so (``conductor_epoch``,
  ``cluster.instance.epochs``). The epoch lives in the record, not in the store's revision: a
  store rebuilt empty or restored from a snapshot gets the record written again, epoch and all,
  by the claim's keeper (below), and a Conductor restarted on it claims anew at whatever revision
  the store is at now, lower perhaps, which the instances take because the claim says so.

* With elastic roles, one Conductor at a time **decides** role switches (``hold_decider``):
  ``members/elastic/decider`` is created under its lease by whichever asks first, and the others
  ask again until it is gone. A decider decides only while its lease is surely alive
  (``LeasedKey.held``): one paused past its TTL stops before another can have taken over.

Every signed record carries the time its signature **expires** (``SIGNED_LIFETIME_S`` after it was
signed, in the MAC): its keeper signs it again every third of that. A record copied out of the
store and written back later (by someone who can write to etcd but holds no secret: a replay of
a dead instance's record, outside any lease, which would stay for good) is refused once it has
expired.

A key is kept by a ``LeasedKey``: a thread that renews the lease every third of its TTL and, if
the lease was lost all the same (the process was paused or cut off for longer, or the store was
rebuilt or restored), writes the key again under a new one; an exclusive key found held by
another is waited for as a claim waits (a predecessor's record restored from a snapshot lapses
within its TTL), and given up past that. Every store call is bounded by the store's own timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.metadata import LeaseGone, MetadataStore, MetadataUnavailable

log = logging.getLogger(__name__)

INSTANCES = "members/instances/"
CONDUCTORS = "members/conductors/"
DEFAULT_TTL_S = 3.0


class LeasedKey:
    """``key`` = ``value`` under a lease of its own, kept alive by a daemon thread until ``close``
    (which revokes the lease: the key is gone at once). Made by ``hold``, which writes it first.
    When the lease ran out all the same, the key is written again under a new one; an
    ``exclusive`` key that another process holds meanwhile is given up (``lost`` is set) once it
    has been held for longer than a claim waits (twice the TTL, and a second)."""

    def __init__(self, store: MetadataStore, key: str, value: str, lease: int, ttl_s: float, *,
                 exclusive: bool, granted_at: float | None = None, sign: Callable[[], str] | None = None) -> None:
        self.store, self.key, self.value, self.ttl_s = store, key, value, ttl_s
        self._sign = sign  # makes the value again, signed anew (``rewrite``)
        self._signed_at = time.monotonic()
        self._lease: int | None = lease  # None while none is held (being written again)
        # Monotonic: the lease is surely alive till then (its last renewal was asked before
        # ``valid_until - ttl_s``); after it, this process cannot tell, whatever it was doing.
        self.valid_until = (time.monotonic() if granted_at is None else granted_at) + ttl_s
        self._exclusive = exclusive
        self._stop = threading.Event()
        self.lost = threading.Event()  # set when the key could not be written again (held by another)
        self._held_by_other_since: float | None = None
        self._thread = threading.Thread(target=self._keep, name=f"lease {key}", daemon=True)
        self._thread.start()

    @classmethod
    def hold(cls, store: MetadataStore, key: str, value: str | Callable[[], str], ttl_s: float, *,
             exclusive: bool) -> tuple[LeasedKey, int] | None:
        """Write the key under a new lease and keep it: with ``exclusive``, only if it is absent
        (None when it is held; the lease is revoked). Also answers the store's revision of the
        write (0 when not ``exclusive``: ``put`` answers none). A ``value`` given as a function
        makes a signed record: called again every third of ``SIGNED_LIFETIME_S`` (``rewrite``)."""
        sign = value if callable(value) else None
        value = sign() if sign is not None else value
        asked = time.monotonic()
        lease = store.grant_lease(ttl_s)
        try:
            if exclusive:
                revision = store.create(key, value, lease)
                if revision is None:
                    store.revoke(lease)
                    return None
            else:
                store.put(key, value, lease)
                revision = 0
        except BaseException:
            store.revoke(lease)
            raise
        return cls(store, key, value, lease, ttl_s, exclusive=exclusive, granted_at=asked, sign=sign), revision

    @property
    def held(self) -> bool:
        """Whether the key is surely this process's now: kept, and renewed within its TTL (a
        process paused past it may have lost it to another without knowing yet)."""
        return not (self.lost.is_set() or self._stop.is_set()) and time.monotonic() < self.valid_until

    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if self._lease is not None:
                    try:
                        asked = time.monotonic()
                        self.store.keepalive(self._lease)
                        self.valid_until = asked + self.ttl_s
                        if self._sign is not None and asked - self._signed_at >= SIGNED_LIFETIME_S / 3:
                            self.rewrite(self._sign)
                        continue
                    except LeaseGone:
                        log.warning("the lease of %s ran out (this process was paused or cut off from the store, "
                                    "or the store was rebuilt); writing it again", self.key)
                        self._lease = None
                if not self._write_again():
                    log.error("%s is held by another process now: giving it up", self.key)
                    self.lost.set()
                    return
            except MetadataUnavailable as e:  # retried at the next round; the lease has two more
                log.warning("keeping %s: %s", self.key, e)

    def _write_again(self) -> bool:
        """Write the key under a new lease (``_lease`` None: none held now); False once an
        exclusive key has been held by another for longer than a claim waits."""
        asked = time.monotonic()
        if self._sign is not None:  # its signature may have aged while the store was away
            self.value, self._signed_at = self._sign(), asked
        lease = self.store.grant_lease(self.ttl_s)
        if not self._exclusive:
            self.store.put(self.key, self.value, lease)
        elif self.store.create(self.key, self.value, lease) is None:
            self.store.revoke(lease)
            now = time.monotonic()
            self._held_by_other_since = self._held_by_other_since or now
            return now - self._held_by_other_since <= 2 * self.ttl_s + 1
        self._lease, self._held_by_other_since, self.valid_until = lease, None, asked + self.ttl_s
        return True

    def rewrite(self, sign: Callable[[], str]) -> None:
        """Write ``sign()`` under the key's lease now (right after ``hold``, or as its signature
        ages), and from now on whenever the key is written again; signed anew every third of
        ``SIGNED_LIFETIME_S``."""
        self._sign, self._signed_at = sign, time.monotonic()
        self.value = sign()
        if self._lease is not None:
            self.store.put(self.key, self.value, self._lease)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.ttl_s)  # a store call in flight is bounded by the store's timeout
        if self._lease is None:
            return
        try:
            self.store.revoke(self._lease)
        except MetadataUnavailable as e:  # it runs out by itself within the TTL
            log.warning("could not revoke the lease of %s: %s", self.key, e)


# -- instances ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """An announced instance."""

    instance_id: str
    url: str
    role: str


@dataclass(frozen=True)
class Listing:
    """What ``list_instances`` found: the members whose records verified, and the keys of the
    records that did not (unsigned, signed with another key, altered, or malformed)."""

    members: list[Member]
    refused: list[str] = field(default_factory=list)


# Versioned: a change of the signed fields cannot be confused with an earlier one.
_MEMBER_LABEL = "mooncake-py/member/v2"

# A signed record is good for this long after it was signed (its keeper signs it again every third
# of it); clocks of the hosts may differ by up to CLOCK_SKEW_S.
SIGNED_LIFETIME_S = 600.0
CLOCK_SKEW_S = 60.0


def _expiry() -> int:
    """When a record signed now expires: Unix seconds (wall clock, as other hosts read it)."""
    return int(time.time() + SIGNED_LIFETIME_S)


def _unexpired(expires: Any) -> bool:
    return type(expires) is int and time.time() <= expires + CLOCK_SKEW_S


def _mac(key: bytes, label: str, *fields: Any) -> str:
    """The MAC of a record of one kind (``label``, versioned: a change of the signed fields cannot
    be confused with an earlier one). JSON of a list: every tuple of fields has exactly one
    encoding, whatever characters they hold."""
    return hmac.new(key, json.dumps([label, *fields]).encode(), hashlib.sha256).hexdigest()


def _member_mac(key: bytes, instance_id: str, url: str, role: str, expires: int) -> str:
    return _mac(key, _MEMBER_LABEL, instance_id, url, role, expires)


def announce(store: MetadataStore, key: bytes, instance_id: str, url: str, role: str,
             ttl_s: float = DEFAULT_TTL_S) -> LeasedKey:
    """Put this instance in the membership until ``close`` (or its death, plus ``ttl_s``), signed
    with the membership ``key`` (and signed again before the signature expires)."""
    def signed() -> str:
        expires = _expiry()
        return json.dumps({"url": url, "role": role, "expires": expires,
                           "mac": _member_mac(key, instance_id, url, role, expires)})
    held = LeasedKey.hold(store, INSTANCES + instance_id, signed, ttl_s, exclusive=False)
    assert held is not None  # a put under a fresh lease cannot find the key held
    return held[0]


def list_instances(store: MetadataStore, key: bytes,
                   verdicts: dict[str, tuple[str, tuple[Member, int] | None]] | None = None) -> Listing:
    """The instances announced now whose records carry a valid, unexpired MAC under the membership
    ``key``; the others are refused (their keys in ``Listing.refused``). ``verdicts``: a caller that
    lists again and again keeps each record's value and verdict there (record name -> (value,
    (member, expiry) or None)), so that a record unchanged since the last listing is not parsed and
    checked again: thousands of records written without the secret cost a dict lookup each, not an
    HMAC. (An expiry is checked at every listing: a record that stays unchanged ages.)"""
    verdicts = {} if verdicts is None else verdicts
    records = store.get_prefix(INSTANCES)
    members, refused = [], []
    for name, value in records.items():
        known = verdicts.get(name)
        if known is None or known[0] != value:
            known = verdicts[name] = (value, _verified(name[len(INSTANCES):], value, key))
        if known[1] is None or not _unexpired(known[1][1]):
            refused.append(name)
        else:
            members.append(known[1][0])
    for name in [n for n in verdicts if n not in records]:
        del verdicts[name]
    return Listing(members, refused)


def _verified(instance_id: str, value: str, key: bytes) -> tuple[Member, int] | None:
    """The member a record names and when its signature expires, if its MAC verifies."""
    try:
        entry = json.loads(value)
        url, role, expires, mac = entry["url"], entry["role"], entry["expires"], entry["mac"]
        if not (isinstance(url, str) and isinstance(role, str) and type(expires) is int and isinstance(mac, str)):
            raise TypeError("url, role and mac must be strings, expires an integer")
    except (ValueError, KeyError, TypeError) as e:
        log.debug("refusing the membership record of %s: %s", instance_id, e)
        return None
    if not hmac.compare_digest(mac, _member_mac(key, instance_id, url, role, expires)):
        return None
    return Member(instance_id, url, role), expires


# -- Conductors -----------------------------------------------------------------------------------


class ConductorIdTaken(RuntimeError):
    """Another live Conductor holds this id."""


_CLAIM_LABEL = "mooncake-py/conductor-claim/v2"


def _claim_mac(key: bytes, conductor_id: str, url: str, epoch: int, expires: int) -> str:
    return _mac(key, _CLAIM_LABEL, conductor_id, url, epoch, expires)


def claim_conductor(store: MetadataStore, key: bytes, conductor_id: str, url: str, ttl_s: float = DEFAULT_TTL_S,
                    wait_s: float | None = None) -> tuple[LeasedKey, int]:
    """Claim ``conductor_id``; answers the claim and the epoch (the store's revision at the
    claim), which the claim's record carries from then on, signed with the membership ``key``.
    An earlier claim is waited for up to ``wait_s`` (default: twice the TTL, by when the lease of
    a Conductor that died has run out); past that, ``ConductorIdTaken``."""
    wait_s = 2 * ttl_s + 1 if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    value = json.dumps({"url": url})
    logged = False
    while True:
        held = LeasedKey.hold(store, CONDUCTORS + conductor_id, value, ttl_s, exclusive=True)
        if held is not None:
            claim, epoch = held

            def signed(epoch: int = epoch) -> str:
                expires = _expiry()
                return json.dumps({"url": url, "epoch": epoch, "expires": expires,
                                   "mac": _claim_mac(key, conductor_id, url, epoch, expires)})
            try:  # no call carries the epoch before the record does
                claim.rewrite(signed)
            except BaseException:
                claim.close()
                raise
            return claim, epoch
        if time.monotonic() >= deadline:
            holder = store.get(CONDUCTORS + conductor_id)
            raise ConductorIdTaken(f"Conductor id {conductor_id!r} is held by a live Conductor ({holder}); give "
                                   "this one another --conductor-id")
        if not logged:
            log.info("Conductor id %r is still held (by a Conductor that is alive, or died less than %g s ago); "
                     "waiting up to %g s", conductor_id, ttl_s, wait_s)
            logged = True
        time.sleep(min(0.25, ttl_s / 4))


def conductor_epoch(store: MetadataStore, key: bytes, conductor_id: str) -> int | None:
    """The epoch ``conductor_id``'s claim carries now; None when it is not claimed, or its record
    has no epoch yet, fails its MAC under the membership ``key`` (written without the secret) or
    has expired (a replay)."""
    value = store.get(CONDUCTORS + conductor_id)
    if value is None:
        return None
    try:
        entry = json.loads(value)
        url, epoch, expires, mac = entry["url"], entry["epoch"], entry["expires"], entry["mac"]
        if not (isinstance(url, str) and type(epoch) is int and type(expires) is int and isinstance(mac, str)):
            raise TypeError("url and mac must be strings, epoch and expires integers")
    except (ValueError, KeyError, TypeError) as e:
        log.debug("ignoring the claim record of Conductor %r: %s", conductor_id, e)
        return None
    signed = hmac.compare_digest(mac, _claim_mac(key, conductor_id, url, epoch, expires))
    return epoch if signed and _unexpired(expires) else None


# -- the cluster's one elastic-roles decider ------------------------------------------------------

# Held by the one Conductor that decides role switches (``cluster/conductor/elastic.py``): two
# deciding each on its own view could switch the last two decode instances at once.
ELASTIC_DECIDER = "members/elastic/decider"


_DECIDER_LABEL = "mooncake-py/elastic-decider/v2"


def _decider_mac(key: bytes, conductor_id: str, expires: int) -> str:
    return _mac(key, _DECIDER_LABEL, conductor_id, expires)


def hold_decider(store: MetadataStore, key: bytes, conductor_id: str, ttl_s: float = DEFAULT_TTL_S
                 ) -> LeasedKey | None:
    """Become the cluster's elastic-roles decider if none is (None: another Conductor is). The
    key's lease is etcd's: a decider that dies or is cut off loses it within ``ttl_s``. Its record
    is signed with the membership ``key``: one written without the secret (which would stop every
    Conductor from deciding, for good, if it had no lease) is deleted and the key taken."""
    def signed() -> str:
        expires = _expiry()
        return json.dumps({"conductor": conductor_id, "expires": expires,
                           "mac": _decider_mac(key, conductor_id, expires)})
    held = LeasedKey.hold(store, ELASTIC_DECIDER, signed, ttl_s, exclusive=True)
    if held is None and (current := store.get(ELASTIC_DECIDER)) is not None and _decider_of(current, key) is None:
        log.warning("elastic roles: deleting the decider record %r: not signed with the cluster's membership key "
                    "(written by someone without the cluster secret, or altered)", current[:200])
        store.delete(ELASTIC_DECIDER)
        held = LeasedKey.hold(store, ELASTIC_DECIDER, signed, ttl_s, exclusive=True)
    return None if held is None else held[0]


def decider(store: MetadataStore, key: bytes) -> str | None:
    """The id of the Conductor that decides role switches now, if any and if its record verifies
    under the membership ``key``."""
    value = store.get(ELASTIC_DECIDER)
    return None if value is None else _decider_of(value, key)


def _decider_of(value: str, key: bytes) -> str | None:
    try:
        entry = json.loads(value)
        conductor, expires, mac = entry["conductor"], entry["expires"], entry["mac"]
        if not (isinstance(conductor, str) and type(expires) is int and isinstance(mac, str)):
            return None
    except (ValueError, KeyError, TypeError):
        return None
    signed = hmac.compare_digest(mac, _decider_mac(key, conductor, expires))
    return conductor if signed and _unexpired(expires) else None
