"""Everything one outbox runs with, built once by the runner and passed down.

The replica, the holder's loop and the operations all take this one object
instead of a dozen collaborators, and none of them builds its own parts.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from relay.config import OutboxConfig, RelayConfig
from relay.core.mapping import Mapper
from relay.core.metrics import Metrics
from relay.core.publishing import Publisher
from relay.core.state import OutboxState
from relay.ops.operations import Operations
from relay.postgres.command_queue import CommandQueue
from relay.postgres.source import EventSource
from relay.postgres.store import Store


@dataclass
class Wakes:
    """Hints that cut a wait short; polling covers any that is missed."""

    events: asyncio.Event = field(default_factory=asyncio.Event)  # new rows (NOTIFY)
    commands: asyncio.Event = field(default_factory=asyncio.Event)  # an operator's command
    lease: asyncio.Event = field(default_factory=asyncio.Event)  # the lease was released


@dataclass(frozen=True)
class OutboxContext:
    name: str
    config: OutboxConfig
    relay_config: RelayConfig
    identity: str
    source: EventSource
    store: Store
    commands: CommandQueue
    publisher: Publisher
    mapper: Mapper
    operations: Operations
    metrics: Metrics
    state: OutboxState
    stop: asyncio.Event
    wakes: Wakes

    @classmethod
    def build(
        cls,
        name: str,
        relay_config: RelayConfig,
        *,
        identity: str,
        publisher: Publisher,
        metrics: Metrics,
        stop: asyncio.Event,
    ) -> OutboxContext:
        config = relay_config.outboxes[name]
        schema = relay_config.database.schema_
        source, store = EventSource(relay_config.source), Store(schema)
        mapper = Mapper(name, config)
        metrics.register_outbox(name)
        return cls(
            name=name,
            config=config,
            relay_config=relay_config,
            identity=identity,
            source=source,
            store=store,
            commands=CommandQueue(schema),
            publisher=publisher,
            mapper=mapper,
            operations=Operations(store, source, mapper, publisher),
            metrics=metrics,
            state=OutboxState(name),
            stop=stop,
            wakes=Wakes(),
        )
