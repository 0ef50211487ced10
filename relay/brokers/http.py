"""Webhooks: a POST per message, signed as Standard Webhooks say, with aiohttp.

The URL is the config's `url` with `{destination}` (as written), `{key}` and `{type}`
(percent-encoded) filled in; a URL whose path would step elsewhere (`..`, `.`, encoded or
not) or holds a `#` is refused before sending, so that no value of an event moves a request
to another endpoint (`_unusable`). Every request carries `webhook-id` (the message id, which the
receiver deduplicates on), `webhook-timestamp` and, with `signing_keys`, `webhook-signature`:
`v1,<base64 HMAC-SHA256 of "id.timestamp.body">` per key, space separated, so that a receiver
holding either key of a rotation verifies it. CloudEvents travel in the HTTP binding: `ce-`
headers, percent-encoded as the binding says (binary mode), or the whole event as the body
(structured mode).

Order. At most one request of a key is in flight: the next one of that key is sent only
after a 2xx to the one before it. Keys go out side by side, up to `max_in_flight` requests.
A key whose request failed sends nothing more of the batch; the other keys go on. Messages
of other keys delivered after the first failure are remembered, and reported delivered
without a second POST when the core offers them again (counted in `duplicates`).

The status decides: 2xx delivered; 408, 429 and 5xx transient, with Retry-After (seconds or
an HTTP date, capped at `retry_after_max`) handed to the core's backoff (after a 429 no
request of the batch is started); any other answer,
a 3xx not followed included, is permanent and names the status and the first bytes of the
answer. Timeouts and refused connections are transient. A body over `max_body_bytes` is
not sent. Header values from the config are secrets: never logged, never in an error.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import hashlib
import hmac
import re
import ssl
import time
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from datetime import UTC, datetime
from http import HTTPStatus
from urllib.parse import quote, urlsplit

import aiohttp

from relay.brokers._batch import Accepted, not_sent, ready
from relay.brokers._header_values import altered
from relay.config.base import path_step
from relay.config.brokers import HttpBrokerConfig
from relay.core.publishing import Message, Outcome, cloudevent_attributes
from relay.errors import PermanentPublishError, PublishError, TransientPublishError, UnsendableError
from relay.printable import excerpt, printable

ANSWER_BYTES = 200  # of a refused request's answer, in the parked reason
REMEMBER_FOR = 300.0  # seconds a message delivered after a failure is remembered
MAX_REDIRECTS = 10  # with follow_redirects
_TRANSIENT_4XX = {408, 425, 429}  # Request Timeout, Too Early, Too Many Requests
_HTTP_URL = re.compile(r"^https?://", re.IGNORECASE)
# The CloudEvents HTTP binding: space, `"`, `%` and anything outside printable ASCII are
# percent-encoded (UTF-8) in a ce- header value.
_CE_UNSAFE = re.compile(r"[^!#-$&-~]")
_FIELDS = ("{destination}", "{key}", "{type}")
_URL_FIELDS = re.compile(r"(\{destination\}|\{key\}|\{type\})")
_URL_SAFE = re.compile(r"[A-Za-z0-9_.~-]+")  # what quote(safe="") leaves as it is


class HttpPublisher:
    def __init__(self, name: str, config: HttpBrokerConfig) -> None:
        self.name = name
        self._config = config
        self._keys = prepared(
            base64.b64decode(key.get_secret_value().removeprefix("whsec_"))
            for key in config.signing_keys
        )
        self._session: aiohttp.ClientSession | None = None
        self._workers = config.max_in_flight  # each sends one request at a time
        self._urls: dict[str, str | None] = {}  # a rendered URL -> why it cannot be used
        self._pieces = [p for p in _URL_FIELDS.split(config.url) if p]
        self._delivered = Accepted(REMEMBER_FOR)
        self.duplicates = 0
        self.last_duplicates: tuple[int, ...] = ()  # a receiver never says

    async def connect(self) -> None:
        """Create the session; no request is made, so an unreachable receiver shows at publish."""
        if self._session is not None and not self._session.closed:
            return
        c = self._config
        connector = aiohttp.TCPConnector(limit=c.max_in_flight, ssl=self._tls())
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=c.ack_timeout, sock_connect=c.connect_timeout),
            headers={name: value.get_secret_value() for name, value in c.headers.items()},
            skip_auto_headers=("User-Agent",),
            auto_decompress=False,
        )

    def _tls(self) -> ssl.SSLContext | bool:
        """Verified against `tls.ca_file`, else the system's CAs; used for https:// only.

        Without a `tls` section, True: aiohttp's own verified context (the system's CAs and
        the host name checked, as `TlsConfig().context()` would), made when aiohttp is
        imported, where a context of the relay's own read the trust store again at every
        start (25 ms of CPU, on the event loop)."""
        return True if self._config.tls is None else self._config.tls.context()

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """For `relay check`: open a connection (TCP, and TLS with the certificate verified) to
        each host the fixed destinations lead to. Sends no request: a webhook has no call
        without effect. What is wrong, one line each."""
        host_fixed = not self._config.url.startswith("{")  # the host is the config's
        urls: set[str] = set()
        problems: list[str] = []
        for destination in sorted(destinations) or ([""] if host_fixed else []):
            url = self._url(Message("probe", "probe", destination, "probe", b"", "", None, 0))
            if (why := self._unusable(url)) is not None:
                problems.append(f"broker {self.name!r}: {why}")
            else:
                parts = urlsplit(url)
                urls.add(f"{parts.scheme.lower()}://{parts.netloc.rpartition('@')[2]}")
        for origin in sorted(urls):
            if problem := await self._probe_origin(origin):
                problems.append(problem)
        return problems

    async def _probe_origin(self, origin: str) -> str | None:
        parts = urlsplit(origin)
        secure = parts.scheme == "https"
        host, port = parts.hostname or "", parts.port or (443 if secure else 80)
        try:
            async with asyncio.timeout(self._config.connect_timeout):
                _, writer = await asyncio.open_connection(
                    host, port, ssl=self._tls() if secure else None
                )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            return f"broker {self.name!r}: cannot connect to {origin}: {_text(exc)}"
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return None

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        if (done := await ready(self.connect, len(messages))) is not None:
            return done
        results = not_sent(len(messages), "an earlier message of its key failed", self.name)
        by_key: dict[str, list[int]] = {}
        for index, message in enumerate(messages):
            by_key.setdefault(message.key, []).append(index)
        halted: list[PublishError] = []  # the receiver cannot be reached: start nothing more
        keys = deque(by_key.values())

        async def worker() -> None:
            """Key after key: `max_in_flight` of these, not a task per key (cheaper)."""
            while keys:
                await self._send_key(messages, keys.popleft(), results, halted)

        await asyncio.gather(*(worker() for _ in range(min(self._workers, len(keys)))))
        self._delivered.remember(messages, results)
        return results

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.close()

    # -- one key, one request --------------------------------------------------------------

    async def _send_key(
        self,
        messages: Sequence[Message],
        indexes: list[int],
        results: list[Outcome],
        halted: list[PublishError],
    ) -> None:
        """The key's messages one after the other; nothing after one that failed."""
        for index in indexes:
            message = messages[index]
            if self._delivered.take(message):
                results[index] = None  # delivered after an earlier failure: not sent again
                self.duplicates += 1
                continue
            outcome = halted[0] if halted else await self._post(message, halted)
            results[index] = outcome
            if outcome is not None:
                return

    def dedup_scope(self, destination: str) -> str | None:
        """A webhook receiver is a consumer: it drops duplicates by id, if at all."""
        return None

    def refusal(self, message: Message) -> str | None:
        """What `publish` would refuse this message for, without sending it (`relay check`)."""
        problem = self._unsendable(message, self._url(message))
        return None if problem is None else str(self._not_sent(message, problem))

    def _unsendable(self, message: Message, url: str) -> str | None:
        """Why the message cannot be sent as written: its URL, its size, its id."""
        if (why := self._unusable(url)) is not None:
            return why
        if len(message.body) > self._config.max_body_bytes:
            return (
                f"the body is {len(message.body):,} bytes, more than max_body_bytes"
                f" ({self._config.max_body_bytes:,})"
            )
        # The id comes from the event; the type, source and content type are the config's,
        # checked at load, and every ce- value is percent-encoded.
        return altered(("webhook-id", message.id))

    async def _post(self, message: Message, halted: list[PublishError]) -> Outcome:
        url = self._url(message)
        if (problem := self._unsendable(message, url)) is not None:
            return self._not_sent(message, problem)
        session = self._session
        if session is None:
            return TransientPublishError(f"broker {self.name!r}: not connected")
        try:
            async with session.post(
                url,
                data=message.body,
                headers=self.headers(message),
                allow_redirects=self._config.follow_redirects,
                max_redirects=MAX_REDIRECTS,
            ) as response:
                if 200 <= response.status < 300:
                    return None
                answer = await _first_bytes(response)
                refused = self._refused(message, url, response, answer)
                if response.status == 429:  # the receiver's own limit: no more of the batch
                    halted.append(refused)
                return refused
        except aiohttp.TooManyRedirects:
            return self._permanent(
                message, f"more than {MAX_REDIRECTS} redirects from {_shown(url)}"
            )
        except aiohttp.InvalidURL:
            return self._permanent(message, f"{_shown(url)} is not a URL aiohttp can send to")
        except TimeoutError:
            error = self._transient(f"{_shown(url)}: no answer within {self._config.ack_timeout}s")
        except (aiohttp.ClientError, OSError) as exc:
            error = self._transient(f"{_shown(url)}: cannot connect: {_text(exc)}")
        halted.append(error)
        return error

    def headers(self, message: Message) -> dict[str, str]:
        """The webhook's headers, then the CloudEvents binding's (binary mode)."""
        timestamp = str(int(time.time()))
        headers = {
            "content-type": message.content_type,
            "webhook-id": message.id,
            "webhook-timestamp": timestamp,
        }
        if self._keys:
            headers["webhook-signature"] = sign(self._keys, message.id, timestamp, message.body)
        for name, value in cloudevent_attributes(message, "ce-").items():
            headers[name] = value if _ce_safe(value) else _CE_UNSAFE.sub(_percent, value)
        return headers

    def _refused(
        self, message: Message, url: str, response: aiohttp.ClientResponse, answer: str
    ) -> PublishError:
        status = response.status
        text = f"{_shown(url)} answered {status} {_phrase(status)}"
        if 300 <= status < 400:
            location = response.headers.get("Location", "")
            text += f", a redirect to {printable(location[:200])!r} not followed (follow_redirects)"
        if answer:
            text += f": {answer}"
        if status in _TRANSIENT_4XX or status >= 500:
            error = self._transient(text)
            error.retry_after = retry_after(
                response.headers.get("Retry-After"), self._config.retry_after_max
            )
            return error
        return self._permanent(message, text)

    # -- URLs -------------------------------------------------------------------------------

    def _url(self, message: Message) -> str:
        """The config's `url` with the message's fields in (one join of precut pieces)."""
        if len(self._pieces) == 1 and self._pieces[0] not in _FIELDS:
            return self._pieces[0]
        parts = []
        for piece in self._pieces:
            if piece == "{destination}":
                parts.append(message.destination)
            elif piece == "{key}":
                key = message.key
                parts.append(key if _URL_SAFE.fullmatch(key) else quote(key, safe=""))
            elif piece == "{type}":
                parts.append(quote(message.type, safe=""))
            else:
                parts.append(piece)
        return "".join(parts)

    def _unusable(self, url: str) -> str | None:
        """Why `url` cannot be sent to (not http(s), no host, a space, a path step or a
        fragment that would send it elsewhere); None when it can.

        A value of the event inside the URL must not move the request to another endpoint.
        `{key}` and `{type}` are percent-encoded, but aiohttp (yarl) and most receivers decode
        `%2E` and resolve `.` and `..` whatever the encoding, and `{destination}` is inserted
        as written: so a URL whose path holds such a step is refused, before sending, as is
        a `#`, after which nothing reaches the receiver."""
        if url in self._urls:
            return self._urls[url]
        why = None
        parts = urlsplit(url)
        if not _HTTP_URL.match(url):
            why = f"{_shown(url)} is not an http:// or https:// URL"
        elif not parts.hostname:
            why = f"{_shown(url)} has no host"
        elif not url.isprintable() or " " in url:
            why = f"{_shown(url)} holds a space or a control character"
        elif (step := path_step(parts.path)) is not None:
            why = (
                f"{_shown(url)} holds the path step {printable(step)!r}, which would be resolved"
                " to another endpoint: a value of the event may not leave its place in the URL"
            )
        elif "#" in url:
            why = f"{_shown(url)} holds a '#': the receiver would not get what follows it"
        if len(self._urls) < 10_000:
            self._urls[url] = why
        return why

    # -- errors ------------------------------------------------------------------------------

    def _transient(self, text: str) -> TransientPublishError:
        return TransientPublishError(f"broker {self.name!r}: {text}")

    def _permanent(self, message: Message, text: str) -> PermanentPublishError:
        return PermanentPublishError(f"broker {self.name!r}: message {excerpt(message.id)}: {text}")

    def _not_sent(self, message: Message, text: str) -> UnsendableError:
        """Refused before sending (`_unsendable`): parked at once."""
        return UnsendableError(f"broker {self.name!r}: message {excerpt(message.id)}: {text}")


