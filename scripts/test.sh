#!/usr/bin/env bash
# Runs every test: unit and component tests, then the SDK tests against one shared KeepState
# server with real gVisor sandboxes, with the newest e2b SDK; the agent tests once more against an agent process
# on the host (what the router keeps private); the whole SDK suite again with clients that know only E2B_DOMAIN
# (the newest SDKs, e2b==2.50.0, the last on the v1 routes, and the control-plane tests with e2b==2.45.0, which
# checks the API key's format); and the SDK suites that exercise state once more against a server on PostgreSQL.
# The templates are built first, on the real network (apt mirrors); everything after that runs inside a network
# namespace of its own (scripts/isolated.sh) linked only to a fake internet (keepstate.testing.internet), so no
# test can reach a real address whatever the code under test does.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin

if [ -z "${KEEPSTATE_TEST_ISOLATED:-}" ]; then
  names=$($BIN/python -c "from keepstate.template.definition import load_all; print(' '.join(load_all()))")
  for name in $names; do
    $BIN/keepstate template build "$name" >/dev/null
  done
  KEEPSTATE_TEST_ISOLATED=1 KEEPSTATE_TEST_TEMPLATES=$names exec scripts/isolated.sh bash "$PWD/scripts/test.sh" "$@"
fi
names=$KEEPSTATE_TEST_TEMPLATES
# Kept warm by the test servers: every template but mcp-gateway and desktop, whose few tests take a cold start (a
# pool of them would hold memory for nothing the rest of the run).
warm=$(echo $names | tr ' ' '\n' | grep -vx -e mcp-gateway -e desktop | paste -sd, -)

