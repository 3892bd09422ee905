"""The template seam: which build of a template a sandbox starts from, and what it serves.

`BuiltTemplates` reads the template builder's cache (keepstate/template); keepstate.testing.FakeTemplates answers
from memory for tests on the fake runtime.
"""

from __future__ import annotations

from typing import Protocol

from keepstate.errors import KeepStateError, NotFound
from keepstate.template import builder, oci
from keepstate.template.builder import Built
from keepstate.template.definition import load as load_definition
from keepstate.template.definition import load_all


class Templates(Protocol):
    def names(self) -> list[str]:
        """Every template this server knows, built or not."""

    def latest(self, name: str) -> Built | None:
        """The newest build of a known template, None if it has none yet; NotFound for an unknown name."""

    def find_by_digest(self, name: str, digest: str) -> Built | None: ...

    def ensure_built(self, name: str) -> Built:
        """Build the template if it has no current build (slow: minutes); blocking."""

    def service_ports(self, name: str) -> list[int]:
        """Ports the template's services listen on: a sandbox is handed out once they all accept."""

    def service_names(self, name: str) -> dict[int, str]:
        """The template's services by the port they listen on (for errors that name the one that did not start)."""


class BuiltTemplates:
    """TOML templates (keepstate/template/builder.py) and root filesystems pulled from OCI images for template
    builds (keepstate/template/oci/__init__.py, names `image-...`), in the same cache layout."""

    def names(self) -> list[str]:
        return sorted(load_all())

    def latest(self, name: str) -> Built | None:
        if oci.is_image_template(name):
            return oci.latest(name)
        return builder.latest(name)

    def find_by_digest(self, name: str, digest: str) -> Built | None:
        if oci.is_image_template(name):
            return oci.find_by_digest(name, digest)
        return builder.find_by_digest(name, digest)

    def ensure_built(self, name: str) -> Built:
        if oci.is_image_template(name):
            built = oci.latest(name)
            if built is None:
                raise NotFound(f"template '{name}' (an image's root filesystem) was never pulled on this host")
            return built
        return builder.ensure_built(name)

    def service_ports(self, name: str) -> list[int]:
        return list(self.service_names(name))

    def service_names(self, name: str) -> dict[int, str]:
        if oci.is_image_template(name):
            return {}
        try:
            return {s.port: s.name for s in load_definition(name).services if s.port}
        except KeepStateError:
            return {}


def latest_digest(templates: Templates, name: str) -> str:
    try:
        b = templates.latest(name)
    except KeepStateError:
        return ""
    return b.digest if b else ""
