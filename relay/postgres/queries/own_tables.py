"""The statements of the relay's own tables in `database.schema`: `StoreQueries` (checkpoints
and parked messages), `PartitionQueries` (the partition set), `CommandQueries`,
`MembershipQueries` and `LeaseQueries` (advisory locks and heartbeats)."""

from __future__ import annotations

from typing import Final

from relay.postgres.queries.reading import lane_expression
from relay.postgres.sql import (
    advisory_locks,
    held_keys,
    holds_lock,
    lane_key,
    lock_holder,
    quote,
)

NOTIFY: Final = "SELECT pg_notify($1, $2)"  # $1 channel, $2 payload


def _tables(schema: str, *names: str) -> list[str]:
    return [f"{quote(schema)}.{name}" for name in names]


def fenced(checkpoints: str, assignments: str, where: str = "") -> str:
    """The one way a holder writes its checkpoint row: only at its claim's epoch, and only
    on the connection that holds its lock ($1 lane, $2 epoch, $3 lock key; `assignments`
    take their values from $4)."""
    also = f" AND {where}" if where else ""
    return (
        f"UPDATE {checkpoints} SET {assignments}"
        f" WHERE outbox = $1 AND epoch = $2 AND {holds_lock('$3')}{also}"
    )


# A parked message's free texts, cut short for a page (event data may be any size).
_CUT_PARKED = frozenset(
    (
        "event_type",
        "aggregate_type",
        "aggregate_id",
        "message_id",
        "message_type",
        "destination",
        "message_key",
        "rule",
        "reason",
        "error",
    )
)


