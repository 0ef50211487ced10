-- The statements of the relay's own tables in `database.schema`, named once, as
-- procrastinate keeps its queries.sql. Each starts with `-- <group>.<name> --`; the comment
-- lines below it say what its $n parameters are. `own_tables.py` reads this file and fills
-- in the pieces in braces:
--   {schema}                 the configured schema, quoted
--   {holds_lock:$3}          true only on the connection holding advisory lock $3
--   {of_outbox:outbox}       the column names the outbox $1 or one of its lanes (`$1/<n>`)
--   {lane_key:ns, lane}      lease.lock_key(ns, lane) of two text expressions
--   {advisory_locks}         every advisory lock granted in this database: (pid, key)
--   {held_keys}              the keys of the advisory locks this connection holds
--   {cut:a, b}               the text columns a and b, cut to $3 characters and an ellipsis
--   {readable:$2}            the command row `c` is one this release can read, by $2 (JSON:
--                            each kind it knows, and the keys its args may hold)
--   {<group>.<name>}         another statement of this file, as it stands
-- Values are never in the text: each is a $n parameter.
--
-- A holder's writes to its checkpoint row are fenced, all in the same way: only at its
-- claim's epoch, and only on the connection that holds its lock, `WHERE outbox = $1 AND
-- epoch = $2 AND {holds_lock:$3}`; a write that matches no row means the writer was fenced.


-- store.create_checkpoint --
-- $1 lane, $2 position, $3 start_xmin, $4 broker; an existing row stays as it is.
INSERT INTO {schema}.checkpoints (outbox, position, start_xmin, broker)
VALUES ($1, $2, $3, $4) ON CONFLICT (outbox) DO NOTHING;

-- store.claim --
-- $1 lane, $2 holder, $3 lock key: the next epoch.
UPDATE {schema}.checkpoints SET epoch = epoch + 1, holder = $2, held_since = now(),
  heartbeat = now(), state = CASE WHEN halted IS NULL THEN 'relaying' ELSE 'halted' END,
  blocking = NULL, updated_at = now()
WHERE outbox = $1 AND {holds_lock:$3}
RETURNING epoch, position, halted, retry_position, retry_rule, attempts, rejections,
  start_xmin, broker, skip::text;

-- store.advance --
-- Fenced ($1 lane, $2 epoch, $3 lock key). $4 position (never backwards), $5 broker (NULL:
-- unchanged). The retry count stays with a failing message beyond $4 (a replay's events
-- before it went through).
UPDATE {schema}.checkpoints SET position = $4, state = 'relaying', last_error = NULL,
  updated_at = now(),
  attempts = coalesce(CASE WHEN retry_position > $4 THEN attempts END, 0),
  rejections = coalesce(CASE WHEN retry_position > $4 THEN rejections END, 0),
  retry_position = CASE WHEN retry_position > $4 THEN retry_position END,
  broker = coalesce($5, broker)
WHERE outbox = $1 AND epoch = $2 AND {holds_lock:$3} AND position <= $4;

-- store.report --
-- Fenced. $4 state, $5 attempts, $6 last_error, $7 retry_position, $8 rejections, $9 rule.
UPDATE {schema}.checkpoints SET state = $4, attempts = $5, last_error = $6,
  retry_position = $7, rejections = $8, retry_rule = $9, updated_at = now()
WHERE outbox = $1 AND epoch = $2 AND {holds_lock:$3};

-- store.halt --
-- Fenced. $4 reason.
UPDATE {schema}.checkpoints
SET halted = $4, state = 'halted', last_error = $4, blocking = NULL, updated_at = now()
WHERE outbox = $1 AND epoch = $2 AND {holds_lock:$3};

-- store.settle_start --
-- Fenced. $4 position (never forwards).
UPDATE {schema}.checkpoints
SET position = least(position, $4), start_xmin = NULL, updated_at = now()
WHERE outbox = $1 AND epoch = $2 AND {holds_lock:$3};

-- store.report_blocking --
-- Fenced. $4 the blocking transaction (JSON), NULL when none.
UPDATE {schema}.checkpoints SET blocking = $4::jsonb,
  state = CASE WHEN $4::jsonb IS NULL THEN 'relaying' ELSE 'waiting' END,
  updated_at = CASE WHEN $4::jsonb IS NULL OR blocking IS NULL THEN now() ELSE updated_at END
WHERE outbox = $1 AND epoch = $2 AND {holds_lock:$3};

-- store.report_standbys --
-- Fenced. $4 why events are held back until standbys have them, NULL once they are not.
UPDATE {schema}.checkpoints
SET state = CASE WHEN $4::text IS NULL THEN 'relaying' ELSE 'waiting for standbys' END,
  last_error = $4, updated_at = now()
WHERE outbox = $1 AND epoch = $2 AND {holds_lock:$3};

-- store.rewind --
-- $1 lane, $2 epoch, $3 position (never forwards), $4 lock key, $5 broker: the position it
-- was at.
UPDATE {schema}.checkpoints c SET position = $3, halted = NULL, skip = NULL,
  state = CASE WHEN old.halted IS NULL THEN c.state ELSE 'relaying' END,
  last_error = CASE WHEN old.halted IS NULL THEN c.last_error END, updated_at = now(),
  broker = coalesce($5, c.broker)
FROM {schema}.checkpoints old
WHERE c.outbox = $1 AND old.outbox = c.outbox AND c.epoch = $2 AND c.position >= $3
  AND {holds_lock:$4}
RETURNING old.position;

-- store.checkpoints --
-- Every row, with its count of parked messages.
SELECT outbox, position, epoch, holder, state, attempts, last_error, blocking,
  extract(epoch FROM now() - c.updated_at)::float8 AS since_update,
  (SELECT count(*) FROM {schema}.parked p WHERE p.outbox = c.outbox) AS parked
FROM {schema}.checkpoints c ORDER BY outbox;

-- store.position --
-- $1 lane.
SELECT position FROM {schema}.checkpoints WHERE outbox = $1;

-- store.park --
-- $1 lane, $2 position, $3-$6 the event's type and aggregate, $7-$11 the message's id,
-- type, destination, key and body, $12 reason, $13 error, $14 attempts, $15 rule.
INSERT INTO {schema}.parked (outbox, position, event_type, aggregate_type, aggregate_id,
  version, message_id, message_type, destination, message_key, body, reason, error,
  attempts, rule)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
ON CONFLICT (outbox, position, rule) DO UPDATE SET attempts = excluded.attempts,
  error = excluded.error, reason = excluded.reason, parked_at = now();

-- store.parked --
-- Parked messages of the lanes $1 (text[]), only the ids $2 (int8[]) unless NULL, read as
-- ParkedMessage's fields.
SELECT id, outbox, position, event_type, aggregate_type, aggregate_id, version, message_id,
  message_type, destination, message_key, body, rule, reason, error, attempts, parked_at
FROM {schema}.parked
WHERE outbox = ANY($1::text[]) AND ($2::bigint[] IS NULL OR id = ANY($2::bigint[]))
ORDER BY position, id;

-- store.parked_attempts --
-- As store.parked: only each one's id and attempts.
SELECT id, attempts FROM {schema}.parked
WHERE outbox = ANY($1::text[]) AND ($2::bigint[] IS NULL OR id = ANY($2::bigint[]));

-- store.newest_parked --
-- The $2 last parked of the lanes $1 (text[]), newest first, by the primary key (no sort of
-- every parked row); without bodies, each text cut to $3 characters and an ellipsis.
SELECT id, outbox, position, {cut:event_type, aggregate_type, aggregate_id}, version,
  {cut:message_id, message_type, destination, message_key}, NULL::bytea AS body,
  {cut:rule, reason, error}, attempts, parked_at
FROM {schema}.parked WHERE outbox = ANY($1::text[]) ORDER BY id DESC LIMIT $2;

-- store.parked_by_id --
-- $1 id.
SELECT id, outbox, position, event_type, aggregate_type, aggregate_id, version, message_id,
  message_type, destination, message_key, body, rule, reason, error, attempts, parked_at
FROM {schema}.parked WHERE id = $1;

-- store.parked_lanes --
-- The ids $1 (int8[]) that the lanes $2 (text[]) parked.
SELECT id, outbox FROM {schema}.parked
WHERE id = ANY($1::bigint[]) AND outbox = ANY($2::text[]);

-- store.parked_count --
-- $1 lane.
SELECT count(*) FROM {schema}.parked WHERE outbox = $1;

-- store.parked_keys --
-- What the lanes $1 (text[]) parked in positions ($2, $3]: lane, position, rule and reason
-- (an audit counts these as parked, not missing).
SELECT outbox, position, rule, reason FROM {schema}.parked
WHERE outbox = ANY($1::text[]) AND position > $2 AND position <= $3;

-- store.park_missing --
-- A message an audit found missing from its broker, parked so that retry-parked publishes
-- it again: $1 lane, $2 position, $3-$6 the event's type and aggregate, $7-$11 the message's
-- id, type, destination, key and body, $12 error, $13 rule. A message parked already keeps
-- its row (and reason): its id either way.
INSERT INTO {schema}.parked (outbox, position, event_type, aggregate_type, aggregate_id,
  version, message_id, message_type, destination, message_key, body, reason, error,
  attempts, rule)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'missing', $12, 0, $13)
ON CONFLICT (outbox, position, rule) DO UPDATE SET outbox = {schema}.parked.outbox
RETURNING id;

-- store.drop_parked --
-- $1 ids (int8[]; NULL: all), $2 lanes (text[]): the ids deleted.
DELETE FROM {schema}.parked
WHERE outbox = ANY($2::text[]) AND ($1::bigint[] IS NULL OR id = ANY($1::bigint[]))
RETURNING id;

-- store.unpark --
-- $1 ids, $2 lane, $3 lock key (holder only).
DELETE FROM {schema}.parked
WHERE id = ANY($1::bigint[]) AND outbox = $2 AND {holds_lock:$3};

-- store.still_parked --
-- $1 ids, $2 their errors, $3 their reasons, $4 lane, $5 lock key (holder only). A message
-- an audit parked as missing stays `missing` (it was published once, and the broker lost
-- it): the audit counts it as missing until it is in the broker again.
UPDATE {schema}.parked p SET attempts = coalesce(p.attempts, 0) + 1, error = f.error,
  reason = CASE WHEN p.reason = 'missing' THEN p.reason ELSE f.reason END
FROM unnest($1::bigint[], $2::text[], $3::text[]) AS f(id, error, reason)
WHERE p.id = f.id AND p.outbox = $4 AND {holds_lock:$5};


-- partitions.admit --
-- The partition set: $1 is the outbox. $2 count, $3 start, $4 start_xmin, $5 who, $6 a
-- replica's claim. The first claim records the count and the start; a replica's claim with
-- the recorded count clears an operator's pin (the CLI's claim, for a command, leaves it).
INSERT INTO {schema}.outboxes AS o (outbox, partitions, start_position, start_xmin,
  changed_by)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (outbox) DO UPDATE
SET start_position = coalesce(o.start_position, excluded.start_position),
  start_xmin = CASE WHEN o.start_position IS NULL THEN excluded.start_xmin
    ELSE o.start_xmin END,
  pinned = o.pinned AND (o.partitions <> excluded.partitions OR NOT $6::bool)
RETURNING outbox, partitions, start_position, start_xmin, pinned, changed_by;

-- partitions.read --
-- $1 outbox: its row, as partitions.admit returns it.
SELECT outbox, partitions, start_position, start_xmin, pinned, changed_by
FROM {schema}.outboxes WHERE outbox = $1;

-- partitions.hold --
-- $1 outbox: the recorded count, kept from changing until the transaction ends.
SELECT partitions FROM {schema}.outboxes WHERE outbox = $1 FOR KEY SHARE;

-- partitions.settle_start --
-- $1 outbox, $2 position.
UPDATE {schema}.outboxes SET start_position = least(start_position, $2), start_xmin = NULL
WHERE outbox = $1 AND start_xmin IS NOT NULL;

-- partitions.lock --
-- A change of $1's count takes its row first, then every lane's checkpoint row.
{partitions.read} FOR UPDATE;

-- partitions.lanes --
-- $1 outbox: the checkpoint rows of all its lanes, of whatever count, locked.
SELECT outbox, position, epoch, start_xmin, broker, skip::text AS skip, retry_position,
  attempts, rejections, retry_rule
FROM {schema}.checkpoints WHERE {of_outbox:outbox} FOR UPDATE;

-- partitions.drop_lanes --
-- $1 outbox.
DELETE FROM {schema}.checkpoints WHERE {of_outbox:outbox};

-- partitions.new_lane --
-- executemany: $1 lane, $2 position, $3 epoch, $4 start_xmin, $5 broker, $6 skip.
INSERT INTO {schema}.checkpoints (outbox, position, epoch, start_xmin, broker, skip)
VALUES ($1, $2, $3, $4, $5, $6::jsonb);

-- partitions.carry_retry --
-- $1 the new lane, $2 retry_position, $3 attempts, $4 rejections, $5 retry_rule.
UPDATE {schema}.checkpoints
SET retry_position = $2, attempts = $3, rejections = $4, retry_rule = $5
WHERE outbox = $1;

-- partitions.end_commands --
-- $1 outbox, $2 the outcome (JSON) of the old lanes' commands that had not finished.
UPDATE {schema}.commands SET finished_at = now(), outcome = $2::jsonb,
  state = CASE state WHEN 'pending' THEN 'expired' ELSE 'failed' END
WHERE {of_outbox:outbox} AND state IN ('pending', 'running');

-- partitions.set_count --
-- $1 outbox, $2 count, $3 pinned, $4 who.
INSERT INTO {schema}.outboxes AS o (outbox, partitions, pinned, changed_by)
VALUES ($1, $2, $3, $4)
ON CONFLICT (outbox) DO UPDATE
SET partitions = $2, pinned = $3, changed_by = $4, updated_at = now();


-- commands.submit --
-- $1 lane, $2 kind, $3 args (JSON), $4 requested_by: the id.
INSERT INTO {schema}.commands (outbox, kind, args, requested_by)
VALUES ($1, $2, $3::jsonb, $4) RETURNING id;

-- commands.result --
-- $1 id.
SELECT state, executed_by, outcome FROM {schema}.commands WHERE id = $1;

-- commands.expire --
-- $1 id.
UPDATE {schema}.commands SET state = 'expired', finished_at = now()
WHERE id = $1 AND state = 'pending';

-- commands.waiting --
-- $1 lane, $2 the commands this release knows (JSON: each kind's args' keys), $3 seconds:
-- whether one it can read waits (ready), and one it cannot has waited longer than $3 (stale).
SELECT
  EXISTS (SELECT 1 FROM {schema}.commands c WHERE c.outbox = $1 AND c.state = 'pending'
    AND {readable:$2}) AS ready,
  EXISTS (SELECT 1 FROM {schema}.commands c WHERE c.outbox = $1 AND c.state = 'pending'
    AND NOT {readable:$2} AND c.requested_at < now() - make_interval(secs => $3)) AS stale;

-- commands.take --
-- $1 lane, $2 executed_by, $3 lock key (holder only), $4 the commands this release knows
-- (JSON, as commands.waiting): the oldest pending one it can read; the others are left to
-- a replica that can.
UPDATE {schema}.commands SET state = 'running', executed_by = $2
WHERE id = (
  SELECT c.id FROM {schema}.commands c WHERE c.outbox = $1 AND c.state = 'pending'
    AND {readable:$4}
  ORDER BY c.id LIMIT 1 FOR UPDATE SKIP LOCKED
) AND {holds_lock:$3}
RETURNING id, outbox, kind, args, requested_by;

-- commands.unreadable --
-- $1 lane, $2 the commands this release knows (JSON, as commands.waiting), $3 seconds: up
-- to 100 pending ones it cannot read that have waited longer than $3, oldest first.
SELECT c.id, c.kind, c.args::text AS args FROM {schema}.commands c
WHERE c.outbox = $1 AND c.state = 'pending' AND NOT {readable:$2}
  AND c.requested_at < now() - make_interval(secs => $3)
ORDER BY c.id LIMIT 100;

-- commands.fail_pending --
-- $1 id, $2 executed_by, $3 outcome (JSON), $4 lock key (holder only): if still pending.
UPDATE {schema}.commands SET state = 'failed', executed_by = $2, outcome = $3::jsonb,
  finished_at = now()
WHERE id = $1 AND state = 'pending' AND {holds_lock:$4};

-- commands.finish --
-- $1 id, $2 state, $3 outcome (JSON).
UPDATE {schema}.commands SET state = $2, outcome = $3::jsonb, finished_at = now()
WHERE id = $1;

-- commands.record --
-- As commands.submit, carried out already: $5 state, $6 outcome (JSON).
INSERT INTO {schema}.commands (outbox, kind, args, requested_by, state, executed_by,
  finished_at, outcome)
VALUES ($1, $2, $3::jsonb, $4, $5, $4, now(), $6::jsonb) RETURNING id;

-- commands.abandon_running --
-- $1 lane.
UPDATE {schema}.commands SET state = 'failed', finished_at = now(),
  outcome = '{{"error": "the holder stopped while carrying it out"}}'::jsonb
WHERE outbox = $1 AND state = 'running';

-- commands.unsettled --
-- $1 seconds, $2 the lease namespace, $3 an outbox (NULL: every one): the commands not
-- finished (of the outbox and its lanes), and those that failed within the last $1
-- seconds: 500 at most, the unfinished ones first, each part newest first; `holding`: a
-- running one's holder (`executed_by`) still holds its lane's lock. No index serves it:
-- read at a claim, by a first lane's holder now and then, and by `relay status`.
SELECT c.id, c.outbox, c.kind, c.state, c.executed_by, c.outcome ->> 'error' AS error,
  extract(epoch FROM now() - c.requested_at)::float8 AS age,
  c.state = 'running' AND EXISTS (
    SELECT 1 FROM ({advisory_locks}) l JOIN pg_stat_activity a ON a.pid = l.pid
    WHERE l.key = {lane_key:$2::text, c.outbox}
      AND a.application_name = c.executed_by || ':lease'
  ) AS holding
FROM {schema}.commands c
WHERE (c.state IN ('pending', 'running')
    OR (c.state = 'failed' AND c.finished_at > now() - make_interval(secs => $1)))
  AND ($3::text IS NULL OR c.outbox = $3 OR left(c.outbox, length($3) + 1) = $3 || '/')
ORDER BY c.state IN ('pending', 'running') DESC, c.id DESC LIMIT 500;

-- commands.fail_stuck --
-- $1 id, $2 the state it was found in, $3 outcome (JSON), $4 who fails it (kept as
-- executed_by unless a holder ran it), $5 lock key (holder only): if still in state $2.
UPDATE {schema}.commands SET state = 'failed', finished_at = now(), outcome = $3::jsonb,
  executed_by = coalesce(executed_by, $4)
WHERE id = $1 AND state = $2 AND {holds_lock:$5};


-- membership.members --
-- The replicas' heartbeat rows of namespace $1 but identity $2, silent for less than $3
-- seconds, and whether the session that wrote each is still there.
SELECT r.identity, r.outboxes::text AS outboxes, r.room, r.version,
  EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = r.pid
    AND a.datname = current_database()) AS connected
FROM {schema}.replicas r WHERE r.namespace = $1 AND r.identity <> $2
  AND r.seen_at > now() - make_interval(secs => $3);

-- membership.beat --
-- membership.members, after writing $2's own row ($4 outboxes as JSON, $5 room, $6 its
-- release) and deleting rows a day old.
WITH me AS (
  INSERT INTO {schema}.replicas (identity, namespace, pid, seen_at, outboxes, room, version)
  VALUES ($2, $1, pg_backend_pid(), now(), $4::jsonb, $5, $6)
  ON CONFLICT (identity) DO UPDATE SET namespace = excluded.namespace, pid = excluded.pid,
    seen_at = now(), outboxes = excluded.outboxes, room = excluded.room,
    version = excluded.version
), gone AS (DELETE FROM {schema}.replicas WHERE seen_at < now() - interval '1 day')
{membership.members};

-- membership.leave --
-- $1 identity.
DELETE FROM {schema}.replicas WHERE identity = $1;


-- lease.try_locks --
-- The lease session's statements: advisory locks and heartbeats. The free locks among the
-- keys $1 (int8[]), taken in order, at most $2.
SELECT k FROM unnest($1::bigint[]) AS k WHERE pg_try_advisory_lock(k) LIMIT $2;

-- lease.terminate --
-- $1 pid.
SELECT pg_terminate_backend($1);

-- lease.unlock --
-- $1 key.
SELECT pg_advisory_unlock($1);

-- lease.row_holder --
-- The session whose transaction locks outbox $1's row of the partition set (none when
-- several share the lock): the row's xmax is that transaction's id.
SELECT a.pid, a.application_name FROM pg_locks l
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
  AND l.transactionid = (SELECT xmax FROM {schema}.outboxes WHERE outbox = $1);

-- lease.holders --
-- Who holds each of the locks $1 (int8[]) of the lanes $2 (text[], by position), and for
-- how long that session has said nothing: since the freshest of its backend's last
-- statement (NULL unless its role may be seen; now while a statement runs on the server,
-- not waiting for its client: a change of count blocked on a lock, or moving many parked
-- rows, is at work, and was ended as silent) and the heartbeats of the lanes whose locks
-- it holds now (lease namespace $3). A lane it has not claimed yet still bears the
-- previous holder's heartbeat: that one counts as the least it did. When none of these is
-- known (a new outbox's lane, taken by a replica that holds no other, whose session cannot
-- be seen), its replica's last membership beat, written on this very session (pid and
-- application_name), is: only then, for it says less.
WITH l AS MATERIALIZED ({advisory_locks}),
h AS (
  SELECT w.key, w.lane, l.pid FROM unnest($1::bigint[], $2::text[]) AS w(key, lane)
  JOIN l ON l.key = w.key
),
s AS MATERIALIZED (
  SELECT l.pid, max(o.heartbeat) AS heartbeat FROM {schema}.checkpoints o
  JOIN l ON l.key = {lane_key:$3::text, o.outbox}
  WHERE l.pid IN (SELECT pid FROM h) GROUP BY l.pid
)
SELECT h.key, h.pid, coalesce(a.application_name, '') AS application_name,
  extract(epoch FROM now() - coalesce(greatest(s.heartbeat, c.heartbeat,
    CASE WHEN a.state = 'active' AND a.wait_event_type IS DISTINCT FROM 'Client'
    THEN now() ELSE a.state_change END), r.seen_at))::float8 AS heartbeat_age
FROM h LEFT JOIN pg_stat_activity a ON a.pid = h.pid
LEFT JOIN s ON s.pid = h.pid LEFT JOIN {schema}.checkpoints c ON c.outbox = h.lane
LEFT JOIN {schema}.replicas r ON r.namespace = $3 AND r.pid = h.pid
  AND a.application_name = left(r.identity || ':lease', 63);

-- lease.heartbeat --
-- The proof: stamp the heartbeat of each lane $2 (text[]) at its epoch $3 (int8[]) whose
-- lock $1 (int8[]) this session holds; the keys proven.
UPDATE {schema}.checkpoints c SET heartbeat = now()
FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS w(key, lane, epoch)
WHERE c.outbox = w.lane AND c.epoch = w.epoch AND w.key IN ({held_keys})
RETURNING w.key;


-- audits.read --
-- $1 outbox: its continuous audit's row.
SELECT outbox, position, extract(epoch FROM now() - audited_at)::float8 AS since_audit,
  checked, missing, last_missing::text, last_missing_at, last_error, auditor
FROM {schema}.audits WHERE outbox = $1;

-- audits.all --
-- Every outbox's continuous audit, for `relay status`.
SELECT outbox, position, extract(epoch FROM now() - audited_at)::float8 AS since_audit,
  checked, missing, last_missing::text, last_missing_at, last_error, auditor
FROM {schema}.audits ORDER BY outbox;

-- audits.begin --
-- The audit's first place: $1 outbox, $2 position, $3 auditor, $4 lock key (the holder of the
-- outbox's first lane only). A row already there stays as it is.
INSERT INTO {schema}.audits (outbox, position, auditor)
SELECT $1, $2, $3 WHERE {holds_lock:$4}
ON CONFLICT (outbox) DO NOTHING;

-- audits.record --
-- A round done: $1 outbox, $2 position reached, $3 messages checked, $4 found missing, $5
-- some of them (JSON), $6 auditor, $7 lock key (the holder of the outbox's first lane only).
UPDATE {schema}.audits SET position = $2, audited_at = now(), checked = checked + $3,
  missing = missing + $4, last_missing = coalesce($5::jsonb, last_missing),
  last_missing_at = CASE WHEN $4 > 0 THEN now() ELSE last_missing_at END,
  last_error = NULL, auditor = $6
WHERE outbox = $1 AND {holds_lock:$7};

-- audits.failed --
-- A round that could not finish: $1 outbox, $2 why, $3 auditor, $4 lock key.
UPDATE {schema}.audits SET last_error = $2, auditor = $3
WHERE outbox = $1 AND {holds_lock:$4};
