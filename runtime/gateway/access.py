"""Who may call the gateway, for which model, within which budget; and the key the gateway itself shows replicas.

With client keys (`--client-keys`): 401 without a known key, 403 for a model the key may not use, 429 with
`Retry-After` and OpenAI's `x-ratelimit-*` headers when a budget is spent. The client's `Authorization` never
reaches a replica: the gateway sends the service's own key (`--upstream-keys`, YAML `MODEL: KEY`, `"*"` for any
other model), which clients never see. Both files are read again when they change.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, Counter

from ..server import metric_names as names
from ..server.error_body import APIError
from .budgets import Budgets, Refusal, Reservation
from .client_keys import ClientKey, KeyRing
from .request_cost import GenerationFields
from .usage_meter import UsageMeter

log = logging.getLogger("capstan.gateway")
CLIENT_CLOSED = 499  # nginx's status for a client that hung up first
RELOAD_SECONDS = 2.0  # how soon a rotated Secret's new content takes effect, once the kubelet has written it


class UpstreamKeys:
    """MODEL -> the key its replicas check; only a digest of the file is kept besides the keys themselves."""

    def __init__(self, path: str | None):
        self.path = Path(path) if path else None
        self._fingerprint = b""
        self._keys: dict[str, str] = {}
        self.reload(strict=True)

    def reload(self, strict: bool = False) -> bool:
        if self.path is None:
            return False
        try:
            text = self.path.read_text()
            fingerprint = hashlib.sha256(text.encode()).digest()
            if fingerprint == self._fingerprint:
                return False
            keys = yaml.safe_load(text) or {}
            if not isinstance(keys, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in keys.items()
            ):
                raise ValueError(f'--upstream-keys {self.path}: expected a mapping of model names (or "*") to keys')
        except (OSError, ValueError, yaml.YAMLError) as error:
            if strict:
                raise ValueError(f"--upstream-keys {self.path}: {error}") from None
            log.error("upstream keys unchanged: %s", error)
            return False
        self._fingerprint, self._keys = fingerprint, keys
        log.info("upstream keys loaded for %d model(s)", len(keys))
        return True

    def authorization(self, model: str) -> str | None:
        key = self._keys.get(model, self._keys.get("*"))
        return f"Bearer {key}" if key else None


class ClientMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            names.GATEWAY_CLIENT_REQUESTS,
            "Requests admitted per client key, by status code.",
            ["client", "code"],
            registry=registry,
        )
        self.tokens = Counter(
            names.GATEWAY_CLIENT_TOKENS,
            "Tokens used per client key (the replicas' usage).",
            ["client", "kind"],
            registry=registry,
        )
        self.rejections = Counter(
            names.GATEWAY_CLIENT_REJECTIONS,
            "Requests refused per client key: forbidden "
            "model (403), or a spent budget (429: requests, tokens, concurrency).",
            ["client", "reason"],
            registry=registry,
        )
        self.unauthenticated = Counter(
            names.GATEWAY_UNAUTHENTICATED, "Requests refused 401: no key, or an unknown one.", registry=registry
        )


@dataclass
class Admission:
    client: ClientKey
    reservation: Reservation
    prompt_tokens: int = 0  # as counted for the reservation (0 where the key has no token budget)


class Access:
    def __init__(self, keys: KeyRing, budgets: Budgets, upstream: UpstreamKeys, registry: CollectorRegistry):
        self.keys, self.budgets, self.upstream = keys, budgets, upstream
        self.metrics = ClientMetrics(registry)

    def authenticate(self, authorization: str | None) -> ClientKey:
        client = self.keys.authenticate(authorization)
        if client is None:
            self.metrics.unauthenticated.inc()
            reason = "no API key" if not authorization else "an unknown API key"
            raise APIError(
                401,
                f"Incorrect API key provided: the request has {reason}; send "
                "`Authorization: Bearer KEY` with a key the gateway's operators gave you.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return client

    def check(self, client: ClientKey, model: str) -> None:
        """Raise 403 for a model the key may not use, or 429 when a budget is spent already (before the prompt is
        counted: a key over its budget costs the replicas nothing)."""
        if not client.may_use(model):
            self.metrics.rejections.labels(client=client.name, reason="model").inc()
            raise APIError(
                403,
                f"The API key of client {client.name!r} may not use model `{model}`.",
                param="model",
                code="model_not_allowed",
            )
        refusal = self.budgets.refusal(client)
        if refusal is not None:
            self._refuse(client, refusal)

    def counts_tokens(self, client: ClientKey) -> bool:
        """Whether the key has a token budget, so each request's worst case must be worked out before it runs."""
        return client.tokens_per_minute is not None

    def admit(self, client: ClientKey, tokens: int = 0, prompt_tokens: int = 0) -> Admission:
        """Raise 429, or take a request, a concurrency slot and `tokens` (its worst case) until `finish`."""
        taken = self.budgets.admit(client, tokens)
        if isinstance(taken, Refusal):
            self._refuse(client, taken)
        assert isinstance(taken, Reservation)
        return Admission(client, taken, prompt_tokens)

    def _refuse(self, client: ClientKey, refusal: Refusal) -> None:
        self.metrics.rejections.labels(client=client.name, reason=refusal.reason).inc()
        retry_after = str(max(1, math.ceil(refusal.retry_after)))
        raise APIError(
            429,
            f"Rate limit reached: {refusal.message}. Retry after {retry_after} s.",
            code="rate_limit_exceeded",
            headers={"Retry-After": retry_after, **self.budgets.headers(client)},
        )

    def settle(
        self, admission: Admission, code: int, meter: UsageMeter, fields: GenerationFields | None, reached: bool
    ) -> None:
        """End the request's hold on its budget: the replica's usage where it came, else what it can have used.
        reached: the request got to a replica (else nothing ran)."""
        prompt, reserved = admission.prompt_tokens, admission.reservation.tokens
        if meter.saw_usage:
            charge = (meter.prompt_tokens, meter.completion_tokens)
        elif not reached or (code >= 400 and code != CLIENT_CLOSED):  # refused, by us or the replica: nothing ran
            charge = (0, 0)
        elif meter.streaming or (fields is not None and fields.stream):  # cut short: the prompt and what it delivered
            charge = (prompt, min(meter.delivered, reserved - prompt) if reserved else meter.delivered)
        else:  # an answer nobody read (or too large to read): the gateway cannot see what ran, so its worst case
            charge = (prompt, reserved - prompt)
        self.finish(admission, code, *charge)

    def finish(self, admission: Admission, code: int, prompt_tokens: int, completion_tokens: int) -> None:
        """Settle the request's reservation with the tokens it used, and count them."""
        name = admission.client.name
        self.budgets.settle(admission.reservation, prompt_tokens + completion_tokens)
        self.metrics.requests.labels(client=name, code=str(code)).inc()
        self.metrics.tokens.labels(client=name, kind="prompt").inc(prompt_tokens)
        self.metrics.tokens.labels(client=name, kind="completion").inc(completion_tokens)

    async def watch(self) -> None:
        """Read the key files again whenever their content changes: a rotated Secret needs no restart."""
        while True:
            await asyncio.sleep(RELOAD_SECONDS)
            await asyncio.to_thread(self.keys.reload)
            await asyncio.to_thread(self.upstream.reload)
