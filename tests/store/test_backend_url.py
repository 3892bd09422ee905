from __future__ import annotations

from pathlib import Path

import pytest

from keepstate.store import LocalBackend, backend_from_url
from tests.store.conftest import ACCESS_KEY, SECRET_KEY, S3Server


def test_file_urls_and_plain_paths(tmp_path: Path) -> None:
    for url in (tmp_path.as_uri(), str(tmp_path), f"file://localhost{tmp_path}"):
        backend = backend_from_url(url)
        assert isinstance(backend, LocalBackend) and backend.root == tmp_path


@pytest.mark.parametrize("url", ["ftp://host/x", "file://otherhost/x", "s3:///prefix"])
def test_unsupported_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        backend_from_url(url)


def test_s3_url(s3_server: S3Server) -> None:
    backend = backend_from_url(s3_server.url("from/url"))
    backend.save("refs/x", b"1")
    assert backend.load("refs/x") == b"1"
    assert backend.location.startswith("s3://keepstate-tests/from/url")
    assert ACCESS_KEY not in backend.location and SECRET_KEY not in backend.location
