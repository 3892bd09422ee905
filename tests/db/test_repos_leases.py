"""Leases on SQLite and PostgreSQL (the `store-gc` lease of paused retention): one holder at a time, even when many
race for it; a lease that runs out by the database's clock goes to the next taker; a holder whose token is stale can
neither renew nor release it; each acquisition moves the token on."""

from __future__ import annotations

import asyncio

import pytest

from keepstate.db.engine import Database
from keepstate.db.repos import Leases, Nodes


async def test_one_holder_at_a_time_and_release_hands_it_on(database: Database) -> None:
    leases = Leases(database)
    assert await leases.get("store-gc") is None
    first = await leases.acquire("store-gc", "a", ttl_s=60)
    assert first == 1
    assert await leases.acquire("store-gc", "b", ttl_s=60) is None  # a holds it
    assert await leases.acquire("store-gc", "a", ttl_s=60) is None  # held already, by a itself too
    assert await leases.acquire("other", "b", ttl_s=60) == 1  # another name is another lease
    now = await Nodes(database).now()
    renewed = await leases.renew("store-gc", "a", first, ttl_s=120)
    assert renewed is not None and renewed == pytest.approx(now + 120, abs=5)
    assert await leases.renew("store-gc", "b", first, ttl_s=60) is None  # not b's
    held = await leases.get("store-gc")
    assert held is not None and (held.holder, held.token, held.expires_at) == ("a", first, renewed)
    assert await leases.release("store-gc", "a", first)
    second = await leases.acquire("store-gc", "b", ttl_s=60)
    assert second == first + 1  # every acquisition moves the token on
    assert await leases.renew("store-gc", "a", first, ttl_s=60) is None  # a's token is stale
    assert not await leases.release("store-gc", "a", first)  # and cannot give away b's lease
    assert (await leases.get("store-gc")).holder == "b"  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        await leases.acquire("store-gc", "", ttl_s=60)


async def test_a_lease_that_runs_out_goes_to_the_next_taker(database: Database) -> None:
    leases = Leases(database)
    stale = await leases.acquire("store-gc", "a", ttl_s=0.2)
    assert stale is not None
    assert await leases.acquire("store-gc", "b", ttl_s=60) is None  # not yet run out
    taken = None
    for _ in range(100):  # until the database's clock says it ran out
        taken = await leases.acquire("store-gc", "b", ttl_s=60)
        if taken is not None:
            break
        await asyncio.sleep(0.05)
    assert taken == stale + 1
    assert await leases.renew("store-gc", "a", stale, ttl_s=60) is None  # the stale holder learns it lost it
    assert not await leases.release("store-gc", "a", stale)
    assert await leases.renew("store-gc", "b", taken, ttl_s=60) is not None


async def test_an_expired_lease_is_not_renewed_even_if_nobody_took_it(database: Database) -> None:
    leases = Leases(database)
    token = await leases.acquire("store-gc", "a", ttl_s=0.05)
    assert token is not None
    for _ in range(100):
        if await leases.renew("store-gc", "a", token, ttl_s=0.05) is None:
            break
        await asyncio.sleep(0.1)  # renewed in time: try again later, until one comes too late
    else:
        pytest.fail("a renewal never came after the lease ran out")
    assert await leases.acquire("store-gc", "a", ttl_s=60) == token + 1  # a new acquisition, a new token


async def test_of_many_racing_for_a_free_lease_one_gets_it(database: Database) -> None:
    others = [await Database.open(database.url) for _ in range(6)]  # six servers on one database
    try:
        got = await asyncio.gather(*(Leases(db).acquire("store-gc", f"node-{i}", ttl_s=60)
                                     for i, db in enumerate(others)))
        assert sorted(got, key=lambda t: t or 0) == [None] * 5 + [1]
        holder = (await Leases(database).get("store-gc")).holder  # type: ignore[union-attr]
        assert holder == f"node-{got.index(1)}"
    finally:
        for db in others:
            await db.close()
