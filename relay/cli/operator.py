"""The CLI's side of operator commands: hand them to the lease holder, or do them directly.

A command is written to the commands table and signalled with NOTIFY; the CLI waits
for the holder's recorded outcome. With no holder, the CLI takes the outbox's lease
itself and carries the command out with the same steps a replica uses (runtime/holding.py,
runtime/commands.py), so two operators, or an operator and a replica starting up, are
serialised by the same lock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import structlog

from relay.brokers import create_publisher
from relay.config import RelayConfig
from relay.config.broker_identity import broker_identity
from relay.core.lanes import Lane, lanes_of
from relay.core.publishing import Publisher
from relay.errors import RelayError, UsageError
from relay.mapping.mapper import Mapper
from relay.postgres.command_queue import CommandKind, CommandQueue, CommandRequest
from relay.postgres.database import Database
from relay.postgres.lease import Lease, LeaseConnection
from relay.postgres.membership import change_coming, live_members
from relay.postgres.migrations import ensure_migrated
from relay.postgres.partitions import PARTITIONS_CHANGED, Partitions, PartitionsChanged
from relay.postgres.source import EventSource
from relay.postgres.store import Store
from relay.runtime import holding
from relay.runtime.commands import CommandRunner, Done, replay_forwards

log = structlog.get_logger("relay.operator")


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What the CLI reports: who carried the command out, and how it went."""

    ok: bool
    executed_by: str | None
    detail: dict[str, Any]
    direct: bool  # carried out by the CLI itself: no replica held the lease


@dataclass(frozen=True, slots=True)
class ReplayFrom:
    position: int | None = None
    start: bool = False
    time: datetime | None = None


@dataclass(frozen=True, slots=True)
class Replayed:
    """What a replay did, from its lanes' own outcomes."""

    checkpoint: int | None  # the furthest checkpoint its lanes had when it was carried out
    events: int  # the events it sends again: each lane's, from where it moved it back


@dataclass(frozen=True, slots=True)
class _Asking:
    """What the CLI asks of each lane, and how long it may wait for it."""

    kind: CommandKind
    deadline: float  # the whole command's, on the monotonic clock
    wait: float
    patient: bool  # `--wait`: a holder's running command extends the deadline


class CommandTimeout(RelayError):
    """The holder did not carry out the command in time.

    `here`: what happened on that lane alone, for a message that also names the lanes the
    command was already carried out on (their changes stand)."""

    def __init__(self, message: str, *, here: str) -> None:
        super().__init__(message)
        self.here = here


class CommandRefused(UsageError):
    """The command makes no sense for this outbox (e.g. a replay forwards)."""


class PartitionsMoved(RelayError):
    """The outbox's partitions changed while the command was carried out on its lanes."""


_ATTEMPTS = 3  # a command whose lanes changed under it is carried out on the new ones


