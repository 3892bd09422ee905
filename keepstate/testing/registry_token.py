"""A token service for the test registry: the Bearer flow of the distribution spec, with real signed JWTs.

`docker-registry` with `auth: token` sends clients to this realm; it checks Basic logins, answers a JWT (RS256,
its certificate in the `x5c` header, trusted by the registry through `rootcertbundle`) granting the asked
actions on the asked repository, or an empty grant for an anonymous caller, or 401 for a wrong password.
"""

from __future__ import annotations

import base64
import datetime
import json
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

SERVICE = "keepstate-test-registry"
ISSUER = "keepstate-test-token"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    def __init__(self, users: dict[str, str]) -> None:
        self.users = users
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ISSUER)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.issued: list[tuple[str, str]] = []  # (user or "", scope) of every token handed out
        self._server: ThreadingHTTPServer | None = None

    @property
    def realm(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def write_cert(self, path: Path) -> Path:
        path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        return path

    def token(self, user: str, scope: str) -> str:
        access = []
        if user and scope.startswith("repository:"):
            _, name, actions = scope.split(":", 2)
            access.append({"type": "repository", "name": name, "actions": actions.split(",")})
        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        now = int(time.time())
        claims = {"iss": ISSUER, "sub": user, "aud": SERVICE, "exp": now + 600, "nbf": now - 60, "iat": now,
                  "jti": secrets.token_hex(8), "access": access}
        signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        sig = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        return f"{signing}.{_b64(sig)}"

    def start(self) -> TokenServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                u = urllib.parse.urlsplit(self.path)
                q = urllib.parse.parse_qs(u.query)
                user = ""
                auth = self.headers.get("Authorization", "")
                if auth.startswith("Basic "):
                    name, _, pw = base64.b64decode(auth[6:]).decode().partition(":")
                    if outer.users.get(name) != pw:
                        self.send_response(401)
                        self.end_headers()
                        return
                    user = name
                scope = (q.get("scope") or [""])[0]
                outer.issued.append((user, scope))
                t = outer.token(user, scope)
                body = json.dumps({"token": t, "access_token": t, "expires_in": 600}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True, name="registry-token").start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
