#!/usr/bin/env bash
# Host set-up for KeepState, as root, idempotent. Installs gVisor (runsc) from Debian
# bookworm-backports, debootstrap and the networking tools the runtime needs, Node.js
# and npm for the JS SDK tests (tests/js), and PostgreSQL 15 for the database tests.
# The backports suite is added with the mirror already configured in this machine's
# apt sources: no host name is written here.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  echo "setup-host: must run as root (sandboxes need namespaces, cgroups and runsc)" >&2
  exit 1
fi

stamp=/var/lib/keepstate/.host-setup-v6
if [ -f "$stamp" ] && command -v runsc >/dev/null && command -v debootstrap >/dev/null \
    && command -v conntrack >/dev/null && command -v nft >/dev/null && command -v node >/dev/null && command -v npm >/dev/null \
    && command -v docker-registry >/dev/null && command -v skopeo >/dev/null && command -v htpasswd >/dev/null \
    && command -v tini-static >/dev/null && [ -x /usr/bin/python3.11 ] && [ -x /bin/busybox ] \
    && command -v /usr/lib/postgresql/15/bin/initdb >/dev/null; then
  exit 0
fi

# The mirror URI of the first "main" Debian source, from deb822 or one-line sources.
mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk '/^URIs:/ {u=$2} /^Suites:/ && / bookworm( |$)/ {print u; exit}' "$f"
  done
  if [ -f /etc/apt/sources.list ]; then
    awk '$1=="deb" && $3=="bookworm" {print $2; exit}' /etc/apt/sources.list
  fi
  return 0
}

bp=/etc/apt/sources.list.d/keepstate-backports.sources
if ! grep -rqs "bookworm-backports" /etc/apt/sources.list /etc/apt/sources.list.d/ ; then
  uri=$(mirror | head -n1)
  if [ -z "$uri" ]; then
    echo "setup-host: no Debian bookworm mirror found in apt sources; add one and retry" >&2
    exit 1
  fi
  cat > "$bp" <<SRC
Types: deb
URIs: $uri
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi

# Debian's nodejs and npm, unless a node or npm is already installed (another distribution's, such as
# NodeSource's nodejs, which bundles npm and conflicts with Debian's npm package).
js=()
command -v node >/dev/null || js+=(nodejs)
command -v npm >/dev/null || js+=(npm)

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  debootstrap iproute2 iptables nftables conntrack util-linux procps ca-certificates \
  python3 python3-venv python3-dev gcc make git restic zstd "${js[@]}" >/dev/null
# The agent runtime (docs/design/agent-runtime.md) is made of this host's python3.11, tini-static and setpriv;
# busybox-static is the root of the tests' image with no Python and no glibc.
apt-get install -y -qq --no-install-recommends python3.11 tini util-linux busybox-static >/dev/null
# The OCI image tests (tests/template/test_oci.py): a real registry on loopback, a real client pushing to it,
# htpasswd for its logins, and a static busybox for an image with no Python and no glibc. Debian's
# docker-registry package enables a service on :5000 where systemd runs: tests start their own, so stop it.
apt-get install -y -qq --no-install-recommends docker-registry skopeo apache2-utils busybox-static >/dev/null
if command -v systemctl >/dev/null && systemctl is-enabled docker-registry >/dev/null 2>&1; then
  systemctl disable --now docker-registry >/dev/null 2>&1 || true
fi
# The database tests (docs/design/database.md) run against a real PostgreSQL 15, Debian's: each test session starts
# its own throwaway server on a Unix socket (keepstate/testing/postgres.py). The package creates and starts a
# "main" cluster listening on :5432; nothing may listen, so stop every cluster and leave each to start by hand only.
apt-get install -y -qq --no-install-recommends postgresql >/dev/null
if command -v systemctl >/dev/null && systemctl is-enabled postgresql >/dev/null 2>&1; then
  systemctl disable --now postgresql >/dev/null 2>&1 || true
fi
{ pg_lsclusters --no-header 2>/dev/null || true; } | while read -r ver name _; do
  pg_ctlcluster "$ver" "$name" stop >/dev/null 2>&1 || true
  conf=/etc/postgresql/$ver/$name/start.conf
  if [ -f "$conf" ]; then
    sed -i 's/^auto$/manual/' "$conf"
  fi
done
apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null

# Debian prints "runsc version 0.0~20240729.0", upstream "release-20240729.0".
ver=$(runsc --version 2>/dev/null | sed -n 's/^runsc version .*\(20[0-9]\{6\}\).*/\1/p' | head -n1)
if [ -z "$ver" ] || [ "$ver" -lt 20240729 ]; then
  echo "setup-host: runsc release ${ver:-unknown} is too old; need 20240729 or newer" >&2
  exit 1
fi

mkdir -p /var/lib/keepstate
touch "$stamp"
