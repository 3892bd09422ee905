"""The event encoding and the pure chain verifier."""

from __future__ import annotations

import hashlib

import pytest

from keepstate.session import GENESIS, Event, canonical, event_hash, verify_events


def test_canonical_encoding_is_sorted_compact_utf8() -> None:
    assert canonical({"b": 1, "a": {"d": [1, 2], "c": "é"}}) == '{"a":{"c":"é","d":[1,2]},"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical({"x": float("nan")})


def test_hash_is_sha256_of_the_canonical_fields_without_hash() -> None:
    ev = Event.make("s1", 1, 1700000000.5, "sandbox.create", {"template_id": "base"}, GENESIS)
    body = ('{"data":{"template_id":"base"},"kind":"sandbox.create","prev":"' + GENESIS +
            '","seq":1,"session_id":"s1","ts":1700000000.5}')
    assert ev.hash == hashlib.sha256(body.encode()).hexdigest()
    assert event_hash("s1", 1, 1700000000.5, "sandbox.create", {"template_id": "base"}, GENESIS) == ev.hash


def _chain(n: int) -> list[Event]:
    out, prev = [], GENESIS
    for i in range(1, n + 1):
        ev = Event.make("s", i, 1.0 * i, "k", {"i": i}, prev)
        out.append(ev)
        prev = ev.hash
    return out


def test_verify_events_finds_the_first_broken_link() -> None:
    chain = _chain(5)
    assert verify_events("s", chain).ok and verify_events("s", chain).checked == 5
    forged = Event.make("s", 3, 3.0, "k", {"i": 99}, chain[1].hash)  # self-consistent, but 4 links to the old 3
    result = verify_events("s", [*chain[:2], forged, *chain[3:]])
    assert not result.ok and result.first_bad_seq == 4 and "prev" in (result.reason or "")
    missing = verify_events("s", [*chain[:2], *chain[3:]])
    assert not missing.ok and missing.first_bad_seq == 3


def test_from_dict_names_bad_fields() -> None:
    d = _chain(1)[0].to_dict()
    del d["prev"]
    with pytest.raises(ValueError, match="prev"):
        Event.from_dict(d)
    with pytest.raises(ValueError, match="seq"):
        Event.from_dict({**_chain(1)[0].to_dict(), "seq": "1"})
