"""The sniffer on real ClientHellos (made by Python's ssl through memory BIOs) and on HTTP/1 heads."""

from __future__ import annotations

import ssl

import pytest

from keepstate.egress.sniff import OPAQUE, Sniffed, final, host_header_name, sniff


def client_hello(server_hostname: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname=server_hostname)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def refragment(hello: bytes, size: int) -> bytes:
    """The same handshake bytes split into records of at most `size` bytes (as some stacks and middleboxes do)."""
    body = hello[5:5 + int.from_bytes(hello[3:5], "big")]
    out = b""
    for i in range(0, len(body), size):
        part = body[i:i + size]
        out += hello[:3] + len(part).to_bytes(2, "big") + part
    return out


def test_sni_from_a_real_client_hello() -> None:
    assert sniff(client_hello("API.Example.test")) == Sniffed("tls", "api.example.test")


def test_a_hello_without_sni_is_tls_without_a_name() -> None:
    assert sniff(client_hello(None)) == Sniffed("tls", None)


def test_every_prefix_waits_for_more_and_the_whole_decides() -> None:
    hello = client_hello("a.allowed.test")
    for i in range(1, len(hello)):
        assert sniff(hello[:i]) is None, i
    assert final(hello[:10]) == Sniffed("tls", None)


@pytest.mark.parametrize("size", [1, 7, 100, 512])
def test_a_hello_fragmented_over_records(size: int) -> None:
    frag = refragment(client_hello("frag.test"), size)
    assert sniff(frag) == Sniffed("tls", "frag.test")
    assert sniff(frag[:-1]) is None


def test_malformed_tls_is_opaque_or_nameless_never_an_error() -> None:
    hello = client_hello("x.test")
    assert sniff(b"\x16\x03\x01\x00\x00") == OPAQUE  # empty record
    assert sniff(b"\x16\x09\x01\x00\x05hello") == OPAQUE  # not TLS's version byte
    assert sniff(b"\x16\x03\x01\x00\x04\x02\x00\x00\x00") == OPAQUE  # a ServerHello
    # a ClientHello whose inner lengths lie: cut the extensions short but keep the outer lengths
    broken = bytearray(hello)
    broken[5 + 4 + 2 + 32] = 0xFF  # session id length beyond the message
    assert sniff(bytes(broken)) == Sniffed("tls", None)
    for i in range(len(hello)):  # flip each byte: any result, no exception
        mutated = bytearray(hello)
        mutated[i] ^= 0xFF
        sniff(bytes(mutated))


def test_http_host() -> None:
    assert sniff(b"GET / HTTP/1.1\r\nHost: Api.Rule.Test:8080\r\n\r\n") == Sniffed("http", "api.rule.test")
    assert sniff(b"POST /x HTTP/1.0\r\nhost: [::1]:80\r\nx: y\r\n\r\n") == Sniffed("http", "::1")
    assert sniff(b"GET / HTTP/1.1\r\nAccept: */*\r\n\r\n") == Sniffed("http", None)
    assert sniff(b"GET / HTTP/1.1\r\nHost: bad host\r\n\r\n") == Sniffed("http", None)


def test_http_prefixes_wait_and_other_bytes_are_opaque() -> None:
    req = b"GET /path HTTP/1.1\r\nHost: h.test\r\n\r\n"
    for i in range(1, len(req)):
        assert sniff(req[:i]) is None, req[:i]
    assert final(req[:25]) == Sniffed("http", None)
    assert sniff(b"SSH-2.0-OpenSSH_9.6\r\n") == OPAQUE
    assert sniff(b"\x00\x01\x02") == OPAQUE
    assert sniff(b"get / HTTP/1.1\r\n") == OPAQUE
    assert sniff(b"GET / HTTP/2.0\r\n") == OPAQUE
    assert final(b"") == OPAQUE


def test_host_header_forms() -> None:
    assert host_header_name("a.test") == "a.test"
    assert host_header_name("203.0.113.7:80") == "203.0.113.7"
    assert host_header_name("a.test:x") is None
    assert host_header_name("[zz]") is None