export KEEPSTATE_TEMPLATE_CACHE=/var/lib/keepstate/templates
# Every server the tests start checks each control-plane response against docs/openapi.yaml: a violation is a 500.
export KEEPSTATE_VALIDATE_RESPONSES=1
export KEEPSTATE_TEST_HOME=$(mktemp -d /tmp/keepstate-test.XXXXXX)
port=$($BIN/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export KEEPSTATE_TEST_API=http://127.0.0.1:$port
logs=$KEEPSTATE_TEST_HOME/server.log
internet=$KEEPSTATE_TEST_HOME/internet.json
server=
pg_server=
pg_state=$KEEPSTATE_TEST_HOME/postgres.json
cleanup() {
  if [ -n "$server" ]; then kill -TERM "$server" 2>/dev/null && wait "$server" 2>/dev/null || true; fi
  if [ -n "$pg_server" ]; then kill -TERM "$pg_server" 2>/dev/null && wait "$pg_server" 2>/dev/null || true; fi
  if [ -n "${d_server:-}" ]; then kill -TERM "$d_server" 2>/dev/null && wait "$d_server" 2>/dev/null || true; fi
  if [ -n "${d_dns:-}" ]; then kill -TERM "$d_dns" 2>/dev/null || true; fi
  $BIN/python -m keepstate.testing.postgres down --state "$pg_state" || true
  $BIN/python -m keepstate.testing.internet down --state "$internet" || true
  # The server's data directory (catalog, event logs, checkpoint store: ~200 MB) is kept only for a failed run.
  if [ "${status:-1}" -eq 0 ]; then
    rm -rf "$KEEPSTATE_TEST_HOME"
  else
    echo "== the test server's data directory is kept for inspection: $KEEPSTATE_TEST_HOME"
  fi
}
trap cleanup EXIT
# The fake internet (DNS for *.test, HTTP/HTTPS sites, SOCKS5, a bulk server) as this namespace's only route out;
# tests read its addresses from the state file (tests/sdk/sdkharness.py: fake_internet()).
$BIN/python -m keepstate.testing.internet up --state "$internet"
export KEEPSTATE_FAKE_INTERNET=$internet
# The shared server resolves through the fake DNS and trusts the fake sites' CA.
state() { $BIN/python -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$internet" "$1"; }
serve_flags=(--dns-upstream "$(state dns)" --egress-ca-bundle "$(state ca_file)")
# wait_serving PID URL LOG: until the server answers /health; its log and exit 1 if it dies first.
wait_serving() {
  for _ in $(seq 1 600); do
    curl -fsS "$2/health" >/dev/null 2>&1 && return 0
    kill -0 "$1" 2>/dev/null || { cat "$3"; echo "the test server at $2 died" >&2; exit 1; }
    sleep 0.2
  done
}
KEEPSTATE_HOME=$KEEPSTATE_TEST_HOME $BIN/keepstate serve --listen 127.0.0.1:$port --pool-size 3 \
  --warm "$warm" --reap-on-exit "${serve_flags[@]}" \
  >"$logs" 2>&1 &
server=$!
wait_serving "$server" "$KEEPSTATE_TEST_API" "$logs"
export KEEPSTATE_TEST_KEY=$(KEEPSTATE_HOME=$KEEPSTATE_TEST_HOME $BIN/keepstate keys create tests 2>/dev/null)

status=0
$BIN/python -m pytest -n 2 -rs -p no:cacheprovider tests "$@" || status=$?
echo "== agent tests in host mode: an agent process on this host behind a control-plane stub (/init, tokens)"
env -u KEEPSTATE_TEST_API -u KEEPSTATE_TEST_KEY $BIN/python -m pytest -n 2 -rs -p no:cacheprovider tests/agent \
  || status=$?
# Clients that know only E2B_DOMAIN (the next major SDK drops E2B_API_URL and E2B_SANDBOX_URL): a server of its own
# with TLS on 127.0.0.1:443 for the domain ks.test, whose names (api.ks.test, <port>-<id>.ks.test) only the
# clients resolve, through a resolver of this run (keepstate.testing.domain_dns) in a mount namespace of their own.
domain=ks.test
d_home=$KEEPSTATE_TEST_HOME/by-domain
mkdir -p "$d_home"
d_logs=$d_home/server.log
d_port=$($BIN/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
$BIN/python -m keepstate.testing.domain_dns serve --listen 127.0.0.53 --domain $domain >"$d_home/dns.log" 2>&1 &
d_dns=$!
KEEPSTATE_HOME=$d_home $BIN/keepstate serve --listen 127.0.0.1:$d_port --tls-self-signed --tls-listen 127.0.0.1:443 \
  --domain $domain --pool-size 2 --warm "$warm" --reap-on-exit "${serve_flags[@]}" \
  >"$d_logs" 2>&1 &
d_server=$!
wait_serving "$d_server" "http://127.0.0.1:$d_port" "$d_logs"
d_key=$(KEEPSTATE_HOME=$d_home $BIN/keepstate keys create tests 2>/dev/null)
cat "$d_home/tls/router-ca.pem" "$(state ca_file)" >"$d_home/ca-bundle.pem"
by_domain() {
  KEEPSTATE_TEST_API=http://127.0.0.1:$d_port KEEPSTATE_TEST_KEY=$d_key KEEPSTATE_TEST_HOME=$d_home \
    KEEPSTATE_TEST_DOMAIN=$domain SSL_CERT_FILE=$d_home/ca-bundle.pem NODE_EXTRA_CA_CERTS=$d_home/ca-bundle.pem \
    $BIN/python -m keepstate.testing.domain_dns run --resolver 127.0.0.53 -- \
    env -u E2B_API_URL -u E2B_SANDBOX_URL KEEPSTATE_AGENT_PYTHON=$PWD/$BIN/python "$@"
}
echo "== the whole SDK suite again, Python and JS, with only E2B_DOMAIN=$domain set (https://api.$domain)"
by_domain $BIN/python -m pytest -n 2 -rs \
  -p no:cacheprovider -c tests/sdk/pytest.ini --rootdir . tests/sdk tests/agent || status=$?
echo "== SDK tests (control plane, durability, commands, files, PTY) again with e2b==2.50.0, the last release on the v1 routes, by domain"
by_domain .venv-e2b250/bin/python -m pytest -rs \
  -n 2 -p no:cacheprovider -c tests/sdk/pytest.ini --rootdir . tests/sdk tests/agent || status=$?
echo "== control-plane SDK tests again with e2b==2.45.0, which checks the API key's format before any request, by domain"
by_domain .venv-e2b245/bin/python -m pytest -n 2 -rs -p no:cacheprovider \
  -c tests/sdk/pytest.ini --rootdir . tests/sdk/test_control_plane.py || status=$?
kill -TERM "$d_server" "$d_dns" 2>/dev/null && wait "$d_server" 2>/dev/null || true
d_server=
echo "== SDK tests (newest e2b: control plane, durability, commands, files) again against a server on PostgreSQL"
# Its own PostgreSQL 15 (Debian's, as the postgres user, on a Unix socket in a temporary directory), its own data
# directory; only this server gets the URL: the servers tests start themselves stay on SQLite.
pg_home=$KEEPSTATE_TEST_HOME/on-postgres
mkdir -p "$pg_home"
pg_logs=$pg_home/server.log
pg_url=$($BIN/python -m keepstate.testing.postgres up --state "$pg_state")
pg_port=$($BIN/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
KEEPSTATE_HOME=$pg_home KEEPSTATE_DB=$pg_url $BIN/keepstate serve --listen 127.0.0.1:$pg_port --pool-size 2 \
  --warm "$warm" --reap-on-exit "${serve_flags[@]}" >"$pg_logs" 2>&1 &
pg_server=$!
wait_serving "$pg_server" "http://127.0.0.1:$pg_port" "$pg_logs"
pg_key=$(KEEPSTATE_HOME=$pg_home KEEPSTATE_DB=$pg_url $BIN/keepstate keys create tests 2>/dev/null)
KEEPSTATE_TEST_API=http://127.0.0.1:$pg_port KEEPSTATE_TEST_KEY=$pg_key KEEPSTATE_TEST_HOME=$pg_home \
  $BIN/python -m pytest -n 2 -rs -p no:cacheprovider tests/sdk/test_control_plane.py tests/sdk/test_durable.py \
  tests/agent/test_commands.py tests/agent/test_files.py || status=$?
kill -TERM "$pg_server" 2>/dev/null && wait "$pg_server" 2>/dev/null || true
pg_server=
if [ $status -ne 0 ]; then
  echo "== server log (last 80 lines)"; tail -n 80 "$logs"
  echo "== the server on PostgreSQL: its log (last 40 lines)"; tail -n 40 "$pg_logs"
  echo "== the server reached by its domain: its log (last 40 lines)"; tail -n 40 "$d_logs"
fi
exit $status
