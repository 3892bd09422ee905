"""The request side of the header rules, without sockets: parsing, framing, headers set, secrets filled."""

from __future__ import annotations

import json

import pytest

from keepstate.egress.http1 import Answer, parse_head, set_rule_headers
from keepstate.egress.policy import HeaderRule

SECRETS = {"key": "VALUE-1", "nl": "a\r\nb", "wide": "snow\u2603"}


def head(*lines: str) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_parse_and_encode_round_trip() -> None:
    raw = head("POST /a?b=c HTTP/1.1", "Host: api.test:8443", "X-A:  spaced  ", "content-length: 3")
    req = parse_head(raw)
    assert (req.method, req.target, req.version, req.host) == ("POST", "/a?b=c", "HTTP/1.1", "api.test")
    assert req.get("x-a") == "spaced" and req.framing() == 3
    assert parse_head(req.encode()).headers == req.headers


@pytest.mark.parametrize("raw", [
    head("GET / HTTP/1.1", " folded: no"),
    head("GET / HTTP/1.1", "bad header"),
    head("GET  / HTTP/1.1"),
    head("GET / HTTP/2"),
])
def test_malformed_heads_are_400(raw: bytes) -> None:
    with pytest.raises(Answer) as e:
        parse_head(raw)
    assert e.value.status == 400


@pytest.mark.parametrize("lines,expected", [
    (["Transfer-Encoding: gzip, chunked"], None),
    (["Content-Length: 5", "content-length: 5"], 5),
    ([], 0),
])
def test_framing(lines: list[str], expected: int | None) -> None:
    assert parse_head(head("POST / HTTP/1.1", *lines)).framing() == expected


@pytest.mark.parametrize("lines", [
    ["Transfer-Encoding: chunked", "Content-Length: 5"],  # smuggling
    ["Transfer-Encoding: chunked, gzip"],
    ["Content-Length: 5", "Content-Length: 6"],
    ["Content-Length: -1"],
])
def test_ambiguous_framing_is_refused(lines: list[str]) -> None:
    with pytest.raises(Answer) as e:
        parse_head(head("POST / HTTP/1.1", *lines)).framing()
    assert e.value.status == 400


def test_rules_replace_case_insensitively_and_fill_secrets() -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: api.test", "AUTHORIZATION: mine", "authorization: again"))
    rules = (HeaderRule((("Authorization", "Bearer ${e2b.secrets.KEY}"), ("Content-Length", "9"))),
             HeaderRule((("X-Two", "${e2b.secrets.key}-${e2b.secrets.key}"),)))
    assert set_rule_headers(req, "api.test", rules, SECRETS.get) == ["Authorization", "X-Two"]
    assert req.values("authorization") == ["Bearer VALUE-1"] and req.get("x-two") == "VALUE-1-VALUE-1"
    assert req.get("content-length") is None  # framing headers are never set by a rule


def test_a_value_beyond_latin1_goes_as_its_utf8_bytes() -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: api.test"))
    set_rule_headers(req, "api.test", (HeaderRule((("X-W", "${e2b.secrets.wide}"),)),), SECRETS.get)
    assert b"X-W: snow\xe2\x98\x83\r\n" in req.encode()


@pytest.mark.parametrize("template,named", [("${e2b.secrets.gone}", "'gone'"), ("${e2b.secrets.nl}", "'nl'")])
def test_unusable_secrets_are_a_502_naming_them_and_nothing_is_set(template: str, named: str) -> None:
    req = parse_head(head("GET / HTTP/1.1", "Host: api.test"))
    before = list(req.headers)
    rules = (HeaderRule((("X-Ok", "${e2b.secrets.key}"), ("X-Bad", template))),)
    with pytest.raises(Answer) as e:
        set_rule_headers(req, "api.test", rules, SECRETS.get)
    body = e.value.response().split(b"\r\n\r\n", 1)[1]
    message = json.loads(body)["message"]
    assert e.value.status == 502 and named in message and "X-Bad" in message
    assert not any(v in body.decode() for v in SECRETS.values())
    assert req.headers == before
