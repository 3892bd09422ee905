"""`keepstate template`: list and build sandbox templates."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from keepstate.ports import API_PORT

from .common import Group, emit_json, home_option, json_option


@click.group(cls=Group)
def template() -> None:
    """List and build sandbox templates (definitions: keepstate/template/definitions/, or $KEEPSTATE_TEMPLATES).

    \b
    Examples:
      keepstate template ls
      keepstate template build base
      keepstate template build code-interpreter-v1 --force
    """


@template.command("ls")
@json_option()
@home_option
def ls(as_json: bool) -> None:
    """List templates, whether they are built, and their digests."""
    from keepstate.template.builder import list_built

    rows = list_built()
    if as_json:
        emit_json(rows)
        return
    click.echo(f"{'NAME':<22} {'BUILT':<6} {'DIGEST':<18} {'CPU':>4} {'MEM MB':>7}  BUILT AT")
    for r in rows:
        at = time.strftime("%Y-%m-%d %H:%M", time.localtime(float(str(r["built_at"])))) if r["built_at"] else "-"
        digest = str(r["digest"])[:16] if r["digest"] else "-"
        click.echo(f"{r['name']:<22} {'yes' if r['built'] else 'no':<6} {digest:<18} {r['cpu']:>4} "
                   f"{r['memory_mb']:>7}  {at}")


@template.command("build")
@click.argument("definition", required=False)
@click.option("--force", is_flag=True, help="Rebuild even if cached (a TOML definition; with --dockerfile: every "
                                            "step, like the SDK's skip_cache).")
@click.option("--dockerfile", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Build a template from this Dockerfile on a running server (docs/design/template-builds.md).")
@click.option("--name", default=None, help="With --dockerfile: the template's name (name or name:tag).")
@click.option("--context", "context_dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, help="With --dockerfile: the folder COPY sources are relative to (default: the "
                                 "Dockerfile's).")
@click.option("--ready-cmd", default=None, help="With --dockerfile: the command that says the start command is "
                                                "ready (default with a CMD/ENTRYPOINT: E2B's `sleep 20`).")
@click.option("--cpu", type=int, default=None, help="With --dockerfile: the build sandbox's and template's CPUs.")
@click.option("--memory-mb", type=int, default=None, help="With --dockerfile: their memory.")
@click.option("--api-url", envvar="E2B_API_URL", default=f"http://127.0.0.1:{API_PORT}", show_default=True,
              help="With --dockerfile: the KeepState server (E2B_API_URL).")
@click.option("--api-key", envvar="E2B_API_KEY", default=None, help="With --dockerfile: API key (E2B_API_KEY).")
@home_option
def build(definition: str | None, force: bool, dockerfile: Path | None, name: str | None,
          context_dir: Path | None, ready_cmd: str | None, cpu: int | None, memory_mb: int | None, api_url: str,
          api_key: str | None) -> None:
    """Build template DEFINITION (a TOML definition, cached: only rebuilt when it changes) and the agent runtime
    every sandbox runs its agent on (docs/design/agent-runtime.md) if this host has none yet; or, with
    --dockerfile, a template from a Dockerfile on a running server (its steps cached by the server).

    \b
    Examples:
      keepstate template build base
      keepstate template build --dockerfile ./Dockerfile --name my-app --context .
    """
    if dockerfile is not None:
        from .template_dockerfile import build_dockerfile

        if not name:
            raise click.UsageError("--dockerfile needs --name NAME (or NAME:TAG)")
        sys.exit(build_dockerfile(dockerfile, name, context_dir or dockerfile.parent, ready_cmd, force, cpu,
                                  memory_mb, api_url, api_key))
    if not definition:
        raise click.UsageError("name a TOML definition to build, or give --dockerfile PATH --name NAME")
    from keepstate.runtime.agent_runtime import ensure
    from keepstate.template.builder import ensure_built, stderr_progress

    b = ensure_built(definition, force=force)
    ensure(stderr_progress)
    click.echo(f"{b.name} {b.digest}")
