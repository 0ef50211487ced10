"""An HTTP proxy in front of moto's Kinesis that fails chosen records of PutRecords calls,
as Kinesis does when a shard's throughput is exceeded: moto has no such limit and never
fails one record of a good call.

The relay's own HTTP client talks to it as to Kinesis. A PutRecords request loses the
records the plan fails before it reaches moto (so they are not stored), and moto's answer
gets them back, in their places, with an ErrorCode, as Kinesis answers; FailedRecordCount
counts them. Every other request goes through unchanged. Records are told apart by the id
of the CloudEvent they carry.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.net import free_port

THROTTLED = "ProvisionedThroughputExceededException"


class KinesisFaults:
    """`plan` maps a message id to the error codes of its next attempts; `calls` records the
    ids of every PutRecords call, in record order."""

    def __init__(self, upstream: str, plan: dict[str, list[str]] | None = None) -> None:
        self.upstream = upstream
        self.plan = plan or {}
        self.calls: list[list[str]] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def sent(self, message_id: str) -> int:
        return sum(call.count(message_id) for call in self.calls)

    async def __aenter__(self) -> KinesisFaults:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        target = request.headers.get("X-Amz-Target", "")
        failed: dict[int, str] = {}
        if target.endswith(".PutRecords"):
            body, failed = self._take_out(body)
            if not json.loads(body)["Records"]:  # all of them fail: Kinesis answers alone
                return self._answer({"FailedRecordCount": 0, "Records": []}, failed)
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")
        }
        assert self._session is not None
        async with self._session.request(
            request.method, self.upstream + request.path_qs, data=io.BytesIO(body), headers=headers
        ) as response:
            answer = await response.read()
            if failed and response.status == 200:
                return self._answer(json.loads(answer), failed)
            return web.Response(
                body=answer,
                status=response.status,
                content_type=response.content_type,
                headers={
                    k: v for k, v in response.headers.items() if k.lower() == "x-amzn-requestid"
                },
            )

    def _take_out(self, body: bytes) -> tuple[bytes, dict[int, str]]:
        request = json.loads(body)
        records = request["Records"]
        ids = [json.loads(base64.b64decode(r["Data"]))["id"] for r in records]
        self.calls.append(ids)
        failed = {}
        for position, message_id in enumerate(ids):
            if self.plan.get(message_id):
                failed[position] = self.plan[message_id].pop(0)
        request["Records"] = [r for i, r in enumerate(records) if i not in failed]
        return json.dumps(request).encode(), failed

    @staticmethod
    def _answer(moto: dict[str, Any], failed: dict[int, str]) -> web.Response:
        stored = iter(moto["Records"])
        total = len(moto["Records"]) + len(failed)
        records = [
            {"ErrorCode": failed[i], "ErrorMessage": f"injected: {failed[i]}"}
            if i in failed
            else next(stored)
            for i in range(total)
        ]
        answer: dict[str, Any] = {
            "FailedRecordCount": moto.get("FailedRecordCount", 0) + len(failed),
            "Records": records,
        }
        return web.json_response(answer, content_type="application/x-amz-json-1.1")