class Operator:
    """The CLI's side: hand a command to each lane's holder, or do it under the lease itself."""

    def __init__(self, config: RelayConfig, outbox: str, identity: str) -> None:
        """`config` gives the outbox the partitions it runs with (recorded.py)."""
        self.outbox_config = config.outbox(outbox)  # unknown: a ConfigError
        self.config = config
        self.outbox = outbox
        self.identity = identity
        self.lanes = lanes_of(outbox, self.outbox_config.partitions)
        self.db = Database.of(config, identity)
        self.store = Store(config.database.schema_)
        self.source = EventSource(config.source)
        self.queue = CommandQueue(config.database.schema_)
        self.partitions = Partitions(config.database.schema_)

    async def run(
        self, kind: CommandKind, args: dict[str, Any], wait: float, *, patient: bool = False
    ) -> CommandResult:
        """The command, carried out on every lane of the outbox (one by one).

        `wait` bounds the whole command; `patient` (`--wait`) bounds only the wait for a
        holder to take it: once taken, it may run as long as its work takes.
        """
        kind = CommandKind(kind)
        asking = _Asking(kind, time.monotonic() + wait, wait, patient)
        session = LeaseConnection(
            self.db, self.config.lease, self.config.database.schema_, self.identity
        )
        earlier: list[CommandResult] = []  # lanes done before their partitions changed
        asked = args
        try:
            for attempt in range(1, _ATTEMPTS + 1):
                await self.resolve()
                results: dict[str, CommandResult] = {}
                shares = await self._lane_args(kind, args)
                try:
                    for lane, lane_args in shares:
                        try:
                            results[lane.name] = await self._on_lane(
                                session, lane, lane_args, asking
                            )
                        except CommandTimeout as exc:
                            later = [other.name for other, _ in shares][len(results) + 1 :]
                            raise _partly_done(exc, lane, [*results], len(earlier), later) from exc
                except PartitionsMoved as exc:
                    if attempt == _ATTEMPTS:
                        raise
                    earlier += results.values()
                    args = _still_to_do(kind, args, earlier)
                    log.warning(
                        "the outbox's partitions changed during the command: carrying it out"
                        " on its new lanes",
                        kind=kind,
                        outbox=self.outbox,
                        reason=str(exc),
                    )
                    continue
                return merged(self.lanes, kind, asked, results, earlier)
        finally:
            await session.close()
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def resolve(self) -> None:
        """The lanes the outbox runs with now, whatever the config says (recorded.py)."""
        async with self.db.one_shot("cli") as conn:
            count = await self.partitions.count(conn, self.outbox, self.outbox_config.partitions)
        self.lanes = lanes_of(self.outbox, count)

    async def _lane_args(
        self, kind: CommandKind, args: dict[str, Any]
    ) -> list[tuple[Lane, dict[str, Any]]]:
        """Each lane's share of the command: retry-parked ids go to the lane that parked them."""
        ids = args.get("ids")
        if kind is not CommandKind.RETRY_PARKED or ids is None or len(self.lanes) == 1:
            return [(lane, args) for lane in self.lanes]
        async with self.db.one_shot("cli") as conn:
            owners = await self.store.parked_lanes(conn, [lane.name for lane in self.lanes], ids)
        return [
            (lane, {"ids": [i for i in ids if owners.get(i) == lane.name]})
            for lane in self.lanes
            if any(owners.get(i) == lane.name for i in ids)
        ] or [(self.lanes[0], args)]  # none of them parked: the first lane says "not found"

    async def _on_lane(
        self, session: LeaseConnection, lane: Lane, args: dict[str, Any], asking: _Asking
    ) -> CommandResult:
        """Do it under the lane's lease if free; else ask its holder; take over if it leaves."""
        lease = Lease(session, lane.name)
        said = False
        while True:
            said = await self._while_changing_over(lane, asking, said)
            try:
                if await lease.try_acquire():
                    return await self._directly(lease, lane, asking.kind, args)
                result = await self._through_holder(lease, lane, args, asking)
            finally:
                await lease.release()
            if result is not None:
                return result

    async def _while_changing_over(self, lane: Lane, asking: _Asking, said: bool) -> bool:
        """Wait, on one connection, while the CLI must not carry a command out on `lane`
        itself; True once it has said that it waits.

        When every live replica that runs the outbox says one other count, and the count is
        not pinned, they change the outbox over as soon as its lanes are free (replica.py).
        Work the CLI did on an old lane meanwhile would be redone on the new ones when the
        change lands between two lanes of the command: a third copy of a replay's events.
        """
        lease = self.config.lease
        schema = self.config.database.schema_
        async with self.db.one_shot("cli") as conn:
            while True:
                record = await self.partitions.read(conn, self.outbox)
                if record is None:
                    return said
                if record.partitions != lane.count:  # it has changed over
                    raise PartitionsMoved(
                        f"{self.outbox} runs with {record.partitions} partitions now,"
                        f" not {lane.count}"
                    )
                members = await live_members(conn, schema, lease.namespace, lease.takeover_after)
                count = change_coming(self.outbox, record.partitions, record.pinned, members)
                if count is None:
                    return said
                changing = (
                    f"the outbox is changing over from {lane.count} to {count} partitions"
                    f" (every live replica that runs it is configured with {count})"
                )
                said = _wait_for_the_change(lane, changing, asking, said)
                await asyncio.sleep(0.1)

    async def _through_holder(
        self, lease: Lease, lane: Lane, args: dict[str, Any], asking: _Asking
    ) -> CommandResult | None:
        """The holder's outcome; None if the lease fell free first (command withdrawn)."""
        deadline, wait = asking.deadline, asking.wait
        conn = await self.db.connect("cli")
        try:
            request = CommandRequest(lane, asking.kind, args, self.identity)
            try:
                command_id = await self.queue.submit(conn, request)
            except PartitionsChanged as exc:  # changed since this lane was resolved
                raise PartitionsMoved(str(exc)) from exc
            while time.monotonic() < deadline:
                state = await self.queue.result(conn, command_id)
                if (state.outcome or {}).get(PARTITIONS_CHANGED):
                    raise PartitionsMoved(str((state.outcome or {}).get("error")))
                if state.finished:
                    ok = state.state == "done"
                    return CommandResult(ok, state.executed_by, state.outcome or {}, False)
                holder = await lease.holder()
                if asking.patient and state.state == "running" and holder is not None:
                    # Taken, and its holder alive: the work may take as long as it takes.
                    deadline = time.monotonic() + wait
                if holder is None and await self.queue.expire(conn, command_id):
                    return None  # nobody holds it now: do the work ourselves
                await asyncio.sleep(0.1)
            if await self.queue.expire(conn, command_id):
                here = f"no lease holder carried out command {command_id} within {wait:g}s;"
                here += " it was withdrawn"
                raise CommandTimeout(f"{here} and nothing was changed", here=here)
            here = f"command {command_id} is still running on the holder after {wait:g}s;"
            here += " its outcome will be recorded in the commands table"
            raise CommandTimeout(here, here=here)
        finally:
            await conn.close()

    async def _directly(
        self, lease: Lease, lane: Lane, kind: CommandKind, args: dict[str, Any]
    ) -> CommandResult:
        """No replica holds the lease: take it, do the work, record it, let go."""
        outbox = self.outbox_config
        source = EventSource(self.config.source, lane)
        reader = await self.db.connect("cli")
        publisher: Publisher | None = None
        try:
            broker = broker_identity(self.config.brokers[outbox.broker])
            claimant = holding.Claimant(
                lane,
                outbox.start,
                source,
                self.store,
                self.queue,
                self.partitions,
                broker,
                replica=False,
            )
            try:
                claimed = await holding.claim(lease, claimant, reader)
            except PartitionsChanged as exc:
                raise PartitionsMoved(str(exc)) from exc
            holding.warn_if_broker_changed(log, self.outbox, claimed.claim)
            holding.warn_if_skip_unreadable(log, claimed.claim)
            log.info(
                "no holder: carrying out the command under the lease",
                kind=kind,
                outbox=lane.name,
                epoch=claimed.claim.epoch,
            )
            if kind is CommandKind.RETRY_PARKED:
                publisher = create_publisher(outbox.broker, self.config.brokers[outbox.broker])
            runner = CommandRunner(
                self.store,
                source,
                Mapper(self.outbox, outbox),
                publisher,
                outbox.batch.max_messages,
            )
            # Keep proving the lease (and stamping the heartbeat) while the work runs: else
            # a replica starting meanwhile would take this CLI for a silent holder.
            held = await holding.while_held(
                lease, claimed.claim.epoch, runner.carry_out(kind, args, claimed, reader)
            )
            if held.lost is not None:
                raise RelayError(f"lost the lease while carrying out the command: {held.lost}")
            done = held.result or Done(ok=False)
            async with lease.statement() as conn:
                request = CommandRequest(lane, kind, args, self.identity)
                await self.queue.record(conn, request, ok=done.ok, outcome=done.detail)
            return CommandResult(done.ok, self.identity, done.detail, True)
        finally:
            if publisher is not None:
                await publisher.close()
            await reader.close()

    async def head(self) -> int:
        """The event table's head now: where a replay's `--wait` ends."""
        async with self.db.one_shot("cli") as conn:
            return await self.source.head(conn)

    async def replay_target(self, spec: ReplayFrom) -> tuple[int, int]:
        """(the position to move back to, the furthest checkpoint of the outbox's lanes)."""
        await self.resolve()
        async with self.db.one_shot("cli") as conn:
            await ensure_migrated(conn, self.config.database.schema_)
            positions = await self._positions(conn)
            if not positions:
                raise CommandRefused(f"outbox {self.outbox!r} has never relayed: nothing to replay")
            current = max(positions.values())
            if spec.start:
                target = 0
            elif spec.time is not None:
                first = await self.source.first_position_since(conn, spec.time)
                target = current if first is None else first - 1
            else:
                assert spec.position is not None  # the CLI requires one of the three
                target = spec.position - 1
            if target > current:
                raise CommandRefused(replay_forwards(target + 1, current))
            return max(target, 0), current

    async def replayed(self, to: int, outcome: CommandResult) -> Replayed:
        """What a replay back to `to` did, from each lane's outcome: where each lane's
        checkpoint was and where it went, and the events that sends again.

        Not from what the lanes held when the replay was asked: another command (a replay,
        a repartition) may have moved them back in between. A replay that found every
        lane before `to` moved nothing: it has become a replay forwards, and is refused as
        one (CommandRefused)."""
        details = outcome.detail.get("lanes", {self.lanes[0].name: outcome.detail})
        moves = {
            name: (d["previous_checkpoint"], d["checkpoint"])
            for name, d in details.items()
            if isinstance(d, dict) and _positions(d.get("previous_checkpoint"), d.get("checkpoint"))
        }
        if not moves:
            return Replayed(None, 0)
        furthest = max(before for before, _ in moves.values())
        if len(moves) == len(details) and furthest < to:
            raise CommandRefused(
                f"{replay_forwards(to + 1, furthest)}; the checkpoint moved back after this"
                " command was asked (another replay or a repartition ran first), and nothing"
                " was changed"
            )
        lanes = {lane.name: lane for lane in self.lanes}
        outbox = self.outbox_config
        events = 0
        async with self.db.one_shot("cli") as conn:
            for name, (before, after) in moves.items():
                if before > after and name in lanes:
                    events += await EventSource(self.config.source, lanes[name]).count(
                        conn,
                        after=after,
                        upto=before,
                        aggregates=outbox.aggregates,
                        types=list(outbox.messages),
                    )
        return Replayed(furthest, events)

    async def count(self, after: int, upto: int) -> int:
        """Events a replay from `after` sends again: each lane's, up to its own checkpoint."""
        outbox = self.outbox_config
        async with self.db.one_shot("cli") as conn:
            positions = await self._positions(conn)
            total = 0
            for lane in self.lanes:
                lane_upto = min(upto, positions.get(lane.name, after))
                if lane_upto > after:
                    total += await EventSource(self.config.source, lane).count(
                        conn,
                        after=after,
                        upto=lane_upto,
                        aggregates=outbox.aggregates,
                        types=list(outbox.messages),
                    )
            return total

    async def _positions(self, conn: asyncpg.Connection) -> dict[str, int]:
        found = {}
        for lane in self.lanes:
            position = await self.store.position(conn, lane.name)
            if position is not None:
                found[lane.name] = position
        return found


