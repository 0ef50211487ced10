-- The default event table the relay reads: the application's event store, written by the app.
-- The relay does not own it (it only selects from it); this file exists for the example set-up and tests.
CREATE TABLE events (
  position       bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  aggregate_type text        NOT NULL,
  aggregate_id   text        NOT NULL,
  version        bigint      NOT NULL,
  type           text        NOT NULL,
  payload        jsonb       NOT NULL,
  metadata       jsonb       NOT NULL DEFAULT '{}',
  created_at     timestamptz NOT NULL DEFAULT now(),
  UNIQUE (aggregate_type, aggregate_id, version)
);
