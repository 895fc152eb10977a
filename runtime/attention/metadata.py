"""AttentionMetadata: where each token of a ragged step sits in the paged KV cache."""

from __future__ import annotations

from typing import Generic

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ..arrays import HostOrDevice

# A slot index past any cache: scatters with mode="drop" ignore it, so padding tokens write nothing.
INVALID_SLOT = jnp.iinfo(jnp.int32).max
QUERY_ROWS = 64  # (token, query head) rows per program of the ragged GPU kernel: one kv head's group of heads


def padded_group(queries_per_kv: int) -> int:
    """Query heads per kv head rounded up to a power of two (Triton tiles have power-of-two sides)."""
    return 1 << (queries_per_kv - 1).bit_length()


def query_block_tokens(queries_per_kv: int) -> int:
    """Tokens of one sequence per query block: QUERY_ROWS rows with all of a kv head's query heads."""
    return max(1, QUERY_ROWS // padded_group(queries_per_kv))


def max_query_blocks(num_tokens: int, max_rows: int, queries_per_kv: int) -> int:
    """Blocks a step of num_tokens tokens in at most max_rows chunks can need: each chunk adds one partial block."""
    return -(-num_tokens // query_block_tokens(queries_per_kv)) + min(max_rows, num_tokens)


def query_blocks(chunks, num_tokens: int, max_rows: int, queries_per_kv: int) -> np.ndarray:
    """The step's query blocks from its chunks, (row, first position, tokens) in token order."""
    size = query_block_tokens(queries_per_kv)
    blocks = np.zeros((max_query_blocks(num_tokens, max_rows, queries_per_kv), 4), np.int32)
    rows, starts, n = np.asarray(list(chunks), np.int64).reshape(-1, 3).T  # in numpy: a step has up to 256 rows
    count = -(-n // size)  # blocks a chunk takes
    offset = (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)) * size  # a block's, in its chunk
    first = np.repeat(np.cumsum(n) - n, count) + offset
    blocks[: len(first)] = np.stack(
        [
            first,
            np.minimum(size, np.repeat(n, count) - offset),
            np.repeat(rows, count),
            np.repeat(starts, count) + offset,
        ],
        axis=1,
    )
    return blocks


class AttentionMetadata(eqx.Module, Generic[HostOrDevice]):
    """One step's flat token batch: T tokens (padded to a bucket) from S sequences (padded to the maximum)."""

    positions: HostOrDevice  # [T] int32: position of each token in its sequence
    slot_mapping: HostOrDevice  # [T] int32: page * page_size + offset where its K/V go; INVALID_SLOT for padding
    token_seq: HostOrDevice  # [T] int32: row of block_tables that the token belongs to
    block_tables: HostOrDevice  # [S, max_pages_per_seq] int32: the pages of each sequence, in order
    seq_lens: HostOrDevice  # [S] int32: tokens in the cache for each sequence after this step (0 for padding)
    # [NB, 4] int32 (first token, tokens, row, first position) per query block, num tokens 0 for unused ones;
    # built by the batch builder for the ragged GPU kernel, None in multi-step decoding
    query_blocks: HostOrDevice | None = None
    decode: bool = eqx.field(static=True, default=False)  # token r is row r's only token (decode kernels apply)