def _positions(*values: object) -> bool:
    """Each value a checkpoint position (an int, not a bool), as a lane's outcome holds it."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _wait_for_the_change(lane: Lane, changing: str, asking: _Asking, said: bool) -> bool:
    """Say once that the command waits for a change-over; past the deadline, give up."""
    if time.monotonic() >= asking.deadline:
        here = f"{changing}, and it did not within {asking.wait:g}s; {lane.name} was not asked"
        raise CommandTimeout(f"{here}, and nothing was changed", here=here)
    if not said:
        log.warning(
            "waiting for the outbox to change over before carrying the command out",
            outbox=lane.name,
            reason=changing,
        )
    return True


def _partly_done(
    exc: CommandTimeout, lane: Lane, done: list[str], before_change: int, later: list[str]
) -> CommandTimeout:
    """A lane timed out after the command was carried out on others: those changes stand
    (a replay's events there go out again), so the message must not say nothing changed."""
    if before_change:
        done.append(f"{before_change} lane(s) of the count before the partitions changed")
    if not done:
        return exc
    message = f"{lane.name}: {exc.here}; the command was already carried out on"
    message += f" {', '.join(done)}, and those changes stand"
    if later:
        message += f"; not asked: {', '.join(later)}"
    return CommandTimeout(message + " (run it again to finish)", here=exc.here)


def _still_to_do(
    kind: CommandKind, args: dict[str, Any], done: list[CommandResult]
) -> dict[str, Any]:
    """What is left of the command once `done` lanes were carried out: a replay goes again
    on every new lane; a retry of given ids, without those already published."""
    ids = args.get("ids")
    if kind is not CommandKind.RETRY_PARKED or ids is None:
        return args
    published = {i for r in done for i in r.detail.get("published", [])}
    return {**args, "ids": [i for i in ids if i not in published]}


def merged(
    lanes: list[Lane],
    kind: CommandKind,
    args: dict[str, Any],
    results: dict[str, CommandResult],
    earlier: list[CommandResult] | None = None,
) -> CommandResult:
    """One result for the outbox; an outbox with one lane reports its lane's as it is.

    `earlier`: lanes carried out before the partitions changed under the command; a retry's
    messages they published count as published."""
    if len(lanes) == 1 and not earlier:
        return next(iter(results.values()))
    every = [*(earlier or []), *results.values()]
    ok = all(r.ok for r in results.values())
    by = sorted({r.executed_by for r in every if r.executed_by})
    detail: dict[str, Any] = {"lanes": {name: r.detail for name, r in results.items()}}
    if kind is CommandKind.RETRY_PARKED:
        published = [i for r in every for i in r.detail.get("published", [])]
        still = {
            k: v
            for r in results.values()
            for k, v in r.detail.get("still_parked", {}).items()
            if int(k) not in published
        }
        outcomes = sorted(
            (o for r in every for o in r.detail.get("outcomes", [])),
            key=lambda o: (o["position"], o["id"]),
        )
        detail.update(published=published, still_parked=still, outcomes=outcomes)
        asked = args.get("ids")
        if asked is not None:
            found = set(published) | {int(k) for k in still}
            unknown = sorted(set(asked) - found)
            if unknown:
                detail["not_found"] = unknown
    return CommandResult(ok, ", ".join(by) or None, detail, all(r.direct for r in results.values()))
