"""Dockerfiles into a build's steps (keepstate/builds/dockerfile.py): the CLI's half, pure."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from keepstate.builds.dockerfile import pack, parse
from keepstate.builds.steps import archive_hash, parse_spec
from keepstate.errors import BadRequest

DOCKERFILE = """\
# a comment
ARG V=1
FROM e2bdev/base
ENV A=1 B="two words"
ENV C three
WORKDIR /app
COPY --chown=user:user --chmod=0755 run.sh lib/ /app/
RUN apt-get update && \\
    echo done
USER user
EXPOSE 8000
CMD ["python", "-m", "http.server", "8000"]
"""


def test_a_dockerfile_becomes_the_sdks_steps(tmp_path: Path) -> None:
    p = parse(DOCKERFILE)
    assert p.base == "e2bdev/base"
    assert [(s["type"], s["args"]) for s in p.steps] == [
        ("ENV", ["A", "1", "B", "two words"]), ("ENV", ["C", "three"]), ("WORKDIR", ["/app"]),
        ("COPY", ["run.sh", "/app/", "user:user", "0755"]), ("COPY", ["lib/", "/app/", "user:user", "0755"]),
        ("RUN", ["apt-get update &&      echo done"]), ("USER", ["user"])]
    assert p.start_cmd == "python -m http.server 8000"
    body = p.body(None, False, is_template=False)
    assert body["fromImage"] == "e2bdev/base" and body["readyCmd"] == "sleep 20"
    for s in p.steps:
        if s["type"] == "COPY":
            s["filesHash"] = "ab" * 32
    assert len(parse_spec(body).steps) == 7  # what the server accepts


def test_entrypoint_takes_cmd_as_arguments() -> None:
    p = parse('FROM base\nENTRYPOINT ["node", "server.js"]\nCMD ["--port", "80"]\n')
    assert p.start_cmd == "node server.js --port 80"
    assert p.body("curl -s localhost", True, is_template=True)["fromTemplate"] == "base"


@pytest.mark.parametrize("text, words", [
    ("FROM a AS build\nRUN make\nFROM b\n", "line 3: a second FROM: multi-stage"),
    ("FROM a\nCOPY --from=build /x /y\n", "line 2: COPY --from is a multi-stage build"),
    ("RUN true\n", "line 1: RUN before FROM"),
    ("FROM a\nADD https://example.invalid/x /x\n", "ADD of a URL"),
    ("FROM a\nFROBNICATE x\n", "FROBNICATE is not supported"),
    ("# nothing\n", "no FROM"),
])
def test_what_is_refused_names_its_line(text: str, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        parse(text)


def test_pack_keeps_links_and_hashes_what_it_sends(tmp_path: Path) -> None:
    (tmp_path / "lib" / "deep").mkdir(parents=True)
    (tmp_path / "lib" / "deep" / "x.txt").write_text("x")
    (tmp_path / "lib" / "ln").symlink_to("deep/x.txt")
    data, files_hash = pack(tmp_path, "lib", "/app/")
    assert archive_hash("lib", "/app/", io.BytesIO(data)) == files_hash
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = {m.name: m for m in tar}
    assert set(members) == {"lib", "lib/deep", "lib/deep/x.txt", "lib/ln"}
    assert members["lib/ln"].issym() and members["lib/ln"].linkname == "deep/x.txt"
    with pytest.raises(BadRequest, match="nothing in the context"):
        pack(tmp_path, "missing", "/x")
