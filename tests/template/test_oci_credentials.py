"""E2B's `fromImageRegistry` shapes become registry logins; AWS's through a real (boto3, SigV4-signed)
GetAuthorizationToken call to a loopback ECR endpoint, then used against a real registry."""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from keepstate.errors import BadRequest
from keepstate.template import oci
from keepstate.template.oci.credentials import ECR_ENDPOINT_ENV, from_wire
from keepstate.template.oci.errors import RegistryAuthFailed
from keepstate.template.oci.registry import Credentials
from keepstate.testing import oci_layout
from keepstate.testing.registry import Registry

KEY_ID, SECRET = "AKIAKEEPSTATETEST", "not-a-real-secret"
ECR_PASSWORD = "ecr-token-password"


def test_shapes() -> None:
    assert from_wire(None) is None
    assert from_wire({"type": "registry", "username": "u", "password": "p"}) == Credentials("u", "p")
    sa = json.dumps({"type": "service_account", "client_email": "x@y.test"})
    assert from_wire({"type": "gcp", "serviceAccountJson": sa}) == Credentials("_json_key", sa)
    for bad in ("x", {"type": "registry", "username": "u"}, {"type": "gcp", "serviceAccountJson": "{"},
                {"type": "azure"}, {"type": "aws", "awsAccessKeyId": "k"}):
        with pytest.raises(BadRequest):
            from_wire(bad)


@pytest.fixture
def ecr(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen.append(self.headers.get("X-Amz-Target", ""))
            if f"Credential={KEY_ID}/" not in self.headers.get("Authorization", ""):
                code, body = 400, {"__type": "UnrecognizedClientException",
                                   "message": "The security token included in the request is invalid."}
            else:
                token = base64.b64encode(f"AWS:{ECR_PASSWORD}".encode()).decode()
                code, body = 200, {"authorizationData": [{"authorizationToken": token, "expiresAt": 2e9,
                                                          "proxyEndpoint": "https://ecr.example.test"}]}
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/x-amz-json-1.1")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv(ECR_ENDPOINT_ENV, f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield seen
    srv.shutdown()
    srv.server_close()


@pytest.mark.skipif(os.geteuid() != 0, reason="unpacking images keeps owners: needs root")
def test_aws_ecr_token(ecr: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEEPSTATE_TEMPLATE_CACHE", str(tmp_path / "templates"))
    aws = {"type": "aws", "awsAccessKeyId": KEY_ID, "awsSecretAccessKey": SECRET, "awsRegion": "us-west-2"}
    creds = from_wire(aws)
    assert creds == Credentials("AWS", ECR_PASSWORD)
    assert ecr == ["AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"]
    with pytest.raises(RegistryAuthFailed, match="AWS ECR refused the access key AKIAWRONG"):
        from_wire({**aws, "awsAccessKeyId": "AKIAWRONG"})
    with Registry(auth=("AWS", ECR_PASSWORD)) as reg:
        reg.push_layout(oci_layout.busybox_image(tmp_path / "bb").dir, "team/app:1")
        img = oci.pull(f"{reg.host}/team/app:1", creds, dest=tmp_path / "root")
    assert os.readlink(img.rootfs / "bin/sh") == "busybox"
