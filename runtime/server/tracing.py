"""OpenTelemetry: one span per API request with GenAI semantic-convention attributes, exported over OTLP/HTTP
when OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set; without it no tracer exists and nothing runs."""

from __future__ import annotations

import logging
import os

log = logging.getLogger("capstan.server")


def make_tracer_provider():
    """A provider exporting to the configured OTLP endpoint, or None when none is configured."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME", "capstan")  # explicit attributes would override the env var
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("exporting OpenTelemetry spans over OTLP/HTTP to %s", endpoint)
    return provider


def start_request_span(tracer, operation: str, model: str, params):
    """The request's span, or None without a tracer; `end_request_span` adds the response and ends it."""
    if tracer is None:
        return None
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.system": "capstan",
        "gen_ai.request.model": model,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
    }
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return tracer.start_span(f"{operation} {model}", attributes=attributes)


def end_request_span(
    span,
    *,
    response_id: str,
    model: str,
    input_tokens: int,
    output_tokens: int,
    finish_reasons: list[str],
    error: BaseException | None = None,
) -> None:
    if span is None:
        return
    if error is not None:  # refused (400, 429) or failed: the type only, as messages may quote the request
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("error.type", type(error).__name__)
        span.set_status(Status(StatusCode.ERROR))
    span.set_attributes(
        {
            "gen_ai.response.id": response_id,
            "gen_ai.response.model": model,
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            "gen_ai.response.finish_reasons": finish_reasons,
        }
    )
    span.end()
