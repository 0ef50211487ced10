"""Operator commands in Postgres: the commands table, written by the CLI, taken by the holder.

The CLI may run anywhere. It writes a command to `<schema>.commands` and sends NOTIFY;
the lease holder takes it between two batches, carries it out and records the outcome,
which the CLI waits for. A standby never takes one: taking needs the outbox's lock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any

import asyncpg
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relay import __version__
from relay.core.lanes import Lane
from relay.errors import RelayError
from relay.postgres.partitions import Partitions
from relay.postgres.queries import NOTIFY, statements
from relay.postgres.store import Claim
from relay.printable import excerpt

COMMAND_CHANNEL = "relay_commands"
_BIGINT = 2**63 - 1


class CommandKind(StrEnum):
    """What an operator may ask the holder to do; the table's CHECK allows these only."""

    REPLAY = "replay"
    RETRY_PARKED = "retry-parked"


class _Arguments(BaseModel):
    # strict: a row is written by the CLI or by hand; "5" or true for a position is a mistake.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    def as_row(self) -> dict[str, Any]:
        return self.model_dump()


class ReplayArgs(_Arguments):
    """Move the checkpoint back to `to`: the events after it are published again."""

    to: Annotated[int, Field(ge=0, le=_BIGINT)]


class RetryParkedArgs(_Arguments):
    """Publish these parked messages again (None: all of the lane's)."""

    ids: list[Annotated[int, Field(ge=1, le=_BIGINT)]] | None = None


Arguments = ReplayArgs | RetryParkedArgs
_MODELS: dict[CommandKind, type[_Arguments]] = {
    CommandKind.REPLAY: ReplayArgs,
    CommandKind.RETRY_PARKED: RetryParkedArgs,
}


# What this release can carry out, as commands.waiting and commands.take read it: each kind
# and the keys its args may hold. A pending row of another kind, or with another key, is a
# newer release's (docs/upgrading.md): it is left to a replica that knows it.
KNOWN = json.dumps({kind.value: sorted(model.model_fields) for kind, model in _MODELS.items()})
# How long such a row waits for a replica that knows it before the holder fails it: longer
# than a CLI waits for its command (`--timeout`, 30 s by default), after which the CLI
# withdraws it itself, so only a command nobody waits for any more is failed.
UNREADABLE_WAIT = 600.0


def unreadable(kind: str, args: str) -> str:
    """Why this release cannot carry out a pending command (a newer release's, say)."""
    known = ", ".join(k.value for k in CommandKind)
    if kind not in {k.value for k in CommandKind}:
        what = f"kind {excerpt(kind)} is not one this release knows ({known})"
    else:
        keys = json.loads(args)
        extra = sorted(set(keys) - set(_MODELS[CommandKind(kind)].model_fields))
        what = f"its args hold {', '.join(map(excerpt, extra))}, unknown to {kind} here"
    return (
        f"{what}, and no replica that knows it took it within {UNREADABLE_WAIT / 60:g} minutes"
        f" (this replica runs relay {__version__}): a newer release's command, written during"
        " a rolling upgrade? Ask again once the upgrade is done"
    )


@dataclass(frozen=True, slots=True)
class Waiting:
    """What the holder finds in the commands table for its lane."""

    ready: bool  # a command this release can carry out waits
    stale: bool  # one it cannot read has waited UNREADABLE_WAIT: fail it (`fail_unreadable`)


class BadArguments(RelayError):
    """A command row whose args the relay cannot carry out: it fails, the relay goes on."""


def arguments(kind: CommandKind, raw: object) -> Arguments:
    """The command's args, checked by the models the CLI builds them with.

    Anyone who can INSERT a row writes them, so they are checked when read, not trusted.
    """
    try:
        # As JSON, so that the messages speak of objects and lists, as the row does.
        parsed = _MODELS[kind].model_validate_json(json.dumps(raw))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'args'}: {e['msg']}" for e in exc.errors()
        )
        raise BadArguments(f"bad args for {kind.value}: {problems}") from None
    assert isinstance(parsed, ReplayArgs | RetryParkedArgs)
    return parsed


