"""A volume's catalog record. Pure data."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    name: str
    token: str
    size_mb: int
    created_at: float
