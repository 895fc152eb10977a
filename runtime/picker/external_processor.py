"""Envoy's ext_proc service, one stream per HTTP request, as the Gateway API Inference Extension drives it.

Envoy sends the request's headers, then its body in chunks (the last with end_of_stream, or trailers after it), then,
once a replica answers, the response's headers and body. The picker needs the body to pick (model, adapter, prompt),
so in FULL_DUPLEX_STREAMED mode (GIE's) it answers nothing until the body is whole, then sends the headers' answer
with the destination and the body back in chunks, as that mode asks of a processor. In BUFFERED mode (and STREAMED,
chunk by chunk) the headers are answered at once and the destination rides on the body's answer. A request with no
body is picked at its headers. The response passes through unchanged.

A request the picker refuses gets an ImmediateResponse (400 malformed, 404 unknown model, 408 a body that stops
arriving, 413 too big, 503 no ready replica) and the stream ends; a stream Envoy ends early just ends.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc

from ..gateway.replica_pool import Replica
from . import ext_proc_replies as replies
from .endpoint_picker import EndpointPicker, Pick
from .pick_request import PickError, RequestBody, read_request
from .picker_flags import BODY_TIMEOUT_SECONDS
from .picker_metrics import PickerMetrics

log = logging.getLogger("capstan.picker")
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
NO_BODY = processing_mode_pb2.ProcessingMode.NONE  # Envoy sends no body: the pick cannot wait for one


class ExternalProcessor(ext_proc_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        picker: EndpointPicker,
        metrics: PickerMetrics,
        max_body_bytes: int,
        prefix_chars: int,
        body_timeout: float = BODY_TIMEOUT_SECONDS,
    ):
        self.picker, self.metrics = picker, metrics
        self.max_body_bytes, self.prefix_chars, self.body_timeout = max_body_bytes, prefix_chars, body_timeout

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 - gRPC's name
        self.metrics.streams.inc()
        stream = RequestStream(self, context)
        try:
            await stream.run()
        finally:
            stream.release()
            self.metrics.streams.dec()


class RequestStream:
    """One HTTP request's ext_proc stream: read until the body is whole, pick, then relay the response."""

    def __init__(self, processor: ExternalProcessor, context: grpc.aio.ServicerContext):
        self.processor, self.context = processor, context
        self.request_mode: int = FULL_DUPLEX  # GIE's Gateways stream both ways; protocol_config says otherwise
        self.response_mode: int = FULL_DUPLEX
        self.body = RequestBody(processor.max_body_bytes)
        self.headers_answered = False
        self.metadata = ext_proc.ProcessingRequest().metadata_context
        self.headers: dict[str, str] = {}
        self.pick: Pick | None = None
        self.counted: Replica | None = None  # the replica whose in_flight this request holds

    async def run(self) -> None:
        while True:
            message = await self._read()
            if message is None:
                return
            if message.HasField("protocol_config"):
                self.request_mode = message.protocol_config.request_body_mode
                self.response_mode = message.protocol_config.response_body_mode
            try:
                await self._handle(message)
            except PickError as error:
                await self._refuse(error)
                return

    async def _read(self) -> ext_proc.ProcessingRequest | None:
        """The next message; None once Envoy ends the stream. Before the pick a silent client gets a 408."""
        timeout = None if self.pick else self.processor.body_timeout
        try:
            message = await asyncio.wait_for(self.context.read(), timeout)
        except TimeoutError:
            await self._refuse(
                PickError(408, f"the request did not arrive whole within {timeout:g} s", code="request_timeout")
            )
            return None
        if message is grpc.aio.EOF:
            if self.pick is None:
                log.debug("the stream ended before the request was whole: nothing to pick")
            return None
        assert isinstance(message, ext_proc.ProcessingRequest)
        return message

    async def _handle(self, message: ext_proc.ProcessingRequest) -> None:
        """Answer one message (a PickError refuses the request)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.metadata = message.metadata_context
            self.headers = {h.key.lower(): replies.header_value(h) for h in message.request_headers.headers.headers}
            if message.request_headers.end_of_stream or self.request_mode == NO_BODY:  # no body (sent): pick now
                await self._picked(None, body_ends=True)
            elif self.request_mode != FULL_DUPLEX:
                await self._write(replies.request_headers_reply())
                self.headers_answered = True
        elif kind == "request_body":
            if self.pick is not None:  # a body after the pick (more after trailers cannot come): relay
                await self._write(replies.request_body_reply())
                return
            self.body.add(message.request_body.body)
            if message.request_body.end_of_stream:
                await self._picked(self.body.bytes(), body_ends=True)
            elif self.request_mode != FULL_DUPLEX:  # STREAMED: every chunk is answered
                await self._write(replies.request_body_reply())
        elif kind == "request_trailers":
            if self.pick is None:  # the body ended with trailers
                await self._picked(self.body.bytes(), body_ends=False)
            await self._write(replies.pass_through(kind))
        elif kind == "response_headers":
            self._note_served(message)
            await self._write(replies.pass_through(kind))
        elif kind == "response_body":
            chunk = message.response_body
            if self.response_mode == FULL_DUPLEX:
                for reply in replies.streamed_body(chunk.body, chunk.end_of_stream, response=True):
                    await self._write(reply)
            else:
                await self._write(replies.pass_through(kind))
        elif kind == "response_trailers":
            await self._write(replies.pass_through(kind))

    async def _picked(self, raw: bytes | None, body_ends: bool) -> None:
        """The request is whole: pick, and send the destination (and, streaming, the body back)."""
        request = read_request(raw, self.metadata, self.processor.prefix_chars, self.headers)
        picker = self.processor.picker
        pick = picker.pick(request, await picker.kv_scores(request))
        self.pick = pick
        self.counted = pick.replicas[0]
        self.counted.in_flight += 1
        metrics = self.processor.metrics
        metrics.requests.labels(model=request.model or "", result="failed_open" if pick.failed_open else "picked").inc()
        metrics.picked.labels(endpoint=pick.endpoints[0]).inc()
        if self.headers_answered:
            await self._write(replies.request_body_reply(pick.endpoints))
            return
        await self._write(replies.request_headers_reply(pick.endpoints))
        if raw is not None and self.request_mode == FULL_DUPLEX:
            for reply in replies.streamed_body(raw, end_of_stream=body_ends):
                await self._write(reply)

    def _note_served(self, message: ext_proc.ProcessingRequest) -> None:
        """Envoy names the endpoint that answered (a retry may have gone to a fallback): count the request there."""
        served = replies.metadata_value(message.metadata_context, replies.DESTINATION_NAMESPACE, replies.SERVED_KEY)
        if not isinstance(served, str) or self.counted is None:
            return
        replica = self.processor.picker.replica_at(served.strip())
        if replica is not None and replica is not self.counted:
            self.counted.in_flight -= 1
            self.counted = replica
            replica.in_flight += 1

    async def _refuse(self, error: PickError) -> None:
        log.info("refused a request: %d %s", error.status, error.message)
        self.processor.metrics.requests.labels(model="", result=str(error.status)).inc()
        await self._write(replies.immediate_error(error.status, error.message, code=error.code, param=error.param))

    async def _write(self, reply: ext_proc.ProcessingResponse) -> None:
        await self.context.write(reply)

    def release(self) -> None:
        if self.counted is not None:
            self.counted.in_flight -= 1
            self.counted = None
