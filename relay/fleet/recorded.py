"""Operators' commands act on the partition set an outbox runs with, whatever their config says.

A `relay replay`, `retry-parked` or `parked` run with a config whose `partitions` is not
the recorded count (a deploy half done, a laptop's old copy) must reach the outbox's real
lanes: acting on the config's would claim lanes of another count. So each command reads
the recorded count first and carries on with it, and says so.
"""

from __future__ import annotations

from collections.abc import Iterable

from relay.config import RelayConfig
from relay.fleet.identity import identity
from relay.postgres.database import Database
from relay.postgres.migrations import ensure_migrated
from relay.postgres.partitions import Partitions


async def as_recorded(
    config: RelayConfig, outboxes: Iterable[str] | None = None
) -> tuple[RelayConfig, list[str]]:
    """The config with these outboxes' partitions as recorded, and a note for each one whose
    config says another count. An unknown outbox is a ConfigError, as everywhere."""
    names = list(config.outboxes) if outboxes is None else list(outboxes)
    for name in names:
        config.outbox(name)
    schema = config.database.schema_
    changed = {}
    notes = []
    async with Database.of(config, identity()).one_shot("cli") as conn:
        await ensure_migrated(conn, schema)
        partitions = Partitions(schema)
        for name in names:
            configured = config.outboxes[name].partitions
            count = await partitions.count(conn, name, configured)
            if count != configured:
                changed[name] = config.outboxes[name].model_copy(update={"partitions": count})
                notes.append(
                    f"note: {name} runs with {count} partition(s) (this config says"
                    f" {configured}); the command acts on its {count} lane(s)"
                )
    if not changed:
        return config, notes
    return config.model_copy(update={"outboxes": {**config.outboxes, **changed}}), notes
