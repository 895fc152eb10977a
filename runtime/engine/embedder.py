"""Embedder: pooled, L2-normalised final hidden states of a decoder checkpoint (/v1/embeddings, LLM.embed).

Embedding inputs go through the served model and the engine's own KV pool, not a second cache: an input borrows
pages for its tokens, its chunks are packed into the step's token buckets (a long input takes several batches,
each attending to the pages of the chunks before it), and the pages go back when the input is pooled. The jitted
forward stops at the final norm: no logits, no sampling. The engine thread runs one embedding batch between
generation steps, so the device runs one program at a time and both kinds of request make progress.

Pooling is chosen per server (`--embedding-pooling`): `last` (the last token's state, what decoder embedding
models such as e5-mistral or Qwen3-Embedding are trained for) or `mean` (over every input token)."""

from __future__ import annotations

import collections
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from ..attention import INVALID_SLOT, AttentionMetadata, query_blocks
from ..sampling.sampling_params import InvalidRequestError
from .input_processor import EmbeddingRequest
from .outputs import EmbeddingOutput, EmbeddingRequestOutput

log = logging.getLogger("capstan.engine")
POOLING = ("last", "mean")


@dataclasses.dataclass(eq=False)
class EmbeddingInput:
    """One input of an embedding request, as the embedder schedules it."""

    request_id: str
    index: int
    token_ids: list[int]
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    total: np.ndarray | None = None  # running float32 sum of its hidden states (mean pooling)
    last: np.ndarray | None = None  # its last token's hidden state

    @property
    def done(self) -> bool:
        return self.num_computed == len(self.token_ids)


def pool_forward(model, kv, tokens, meta: AttentionMetadata[jax.Array], valid, last_index):
    """Per row of the batch: the float32 sum of its tokens' final hidden states, and its last token's state."""
    hidden, kv = model(tokens, meta, kv)
    h = hidden.array.astype(jnp.float32)  # [T, Embed]
    sums = jax.ops.segment_sum(h * valid[:, None], meta.token_seq, num_segments=meta.seq_lens.shape[0])
    return kv, sums, h[last_index]


# The KV cache is donated, as in the generation step: the borrowed pages are written in place.
pool_forward_fn = jax.jit(pool_forward, donate_argnums=(1,))


