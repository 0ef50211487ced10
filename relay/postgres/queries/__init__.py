"""The relay's statements, named in one package.

The application's event table is read in the config's table and column names, so those
statements are built in Python: `SourceQueries` (and `ReplicationQueries`, the catalogs the
drain barrier and the standby check read), in reading.py. The relay's own tables in
`database.schema` are its own: their statements are written out by name in
own_tables.sql, in groups (`store`, `partitions`, `commands`, `membership`, `lease`), and
`statements(group, schema)` gives one group's, filled in for the schema. The class that
runs them takes its group once, in its own constructor, and uses them by name: Store,
Partitions, CommandQueue, Membership and LeaseConnection.

Names from the config are quoted here (sql.quote, sql.qualified) as the text is built;
values never are in the text: each is a $n parameter, listed with its statement. The
schema's DDL stays with the migrations (migrations.py), what the relay checks of the
event table and of its rights with those checks (event_table.py, rights.py).
"""

from relay.postgres.queries.own_tables import (
    HOLDER_OF,
    NOTIFY,
    lock_wait,
    move_parked,
    statements,
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
    "HOLDER_OF",
    "NOTIFY",
    "ReplicationQueries",
    "SourceQueries",
    "lane_at",
    "lane_expression",
    "lane_of",
    "lock_wait",
    "move_parked",
    "published",
    "statements",
]
