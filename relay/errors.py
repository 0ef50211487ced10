"""One hierarchy for every failure the relay reports, rooted in RelayError.

Drivers' exceptions are translated at the adapter boundary so that the core
and the CLI only ever reason about these.
"""

from __future__ import annotations


class RelayError(Exception):
    """Base of every error the relay raises on purpose."""


class ConfigError(RelayError):
    """The configuration is invalid; the message names the file and key."""


class UsageError(RelayError):
    """The command makes no sense as asked (exit code 2, like bad config)."""


class ContractError(UsageError):
    """A file `relay contract diff` cannot read as a contract (exit code 2); the message names
    the file and the key."""


class DatabaseError(RelayError):
    """Postgres could not be reached or refused a statement."""


class NotMigratedError(DatabaseError):
    """The relay's own tables are missing or older than this version."""


class SourceError(RelayError):
    """The event table does not meet the relay's preconditions."""


class PublishError(RelayError):
    """A broker did not accept a message."""

    permanent: bool = False
    at_once: bool = False
    """No retry can mend it (UnsendableError): parked at its first failure, not after
    `park_after`."""
    reason: str = "error"
    retry_after: float | None = None
    """Seconds the broker asked to be left alone (HTTP Retry-After); the backoff waits at least
    that long before the next attempt."""


class TransientPublishError(PublishError):
    """Worth retrying for ever: the broker is down, slow or restarting."""

    reason = "transient"


class PermanentPublishError(PublishError):
    """Retrying cannot help: the message is parked after `park_after` attempts."""

    permanent = True
    reason = "rejected"


class UnsendableError(PermanentPublishError):
    """Refused by the adapter before sending, for what the message holds: a name, a header
    value, a size over a limit the adapter knows. Every retry would be refused the same way,
    so it is parked at once; a refusal only the broker's answer gives stays retried
    `park_after` times (docs/delivery.md lists which is which, per broker)."""

    at_once = True


class MappingError(PermanentPublishError):
    """An event could not be turned into a message at run time."""

    reason = "mapping"


class MalformedEventError(MappingError):
    """A row of the event table that no config can map: a NULL, or a payload that is not
    strict JSON or is nested deeper than the relay reads."""

    reason = "malformed"

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem  # the column at fault, as `relay check` shows it


class SchemaViolation(MappingError):
    """A message body that does not match its rule's JSON Schema."""

    reason = "schema"

    def __init__(self, message: str, violations: list[str]) -> None:
        super().__init__(message)
        self.violations = violations  # each `$.path: message`, as `relay check` lists them


class FencedError(RelayError):
    """This replica no longer holds the outbox's lease; it must stop relaying."""


class CannotReadBack(UsageError):
    """An audit asked of a broker, or a destination, that cannot be read back (SQS, SNS,
    webhooks, a classic RabbitMQ queue): it says so, and never reports a pass there."""


class ReadBackError(RelayError):
    """A broker that can be read back did not answer an audit's read (down, a timeout)."""
