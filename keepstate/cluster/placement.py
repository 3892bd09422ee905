"""Where a new sandbox goes (docs/design/cluster.md, "Placement"): best of K live nodes, judged from the database's
figures (keepstate.db.repos.placement), never from one node's memory.

    order = ranked(loads, cpu=2, memory_mb=512, template="base")   # the nodes to try, best first

K candidates are drawn at random among the nodes with room, and ranked by their free share of CPUs, memory and
sandbox places, a node keeping the template warm preferred; the rest follow, best first, as the fall-backs when
the chosen node refuses (it filled up meanwhile: its own admission is the last word). Drawing K instead of taking
the single best keeps concurrent creates, which all read the same figures, from piling onto one node (the "power
of two choices" of Mitzenmacher, as Nomad's and Kubernetes' schedulers sample).
"""

from __future__ import annotations

import random

from keepstate.db.records import NodeLoad, NodeRecord

K = 2
WARM_BONUS = 0.25  # a node that keeps the template warm is worth a quarter of a free host


def has_room(load: NodeLoad) -> bool:
    return not load.node.max_sandboxes or load.sandboxes < load.node.max_sandboxes


def score(load: NodeLoad, cpu: float, memory_mb: int, template: str | None) -> float:
    """The node's free share once this sandbox is on it (mean of CPUs, memory, places), plus the warm bonus."""
    node = load.node
    shares = [1.0 - (load.cpu + cpu) / node.cpus if node.cpus > 0 else 0.0,
              1.0 - (load.memory_mb + memory_mb) / node.memory_mb if node.memory_mb > 0 else 0.0,
              1.0 - (load.sandboxes + 1) / node.max_sandboxes if node.max_sandboxes else 1.0]
    return sum(shares) / len(shares) + (WARM_BONUS if template is not None and template in node.templates else 0.0)


def ranked(loads: list[NodeLoad], cpu: float, memory_mb: int, template: str | None, k: int = K,
           rng: random.Random | None = None) -> list[NodeRecord]:
    """The nodes with room to try, in order: K drawn at random, best first, then the others, best first."""
    fits = [load for load in loads if has_room(load)]
    drawn = (rng or random).sample(fits, min(k, len(fits)))
    rest = [load for load in fits if load not in drawn]

    def best_first(group: list[NodeLoad]) -> list[NodeLoad]:
        return sorted(group, key=lambda load: (-score(load, cpu, memory_mb, template), load.node.node_id))

    return [load.node for load in best_first(drawn) + best_first(rest)]


def incompatible(node: NodeRecord, origin: NodeRecord) -> str | None:
    """Why `node` cannot resume a checkpoint taken on `origin` (None: it can): gVisor restores only under the same
    runsc release, on a CPU with every feature the checkpointed one had."""
    if node.runsc_release != origin.runsc_release:
        return (f"node {node.node_id} runs runsc {node.runsc_release or '?'}, the checkpoint was taken under "
                f"{origin.runsc_release or '?'} on node {origin.node_id}")
    missing = sorted(set(origin.cpu_features) - set(node.cpu_features))
    if missing:
        return (f"node {node.node_id}'s CPU lacks {', '.join(missing[:8])}{' …' if len(missing) > 8 else ''}, which "
                f"node {origin.node_id}'s had when the checkpoint was taken")
    return None
