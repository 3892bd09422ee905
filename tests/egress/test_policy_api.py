"""The network policy through the API, on the fake runtime: parsed at create (a bad one creates nothing), shown by
GET, replaced by PUT /sandboxes/{id}/network (a bad one changes nothing; a paused sandbox is a 409), kept across
pause and resume, inherited by a fork, and checked against the secrets that exist."""

from __future__ import annotations

from typing import Any

from tests.sandbox.conftest import Served, serving


async def create(s: Served, **body: Any) -> tuple[int, Any]:
    return await s.call("POST", "/sandboxes", {"templateID": "base", **body})


async def listed(s: Served) -> int:
    status, rows = await s.call("GET", "/v2/sandboxes")
    assert status == 200
    return len(rows)


async def test_create_show_update_and_bad_policies() -> None:
    async with serving(pool_size=0) as s:
        status, sbx = await create(s, network={"allowOut": ["203.0.113.7"], "denyOut": ["0.0.0.0/0"]})
        assert status == 201, sbx
        sid = sbx["sandboxID"]
        status, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["network"]["allowOut"] == ["203.0.113.7"] and info["network"]["denyOut"] == ["0.0.0.0/0"]
        assert s.manager.egress.policy_of(sid) is not None
        assert s.manager.egress.policy_of(sid).ip_verdict("198.51.100.1") == "deny"
        # bad policies at create: 400 JSON, nothing created
        before = await listed(s)
        for body in ({"network": {"allowOut": ["300.1.2.3/8"]}}, {"network": {"allowed": []}},
                     {"network": {"denyOut": ["plain.test"]}}, {"allow_internet_access": "no"},
                     {"network": {"rules": {"api.test": [{"transform": {"headers": {"X": "${e2b.secrets.nope}"}}}]}}}):
            status, err = await create(s, **body)
            assert status == 400 and err["code"] == 400 and err["message"], (body, err)
        assert await listed(s) == before
        # a live update replaces the policy whole
        status, _ = await s.call("PUT", f"/sandboxes/{sid}/network", {"denyOut": ["198.51.100.9"]})
        assert status == 204
        _, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["network"]["allowOut"] == [] and info["network"]["denyOut"] == ["198.51.100.9"]
        assert s.manager.egress.policy_of(sid).ip_verdict("203.0.113.7") == "allow"
        # a bad update: 400, nothing changed
        for body in ({"denyOut": ["not-an-ip"]}, {"bogus": 1}, ["x"], {"allow_internet_access": 3}):
            status, err = await s.call("PUT", f"/sandboxes/{sid}/network", body)
            assert status == 400 and err["code"] == 400, (body, err)
        _, again = await s.call("GET", f"/sandboxes/{sid}")
        assert again["network"] == info["network"]
        # clearing
        assert (await s.call("PUT", f"/sandboxes/{sid}/network", {}))[0] == 204
        _, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["network"]["denyOut"] == [] and info["network"]["allowOut"] == []
        status, err = await s.call("PUT", "/sandboxes/nosuchsandbox/network", {})
        assert status == 404 and err["code"] == 404


async def test_policy_survives_pause_and_resume_and_a_fork_inherits_it() -> None:
    async with serving(pool_size=0) as s:
        status, sbx = await create(s, allow_internet_access=False)
        assert status == 201, sbx
        sid = sbx["sandboxID"]
        _, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["allowInternetAccess"] is False
        assert s.manager.egress.policy_of(sid).denies_all
        status, _ = await s.call("POST", f"/sandboxes/{sid}/pause")
        assert status == 204
        status, err = await s.call("PUT", f"/sandboxes/{sid}/network", {})
        assert status == 409 and err["code"] == 409
        _, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["allowInternetAccess"] is False and info["network"]["allowOut"] == []
        status, _ = await s.call("POST", f"/sandboxes/{sid}/connect", {"timeout": 60})
        assert status in (200, 201)
        assert s.manager.get(sid).settings.policy.denies_all
        assert s.manager.egress.policy_of(sid).denies_all  # attached again on resume
        status, forks = await s.call("POST", f"/sandboxes/{sid}/fork", {"count": 1})
        assert status == 201, forks
        child = forks[0]["sandbox"]["sandboxID"]
        assert s.manager.get(child).settings.policy.denies_all
        assert s.manager.egress.policy_of(child).denies_all


async def test_a_policy_may_name_only_secrets_that_exist() -> None:
    rules = {"rules": {"api.test": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.key}"}}}]}}
    async with serving(pool_size=0) as s:
        status, err = await create(s, network=rules)
        assert status == 400 and "key" in err["message"]  # no such secret yet: nothing created
        assert await listed(s) == 0
        status, _ = await s.call("POST", "/secrets", {"name": "key", "value": "s3cret"})
        assert status == 201
        status, sbx = await create(s, network=rules)
        assert status == 201, sbx
        sid = sbx["sandboxID"]
        bad = {"rules": {"api.test": [{"transform": {"headers": {"X": "${e2b.secrets.other}"}}}]}}
        status, err = await s.call("PUT", f"/sandboxes/{sid}/network", bad)
        assert status == 400 and "other" in err["message"]
        _, info = await s.call("GET", f"/sandboxes/{sid}")
        assert info["network"]["rules"]["api.test"][0]["transform"]["headers"]["Authorization"].endswith(
            "${e2b.secrets.key}")