class StoreQueries:
    """The checkpoints' and the parked messages' statements (Store)."""

    def __init__(self, schema: str, parked_columns: str) -> None:
        """`parked_columns`: what a parked message is read as (ParkedMessage's fields)."""
        checkpoints, parked = _tables(schema, "checkpoints", "parked")
        # $1 lane, $2 position, $3 start_xmin, $4 broker; an existing row stays as it is.
        self.create_checkpoint: Final = (
            f"INSERT INTO {checkpoints} (outbox, position, start_xmin, broker)"
            " VALUES ($1, $2, $3, $4) ON CONFLICT (outbox) DO NOTHING"
        )
        # $1 lane, $2 holder, $3 lock key: the next epoch.
        self.claim: Final = (
            f"UPDATE {checkpoints} SET epoch = epoch + 1, holder = $2, held_since = now(),"
            " heartbeat = now(), state = CASE WHEN halted IS NULL THEN 'relaying' ELSE 'halted'"
            " END, blocking = NULL, updated_at = now()"
            f" WHERE outbox = $1 AND {holds_lock('$3')}"
            " RETURNING epoch, position, halted, retry_position, retry_rule, attempts, rejections,"
            " start_xmin, broker, skip::text"
        )
        # The fenced writes: $1 lane, $2 epoch, $3 lock key, then their own.
        # $4 position (never backwards), $5 broker (NULL: unchanged). The retry count stays
        # with a failing message beyond $4 (a replay's events before it went through).
        kept = "CASE WHEN retry_position > $4 THEN {} END"
        self.advance: Final = fenced(
            checkpoints,
            "position = $4, state = 'relaying', last_error = NULL, updated_at = now(),"
            f" attempts = coalesce({kept.format('attempts')}, 0),"
            f" rejections = coalesce({kept.format('rejections')}, 0),"
            f" retry_position = {kept.format('retry_position')},"
            " broker = coalesce($5, broker)",
            where="position <= $4",
        )
        # $4 state, $5 attempts, $6 last_error, $7 retry_position, $8 rejections, $9 rule.
        self.report: Final = fenced(
            checkpoints,
            "state = $4, attempts = $5, last_error = $6, retry_position = $7, rejections = $8,"
            " retry_rule = $9, updated_at = now()",
        )
        # $4 reason.
        self.halt: Final = fenced(
            checkpoints,
            "halted = $4, state = 'halted', last_error = $4, blocking = NULL, updated_at = now()",
        )
        # $4 position (never forwards).
        self.settle_start: Final = fenced(
            checkpoints, "position = least(position, $4), start_xmin = NULL, updated_at = now()"
        )
        # $4 the blocking transaction (JSON), NULL when none.
        self.report_blocking: Final = fenced(
            checkpoints,
            "blocking = $4::jsonb,"
            " state = CASE WHEN $4::jsonb IS NULL THEN 'relaying' ELSE 'waiting' END,"
            " updated_at = CASE WHEN $4::jsonb IS NULL OR blocking IS NULL THEN now()"
            " ELSE updated_at END",
        )
        # $4 why events are held back until standbys have them, NULL once they are not.
        self.report_standbys: Final = fenced(
            checkpoints,
            "state = CASE WHEN $4::text IS NULL THEN 'relaying' ELSE 'waiting for standbys' END,"
            " last_error = $4, updated_at = now()",
        )
        # $1 lane, $2 epoch, $3 position (never forwards), $4 lock key, $5 broker: the
        # position it was at.
        self.rewind: Final = (
            f"UPDATE {checkpoints} c SET position = $3, halted = NULL, skip = NULL,"
            " state = CASE WHEN old.halted IS NULL THEN c.state ELSE 'relaying' END,"
            " last_error = CASE WHEN old.halted IS NULL THEN c.last_error END, updated_at = now(),"
            " broker = coalesce($5, c.broker)"
            f" FROM {checkpoints} old"
            " WHERE c.outbox = $1 AND old.outbox = c.outbox AND c.epoch = $2"
            f" AND c.position >= $3 AND {holds_lock('$4')} RETURNING old.position"
        )
        # Every row, with its count of parked messages.
        self.checkpoints: Final = (
            "SELECT outbox, position, epoch, holder, state, attempts, last_error, blocking,"
            " extract(epoch FROM now() - c.updated_at)::float8 AS since_update,"
            f" (SELECT count(*) FROM {parked} p WHERE p.outbox = c.outbox) AS parked"
            f" FROM {checkpoints} c ORDER BY outbox"
        )
        # $1 lane.
        self.position: Final = f"SELECT position FROM {checkpoints} WHERE outbox = $1"
        # $1 lane, $2 position, $3-$6 the event's type and aggregate, $7-$11 the message's
        # id, type, destination, key and body, $12 reason, $13 error, $14 attempts, $15 rule.
        self.park: Final = (
            f"INSERT INTO {parked} (outbox, position, event_type, aggregate_type,"
            " aggregate_id, version, message_id, message_type, destination, message_key, body,"
            " reason, error, attempts, rule)"
            " VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11,$12,$13,$14,$15)"
            " ON CONFLICT (outbox, position, rule) DO UPDATE SET attempts = excluded.attempts,"
            " error = excluded.error, reason = excluded.reason, parked_at = now()"
        )
        # Parked messages of the lanes $1 (text[]), only the ids $2 (int8[]) unless NULL.
        chosen = "outbox = ANY($1::text[]) AND ($2::bigint[] IS NULL OR id = ANY($2::bigint[]))"
        self.parked: Final = (
            f"SELECT {parked_columns} FROM {parked} WHERE {chosen} ORDER BY position, id"
        )
        self.parked_attempts: Final = f"SELECT id, attempts FROM {parked} WHERE {chosen}"
        # The $2 last parked of the lanes $1 (text[]), newest first, by the primary key (no
        # sort of every parked row); without bodies, each text cut to $3 characters and an
        # ellipsis.
        cut = ", ".join(
            f"left({c}, $3) || CASE WHEN length({c}) > $3 THEN '…' ELSE '' END AS {c}"
            if c in _CUT_PARKED
            else ("NULL::bytea AS body" if c == "body" else c)
            for c in parked_columns.split(", ")
        )
        self.newest_parked: Final = (
            f"SELECT {cut} FROM {parked} WHERE outbox = ANY($1::text[]) ORDER BY id DESC LIMIT $2"
        )
        # $1 id.
        self.parked_by_id: Final = f"SELECT {parked_columns} FROM {parked} WHERE id = $1"
        # The ids $1 (int8[]) that the lanes $2 (text[]) parked.
        self.parked_lanes: Final = (
            f"SELECT id, outbox FROM {parked} WHERE id = ANY($1::bigint[])"
            " AND outbox = ANY($2::text[])"
        )
        # $1 lane.
        self.parked_count: Final = f"SELECT count(*) FROM {parked} WHERE outbox = $1"
        # $1 ids (int8[]; NULL: all), $2 lanes (text[]): the ids deleted.
        self.drop_parked: Final = (
            f"DELETE FROM {parked} WHERE outbox = ANY($2::text[])"
            " AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[])) RETURNING id"
        )
        # $1 ids, $2 lane, $3 lock key (holder only).
        self.unpark: Final = (
            f"DELETE FROM {parked} WHERE id = ANY($1::bigint[]) AND outbox = $2"
            f" AND {holds_lock('$3')}"
        )
        # $1 ids, $2 their errors, $3 their reasons, $4 lane, $5 lock key (holder only).
        self.still_parked: Final = (
            f"UPDATE {parked} p SET attempts = p.attempts + 1, error = f.error,"
            " reason = f.reason FROM unnest($1::bigint[], $2::text[], $3::text[])"
            " AS f(id, error, reason)"
            f" WHERE p.id = f.id AND p.outbox = $4 AND {holds_lock('$5')}"
        )


