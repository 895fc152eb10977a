"""Streaming clients that keep sending completions through a Service until stopped, as real users would:
the openai client, keep-alive connections, no retries (every failed request counts)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import openai


@dataclass
class StreamResult:
    started: float
    ended: float
    finish_reason: str | None
    error: str | None


class StreamingLoad:
    def __init__(self, base_url: str, clients: int = 64, max_tokens: int = 16):
        self.base_url, self.max_tokens = base_url, max_tokens
        self.results: list[StreamResult] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in self._threads), "a streaming client hung"

    def _client(self, index: int) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)
        while not self.stopping.is_set():
            started, finish_reason, error = time.monotonic(), None, None
            try:
                stream = client.completions.create(
                    model="tiny",
                    prompt=f"Client {index} asks",
                    stream=True,
                    max_tokens=self.max_tokens,
                    temperature=0.8,
                )
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish_reason = chunk.choices[0].finish_reason
                if finish_reason is None:
                    error = "the stream ended without a finish_reason"
            except Exception as failure:  # noqa: BLE001 - any failure is what the test counts
                error = f"{type(failure).__name__}: {failure}"
            with self._lock:
                self.results.append(StreamResult(started, time.monotonic(), finish_reason, error))

    def completed_since(self, moment: float) -> int:
        with self._lock:
            return sum(1 for r in self.results if r.started >= moment and r.error is None)

    @property
    def failures(self) -> list[StreamResult]:
        with self._lock:
            return [r for r in self.results if r.error is not None]
