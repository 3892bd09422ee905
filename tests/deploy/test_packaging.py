"""`keepstate deploy`: the systemd unit and the Kubernetes manifest of a cluster node, rendered and read back the way
systemd and Kubernetes read them, their command lines parsed by the real `keepstate serve` (not run: no systemd or
Kubernetes runs here; docs/deploy.md says what is tested only on paper)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from click.testing import CliRunner, Result

from keepstate.cli.main import cli
from keepstate.cli.serve import NODE_NAME, serve
from keepstate.config import home
from keepstate.db.setup import db_url

REPO = Path(__file__).resolve().parents[2]
KEEPSTATE = str(Path(sys.executable).with_name("keepstate"))  # this venv's: systemd-analyze wants it to exist
DB = "postgresql://keepstate:pw@db.internal/keepstate"
STORE = "s3://sessions/ks?endpoint=http://s3.internal:8333"
NODE_ARGS = ["--node", "host-a", "--advertise", "http://10.0.0.5:3000", "--db", DB, "--store", STORE]
NO_CREDENTIALS = {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "KEEPSTATE_DB": None,
                  "KEEPSTATE_STORE": None}
# What deploy/ holds: each file as these commands print it (docs/deploy.md shows them).
EXAMPLES = {
    "deploy/systemd/keepstate-node.service": ["deploy", "systemd", "unit", "--keepstate",
                                              "/opt/keepstate/bin/keepstate"],
    "deploy/systemd/node.env.example": ["deploy", "systemd", "env", "--node", "host-a", "--advertise",
                                        "http://10.0.0.5:3000", "--db",
                                        "postgresql://keepstate:CHANGE-ME@db.internal/keepstate", "--store", STORE],
    "deploy/kubernetes/keepstate.yaml": ["deploy", "kubernetes", "--image", "registry.example.com/keepstate:0.1.0",
                                         "--store", STORE],
}


def ks(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner(env={**NO_CREDENTIALS, **(env or {})}).invoke(cli, list(args), prog_name="keepstate")


def rendered(*args: str, env: dict[str, str | None] | None = None) -> str:
    done = ks(*args, env=env)
    assert done.exit_code == 0, done.output
    return done.stdout


# -- systemd, read as systemd reads it ----------------------------------------------------------------------------
def unit_file(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value given (systemd.syntax: comments, a trailing backslash continues the line)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"not KEY=VALUE in a section: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def env_file(text: str) -> dict[str, str]:
    """An EnvironmentFile whose every value is single-quoted (what the renderer writes): read literally."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        found = re.fullmatch(r"([A-Z_][A-Z0-9_]*)='([^']*)'", line)
        assert found, f"not KEY='VALUE': {line!r}"
        out[found[1]] = found[2]
    return out


def systemd_argv(command: str, env: dict[str, str]) -> list[str]:
    """An Exec*= line as systemd runs it (systemd.service, "Command lines"): words split as a shell would (no
    other syntax is used here), then `$$` is a `$`, `${NAME}` the variable's value within its word, and a word
    that is `$NAME` alone the value split at whitespace (zero words when it is empty)."""
    argv: list[str] = []
    for word in shlex.split(command):
        whole = re.fullmatch(r"\$([A-Za-z_]\w*)", word)
        if whole:
            argv += env.get(whole[1], "").split()
            continue
        assert not re.search(r"(?<!\$)\$[A-Za-z_]", word.replace("$$", "")), f"$NAME inside a word: {word!r}"
        argv.append(re.sub(r"\$\$|\$\{(\w+)\}", lambda m: "$" if m[0] == "$$" else env.get(m[1], ""), word))
    return argv


def parse_serve(argv: list[str], env: dict[str, str]) -> dict[str, object]:
    """`keepstate serve`'s options as it parses them from argv in this environment (nothing runs), and the database
    and data directory it would then use (its options put them in the environment)."""
    with mock.patch.dict(os.environ, env, clear=True):
        ctx = serve.make_context("serve", list(argv))
        return {**ctx.params, "database": db_url(home()), "home": str(home())}