# An outbox's row of the partition set, as every statement of it returns the row.
PARTITION_SET: Final = "outbox, partitions, start_position, start_xmin, pinned, changed_by"


def of_outbox(column: str) -> str:
    """`column` names the outbox $1 or one of its lanes (`$1/<n>`), of whatever count.

    Not LIKE: an outbox name may hold `_`, which LIKE would take for any character.
    """
    return f"({column} = $1 OR left({column}, length($1) + 1) = $1 || '/')"


class PartitionQueries:
    """The partition set's statements (Partitions), and a change of it: $1 is the outbox."""

    def __init__(self, schema: str) -> None:
        outboxes, checkpoints, parked, commands = _tables(
            schema, "outboxes", "checkpoints", "parked", "commands"
        )
        self._parked = parked
        # $2 count, $3 start, $4 start_xmin, $5 who, $6 a replica's claim. The first claim
        # records the count and the start; a replica's claim with the recorded count clears
        # an operator's pin (the CLI's claim, for a command, leaves it).
        self.admit: Final = (
            f"INSERT INTO {outboxes} AS o (outbox, partitions, start_position,"
            " start_xmin, changed_by) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (outbox) DO UPDATE"
            " SET start_position = coalesce(o.start_position, excluded.start_position),"
            " start_xmin = CASE WHEN o.start_position IS NULL THEN excluded.start_xmin"
            " ELSE o.start_xmin END,"
            " pinned = o.pinned AND (o.partitions <> excluded.partitions OR NOT $6::bool)"
            f" RETURNING {PARTITION_SET}"
        )
        self.read: Final = f"SELECT {PARTITION_SET} FROM {outboxes} WHERE outbox = $1"
        # The recorded count, kept from changing until the transaction ends.
        self.hold: Final = f"SELECT partitions FROM {outboxes} WHERE outbox = $1 FOR KEY SHARE"
        # $2 position.
        self.settle_start: Final = (
            f"UPDATE {outboxes} SET start_position = least(start_position, $2),"
            " start_xmin = NULL WHERE outbox = $1 AND start_xmin IS NOT NULL"
        )
        # A change: the row, then every lane's checkpoint row, locked.
        self.lock: Final = self.read + " FOR UPDATE"
        self.lanes: Final = (
            "SELECT outbox, position, epoch, start_xmin, broker, skip::text AS skip,"
            " retry_position, attempts, rejections, retry_rule"
            f" FROM {checkpoints} WHERE {of_outbox('outbox')} FOR UPDATE"
        )
        self.drop_lanes: Final = f"DELETE FROM {checkpoints} WHERE {of_outbox('outbox')}"
        # executemany: $1 lane, $2 position, $3 epoch, $4 start_xmin, $5 broker, $6 skip.
        self.new_lane: Final = (
            f"INSERT INTO {checkpoints} (outbox, position, epoch, start_xmin, broker, skip)"
            " VALUES ($1, $2, $3, $4, $5, $6::jsonb)"
        )
        # $1 the new lane, $2 retry_position, $3 attempts, $4 rejections, $5 retry_rule.
        self.carry_retry: Final = (
            f"UPDATE {checkpoints} SET retry_position = $2, attempts = $3,"
            " rejections = $4, retry_rule = $5 WHERE outbox = $1"
        )
        # $2 the outcome (JSON) of the old lanes' commands that had not finished.
        self.end_commands: Final = (
            f"UPDATE {commands} SET finished_at = now(), outcome = $2::jsonb,"
            " state = CASE state WHEN 'pending' THEN 'expired' ELSE 'failed' END"
            f" WHERE {of_outbox('outbox')} AND state IN ('pending', 'running')"
        )
        # $2 count, $3 pinned, $4 who.
        self.set_count: Final = (
            f"INSERT INTO {outboxes} AS o (outbox, partitions, pinned, changed_by)"
            " VALUES ($1, $2, $3, $4) ON CONFLICT (outbox) DO UPDATE SET partitions = $2,"
            " pinned = $3, changed_by = $4, updated_at = now()"
        )

    def move_parked(self, count: int) -> str:
        """The parked messages of the outbox's lanes, each to its aggregate's lane of `count`."""
        if count == 1:
            target = "$1"
        else:
            lane = lane_expression("aggregate_type", "aggregate_id", count)
            target = f"$1 || '/' || ({lane})::text"
        return f"UPDATE {self._parked} SET outbox = {target} WHERE {of_outbox('outbox')}"


