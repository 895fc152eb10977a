"""Prometheus metric names: the one list shared by the server (which exports them), the operator's
autoscaler (which reads them) and docs/metrics.md. No imports, so the operator can use it without JAX."""

PREFIX = "capstan_"

REQUESTS_RUNNING = PREFIX + "requests_running"  # gauge: sequences in the running batch
REQUESTS_WAITING = PREFIX + "requests_waiting"  # gauge: requests queued, not yet scheduled
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_ratio"  # gauge 0..1: used KV pages / all KV pages
KV_PAGES_FREE = PREFIX + "kv_pages_free"  # gauge
KV_PAGES_TOTAL = PREFIX + "kv_pages_total"  # gauge
PROGRAMS_COMPILING = PREFIX + "programs_compiling"  # gauge: step programs the warm-up still compiles while serving
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queried_tokens"  # counter (_total): prompt tokens looked up
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hit_tokens"  # counter (_total): prompt tokens found cached
PREFIX_CACHE_HIT_RATE = PREFIX + "prefix_cache_hit_rate"  # gauge 0..1: hit tokens / queried tokens since start
PREEMPTIONS = PREFIX + "preemptions"  # counter (_total)
PROMPT_TOKENS = PREFIX + "prompt_tokens"  # counter (_total)
GENERATION_TOKENS = PREFIX + "generation_tokens"  # counter (_total)
SPEC_DRAFT_TOKENS = PREFIX + "spec_decode_draft_tokens"  # counter (_total): tokens proposed by speculation
SPEC_ACCEPTED_TOKENS = PREFIX + "spec_decode_accepted_tokens"  # counter (_total): proposed tokens verified
SPEC_DRAFTS = PREFIX + "spec_decode_drafts"  # counter (_total): sequences' proposals verified (one a row a step)
SPEC_ACCEPTED_PER_POS = PREFIX + "spec_decode_accepted_tokens_per_pos"  # counter (_total), label position
KV_OFFLOAD_USAGE = PREFIX + "kv_offload_usage_ratio"  # gauge 0..1: host-tier pages held / its pages
KV_OFFLOAD_QUERIES = PREFIX + "kv_offload_queried_tokens"  # counter (_total): prompt tokens the device tier lacked
KV_OFFLOAD_HITS = PREFIX + "kv_offload_hit_tokens"  # counter (_total): of those, copied back from host memory
KV_OFFLOAD_BYTES = PREFIX + "kv_offload_bytes"  # counter (_total), label direction (to_host, to_device)
KV_OFFLOAD_FAILED_LOADS = PREFIX + "kv_offload_failed_loads"  # counter (_total): copies back dropped (recomputed)
KV_OFFLOAD_SAVED_SECONDS = PREFIX + "kv_offload_saved_seconds"  # gauge: estimated prefill time saved, less the waits
LORA_SLOTS_USED = PREFIX + "lora_slots_used"  # gauge: LoRA adapter slots held by running sequences
LORA_SLOTS_TOTAL = PREFIX + "lora_slots_total"  # gauge: LoRA adapter slots (--max-loras)
LORA_SLOT_LOADS = PREFIX + "lora_slot_loads"  # counter (_total): adapters written into a device slot (swaps)
LORA_REQUESTS_WAITING = PREFIX + "lora_requests_waiting"  # gauge: sequences waiting for their adapter's slot
REQUESTS_FINISHED = PREFIX + "requests_finished"  # counter (_total), label finish_reason
TIME_TO_FIRST_TOKEN = PREFIX + "time_to_first_token_seconds"  # histogram
INTER_TOKEN_LATENCY = PREFIX + "inter_token_latency_seconds"  # histogram
E2E_REQUEST_LATENCY = PREFIX + "e2e_request_latency_seconds"  # histogram

# The gateway's own (capstan gateway, docs/gateway.md)
GATEWAY_REQUESTS = PREFIX + "gateway_requests"  # counter (_total), labels model, code: answered requests
GATEWAY_RETRIES = PREFIX + "gateway_retries"  # counter (_total), label model: sent again after failing before a byte
GATEWAY_BROKEN_OFF = PREFIX + "gateway_broken_off"  # counter (_total): responses cut after their first byte
GATEWAY_HELD = PREFIX + "gateway_requests_held"  # gauge: waiting for a ready replica (scale from zero)
GATEWAY_HOLD_REFUSED = PREFIX + "gateway_hold_refused"  # counter (_total): 503 after a full hold queue or its timeout
GATEWAY_REPLICAS_READY = PREFIX + "gateway_replicas_ready"  # gauge, label model
GATEWAY_REPLICA_LOAD = PREFIX + "gateway_replica_load"  # gauge, label replica: the load the policy sees
GATEWAY_ROUTED = PREFIX + "gateway_routed"  # counter (_total), label replica
GATEWAY_TIME_TO_FIRST_BYTE = PREFIX + "gateway_time_to_first_byte_seconds"  # histogram: arrival to upstream headers
GATEWAY_CLIENT_REQUESTS = PREFIX + "gateway_client_requests"  # counter (_total), labels client, code: admitted
GATEWAY_CLIENT_TOKENS = PREFIX + "gateway_client_tokens"  # counter (_total), labels client, kind (prompt, completion)
GATEWAY_CLIENT_REJECTIONS = PREFIX + "gateway_client_rejections"  # counter (_total), labels client, reason
GATEWAY_UNAUTHENTICATED = PREFIX + "gateway_unauthenticated"  # counter (_total): 401s, no key or an unknown one
# capstan picker (the GIE endpoint picker), from its own pod's --metrics-port
PICKER_REQUESTS = PREFIX + "picker_requests"  # counter (_total), labels model, result (picked, failed_open, 4xx/5xx)
PICKER_PICKED = PREFIX + "picker_picked"  # counter (_total), label endpoint: requests sent there first
PICKER_STREAMS = PREFIX + "picker_streams_open"  # gauge: ext_proc streams (HTTP requests) in progress
PICKER_REPLICAS_READY = PREFIX + "picker_replicas_ready"  # gauge, label model
PICKER_REPLICA_LOAD = PREFIX + "picker_replica_load"  # gauge, label endpoint: the load the policy sees
