"""EngineStats: one snapshot of the engine's gauges and counters (probes, /metrics, the autoscaler), plain values
that cross from the engine core to its frontends."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    running: int
    waiting: int
    kv_pages_used: int
    kv_pages_total: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    programs_compiling: int = 0  # step programs serve's warm-up still compiles in the background (engine/warmup.py)
    spec_draft_tokens: int = 0  # tokens proposed by speculative decoding
    spec_accepted_tokens: int = 0  # of those, the ones the target verified
    spec_drafts: int = 0  # rows verified with a proposal (draft tokens / drafts: the mean proposal length)
    spec_accepted_per_pos: tuple[int, ...] = ()  # accepted proposals by position 0..K-1 (where acceptance falls off)
    # the prefix cache's host-memory tier (--kv-offloading-size)
    kv_offload_pages_used: int = 0
    kv_offload_pages_total: int = 0
    kv_offload_queried_tokens: int = 0  # prompt tokens the device tier lacked, looked up in host memory
    kv_offload_hit_tokens: int = 0  # of those, the ones copied back instead of recomputed
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0
    kv_offload_failed_loads: int = 0  # copies back that failed or were late: their pages were recomputed
    kv_offload_saved_seconds: float = 0.0  # estimated prefill time saved, less the time the copies took
    # LoRA adapters (--enable-lora): device slots held by running sequences, all slots, adapters written into a slot,
    # sequences that waited for a slot at the last schedule
    lora_slots_used: int = 0
    lora_slots_total: int = 0
    lora_slot_loads: int = 0
    lora_requests_waiting: int = 0