@dataclass(frozen=True, slots=True)
class Command:
    id: int
    outbox: str
    kind: CommandKind
    args: Any  # as the row holds them: checked by `arguments` before they are used
    requested_by: str


@dataclass(frozen=True, slots=True)
class CommandRequest:
    """What an operator asks for, of which lane (of which count), and who asks."""

    lane: Lane
    kind: CommandKind
    args: dict[str, Any]
    by: str

    @property
    def outbox(self) -> str:
        return self.lane.name

    def columns(self) -> tuple[str, str, str, str]:
        """outbox, kind, args (JSON) and requested_by, as the table stores them."""
        return self.outbox, self.kind.value, json.dumps(self.args), self.by


@dataclass(frozen=True, slots=True)
class CommandState:
    """Where a submitted command stands: pending, running, done, failed or expired."""

    state: str
    executed_by: str | None
    outcome: dict[str, Any] | None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed")


# How long `relay status` shows a failed command.
FAILED_SHOWN_FOR = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Unsettled:
    """A command not finished, or one that failed lately: what `relay status` shows and
    what a holder fails when no holder will ever carry it out or finish it."""

    id: int
    lane: str  # the row's `outbox`: a lane's name, or whatever a hand-written row says
    kind: str
    state: str
    executed_by: str | None
    age: float  # seconds since it was asked
    holding: bool  # running, and its holder still holds the lane's lock
    error: str | None  # why it failed, for a failed one

    def stuck(self, outbox: str, lanes: Sequence[str]) -> str | None:
        """Why no holder will ever carry it out or finish it, given the names of the lanes
        `outbox` runs with; None when one may (or it is finished)."""
        if self.state not in ("pending", "running"):
            return None
        lane = excerpt(self.lane)
        if self.lane not in lanes:
            span = lanes[0] if len(lanes) == 1 else f"{lanes[0]} to {lanes[-1]}"
            if self.lane == outbox:
                return (
                    f"{outbox} is split into {len(lanes)} partitions, so its bare name is none"
                    f" of its lanes ({span}) and no holder takes the command: `relay"
                    f" {self.kind} {outbox}` writes a row for each lane"
                )
            return (
                f"{lane} is not a lane of {outbox}, which runs with {len(lanes)}"
                f" partition(s) ({span}): no holder takes the command"
            )
        if self.state == "running" and not self.holding:
            who = excerpt(self.executed_by or "its holder")
            return (
                f"left running by {who}, which no longer holds {lane}: it stopped while"
                " carrying it out, and what it did before is kept"
            )
        return None