class Embedder:
    def __init__(self, engine, pooling: str = "last"):
        if pooling not in POOLING:
            raise ValueError(f"embedding_pooling must be one of {POOLING}, got {pooling!r}")
        self.engine, self.pooling = engine, pooling
        self.waiting: collections.deque[EmbeddingInput] = collections.deque()
        self.running: list[EmbeddingInput] = []
        self.requests: dict[str, list[EmbeddingInput]] = {}
        self._compiled: set[int] = set()
        self.refusal: str | None = None  # why every embedding request is refused (several hosts), if it is

    @property
    def dimensions(self) -> int:
        return self.engine.model.cfg.hidden_size

    def prepare(self, request_id: str, prompts: list[str | list[int]]) -> list[EmbeddingInput]:
        """Validates and tokenizes a request's inputs without touching embedder state (safe from any thread)."""
        return self.inputs_of(self.engine.inputs.embedding(request_id, prompts))

    @staticmethod
    def inputs_of(request: EmbeddingRequest) -> list[EmbeddingInput]:
        return [EmbeddingInput(request.request_id, i, ids) for i, ids in enumerate(request.inputs)]

    def add(self, inputs: list[EmbeddingInput]) -> None:
        if self.refusal is not None:
            raise InvalidRequestError(self.refusal, "input")
        request_id = inputs[0].request_id
        if request_id in self.requests or request_id in self.engine.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        self.requests[request_id] = inputs
        self.waiting.extend(inputs)
        self.engine.prompt_tokens += sum(len(x.token_ids) for x in inputs)

    def has_work(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> None:
        for x in self.requests.pop(request_id, []):
            self._release(x)
        self.waiting = collections.deque(x for x in self.waiting if x.request_id != request_id)

    def fail(self, request_id: str, error: BaseException) -> None:
        log.error(
            "embedding request %s failed and was dropped: %s: %s",
            request_id,
            type(error).__name__,
            error,
            exc_info=error,
        )
        self.abort(request_id)
        self.engine.failed.append((request_id, error))

    def step(self) -> list[tuple[str, list[EmbeddingRequestOutput]]]:
        """One batch of input chunks through the model; returns the requests whose every input is now pooled."""
        chunks = self._schedule()
        if not chunks:
            return []
        try:
            args = self._build(chunks)
        except Exception as e:  # noqa: BLE001 - a batch that cannot be built is its inputs' fault, not the engine's
            for rid in {x.request_id for x, _, _ in chunks}:
                self.fail(rid, e)
            return []
        T = args[0].shape[0]
        if T not in self._compiled:
            log.info("compiling the embedding forward for %d tokens (once per token bucket)", T)
            self._compiled.add(T)
        engine = self.engine
        with engine._precision():
            engine.kv, sums, last = pool_forward_fn(engine.model, engine.kv, *args)
        sums, last = np.asarray(sums), np.asarray(last)
        for r, (x, start, n) in enumerate(chunks):
            x.total = sums[r] if x.total is None else x.total + sums[r]
            x.num_computed = start + n
            if x.done:
                x.last = last[r]
                self._release(x)
        return self._collect({x.request_id for x, _, _ in chunks})

    def _pages_for(self, ids) -> int:
        return -(-len(ids) // self.engine.pool.page_size)

    def _schedule(self) -> list[tuple[EmbeddingInput, int, int]]:
        """(input, first position, tokens) per row: running inputs go on, then waiting ones take pages."""
        builder, pool = self.engine.builder, self.engine.pool
        budget = builder.buckets[-1]
        chunks: list[tuple[EmbeddingInput, int, int]] = []
        for x in self.running:
            if budget == 0 or len(chunks) == builder.S:
                return chunks
            n = min(len(x.token_ids) - x.num_computed, budget)
            chunks.append((x, x.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(chunks) < builder.S:
            x = self.waiting[0]
            need = self._pages_for(x.token_ids)
            if need > pool.num_free:
                break  # generation holds the pages: wait for them
            self.waiting.popleft()
            x.pages = pool.allocate(need)
            self.running.append(x)
            n = min(len(x.token_ids), budget)
            chunks.append((x, 0, n))
            budget -= n
        return chunks

    def _build(self, chunks) -> tuple:
        """pool_forward's host inputs for these chunks, padded to the step's token bucket and row count."""
        builder = self.engine.builder
        S, page = builder.S, builder.page_size
        T = builder.bucket_for(sum(n for _, _, n in chunks))
        tokens, positions = np.zeros(T, np.int32), np.zeros(T, np.int32)
        slots, token_seq = np.full(T, INVALID_SLOT, np.int32), np.zeros(T, np.int32)
        valid = np.zeros(T, np.float32)
        block_tables = np.zeros((S, builder.max_pages), np.int32)
        seq_lens, last_index = np.zeros(S, np.int32), np.zeros(S, np.int32)
        t = 0
        for r, (x, start, n) in enumerate(chunks):
            pos = np.arange(start, start + n)
            pages = np.asarray(x.pages, np.int32)
            tokens[t : t + n] = x.token_ids[start : start + n]
            positions[t : t + n] = pos
            slots[t : t + n] = pages[pos // page] * page + pos % page
            token_seq[t : t + n] = r
            valid[t : t + n] = 1.0
            block_tables[r, : len(pages)] = pages
            seq_lens[r] = start + n
            last_index[r] = t + n - 1
            t += n
        blocks = query_blocks([(r, start, n) for r, (_, start, n) in enumerate(chunks)], T, S, builder.queries_per_kv)
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            token_seq=token_seq,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_blocks=blocks,
        )
        return tokens, meta, valid, last_index

    def _release(self, x: EmbeddingInput) -> None:
        if x in self.running:
            self.running.remove(x)
        self.engine.pool.release(x.pages)
        x.pages = []

    def _collect(self, request_ids) -> list[tuple[str, list[EmbeddingRequestOutput]]]:
        finished = []
        for rid in request_ids:
            inputs = self.requests.get(rid)
            if inputs is None or not all(x.done for x in inputs):
                continue
            del self.requests[rid]
            finished.append(
                (
                    rid,
                    [
                        EmbeddingRequestOutput(
                            request_id=f"{rid}-{x.index}",
                            prompt_token_ids=x.token_ids,
                            outputs=EmbeddingOutput(self._pooled(x)),
                        )
                        for x in inputs
                    ],
                )
            )
        return finished

    def _pooled(self, x: EmbeddingInput) -> list[float]:
        assert x.total is not None and x.last is not None, "pooled only once all its tokens ran"
        v = x.last if self.pooling == "last" else x.total / len(x.token_ids)
        return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32).tolist()  # unit length, as vLLM's
