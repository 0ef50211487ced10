"""Everything one lane of an outbox runs with, built once by the runner and passed down.

The replica, the holder's loop and the operators' commands all take this one object instead
of a dozen collaborators, and none of them builds its own parts. An outbox with one
lane has one context, named after the outbox.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from relay.config import OutboxConfig, RelayConfig
from relay.core.lane_state import OutboxState
from relay.core.lanes import Lane
from relay.core.metrics import Metrics
from relay.core.publishing import Publisher
from relay.mapping.mapper import Mapper
from relay.postgres.command_queue import CommandQueue
from relay.postgres.partitions import Partitions
from relay.postgres.replication import ReplicationWait
from relay.postgres.source import EventSource
from relay.postgres.store import Store
from relay.runtime.commands import CommandRunner


@dataclass
class Wakes:
    """Hints that cut a wait short; polling covers any that is missed."""

    events: asyncio.Event = field(default_factory=asyncio.Event)  # new rows (NOTIFY)
    commands: asyncio.Event = field(default_factory=asyncio.Event)  # an operator's command


@dataclass(frozen=True)
class OutboxContext:
    name: str  # the lane's name: `loans`, or `loans/2` when the outbox is split
    lane: Lane
    config: OutboxConfig
    relay_config: RelayConfig
    identity: str
    source: EventSource
    store: Store
    commands: CommandQueue
    partitions: Partitions
    publisher: Publisher
    mapper: Mapper
    command_runner: CommandRunner
    metrics: Metrics
    state: OutboxState
    stop: asyncio.Event  # this lane's: set on shutdown, or to hand the lane over
    wakes: Wakes
    # The relay's stop, set at SIGTERM, before the lanes' own are: from then on a lane
    # takes no new command, which would otherwise be carried out and then handed on.
    shutdown: asyncio.Event
    replication: ReplicationWait | None = None  # source.survive_failover, when set

    @classmethod
    def build(
        cls,
        lane: Lane,
        relay_config: RelayConfig,
        *,
        identity: str,
        publisher: Publisher,
        metrics: Metrics,
        shutdown: asyncio.Event,
    ) -> OutboxContext:
        config = relay_config.outboxes[lane.outbox]
        schema = relay_config.database.schema_
        invalid_trace = (  # a series (from 0) only for outboxes that read trace context
            metrics.trace_context_invalid.labels(*lane.labels).inc if config.trace_context else None
        )
        mapper = Mapper(lane.outbox, config, count_invalid_trace=invalid_trace)
        source = EventSource(relay_config.source, lane, metadata=mapper.reads_metadata)
        store = Store(schema)
        metrics.register_lane(lane.labels)
        if relay_config.source.survive_failover is not None:  # alerts see it from the start
            metrics.standbys_missing.labels(*lane.labels).set(0)
        return cls(
            name=lane.name,
            lane=lane,
            config=config,
            relay_config=relay_config,
            identity=identity,
            source=source,
            store=store,
            commands=CommandQueue(schema),
            partitions=Partitions(schema),
            publisher=publisher,
            mapper=mapper,
            command_runner=CommandRunner(
                store, source, mapper, publisher, config.batch.max_messages
            ),
            metrics=metrics,
            state=OutboxState(lane.name),
            stop=asyncio.Event(),
            wakes=Wakes(),
            shutdown=shutdown,
            replication=(
                None
                if (survive := relay_config.source.survive_failover) is None
                else ReplicationWait(survive)
            ),
        )