class CommandQueue:
    """The commands table, seen from the CLI and from the holder."""

    def __init__(self, schema: str) -> None:
        self.queries = statements("commands", schema)
        self._partitions = Partitions(schema)

    async def submit(self, conn: asyncpg.Connection, request: CommandRequest) -> int:
        """Queue a command for the holder, and wake it.

        Only for a lane of the count the outbox runs with: lanes of two counts share names
        (`loans/1`), and a change of partitions ends the old lanes' commands in its own
        transaction. `Partitions.hold` keeps that change out until the command is in, so one
        asked during a change waits for it and is then refused (PartitionsChanged): the
        caller carries it out on the new lanes.
        """
        async with conn.transaction():
            await self._partitions.hold(conn, request.lane)
            command_id = await conn.fetchval(self.queries["submit"], *request.columns())
            await conn.execute(NOTIFY, COMMAND_CHANNEL, request.outbox)
        return int(command_id)

    async def result(self, conn: asyncpg.Connection, command_id: int) -> CommandState:
        row = await conn.fetchrow(self.queries["result"], command_id)
        outcome = json.loads(row["outcome"]) if row["outcome"] else None
        return CommandState(row["state"], row["executed_by"], outcome)

    async def expire(self, conn: asyncpg.Connection, command_id: int) -> bool:
        """Withdraw a command nobody took; False if a holder has started it already."""
        status = await conn.execute(self.queries["expire"], command_id)
        return bool(status.endswith(" 1"))

    async def waiting(self, conn: asyncpg.Connection, outbox: str) -> Waiting:
        """Whether a command waits for the outbox: a read on any connection, so that the
        holder's polling costs its shared lease connection nothing while none does."""
        row = await conn.fetchrow(self.queries["waiting"], outbox, KNOWN, UNREADABLE_WAIT)
        return Waiting(bool(row["ready"]), bool(row["stale"]))

    async def take(self, conn: asyncpg.Connection, claim: Claim, by: str) -> Command | None:
        """The oldest pending command of the outbox that this release can read, marked
        running; holder only. Those it cannot read stay pending for a replica that can."""
        row = await conn.fetchrow(self.queries["take"], claim.outbox, by, claim.key, KNOWN)
        if row is None:
            return None
        return Command(
            row["id"],
            row["outbox"],
            CommandKind(row["kind"]),
            json.loads(row["args"]),
            row["requested_by"],
        )

    async def fail_unreadable(
        self, conn: asyncpg.Connection, claim: Claim, by: str
    ) -> list[tuple[int, str]]:
        """Fail the pending commands this release cannot read that no replica took within
        UNREADABLE_WAIT, each saying why; (id, why) of each (holder only)."""
        rows = await conn.fetch(self.queries["unreadable"], claim.outbox, KNOWN, UNREADABLE_WAIT)
        failed = []
        for row in rows:
            why = unreadable(row["kind"], row["args"])
            outcome = json.dumps({"error": why})
            status = await conn.execute(
                self.queries["fail_pending"], row["id"], by, outcome, claim.key
            )
            if status.endswith(" 1"):
                failed.append((int(row["id"]), why))
        return failed

    async def finish(
        self, conn: asyncpg.Connection, command_id: int, ok: bool, outcome: dict[str, Any]
    ) -> None:
        await conn.execute(
            self.queries["finish"],
            command_id,
            "done" if ok else "failed",
            json.dumps(outcome, default=str),
        )

    async def record(
        self, conn: asyncpg.Connection, request: CommandRequest, *, ok: bool, outcome: Any
    ) -> int:
        """A command the CLI carried out itself, under the lease: kept like any other."""
        command_id = await conn.fetchval(
            self.queries["record"],
            *request.columns(),
            "done" if ok else "failed",
            json.dumps(outcome, default=str),
        )
        return int(command_id)

    async def abandon_running(self, conn: asyncpg.Connection, outbox: str) -> None:
        """A new holder fails what a previous holder left half-done."""
        await conn.execute(self.queries["abandon_running"], outbox)

    async def unsettled(
        self,
        conn: asyncpg.Connection,
        namespace: str,
        *,
        outbox: str | None = None,
        failed_within: float = FAILED_SHOWN_FOR,
    ) -> list[Unsettled]:
        """The commands not finished (of `outbox` and its lanes, or of every outbox), and
        those that failed within `failed_within` seconds: 500 at most, the unfinished ones
        first, by id."""
        rows = await conn.fetch(self.queries["unsettled"], failed_within, namespace, outbox)
        return [
            Unsettled(
                int(r["id"]),
                r["outbox"],
                r["kind"],
                r["state"],
                r["executed_by"],
                float(r["age"]),
                bool(r["holding"]),
                r["error"],
            )
            for r in sorted(rows, key=lambda r: int(r["id"]))
        ]

    async def fail_stuck(
        self,
        conn: asyncpg.Connection,
        claim: Claim,
        stuck: Sequence[tuple[Unsettled, str]],
        by: str,
    ) -> list[tuple[int, str]]:
        """Fail each of `stuck` (a command, why no holder will carry it out or finish it) if
        it is still as it was found; holder only. (id, why) of each failed."""
        failed = []
        for command, why in stuck:
            status = await conn.execute(
                self.queries["fail_stuck"],
                command.id,
                command.state,
                json.dumps({"error": why}),
                by,
                claim.key,
            )
            if status.endswith(" 1"):
                failed.append((command.id, why))
        return failed
