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
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry, Counter

from ..server import metric_names as names
from ..server.error_body import APIError
from .budgets import Budgets
from .client_keys import ClientKey, KeyRing

log = logging.getLogger("capstan.gateway")
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
    upstream_authorization: str | None


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

    def admit(self, client: ClientKey, model: str) -> Admission:
        """Raise 403 or 429, or take a budget slot (give it back with `finish`)."""
        if not client.may_use(model):
            self.metrics.rejections.labels(client=client.name, reason="model").inc()
            raise APIError(
                403,
                f"The API key of client {client.name!r} may not use model `{model}`.",
                param="model",
                code="model_not_allowed",
            )
        refusal = self.budgets.admit(client)
        if refusal is not None:
            self.metrics.rejections.labels(client=client.name, reason=refusal.reason).inc()
            retry_after = str(max(1, round(refusal.retry_after + 0.5)))
            raise APIError(
                429,
                f"Rate limit reached: {refusal.message}. Retry after {retry_after} s.",
                code="rate_limit_exceeded",
                headers={"Retry-After": retry_after, **self.budgets.headers(client)},
            )
        return Admission(client, self.upstream.authorization(model))

    def finish(self, admission: Admission, code: int, prompt_tokens: int, completion_tokens: int) -> None:
        name = admission.client.name
        self.budgets.finish(admission.client, prompt_tokens + completion_tokens)
        self.metrics.requests.labels(client=name, code=str(code)).inc()
        self.metrics.tokens.labels(client=name, kind="prompt").inc(prompt_tokens)
        self.metrics.tokens.labels(client=name, kind="completion").inc(completion_tokens)

    async def watch(self) -> None:
        """Read the key files again whenever their content changes: a rotated Secret needs no restart."""
        while True:
            await asyncio.sleep(RELOAD_SECONDS)
            await asyncio.to_thread(self.keys.reload)
            await asyncio.to_thread(self.upstream.reload)