class CommandQueries:
    """The commands table's statements (CommandQueue)."""

    def __init__(self, schema: str) -> None:
        (table,) = _tables(schema, "commands")
        # $1 lane, $2 kind, $3 args (JSON), $4 requested_by: the id.
        self.submit: Final = (
            f"INSERT INTO {table} (outbox, kind, args, requested_by)"
            " VALUES ($1, $2, $3::jsonb, $4) RETURNING id"
        )
        # $1 id.
        self.result: Final = f"SELECT state, executed_by, outcome FROM {table} WHERE id = $1"
        self.expire: Final = (
            f"UPDATE {table} SET state = 'expired', finished_at = now()"
            " WHERE id = $1 AND state = 'pending'"
        )
        # $1 lane.
        self.waiting: Final = (
            f"SELECT EXISTS (SELECT 1 FROM {table} WHERE outbox = $1 AND state = 'pending')"
        )
        # $1 lane, $2 executed_by, $3 lock key (holder only): the oldest pending one.
        self.take: Final = (
            f"UPDATE {table} SET state = 'running', executed_by = $2 WHERE id = ("
            f" SELECT id FROM {table} WHERE outbox = $1 AND state = 'pending'"
            " ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)"
            f" AND {holds_lock('$3')} RETURNING id, outbox, kind, args, requested_by"
        )
        # $1 id, $2 state, $3 outcome (JSON).
        self.finish: Final = (
            f"UPDATE {table} SET state = $2, outcome = $3::jsonb, finished_at = now() WHERE id = $1"
        )
        # As `submit`, carried out already: $5 state, $6 outcome (JSON).
        self.record: Final = (
            f"INSERT INTO {table} (outbox, kind, args, requested_by, state, executed_by,"
            " finished_at, outcome) VALUES ($1, $2, $3::jsonb, $4, $5, $4, now(), $6::jsonb)"
            " RETURNING id"
        )
        # $1 lane.
        self.abandon_running: Final = (
            f"UPDATE {table} SET state = 'failed', finished_at = now(),"
            ' outcome = \'{"error": "the holder stopped while carrying it out"}\'::jsonb'
            " WHERE outbox = $1 AND state = 'running'"
        )


class MembershipQueries:
    """The replicas' heartbeat rows (Membership)."""

    def __init__(self, schema: str) -> None:
        (table,) = _tables(schema, "replicas")
        # Rows of namespace $1 but identity $2, silent for less than $3 seconds, and whether
        # the session that wrote each is still there.
        self.members: Final = (
            f"SELECT r.identity, r.outboxes::text AS outboxes, r.room, r.version,"
            " EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid"
            " AND a.datname = current_database()) AS connected"
            f" FROM {table} r WHERE r.namespace = $1 AND r.identity <> $2"
            " AND r.seen_at > now() - make_interval(secs => $3)"
        )
        # `members`, after writing $2's own row ($4 outboxes as JSON, $5 room, $6 its release)
        # and deleting rows a day old.
        self.beat: Final = (
            f"WITH me AS (INSERT INTO {table} (identity, namespace, pid, seen_at, outboxes,"
            " room, version) VALUES ($2, $1, pg_backend_pid(), now(), $4::jsonb, $5, $6)"
            " ON CONFLICT (identity) DO UPDATE SET namespace = excluded.namespace,"
            " pid = excluded.pid, seen_at = now(), outboxes = excluded.outboxes,"
            " room = excluded.room, version = excluded.version),"
            f" gone AS (DELETE FROM {table} WHERE seen_at < now() - interval '1 day')"
            f" {self.members}"
        )
        # $1 identity.
        self.leave: Final = f"DELETE FROM {table} WHERE identity = $1"


