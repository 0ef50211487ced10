"""`relay parked list | show | drop`: the messages set aside, for an operator to decide on."""

from __future__ import annotations

from typing import Any

from relay.config import RelayConfig
from relay.core.lanes import lanes_of
from relay.errors import RelayError
from relay.fleet.identity import identity
from relay.fleet.recorded import as_recorded
from relay.postgres.database import Database
from relay.postgres.migrations import ensure_migrated
from relay.postgres.store import ParkedMessage, Store


async def parked_list(config: RelayConfig, outbox: str) -> tuple[list[ParkedMessage], list[str]]:
    """The outbox's parked messages, of the partitions it runs with, and a note when the
    config says another count (recorded.py)."""
    config, notes = await as_recorded(config, [outbox])
    lanes = lane_names(config, outbox)
    async with Database.of(config, identity()).one_shot("cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        return await Store(config.database.schema_).parked(conn, lanes), notes


async def parked_show(config: RelayConfig, id_: int) -> ParkedMessage:
    async with Database.of(config, identity()).one_shot("cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        parked = await Store(config.database.schema_).parked_by_id(conn, id_)
    if parked is None:
        raise RelayError(f"no parked message with id {id_}")
    return parked


async def parked_drop(config: RelayConfig, ids: list[int] | None, outbox: str | None) -> list[int]:
    config, _ = await as_recorded(config, None if outbox is None else [outbox])
    lanes = _lanes_of(config, outbox)
    async with Database.of(config, identity()).one_shot("cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        return await Store(config.database.schema_).drop_parked(conn, ids, lanes)


async def parked_to_drop(
    config: RelayConfig, ids: list[int] | None, outbox: str | None
) -> list[ParkedMessage]:
    """What `parked_drop` with the same arguments would delete, in position order."""
    config, _ = await as_recorded(config, None if outbox is None else [outbox])
    lanes = _lanes_of(config, outbox)
    async with Database.of(config, identity()).one_shot("cli") as conn:
        await ensure_migrated(conn, config.database.schema_)
        return await Store(config.database.schema_).parked(conn, lanes, ids)


def _lanes_of(config: RelayConfig, outbox: str | None) -> list[str]:
    """The lanes of `outbox` (unknown: a ConfigError), or of every outbox."""
    names = [outbox] if outbox is not None else list(config.outboxes)
    return [lane for name in names for lane in lane_names(config, name)]


def summary(parked: ParkedMessage) -> dict[str, Any]:
    """The columns `relay parked list` shows."""
    return {
        "id": parked.id,
        "outbox": parked.outbox,
        "position": parked.position,
        "event": parked.event,
        "event_type": parked.event_type,
        "message_id": parked.message_id,
        "rule": parked.rule,
        "reason": parked.reason,
        "attempts": parked.attempts,
        "parked_at": parked.parked_at,
        "error": parked.error,
    }


def whole(parked: ParkedMessage) -> dict[str, Any]:
    """Every field, the body as text, for `relay parked show`."""
    body = parked.body.decode("utf-8", "replace") if parked.body is not None else None
    fields = {name: getattr(parked, name) for name in parked.__dataclass_fields__}
    return {**fields, "body": body}


def lane_names(config: RelayConfig, outbox: str) -> list[str]:
    """Where the outbox's messages are parked: its lanes (itself, when it has one), by the
    config's count (which `as_recorded` made the outbox's own)."""
    partitions = config.outbox(outbox).partitions  # unknown: a ConfigError
    return [lane.name for lane in lanes_of(outbox, partitions)]
