"""Nodes as the API and the CLI show them: one JSON shape for both (`GET /nodes`, `keepstate nodes ls --json`)."""

from __future__ import annotations

import json
from typing import Any

from keepstate.clock import rfc3339
from keepstate.db.records import NodeRecord


def node_json(node: NodeRecord, db_now: float, self_id: str | None = None) -> dict[str, Any]:
    """A node; `leaseRemainingSeconds` is judged by the database's clock `db_now`, as the reaper judges it."""
    try:
        metrics = json.loads(node.metrics)
    except ValueError:
        metrics = {}
    return {
        "nodeID": node.node_id, "incarnation": node.incarnation, "state": node.state, "address": node.address,
        "cpuCount": node.cpus, "memoryMB": node.memory_mb, "maxSandboxes": node.max_sandboxes,
        "runscRelease": node.runsc_release, "cpuFeatures": list(node.cpu_features),
        "templates": list(node.templates), "metrics": metrics if isinstance(metrics, dict) else {},
        "joinedAt": rfc3339(node.joined_at), "leaseExpiresAt": rfc3339(node.lease_expires_at),
        "leaseRemainingSeconds": round(node.lease_expires_at - db_now, 3), "self": node.node_id == self_id,
    }