@pytest.mark.parametrize("extra", ["", "--domain sbx.example.com --max-sandboxes 200"])
def test_the_unit_runs_serve_as_the_node_its_environment_file_names(tmp_path: Path, extra: str) -> None:
    unit = unit_file(rendered("deploy", "systemd", "unit", "--keepstate", KEEPSTATE))
    env = env_file(rendered("deploy", "systemd", "env", *NODE_ARGS, "--serve-args", extra))
    service = unit["Service"]
    assert service["EnvironmentFile"] == ["/etc/keepstate/node.env"]
    [start] = service["ExecStart"]
    argv = systemd_argv(start, env)
    assert argv[:2] == [KEEPSTATE, "serve"]
    parsed = parse_serve(argv[2:], env)
    assert parsed["node"] == "host-a" and NODE_NAME.fullmatch(str(parsed["node"]))
    assert parsed["advertise"] == "http://10.0.0.5:3000"
    assert parsed["listen"] == "0.0.0.0:3000"
    assert parsed["on_stop"] == "pause"
    assert parsed["store_url"] == STORE  # from KEEPSTATE_STORE: on no command line, as its keys may be in it
    assert parsed["database"] == DB and parsed["home"] == "/var/lib/keepstate"
    assert parsed["secrets_key_file"] == "/etc/keepstate/secrets.key"
    assert (parsed["domain"], parsed["max_sandboxes"]) == (("sbx.example.com", 200) if extra else (None, None))
    assert DB not in start and "KEEPSTATE_DB" not in start and "KEEPSTATE_STORE" not in start
    # Stop: SIGTERM to the server alone, time for its pauses, then SIGKILL to what is left of the unit.
    assert service["KillMode"] == ["mixed"] and service["KillSignal"] == ["SIGTERM"]
    assert int(service["TimeoutStopSec"][0]) >= 300
    assert service["Restart"] == ["on-failure"]
    assert "network-online.target" in unit["Unit"]["After"][0].split()
    assert "network-online.target" in unit["Unit"]["Wants"][0].split()
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    breaking = {"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateNetwork", "DynamicUser",
                "User", "ProtectKernelTunables", "ProtectControlGroups", "RestrictNamespaces", "RuntimeDirectory",
                "CapabilityBoundingSet", "SystemCallFilter", "NoNewPrivileges", "DevicePolicy", "ReadOnlyPaths"}
    assert breaking.isdisjoint(service), "runsc needs the host's mounts, devices, cgroups and namespaces"


