"""The relay's statements, named in one package, each built once from the names in the config.

One class per thing they address: `SourceQueries`, the application's event table (in the
config's table and column names) and the catalogs the drain barrier reads; then the
relay's own tables in `database.schema`: `StoreQueries` (checkpoints and parked
messages), `PartitionQueries` (the partition set), `CommandQueries`, `MembershipQueries`
and `LeaseQueries`. The class that runs a statement builds its queries once, in its own
constructor, and uses them by name: EventSource, Store, Partitions, CommandQueue,
Membership and LeaseConnection.

Names from the config are quoted here (sql.quote, sql.qualified) as the text is built;
values never are in the text: each is a $n parameter, listed with its statement. The
schema's DDL stays with the migrations (migrations.py), what the relay checks of the
event table and of its rights with those checks (event_table.py, rights.py).
"""

from relay.postgres.queries.own_tables import (
    NOTIFY,
    CommandQueries,
    LeaseQueries,
    MembershipQueries,
    PartitionQueries,
    StoreQueries,
)
from relay.postgres.queries.reading import (
    ReplicationQueries,
    SourceQueries,
    lane_at,
    lane_expression,
    lane_of,
    published,
)

__all__ = [
    "NOTIFY",
    "CommandQueries",
    "LeaseQueries",
    "MembershipQueries",
    "PartitionQueries",
    "ReplicationQueries",
    "SourceQueries",
    "StoreQueries",
    "lane_at",
    "lane_expression",
    "lane_of",
    "published",
]
