"""The ext_proc messages the picker sends Envoy (envoy.service.ext_proc.v3), built from xds-protos' classes. Pure.

The Gateway API Inference Extension's protocol (docs/proposals/004-endpoint-picker-protocol): the picked endpoints go
to Envoy twice, as the `x-gateway-destination-endpoint` request header and as the same key in the `envoy.lb` dynamic
metadata, with the route cache cleared so the new header counts; a request the picker refuses gets an
ImmediateResponse with the HTTP status and, here, OpenAI's error body.
"""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from ..server.error_body import error_body

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"  # dynamic metadata namespace of the picked endpoints
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # request metadata namespace of the endpoints the Gateway allows
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"  # in envoy.lb of a response's metadata: who answered
BODY_CHUNK_BYTES = 60 * 1024  # a streamed body goes back in pieces well under gRPC's default 4 MiB message limit


def destination_mutation(endpoints: list[str]) -> tuple[ext_proc.CommonResponse, struct_pb2.Struct]:
    """The header mutation (route cache cleared) and the dynamic metadata that send a request to `endpoints`, in
    order of preference (Envoy tries the next on a retry)."""
    value = ",".join(endpoints)
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )
    common = ext_proc.CommonResponse(
        header_mutation=ext_proc.HeaderMutation(set_headers=[header]), clear_route_cache=True
    )
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: value}})
    return common, metadata


def request_headers_reply(endpoints: list[str] | None = None) -> ext_proc.ProcessingResponse:
    """The answer to the request's headers: with the destination when it is known by then, else CONTINUE as is."""
    if not endpoints:
        return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
    common, metadata = destination_mutation(endpoints)
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=common), dynamic_metadata=metadata
    )


def request_body_reply(endpoints: list[str] | None = None) -> ext_proc.ProcessingResponse:
    """A buffered (or streamed) body's answer: the destination rides on it when the headers were answered already."""
    if not endpoints:
        return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
    common, metadata = destination_mutation(endpoints)
    return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common), dynamic_metadata=metadata)


def streamed_body(body: bytes, end_of_stream: bool, *, response: bool = False) -> list[ext_proc.ProcessingResponse]:
    """In FULL_DUPLEX_STREAMED mode Envoy forwards only the body the processor sends back: `body` in chunks, the
    last one carrying `end_of_stream`."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    replies = []
    for i, piece in enumerate(pieces):
        last = end_of_stream and i == len(pieces) - 1
        mutation = ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(body=piece, end_of_stream=last)
        )
        reply = ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
        replies.append(
            ext_proc.ProcessingResponse(response_body=reply)
            if response
            else ext_proc.ProcessingResponse(request_body=reply)
        )
    return replies


def immediate_error(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> ext_proc.ProcessingResponse:
    """Answer the client now, with OpenAI's error body, instead of routing the request anywhere."""
    body = json.dumps(error_body(status, message, param=param, code=code), ensure_ascii=True).encode()
    headers = ext_proc.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"))
        ]
    )
    if status in (429, 503):
        headers.set_headers.append(
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=b"1"))
        )
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status), headers=headers, body=body, details=message[:200]
        )
    )


def pass_through(kind: str) -> ext_proc.ProcessingResponse:
    """CONTINUE, unchanged, for a message of `kind` (response_headers, response_body, request_trailers, ...)."""
    empty = (
        ext_proc.TrailersResponse()
        if kind.endswith("trailers")
        else (ext_proc.HeadersResponse() if kind.endswith("headers") else ext_proc.BodyResponse())
    )
    return ext_proc.ProcessingResponse(**{kind: empty})


def metadata_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> object:
    """One value of the request's filter metadata as plain Python (None when absent)."""
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    if key not in fields:
        return None
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(fields[key])


def header_value(header: base_pb2.HeaderValue) -> str:
    """Envoy sends raw_value (bytes) in current releases, value (string) in older ones."""
    return header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
