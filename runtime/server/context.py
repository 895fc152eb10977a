"""ServerContext: what every route needs (engine, served names, metrics, drain, tracer), one per app."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import Request

from ..sampling.sampling_params import InvalidRequestError
from ..sampling_keys import SamplingDefaults
from .drain import Drain
from .errors import APIError, model_not_found
from .metrics import ServerMetrics


@dataclasses.dataclass
class ServerContext:
    engine: Any  # AsyncLLM (typed loosely so this module imports without JAX)
    served_model_names: list[str]
    metrics: ServerMetrics
    drain: Drain
    tracer: Any = None  # an OpenTelemetry tracer, or None when no OTLP endpoint is configured
    log_prompts: bool = False
    tool_parser: Any = None  # parses `tool_choice: auto` answers (tool_parsers.py)
    # what a request's left-out sampling fields take (generation_config.py): override > model > SamplingParams'
    sampling_defaults: SamplingDefaults = dataclasses.field(default_factory=SamplingDefaults)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def resolve_model(self, requested: str | None) -> str:
        """The name to echo in the response: a served name or a loaded LoRA adapter's; 404 for any other."""
        if requested is None:
            return self.model_name
        if requested not in self.served_model_names and self.adapter(requested) is None:
            raise model_not_found(requested)
        return requested

    def adapter(self, model: str) -> str | None:
        """The LoRA adapter a resolved model name picks (None: the base model); served names win."""
        if model in self.served_model_names:
            return None
        return next((lora.lora_name for lora in self.engine.list_loras() if lora.lora_name == model), None)

    def validate(self, params, num_prompts: int) -> None:
        """The request's sampling fields against the served model and the server's limits; its choices
        (prompts x n) must fit the waiting queue."""
        self.engine.validate(params)
        choices, cap = num_prompts * params.n, self.engine.config.max_waiting
        if choices > cap:
            raise InvalidRequestError(
                f"n: {num_prompts} prompt(s) x n={params.n} is {choices} choices, more than "
                f"the server queues ({cap}, --max-waiting)",
                "n",
            )

    def check_ready(self) -> None:
        """Generation before warm-up would compile on the request path; clients should retry (probes gate it)."""
        if not self.engine.is_alive():
            raise APIError(
                503,
                "the engine has failed and this server cannot generate; it is restarting (its /health answers 503)",
                code="engine_dead",
            )
        if not self.engine.is_ready():
            raise APIError(
                503,
                "the model is still loading or compiling; retry when /ready answers 200",
                code="not_ready",
                headers={"Retry-After": "5"},
            )


def get_context(request: Request) -> ServerContext:
    return request.app.state.context
