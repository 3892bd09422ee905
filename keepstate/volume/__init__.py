"""Volumes: named directory trees that outlive sandboxes (docs/design/volumes.md)."""

from .paths import VolumeRoot, parts_of
from .record import VolumeRecord
from .store import Volumes

__all__ = ["VolumeRecord", "VolumeRoot", "Volumes", "parts_of"]
