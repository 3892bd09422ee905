"""The package layering the README's architecture map draws, checked on the code (every import, those inside
functions and under TYPE_CHECKING too): a package imports only packages of lower layers, so there is no import
cycle between packages; SQL, `sqlite3` and database drivers appear only under keepstate/db; no module is over ~600
lines (generated protocol modules aside)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "keepstate"

# Lowest first. A unit is a subpackage or a top-level module of keepstate.
LAYERS: list[set[str]] = [
    {"keepstate", "errors", "config", "ports", "pids", "mountpoints", "netaddr", "rootfs", "clock", "faults"},
    {"db", "store", "agent"},  # the agent runs inside sandboxes: it stands on the leaves only
    {"apikeys", "secret", "volume", "session", "gateway", "runtime", "template", "egress", "cluster"},
    {"sandbox"},
    {"builds", "testing"},  # SDK template builds drive sandboxes; testing holds fakes of runtime and templates
    {"api"},
    {"cli"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
MAX_LINES = 600
DRIVERS = {"sqlite3", "aiosqlite", "psycopg", "psycopg2", "asyncpg", "sqlalchemy", "alembic"}
SQL = re.compile(r"""["'](\s*)(SELECT|INSERT INTO|UPDATE \w+ SET|DELETE FROM|CREATE TABLE|ALTER TABLE|PRAGMA)\b""")


def modules() -> list[tuple[str, Path]]:
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        if "proto" in parts:  # generated from .proto files
            continue
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), f))
    return out


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(module: str, path: Path) -> list[str]:
    """Every keepstate module `module` imports, relative imports resolved."""
    out = []
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base == "keepstate":
                out += [f"keepstate.{a.name}" for a in node.names]
            else:
                out.append(base)
    return [m for m in out if m == "keepstate" or m.startswith("keepstate.")]


def edges() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules():
        for target in imports(module, path):
            a, b = unit_of(module), unit_of(target)
            if a != b:
                found[a, b].append(f"{path.relative_to(PACKAGE.parent)} imports {target}")
    return found


def test_every_unit_has_a_layer() -> None:
    units = {unit_of(m) for m, _ in modules()}
    assert units - set(LAYER) == set(), "add new packages to LAYERS (and to the README's architecture map)"


def test_packages_import_only_lower_layers_so_there_is_no_cycle() -> None:
    wrong = [f"{a} (layer {LAYER[a]}) -> {b} (layer {LAYER[b]}): {where[0]}"
             for (a, b), where in edges().items() if LAYER.get(a, 99) <= LAYER.get(b, 99)]
    assert wrong == []


def test_db_imports_no_domain_package() -> None:
    assert {b for (a, b) in edges() if a == "db"} <= LAYERS[0]


def test_sql_and_drivers_only_under_db() -> None:
    outside = []
    for module, path in modules():
        if unit_of(module) == "db":
            continue
        text = path.read_text()
        drivers = {t.split(".")[0] for t in _all_imports(text)} & DRIVERS
        if drivers or SQL.search(text):
            outside.append(f"{path.relative_to(PACKAGE.parent)}: {sorted(drivers) or SQL.search(text)}")
    assert outside == []


def _all_imports(text: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.append(node.module)
    return out


def test_no_module_is_over_600_lines() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for _, p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checker_sees_a_wrong_way_import(tmp_path: Path) -> None:
    # The checker itself can fail: a relative import one level up from a db module is seen as db -> sandbox.
    f = tmp_path / "rows.py"
    f.write_text("from ..sandbox.record import SandboxRow\nfrom . import engine\n")
    assert imports("keepstate.db.rows", f) == ["keepstate.sandbox.record", "keepstate.db"]
    assert LAYER["db"] <= LAYER[unit_of("keepstate.sandbox.record")]