def test_the_unit_refuses_to_start_a_node_that_would_be_alone(tmp_path: Path) -> None:
    unit = unit_file(rendered("deploy", "systemd", "unit", "--keepstate", KEEPSTATE))
    env = env_file(rendered("deploy", "systemd", "env", *NODE_ARGS))
    key = tmp_path / "secrets.key"
    key.write_text("QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=\n")
    env["KEEPSTATE_SECRETS_KEY_FILE"] = str(key)
    [check] = unit["Service"]["ExecStartPre"]

    def start(**changes: str | None) -> subprocess.CompletedProcess[str]:
        run_env = {k: v for k, v in {**env, **changes}.items() if v is not None}
        argv = systemd_argv(check, run_env)
        assert argv[:2] == ["/bin/sh", "-c"]
        return subprocess.run(argv, env={**run_env, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)

    assert start().returncode == 0, start().stderr
    for changes, said in [({"KEEPSTATE_DB": None}, "KEEPSTATE_DB"), ({"KEEPSTATE_NODE": ""}, "KEEPSTATE_NODE"),
                          ({"KEEPSTATE_DB": "sqlite:///var/lib/keepstate/keepstate.sqlite"}, "postgresql://"),
                          ({"KEEPSTATE_STORE": "file:///var/lib/keepstate/store"}, "s3://"),
                          ({"KEEPSTATE_SECRETS_KEY_FILE": str(tmp_path / "none")}, "no key file")]:
        refused = start(**changes)
        assert refused.returncode != 0 and said in refused.stderr, (changes, refused.stderr)


def test_systemd_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        # Only systemd itself checks every directive's spelling and value; where it is not installed the test
        # above (the unit's keys and command lines as systemd reads them) is all that runs.
        return
    path = tmp_path / "keepstate-node.service"
    path.write_text(rendered("deploy", "systemd", "unit", "--keepstate", KEEPSTATE))
    done = subprocess.run([analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (done.stdout + done.stderr).splitlines() if path.name in line]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr


def test_the_environment_file_keeps_secrets_off_the_command_line_and_refuses_what_it_cannot_hold() -> None:
    written = env_file(rendered("deploy", "systemd", "env", "--node", "host-b", "--advertise", "http://10.0.0.6:3000",
                                env={"KEEPSTATE_DB": DB, "KEEPSTATE_STORE": STORE, "AWS_ACCESS_KEY_ID": "AKIA1",
                                     "AWS_SECRET_ACCESS_KEY": "s3cr3t"}))
    assert (written["KEEPSTATE_DB"], written["KEEPSTATE_STORE"]) == (DB, STORE)
    assert (written["AWS_ACCESS_KEY_ID"], written["AWS_SECRET_ACCESS_KEY"]) == ("AKIA1", "s3cr3t")
    without = rendered("deploy", "systemd", "env", *NODE_ARGS)
    assert "AWS_ACCESS_KEY_ID" not in env_file(without) and "\n#AWS_ACCESS_KEY_ID=''\n" in without
    for args, said in [(["--node", "host.a"], "--node"), (["--advertise", "10.0.0.5:3000"], "--advertise"),
                       (["--db", "sqlite:///x.sqlite"], "PostgreSQL"), (["--store", "file:///srv/store"], "S3"),
                       (["--db", "postgresql://ks:it's@db/ks"], "single quote"), (["--listen", "3000"], "--listen"),
                       (["--serve-args", "--domain 'a b'"], "quotes")]:
        refused = ks("deploy", "systemd", "env", *NODE_ARGS, *args)
        assert refused.exit_code == 2 and said in refused.output, (args, refused.output)
    assert ks("deploy", "systemd", "unit", "--keepstate", "keepstate").exit_code == 2  # ExecStart= needs a path


# -- Kubernetes, read as the API server and the kubelet read it ------------------------------------------------------
FIELDS = {"spec.nodeName": "worker-1", "metadata.name": "keepstate-x7k2p", "status.podIP": "10.244.1.7"}
SECRET = {"db-url": DB, "secrets-key": "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUE=", "s3-access-key": "AKIA1",
          "s3-secret-key": "s3cr3t"}


def container_env(container: dict, secret: str) -> dict[str, str]:
    """The container's environment as the kubelet makes it: in order, each `$(NAME)` of a value the value of a
    variable defined before it."""
    out: dict[str, str] = {}
    for var in container["env"]:
        if "value" in var:
            out[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: out.get(m[1], m[0]), var["value"])
        elif "fieldRef" in var["valueFrom"]:
            out[var["name"]] = FIELDS[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret
            out[var["name"]] = SECRET[ref["key"]]
    return out


def manifest(*args: str) -> tuple[dict, dict]:
    docs = list(yaml.safe_load_all(rendered("deploy", "kubernetes", "--image", "reg.example.com/keepstate:1",
                                            "--store", STORE, *args)))
    assert [d["kind"] for d in docs] == ["DaemonSet", "Service"]
    assert all("namespace" not in d["metadata"] for d in docs)  # applied with kubectl -n
    return docs[0], docs[1]


def test_the_daemonset_runs_a_privileged_node_on_the_hosts_runsc() -> None:
    ds, svc = manifest("--serve-args", "--domain sbx.example.com", "--node-selector", "keepstate.dev/runsc=true",
                       "--service-type", "LoadBalancer")
    pod = ds["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "reg.example.com/keepstate:1"
    assert container["securityContext"]["privileged"] is True
    assert pod["hostNetwork"] is False and pod["terminationGracePeriodSeconds"] >= 300
    assert pod["nodeSelector"] == {"keepstate.dev/runsc": "true"}
    env = container_env(container, "keepstate")
    assert env["KEEPSTATE_NODE"] == "worker-1" and env["KEEPSTATE_ADVERTISE"] == "http://10.244.1.7:3000"
    assert env["KEEPSTATE_DB"] == DB and env["KEEPSTATE_STORE"] == STORE and env["AWS_ACCESS_KEY_ID"] == "AKIA1"
    assert "KEEPSTATE_SECRETS_KEY" in env
    optional = {v["name"] for v in container["env"] if v.get("valueFrom", {}).get("secretKeyRef", {}).get("optional")}
    assert optional == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    # The command line, $(NAME) expanded as the kubelet does, parsed by the real `keepstate serve`.
    assert container["command"] == ["/usr/bin/tini", "--", "keepstate"]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
    assert argv[0] == "serve"
    parsed = parse_serve(argv[1:], env)
    assert parsed["node"] == "worker-1" and parsed["advertise"] == "http://10.244.1.7:3000"
    assert parsed["on_stop"] == "pause" and parsed["store_url"] == STORE and parsed["domain"] == "sbx.example.com"
    assert parsed["database"] == DB and parsed["home"] == "/var/lib/keepstate"
    [port] = container["ports"]
    assert parsed["listen"] == f"0.0.0.0:{port['containerPort']}" and port["containerPort"] == 3000
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] in (port["name"], port["containerPort"])
    assert "livenessProbe" not in container  # a restart would break a build or the stop's pauses
    # The host's runsc on the image's PATH, and the host's data directory where KEEPSTATE_HOME says.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/usr/local/bin/runsc"]]["hostPath"] == {"path": "/usr/bin/runsc", "type": "File"}
    assert volumes[mounts[env["KEEPSTATE_HOME"]]]["hostPath"]["path"] == "/var/lib/keepstate"
    assert volumes[mounts["/dev"]]["hostPath"]["path"] == "/dev"  # loop devices made after the pod started
    # The Service: in front of every node's pod, on its port.
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"] and svc["spec"]["selector"].items() <= labels.items()
    [served] = svc["spec"]["ports"]
    assert served["targetPort"] in (port["name"], port["containerPort"]) and svc["spec"]["type"] == "LoadBalancer"


def test_the_manifest_takes_its_names_and_refuses_a_node_outside_a_cluster() -> None:
    ds, svc = manifest("--node-name-from", "metadata.name", "--name", "ks", "--secret", "ks-creds", "--port", "8080")
    [container] = ds["spec"]["template"]["spec"]["containers"]
    env = container_env(container, "ks-creds")
    assert env["KEEPSTATE_NODE"] == "keepstate-x7k2p" and env["KEEPSTATE_ADVERTISE"] == "http://10.244.1.7:8080"
    assert ds["metadata"]["name"] == svc["metadata"]["name"] == "ks"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 8080
    for args, said in [(["--store", "file:///srv/store"], "S3"), (["--name", "Keep_State"], "--name"),
                       (["--runsc", "runsc"], "--runsc"), (["--node-selector", "runsc"], "KEY=VALUE")]:
        refused = ks("deploy", "kubernetes", "--image", "reg.example.com/keepstate:1", "--store", STORE, *args)
        assert refused.exit_code == 2 and said in refused.output, (args, refused.output)


def test_the_files_in_deploy_are_what_the_commands_print() -> None:
    for path, args in EXAMPLES.items():
        assert (REPO / path).read_text() == rendered(*args), f"regenerate it: keepstate {shlex.join(args)} > {path}"
