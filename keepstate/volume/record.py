"""A volume's record: the database's own (keepstate.db.records.VolumeRecord). Pure data."""

from __future__ import annotations

from keepstate.db.records import VolumeRecord

__all__ = ["VolumeRecord"]