class LeaseQueries:
    """The lease session's statements (LeaseConnection): advisory locks and heartbeats."""

    # The free locks among the keys $1 (int8[]), taken in order, at most $2.
    try_locks: Final = (
        "SELECT k FROM unnest($1::bigint[]) AS k WHERE pg_try_advisory_lock(k) LIMIT $2"
    )
    # The session holding lock $1: pid, application_name.
    holder_of: Final = lock_holder("$1")
    terminate: Final = "SELECT pg_terminate_backend($1)"  # $1 pid
    unlock: Final = "SELECT pg_advisory_unlock($1)"  # $1 key

    @staticmethod
    def lock_wait(seconds: float) -> str:
        """Bound each of this transaction's waits for a lock (a claim's, for a row)."""
        return f"SET LOCAL lock_timeout = {max(1, round(seconds * 1000))}"

    def __init__(self, schema: str) -> None:
        checkpoints, outboxes, replicas = _tables(schema, "checkpoints", "outboxes", "replicas")
        # The session whose transaction locks outbox $1's row of the partition set (none
        # when several share the lock): the row's xmax is that transaction's id.
        self.row_holder: Final = (
            "SELECT a.pid, a.application_name FROM pg_locks l"
            " JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted"
            f" AND l.transactionid = (SELECT xmax FROM {outboxes} WHERE outbox = $1)"
        )
        # Who holds each of the locks $1 (int8[]) of the lanes $2 (text[], by position), and
        # for how long that session has said nothing: since the freshest of its backend's
        # last statement (NULL unless its role may be seen; now while a statement runs on
        # the server, not waiting for its client: a change of count blocked on a lock, or
        # moving many parked rows, is at work, and was ended as silent) and the heartbeats
        # of the lanes whose locks it holds now (lease namespace $3). A lane it has not
        # claimed yet still bears the previous holder's heartbeat: that one counts as the
        # least it did. When none of these is known (a new outbox's lane, taken by a replica
        # that holds no other, whose session cannot be seen), its replica's last membership
        # beat, written on this very session (pid and application_name), is: only then, for
        # it says less.
        self.holders: Final = (
            f"WITH l AS MATERIALIZED ({advisory_locks()}),"
            " h AS (SELECT w.key, w.lane, l.pid FROM unnest($1::bigint[], $2::text[])"
            " AS w(key, lane) JOIN l ON l.key = w.key),"
            f" s AS MATERIALIZED (SELECT l.pid, max(o.heartbeat) AS heartbeat FROM {checkpoints} o"
            f" JOIN l ON l.key = {lane_key('$3::text', 'o.outbox')}"
            " WHERE l.pid IN (SELECT pid FROM h) GROUP BY l.pid)"
            " SELECT h.key, h.pid, coalesce(a.application_name, '') AS application_name,"
            " extract(epoch FROM now() - coalesce(greatest(s.heartbeat, c.heartbeat,"
            " CASE WHEN a.state = 'active' AND a.wait_event_type IS DISTINCT FROM 'Client'"
            " THEN now() ELSE a.state_change END), r.seen_at))::float8 AS heartbeat_age"
            " FROM h LEFT JOIN pg_stat_activity a ON a.pid = h.pid"
            f" LEFT JOIN s ON s.pid = h.pid LEFT JOIN {checkpoints} c ON c.outbox = h.lane"
            f" LEFT JOIN {replicas} r ON r.namespace = $3 AND r.pid = h.pid"
            " AND a.application_name = left(r.identity || ':lease', 63)"
        )
        # The proof: stamp the heartbeat of each lane $2 (text[]) at its epoch $3 (int8[])
        # whose lock $1 (int8[]) this session holds; the keys proven.
        self.heartbeat: Final = (
            f"UPDATE {checkpoints} c SET heartbeat = now()"
            " FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS w(key, lane, epoch)"
            f" WHERE c.outbox = w.lane AND c.epoch = w.epoch AND w.key IN ({held_keys()})"
            " RETURNING w.key"
        )
