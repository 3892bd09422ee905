"""A throwaway PostgreSQL 15 for tests: a cluster in a temporary directory, on a Unix socket there and nowhere else.

    with PostgresServer() as pg:
        pg.createdb("t1")
        url = pg.url("t1")        # postgresql://postgres@/t1?host=/tmp/keepstate-pg-XXXX

From a shell (scripts/test.sh runs a server on it), one that outlives the command until `down`:

    python -m keepstate.testing.postgres up --state FILE    # prints the URL of its database `keepstate`
    python -m keepstate.testing.postgres down --state FILE

Debian's `postgresql` package provides the binaries (/usr/lib/postgresql/15/bin). PostgreSQL refuses to run as root,
so when the caller is root (the tests are) the server commands run as the `postgres` user (`runuser`) and the
directory is handed to it; the cluster trusts every local connection (`initdb -A trust`) and listens on no TCP
address (`listen_addresses=''`). `fsync=off`: its data is thrown away with it.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

BIN_DIR = Path("/usr/lib/postgresql/15/bin")
SUPERUSER = "postgres"
OS_USER = "postgres"
_TIMEOUT_S = 60


class PostgresNotInstalled(RuntimeError):
    pass


def installed(bin_dir: Path = BIN_DIR) -> bool:
    return all(os.access(bin_dir / name, os.X_OK) for name in ("initdb", "pg_ctl", "postgres", "createdb"))


class PostgresServer:
    """One cluster. start() and stop() (or `with`); shutdown() and restart() stop it and start it again with its
    data, for tests of a database that goes away under a client."""

    def __init__(self, bin_dir: Path = BIN_DIR, parent: Path | None = None) -> None:
        """`parent`: where its directory goes (the system's temporary directory by default). Every directory above
        it must be searchable by the `postgres` user when the caller is root, and the path short: a Unix socket's
        path has at most 107 bytes."""
        self.bin_dir = bin_dir
        self.parent = parent
        self.dir: Path | None = None
        self.running = False

    # -- life --------------------------------------------------------------------------------------------------------
    def start(self) -> PostgresServer:
        if not installed(self.bin_dir):
            raise PostgresNotInstalled(
                f"PostgreSQL 15 is not installed (no {self.bin_dir}/initdb): install Debian's `postgresql` package "
                "(apt-get install postgresql, as scripts/setup-host.sh does)")
        if self.dir is not None:
            raise RuntimeError("this PostgresServer was started already")
        self.dir = Path(tempfile.mkdtemp(prefix="keepstate-pg-", dir=self.parent))
        atexit.register(self.stop)
        try:
            if os.geteuid() == 0:
                try:
                    user = pwd.getpwnam(OS_USER)
                except KeyError:
                    raise PostgresNotInstalled(f"no `{OS_USER}` user (Debian's postgresql package makes it)") from None
                os.chown(self.dir, user.pw_uid, user.pw_gid)
            self.dir.chmod(0o700)
            self._server_command("initdb", "-D", str(self.data), "-A", "trust", "-U", SUPERUSER, "-E", "UTF8",
                                 "--no-locale", "--no-sync")
            self._pg_ctl_start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server and remove its directory (idempotent)."""
        atexit.unregister(self.stop)
        if self.dir is None:
            return
        try:
            self.shutdown()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def shutdown(self) -> None:
        """Stop the server (`-m fast`: its sessions are cut off at once) and keep its data for restart()."""
        if self.dir is not None and (self.data / "postmaster.pid").exists():
            self._server_command("pg_ctl", "stop", "-D", str(self.data), "-m", "fast", "-w", "-t", str(_TIMEOUT_S))
        self.running = False

    def restart(self) -> None:
        """Start the server again with its data (stopping it first if it runs)."""
        if self.dir is None:
            raise RuntimeError("this PostgresServer is not started")
        self.shutdown()
        self._pg_ctl_start()

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    # -- use ---------------------------------------------------------------------------------------------------------
    @property
    def socket_dir(self) -> Path:
        if self.dir is None:
            raise RuntimeError("this PostgresServer is not started")
        return self.dir

    @property
    def data(self) -> Path:
        return self.socket_dir / "data"

    def createdb(self, name: str) -> str:
        """Create database `name`; its URL."""
        self._run([str(self.bin_dir / "createdb"), "-h", str(self.socket_dir), "-U", SUPERUSER, name])
        return self.url(name)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.socket_dir}"

    # -- internals ---------------------------------------------------------------------------------------------------
    def _pg_ctl_start(self) -> None:
        # pg_ctl hands -o to the server through a shell: '' is the empty list of TCP addresses.
        options = f"-k {self.socket_dir} -c listen_addresses='' -c fsync=off -c full_page_writes=off"
        try:
            self._server_command("pg_ctl", "start", "-D", str(self.data), "-l", str(self.socket_dir / "server.log"),
                                 "-w", "-t", str(_TIMEOUT_S), "-o", options)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\n--- server.log ---\n{self._log_tail()}") from None
        self.running = True

    def _log_tail(self) -> str:
        try:
            return "\n".join((self.socket_dir / "server.log").read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def _server_command(self, name: str, *args: str) -> None:
        """Run a server program as the `postgres` user when we are root (the server refuses to run as root)."""
        cmd = [str(self.bin_dir / name), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", OS_USER, "--", *cmd]
        self._run(cmd)

    def _run(self, cmd: list[str]) -> None:
        # cwd: the postgres user may not be able to read the caller's working directory (root's home).
        done = subprocess.run(cmd, cwd=self.socket_dir, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=_TIMEOUT_S + 30, check=False)
        if done.returncode != 0:
            out = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {out}")


def up(state: Path, dbname: str = "keepstate") -> str:
    """Start a server that outlives this process, create `dbname`, record both in `state`; the database's URL."""
    pg = PostgresServer().start()
    atexit.unregister(pg.stop)  # it outlives this process: `down` stops it
    url = pg.createdb(dbname)
    state.write_text(json.dumps({"dir": str(pg.dir), "url": url}))
    return url


def down(state: Path) -> None:
    """Stop the server `up` recorded in `state` and remove its directory (nothing to do if there is none)."""
    try:
        found = json.loads(state.read_text())
    except (OSError, ValueError):
        return
    pg = PostgresServer()
    pg.dir = Path(found["dir"])
    pg.stop()
    state.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m keepstate.testing.postgres",
                                     description="A throwaway PostgreSQL 15 for tests, on a Unix socket only.")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state", type=Path, required=True, help="where `up` records the server for `down`")
    args = parser.parse_args(argv)
    if args.action == "up":
        print(up(args.state))
    else:
        down(args.state)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
