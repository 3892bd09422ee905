"""A sandbox's lifecycle, written down once: its states, the commands, and which command is legal in which state.

    (pool) --claim--> RUNNING --kill / timeout--> KILLED (row deleted)
    create (cold) -----^  |  ^
                 pause /  |  | connect (standby thawed, or checkpoint restored)
     auto-pause (timeout) v  |
                        PAUSED --kill--> KILLED
    RUNNING --snapshot--> RUNNING (+ a snapshot usable as templateID)
    RUNNING --fork(n)-->  RUNNING (+ n new sandboxes)

Every command on one sandbox runs under that sandbox's lock (SandboxManager.command), which
re-reads the sandbox's record and checks it against LEGAL before acting; so two commands on one
sandbox are serialised, and none acts on a record another command has already changed. The
transient states (PAUSING, RESUMING, CHECKPOINTING, KILLING) are what other readers (the list, the
info call, the router) see while a command holds the lock. Pure: no I/O, imported by the catalog.
"""

from __future__ import annotations

import enum

from keepstate.errors import Conflict, NotFound


class State(enum.StrEnum):
    POOLED = "pooled"  # started ahead of demand, unclaimed
    RUNNING = "running"
    CHECKPOINTING = "checkpointing"  # a snapshot or fork is capturing it; it runs on
    PAUSING = "pausing"  # frozen, being checkpointed; PAUSED once the checkpoint is published
    PAUSED = "paused"  # its checkpoint is in the store (and maybe a frozen standby)
    RESUMING = "resuming"  # being thawed or restored
    KILLING = "killing"
    KILLED = "killed"


class Command(enum.StrEnum):
    CREATE = "create"
    CONNECT = "connect"  # a running sandbox: extend its timeout; a paused one: resume it
    RESUME = "resume"  # E2B's older call: a paused sandbox only
    PAUSE = "pause"  # memory and files
    PAUSE_FILESYSTEM = "pause (filesystem only)"
    SNAPSHOT = "snapshot"
    FORK = "fork"
    KILL = "kill"
    SET_TIMEOUT = "set timeout"
    REFRESH = "refresh"  # keep it alive for a while from now: the end time is extended, never shortened
    EXPIRE = "timeout"  # its end time passed: kill it, or pause it (autoPause)
    NETWORK_UPDATE = "network update"
    METRICS = "metrics"


# What is legal where. A state not listed for a command refuses it with a 409 that names both; commands only ever
# see the stable states (POOLED, RUNNING, PAUSED): the transient ones exist while another command holds the lock.
LEGAL: dict[Command, frozenset[State]] = {
    Command.CREATE: frozenset({State.POOLED}),
    Command.CONNECT: frozenset({State.RUNNING, State.PAUSED}),
    Command.RESUME: frozenset({State.PAUSED}),
    Command.PAUSE: frozenset({State.RUNNING}),
    Command.PAUSE_FILESYSTEM: frozenset({State.RUNNING}),
    Command.SNAPSHOT: frozenset({State.RUNNING}),
    Command.FORK: frozenset({State.RUNNING}),
    Command.KILL: frozenset({State.RUNNING, State.PAUSED}),
    Command.SET_TIMEOUT: frozenset({State.RUNNING}),
    Command.REFRESH: frozenset({State.RUNNING}),
    Command.EXPIRE: frozenset({State.RUNNING}),
    Command.NETWORK_UPDATE: frozenset({State.RUNNING}),
    Command.METRICS: frozenset({State.RUNNING, State.PAUSED}),
}

# What a server starting after a crash does with each state it finds in the catalog (sandbox/adopt.py):
ADOPTION: dict[State, str] = {
    State.POOLED: "back into its pool if runsc runs it and its template build is current; else reaped",
    State.RUNNING: "adopted if runsc runs it (thawed first if a pause froze it and died); else reaped",
    State.CHECKPOINTING: "as RUNNING: the capture was not published",
    State.PAUSING: "as RUNNING: a pause that did not publish left it frozen; it is thawed and runs on",
    State.PAUSED: "kept; its standby is adopted if runsc still holds it frozen, else the checkpoint remains",
    State.RESUMING: "as PAUSED: the resume did not finish; the instance it was starting is reaped",
    State.KILLING: "reaped",
    State.KILLED: "reaped",
}

# The state a persisted transient state stands for after a crash (see ADOPTION).
AFTER_CRASH: dict[State, State] = {
    State.CHECKPOINTING: State.RUNNING, State.PAUSING: State.RUNNING, State.RESUMING: State.PAUSED,
    State.KILLING: State.KILLED,
}

# What the API shows: E2B knows only running and paused.
PUBLIC: dict[State, str] = {
    State.RUNNING: "running", State.CHECKPOINTING: "running", State.PAUSING: "running",
    State.PAUSED: "paused", State.RESUMING: "paused",
}


def listed(state: State) -> bool:
    """Whether the API lists, shows and routes to a sandbox in this state."""
    return state in PUBLIC


def require(command: Command, state: State, sandbox_id: str) -> None:
    """Raise the client's error if `command` is illegal in `state`: 404 for a sandbox that is gone, else 409."""
    if state in LEGAL[command]:
        return
    if state in (State.KILLED, State.KILLING) or (state == State.POOLED and command != Command.CREATE):
        raise NotFound(f"sandbox \"{sandbox_id}\" not found")
    if command in (Command.PAUSE, Command.PAUSE_FILESYSTEM) and state == State.PAUSED:
        raise Conflict(f"Error pausing sandbox - sandbox '{sandbox_id}' is already paused")
    if command == Command.RESUME and state == State.RUNNING:
        raise Conflict(f"sandbox '{sandbox_id}' is already running")
    if state == State.PAUSED:
        raise Conflict(f"sandbox '{sandbox_id}' is paused; {command} needs a running sandbox (connect resumes it)")
    raise Conflict(f"sandbox '{sandbox_id}' is {state}; {command} is not possible now")
