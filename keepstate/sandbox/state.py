"""A sandbox's lifecycle, written down once: its states, the commands, and where each command leads.

    (pool) --claim--> RUNNING --kill / timeout--> KILLED (row deleted)
    create (cold) -----^  |  ^
                 pause /  |  | connect (standby thawed, or checkpoint restored)
     auto-pause (timeout) v  |
                        PAUSED --kill--> KILLED
    RUNNING --snapshot--> RUNNING (+ a snapshot usable as templateID)
    RUNNING --fork(n)-->  RUNNING (+ n new sandboxes)

TRANSITIONS maps (command, state) to (transient state, state on success, state on failure). The one executor of it
is SandboxTable.command (table.py): under the sandbox's lock it re-reads the record, looks the pair up (a pair not
in the table is refused: 404 for a sandbox that is gone, else a 409 naming both), writes the transient state, runs
the command's body, and writes the state on success or on failure. So two commands on one sandbox are serialised,
and none acts on a record another command has already changed; the transient states are what other readers (the
list, the info call, the router) see meanwhile. A command that decides on its way to become another (a timeout that
pauses or kills, a zero timeout that expires) hands over to that command's own transition (`Step.then`): no
command borrows another's name. Pure: no I/O.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

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
    CHECKPOINT = "checkpoint"  # a snapshot's checkpoint with no snapshot record (template builds)
    SET_DEFAULTS = "set defaults"  # default user, workdir and env (a template build's finish)
    DIED = "died"  # the metrics loop found its instance gone (out of memory, a crash)


class Transition(NamedTuple):
    transient: State | None  # written before the command acts (None: none, the record keeps its state meanwhile)
    success: State  # written once it has acted (KILLED: the record is gone; the command deleted its row)
    failure: State  # written if it raised


def _stay(state: State) -> Transition:
    return Transition(None, state, state)


# Where every command leads, from each state it is legal in. The transient states never appear on the left: commands
# only ever see the stable states (POOLED, RUNNING, PAUSED), the transient ones exist while another holds the lock.
TRANSITIONS: dict[tuple[Command, State], Transition] = {
    (Command.CREATE, State.POOLED): Transition(None, State.RUNNING, State.POOLED),
    (Command.CONNECT, State.RUNNING): _stay(State.RUNNING),
    (Command.CONNECT, State.PAUSED): Transition(State.RESUMING, State.RUNNING, State.PAUSED),
    (Command.RESUME, State.PAUSED): Transition(State.RESUMING, State.RUNNING, State.PAUSED),
    (Command.PAUSE, State.RUNNING): Transition(State.PAUSING, State.PAUSED, State.RUNNING),
    (Command.PAUSE_FILESYSTEM, State.RUNNING): Transition(State.PAUSING, State.PAUSED, State.RUNNING),
    (Command.SNAPSHOT, State.RUNNING): Transition(State.CHECKPOINTING, State.RUNNING, State.RUNNING),
    (Command.CHECKPOINT, State.RUNNING): Transition(State.CHECKPOINTING, State.RUNNING, State.RUNNING),
    (Command.FORK, State.RUNNING): Transition(State.CHECKPOINTING, State.RUNNING, State.RUNNING),
    (Command.KILL, State.RUNNING): Transition(State.KILLING, State.KILLED, State.RUNNING),
    (Command.KILL, State.PAUSED): Transition(State.KILLING, State.KILLED, State.PAUSED),
    (Command.DIED, State.RUNNING): Transition(State.KILLING, State.KILLED, State.RUNNING),
    (Command.SET_TIMEOUT, State.RUNNING): _stay(State.RUNNING),
    (Command.REFRESH, State.RUNNING): _stay(State.RUNNING),
    (Command.EXPIRE, State.RUNNING): _stay(State.RUNNING),
    (Command.NETWORK_UPDATE, State.RUNNING): _stay(State.RUNNING),
    (Command.SET_DEFAULTS, State.RUNNING): _stay(State.RUNNING),
    (Command.METRICS, State.RUNNING): _stay(State.RUNNING),
    (Command.METRICS, State.PAUSED): _stay(State.PAUSED),
}


# What is legal where: the left-hand sides of TRANSITIONS.
LEGAL: dict[Command, frozenset[State]] = {
    c: frozenset(state for command, state in TRANSITIONS if command == c) for c in Command}

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


def transition(command: Command, state: State, sandbox_id: str) -> Transition:
    """Where `command` leads from `state`; the client's error if it is illegal there: 404 for a sandbox that is
    gone, else 409."""
    found = TRANSITIONS.get((command, state))
    if found is not None:
        return found
    if state in (State.KILLED, State.KILLING) or (state == State.POOLED and command != Command.CREATE):
        raise NotFound(f"sandbox \"{sandbox_id}\" not found")
    if command in (Command.PAUSE, Command.PAUSE_FILESYSTEM) and state == State.PAUSED:
        raise Conflict(f"Error pausing sandbox - sandbox '{sandbox_id}' is already paused")
    if command == Command.RESUME and state == State.RUNNING:
        raise Conflict(f"sandbox '{sandbox_id}' is already running")
    if state == State.PAUSED:
        raise Conflict(f"sandbox '{sandbox_id}' is paused; {command} needs a running sandbox (connect resumes it)")
    raise Conflict(f"sandbox '{sandbox_id}' is {state}; {command} is not possible now")


def require(command: Command, state: State, sandbox_id: str) -> None:
    """Raise the client's error if `command` is illegal in `state` (transition's check alone)."""
    transition(command, state, sandbox_id)
