"""An ext_proc client that drives the picker as Envoy's ext_proc filter does, with messages built from Envoy's own
protos (xds-protos): one gRPC stream per HTTP request; the first message carries the protocol configuration; the
request's headers, then its body in chunks, the last with end_of_stream; then, once upstream answers, the response's
headers and body. In FULL_DUPLEX_STREAMED mode (GIE's) nothing is answered until the processor has the whole body."""

from __future__ import annotations

import json
import queue
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX, BUFFERED = Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED
REPLY_TIMEOUT = 30.0  # seconds any one reply may take


def headers(path: str, method: str = "POST", end_of_stream: bool = False, extra: dict | None = None):
    pairs = {":method": method, ":path": path, ":authority": "gateway.example", ":scheme": "http"}
    pairs |= {"content-type": "application/json"} if method == "POST" else {}
    pairs |= extra or {}
    return ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=end_of_stream,
    )


def subset_metadata(endpoints: list[str]) -> base_pb2.Metadata:
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": endpoints})
    return base_pb2.Metadata(filter_metadata={"envoy.lb.subset_hint": hint})


@dataclass
class Routed:
    """What the picker answered for one request."""

    replies: list = field(default_factory=list)

    @property
    def immediate(self) -> ext_proc.ImmediateResponse | None:
        last = self.replies[-1] if self.replies else None
        return last.immediate_response if last is not None and last.HasField("immediate_response") else None

    @property
    def status(self) -> int | None:
        return self.immediate.status.code if self.immediate else None

    @property
    def error(self) -> dict:
        assert self.immediate is not None, self.replies
        return json.loads(self.immediate.body)["error"]

    def mutation_reply(self):
        return next(r for r in self.replies if r.HasField("dynamic_metadata"))

    @property
    def destination(self) -> str:
        """The `x-gateway-destination-endpoint` header, checked equal to the envoy.lb metadata (the spec's rule)."""
        reply = self.mutation_reply()
        common = getattr(reply, reply.WhichOneof("response")).response
        assert common.clear_route_cache
        (header,) = [h.header for h in common.header_mutation.set_headers]
        assert header.key == "x-gateway-destination-endpoint"
        metadata = MessageToDict(reply.dynamic_metadata)["envoy.lb"]["x-gateway-destination-endpoint"]
        assert metadata == header.raw_value.decode()
        return metadata

    @property
    def endpoint(self) -> str:
        return self.destination.split(",")[0]

    def forwarded_body(self) -> tuple[bytes, bool]:
        """The request body the processor sent back (FULL_DUPLEX_STREAMED), and whether it ended the stream."""
        chunks = [
            r.request_body.response.body_mutation.streamed_response
            for r in self.replies
            if r.HasField("request_body") and r.request_body.response.body_mutation.HasField("streamed_response")
        ]
        return b"".join(c.body for c in chunks), bool(chunks) and chunks[-1].end_of_stream


class EnvoyStream:
    """One request's stream. `send` queues a message; `reply` waits for the next answer (None: the stream ended)."""

    def __init__(self, channel: grpc.Channel, request_mode=FULL_DUPLEX, response_mode=FULL_DUPLEX):
        self._outbox: queue.Queue = queue.Queue()
        self._first = ext_proc.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode)
        self._call = ext_proc_grpc.ExternalProcessorStub(channel).Process(iter(self._outbox.get, None))
        self._inbox: queue.Queue = queue.Queue()
        self._reader = __import__("threading").Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        try:
            for reply in self._call:
                self._inbox.put(reply)
        except grpc.RpcError as error:
            self._inbox.put(error)
        self._inbox.put(None)

    def send(self, **message) -> None:
        request = ext_proc.ProcessingRequest(**message)
        if self._first is not None:
            request.protocol_config.CopyFrom(self._first)
            self._first = None
        self._outbox.put(request)

    def reply(self, timeout: float = REPLY_TIMEOUT):
        got = self._inbox.get(timeout=timeout)
        if isinstance(got, grpc.RpcError):
            raise got
        if got is None:
            self._inbox.put(None)  # ended: every later reply() says so too
        return got

    def replies_until(self, done, timeout: float = REPLY_TIMEOUT) -> list:
        """Replies until `done(reply)` or an ImmediateResponse; the stream's end stops it too."""
        got = []
        while (reply := self.reply(timeout)) is not None:
            got.append(reply)
            if done(reply) or reply.HasField("immediate_response"):
                break
        return got

    def close(self) -> None:
        """The client half-closes (Envoy ends the stream); then the answers are drained."""
        self._outbox.put(None)
        self._reader.join(REPLY_TIMEOUT)

    def cancel(self) -> None:
        self._call.cancel()
        self._reader.join(REPLY_TIMEOUT)


def route(
    channel: grpc.Channel,
    path: str,
    body: bytes | None,
    *,
    chunk: int = 1024,
    mode=FULL_DUPLEX,
    metadata: base_pb2.Metadata | None = None,
    stream: EnvoyStream | None = None,
) -> Routed:
    """One request's request half, as Envoy sends it, and the picker's answers to it; the stream stays open (for the
    response half) when `stream` is given, else it is closed."""
    own = stream is None
    stream = stream or EnvoyStream(channel, mode)
    context = {"metadata_context": metadata} if metadata is not None else {}
    routed = Routed()
    try:
        if body is None:
            stream.send(request_headers=headers(path, "GET", end_of_stream=True), **context)
            routed.replies = stream.replies_until(lambda r: r.HasField("request_headers"))
            return routed
        stream.send(request_headers=headers(path, extra={"content-length": str(len(body))}), **context)
        if mode != FULL_DUPLEX:  # Envoy waits for the headers' answer before it sends a buffered body
            routed.replies += stream.replies_until(lambda r: r.HasField("request_headers"))
            if routed.immediate:
                return routed
            stream.send(request_body=ext_proc.HttpBody(body=body, end_of_stream=True))
            routed.replies += stream.replies_until(lambda r: r.HasField("request_body"))
            return routed
        pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
        for i, piece in enumerate(pieces):
            stream.send(request_body=ext_proc.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
        routed.replies = stream.replies_until(
            lambda r: (
                r.HasField("request_body") and r.request_body.response.body_mutation.streamed_response.end_of_stream
            )
        )
        return routed
    finally:
        if own:
            stream.close()
