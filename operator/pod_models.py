"""Which LoRA adapters each serving pod has loaded: its own `GET /v1/models`, where adapters are the cards with a
`parent` (the base model's name), as vLLM lists them."""

from __future__ import annotations

import json
import logging
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)
FETCH_TIMEOUT_SECONDS = 2.0


def loaded_adapters(listing: dict[str, Any]) -> list[str]:
    """A /v1/models body -> the adapter names in it, sorted (the base model's card has no parent)."""
    return sorted(
        card["id"]
        for card in listing.get("data", [])
        if isinstance(card, dict) and card.get("parent") and isinstance(card.get("id"), str)
    )


def fetch_adapters(address: str) -> list[str] | None:
    """GET http://address/v1/models; None when the pod does not answer (it is then reported as unknown)."""
    try:
        with urllib.request.urlopen(f"http://{address}/v1/models", timeout=FETCH_TIMEOUT_SECONDS) as response:
            return loaded_adapters(json.loads(response.read()))
    except (OSError, ValueError, AttributeError) as error:
        log.info("no model list from %s: %s", address, error)
        return None


def fetch_pod_adapters(addresses: dict[str, str]) -> dict[str, list[str] | None]:
    """Pod name -> the adapters it reports (None: no answer), for each pod in `addresses`."""
    if not addresses:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        return dict(zip(addresses, pool.map(fetch_adapters, addresses.values()), strict=True))