def prepared(keys: Iterable[bytes]) -> list[hmac.HMAC]:
    """Each key's HMAC-SHA256 state before any data, for `sign`: its padded key hashed once."""
    return [hmac.new(key, digestmod=hashlib.sha256) for key in keys]


def sign(keys: Sequence[hmac.HMAC], message_id: str, timestamp: str, body: bytes) -> str:
    """`v1,<signature>` per key, space separated (Standard Webhooks). Each key comes
    `prepared`: a copy of its state per request skips hashing the padded key again (1.5
    instead of 4.9 µs a request on the bench machine)."""
    signed = b"".join((message_id.encode(), b".", timestamp.encode(), b".", body))
    signatures = []
    for key in keys:
        mac = key.copy()
        mac.update(signed)
        signatures.append("v1," + base64.b64encode(mac.digest()).decode())
    return " ".join(signatures)


def retry_after(value: str | None, cap: float) -> float | None:
    """Seconds to wait from a Retry-After header (seconds or an HTTP date), at most `cap`."""
    if not value:
        return None
    text = value.strip()
    if text.isdigit():
        seconds = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    return min(max(seconds, 0.0), cap)


async def _first_bytes(response: aiohttp.ClientResponse) -> str:
    """The start of the answer, on one line; nothing when it cannot be read."""
    try:
        data = await response.content.read(ANSWER_BYTES)
    except (aiohttp.ClientError, OSError, TimeoutError):
        return ""
    return printable(data.decode("utf-8", errors="replace").strip())


def _ce_safe(value: str) -> bool:
    """Nothing to percent-encode: a few C calls, cheaper than the regex on every value."""
    return (
        value.isascii()
        and value.isprintable()
        and " " not in value
        and '"' not in value
        and "%" not in value
    )


def _percent(match: re.Match[str]) -> str:
    return quote(match.group(), safe="")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _shown(url: str) -> str:
    """The URL without user, password or query (they may hold a token), quoted."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    shown = f"{parts.scheme}://{host}{parts.path}" if parts.scheme and host else url[:80]
    return repr(printable(shown[:200]))


def _text(exc: BaseException) -> str:
    return printable(str(exc) or type(exc).__name__)
