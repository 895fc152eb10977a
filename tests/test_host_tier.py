"""The prefix cache's host-memory tier (--kv-offloading-size): a pool too small for the conversations evicts their
pages, the tier copies them back on the next turn, and every token is what recompute gives."""

import time

import numpy as np
import pytest
from golden import GOLDEN

from capstan.runtime.cli import main
from capstan.runtime.engine.llm import LLM
from capstan.runtime.engine.multi_step import decode_steps_fn
from capstan.runtime.engine.step import step_fn
from capstan.runtime.kv import host_offload
from capstan.runtime.kv.cache import KVCache
from capstan.runtime.kv.host_offload import HostOffload, gather_chunks, gather_pages, scatter_chunks
from capstan.runtime.kv.host_tier import HostTier
from capstan.runtime.kv.page_pool import page_hash
from capstan.runtime.sampling.sampling_params import SamplingParams
from capstan.runtime.server.metrics import ServerMetrics

MODEL = str(GOLDEN / "llama-s11")
# decode_steps 4: multi-step runs go on past their first dispatch (outputs of 6-12 tokens), so loads land while
# dispatches are queued ahead, and the engine polls once a dispatch (loads land two at a time)
SMALL_POOL = dict(
    max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, page_size=4, num_pages=48, decode_steps=4
)
PAGE_BYTES = 2 * 3 * 2 * 16 * 4 * 4  # K and V, 3 layers, 2 KV heads of 16, 4 tokens, float32
TIER_GIB = 64 * PAGE_BYTES / (1 << 30)  # more than the pool's 48 pages, less than the conversations' ~100


def conversations(
    llm: LLM, params: list[SamplingParams], turns: int = 3, seed: int = 0, loras=None, shared: bool = False
) -> list[list[int]]:
    """Each turn of each conversation resends its whole history plus a new user message (in one batch per turn);
    returns every turn's output tokens. loras: each conversation's adapter; shared: all begin with one history."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(10, 500, size=40).tolist() for _ in params]
    if shared:
        histories = [list(histories[0]) for _ in params]
    outputs = []
    for _ in range(turns):
        outs = llm.generate(histories, params, use_tqdm=False, lora_request=loras)
        for i, o in enumerate(outs):
            outputs.append(o.outputs[0].token_ids)
            histories[i] = histories[i] + o.outputs[0].token_ids + rng.integers(10, 500, size=8).tolist()
    return outputs


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=12, ignore_eos=True),
]


@pytest.fixture(scope="module")
def recomputed():
    """The tokens without a tier (the same small pool: its evicted prefixes are recomputed)."""
    return conversations(LLM(MODEL, warmup=False, **SMALL_POOL), PARAMS)


def test_returning_turns_come_back_from_host_memory_with_the_same_tokens(recomputed):
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=True, **SMALL_POOL)  # nothing compiles while serving
    # (the tier commits the cache to its device: a run's later dispatches, fed its committed outputs, once compiled
    # a second program mid-serving, a 2.2-4.5 s stall on an H100)
    copies = (gather_chunks, scatter_chunks, decode_steps_fn)
    compiled = step_fn._cache_size(), *(f._cache_size() for f in copies)
    assert conversations(llm, PARAMS) == recomputed
    s, tier = llm.engine.stats(), llm.engine.scheduler.offload.tier
    assert s.kv_offload_hit_tokens > 100 and s.kv_offload_bytes_to_device > 0 and s.kv_offload_bytes_to_host > 0
    assert s.kv_offload_hit_tokens <= s.kv_offload_queried_tokens
    assert s.kv_offload_failed_loads == 0
    assert s.preemptions > 0  # the batch outgrew the pool: preempted sequences came back through the tier too
    assert (step_fn._cache_size(), *(f._cache_size() for f in copies)) == compiled
    # bounded: the tier's slots were all allocated up front, within the size asked for
    assert tier.page_bytes == PAGE_BYTES and s.kv_offload_pages_total == 64
    assert tier.capacity * tier.page_bytes <= TIER_GIB * (1 << 30) and tier.num_held <= tier.num_chunks
    assert s.kv_offload_pages_used <= s.kv_offload_pages_total
    assert tier.evictions > 0  # it filled, and made room by LRU
    scraped = ServerMetrics(llm.engine).render().decode()  # what /metrics serves
    assert f"capstan_kv_offload_hit_tokens_total {float(s.kv_offload_hit_tokens)}" in scraped
    assert f'capstan_kv_offload_bytes_total{{direction="to_device"}} {float(s.kv_offload_bytes_to_device)}' in scraped
    llm.engine.pool.check_all_free()
    assert not llm.engine.scheduler.loading and not llm.engine.scheduler.restored


@pytest.mark.parametrize("way", ["staged", "direct", "eager", "arrival", "same-step-direct"])
def test_the_other_load_ways_give_the_same_tokens(recomputed, monkeypatch, way):
    """CAPSTAN_KV_OFFLOAD_LOAD_WAY=staged: device_put to the device, then the scatter once the copy is ready; direct:
    one scatter that reads the chunk from host memory itself; eager: the device_put copies scattered at the next poll,
    landed or not (the device orders it after the copy); arrival: same-step's, with copies started as the sequence
    arrives and taken by its load; same-step-direct: direct's scatter before the step of the schedule that starts the
    load; instead of same-step's scatter of eager's copies before the step of the schedule that starts them, which
    admits the sequence. (On a GPU, staged, direct and eager give other tokens than recompute even at
    JAX_DEFAULT_MATMUL_PRECISION=highest, with or without the side stream, and the ways that admit in the schedule
    that starts the load give recompute's: a sequence admitted a step later shares other steps, and a GPU's sums
    round by the batch's shape. Direct, which copies nothing asynchronously, differs too, so it is not a race.)"""
    monkeypatch.setattr(host_offload, "LOAD_WAY", way)
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
    assert conversations(llm, PARAMS) == recomputed
    assert not llm.engine.scheduler.loading and not llm.engine.scheduler.writing
    offload = llm.engine.scheduler.offload
    assert not offload._prefetched and offload._prefetched_bytes == 0 and offload.tier.num_pinned == 0
    assert (offload.prefetched_chunks_used > 0) == (way == "arrival")
    s = llm.engine.stats()
    # (how many: as many as the copies to the host finished before their turns came back, a matter of timing here)
    assert s.kv_offload_hit_tokens > 0 and s.kv_offload_failed_loads == 0
    llm.engine.pool.check_all_free()


STAGING_MIB = 3 * 4 * PAGE_BYTES / (1 << 20)  # three staging buffers of a chunk (4 pages in this tier)


def assert_staging_all_given_back(offload: HostOffload) -> None:
    """Every staging buffer is free or read by a scatter that will run (none leaked), and each is its own memory."""
    held = [b for _, bufs in offload._staging_in_use for b in bufs]
    assert sorted(offload._free_staging + held) == list(range(len(offload._staging)))
    assert len({a.unsafe_buffer_pointer() for a in offload._staging}) == len(offload._staging)


@pytest.mark.parametrize("way", ["direct", "same-step-direct"])
def test_the_side_stream_is_refused_with_the_ways_that_read_host_memory_in_the_scatter(monkeypatch, way):
    """Their scatter copies the chunks itself: staging buffers would be device memory nothing reads."""
    monkeypatch.setenv(host_offload.SIDE_STREAM_SETTING, "1")
    monkeypatch.setattr(host_offload, "LOAD_WAY", way)
    with pytest.raises(ValueError, match=f"CAPSTAN_KV_OFFLOAD_SIDE_STREAM=1 works with .* not .*LOAD_WAY={way},"):
        LLM(MODEL, kv_offloading_size=TIER_GIB, **SMALL_POOL)


@pytest.mark.parametrize("way", ["same-step", "arrival", "eager", "staged"])
def test_copies_outside_the_queue_into_staging_buffers_give_the_same_tokens(recomputed, monkeypatch, way):
    """CAPSTAN_KV_OFFLOAD_SIDE_STREAM=1 (side_copy.py): loads copy into staging buffers taken at warm-up, outside
    XLA's queue (on a GPU a CUDA stream of our own; here a memmove into the CPU device's buffer), and a buffer is
    written again only after the scatter that read it has run: three buffers for the whole run, so they are reused
    many times and loads past them copy by device_put."""
    monkeypatch.setenv(host_offload.SIDE_STREAM_SETTING, "1")
    monkeypatch.setenv(host_offload.STAGING_SETTING, str(STAGING_MIB))
    monkeypatch.setattr(host_offload, "LOAD_WAY", way)
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, **SMALL_POOL)
    assert conversations(llm, PARAMS) == recomputed
    offload = llm.engine.scheduler.offload
    assert len(offload._staging) == 3 and offload.side_copied_chunks > 3
    s = llm.engine.stats()
    assert s.kv_offload_hit_tokens > 0 and s.kv_offload_failed_loads == 0
    assert offload.pages_to_device > offload.side_copied_chunks  # (chunks hold several pages; some by device_put)
    assert_staging_all_given_back(offload)
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize(
    "setting, name, default",
    [
        (host_offload.staging_mib_setting, "CAPSTAN_KV_OFFLOAD_STAGING_MIB", host_offload.STAGING_MIB),
        (host_offload.prefetch_mib_setting, "CAPSTAN_KV_OFFLOAD_PREFETCH_MIB", host_offload.PREFETCH_MIB),
    ],
)
def test_mib_settings_take_a_size_and_name_the_variable_otherwise(setting, name, default):
    assert setting(None) == default
    assert setting("0.5") == 0.5
    for bad in ("0", "-3", "lots", "nan", "1e300", "inf"):
        with pytest.raises(ValueError, match=name):
            setting(bad)


def test_fp8_pages_go_to_host_memory_and_back_as_stored():
    """--kv-cache-dtype fp8: the tier copies the pages' e4m3 bytes (a quarter of float32's), and returning turns
    give the tokens that recomputing their FP8 pages gives."""
    fp8 = dict(SMALL_POOL, kv_cache_dtype="fp8", warmup=False)
    recomputed = conversations(LLM(MODEL, **fp8), PARAMS)
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB / 4, **fp8)
    assert conversations(llm, PARAMS) == recomputed
    s, tier = llm.engine.stats(), llm.engine.scheduler.offload.tier
    assert tier.page_bytes == PAGE_BYTES // 4 and s.kv_offload_pages_total == 64
    assert s.kv_offload_hit_tokens > 100 and s.kv_offload_failed_loads == 0
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("way", ["eager", "same-step", "arrival"])
def test_restored_pages_hold_the_bytes_their_pages_were_evicted_with(recomputed, monkeypatch, way):
    """Every page copied back holds, bit for bit, the bytes the tier was given for its hash, and those are the bytes
    its device page held when it was named in the prefix cache (nothing wrote a named page, no gather read a page's
    next owner's bytes)."""
    monkeypatch.setattr(host_offload, "LOAD_WAY", way)
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
    engine = llm.engine
    offload, scheduler, pool = engine.scheduler.offload, engine.scheduler, engine.pool
    real_gather, real_scatter = host_offload.gather_chunks, host_offload.scatter_chunks
    axis = offload.page_axis
    named: dict[int, tuple[bytes, object]] = {}  # page -> (its hash, its bytes when named: a device array)
    unread: dict[int, bytes] = {}  # named while a dispatch queued after it held the cache: read when it returns
    in_tier: dict[bytes, np.ndarray] = {}  # hash -> the bytes the tier was given
    evicted: dict[int, bytes] = {}  # page -> hash, of the flush under way
    loading: dict[int, bytes] = {}  # page -> hash, of the loads the poll under way may write
    checked = {"evicted": 0, "restored": 0}

    def page_of(kv, page):
        return gather_pages(kv, np.array([page], np.int32), page_axis=axis)

    def read_unread():
        for page, h in unread.items():
            named[page] = (h, page_of(engine._kv, page))
        unread.clear()

    real_register, real_settle = pool.register, engine.multi_step.settle

    def register(page, h):
        new = h not in pool._page_of and page not in pool._hash_of
        real_register(page, h)
        if new and not loading:  # (a load's pages are recorded as they are scattered)
            ahead = engine.multi_step.ahead
            if ahead is not None and ahead.future is not None:  # engine._kv is donated to that dispatch
                unread[page] = h
            else:
                named[page] = (h, page_of(engine._kv, page))

    def settle(d=None):
        real_settle(d)
        read_unread()

    def flush(kv):
        evicted.clear()
        evicted.update(offload._evicted)
        real_flush(kv)

    def gather(kv, pages, page_axis):  # a flush's chunks: pages [chunks, chunk_pages]
        out = real_gather(kv, pages, page_axis=page_axis)
        for chunk, chunk_pages in zip(out, pages.tolist(), strict=True):
            for i, page in enumerate(chunk_pages):
                if evicted.get(page) is not None and named.get(page, (None,))[0] == evicted[page]:
                    np.testing.assert_array_equal(np.asarray(chunk[i]), np.asarray(named[page][1])[0])
                    checked["evicted"] += 1
        return out

    def commit(slots, on_host):
        tier = offload.tier
        for row, h in enumerate(tier._hashes[slots[0] // tier.chunk_pages]):
            in_tier[h] = np.asarray(on_host)[row]
        return real_commit(slots, on_host)

    def poll(read_kv):
        loading.update(
            (page, h)
            for seq, (hashes, _) in scheduler.loading.items()
            for page, h in zip(seq.pages[len(seq.pages) - len(hashes) :], hashes, strict=True)
        )
        loading.update(  # admitted already: the pages after its device hit (its prompt's pages follow them)
            (page, h)
            for seq, hashes in scheduler.writing.items()
            for page, h in zip(seq.pages[len(seq.page_hashes) :], hashes, strict=False)
        )
        try:
            return real_poll(read_kv)
        finally:
            loading.clear()

    def scatter(kv, pages, chunks, rows, page_axis, from_host):  # either load way's (LOAD_WAY)
        out, marker = real_scatter(kv, pages, chunks, rows, page_axis=page_axis, from_host=from_host)
        for page in pages.reshape(-1).tolist():
            if page in loading:
                named[page] = (loading[page], page_of(out, page))
                np.testing.assert_array_equal(np.asarray(named[page][1])[0], in_tier[loading[page]])
                checked["restored"] += 1
        return out, marker

    real_flush, real_commit, real_poll = offload.flush, offload.tier.commit, scheduler.poll_host_tier
    monkeypatch.setattr(pool, "register", register)
    monkeypatch.setattr(engine.multi_step, "settle", settle)
    monkeypatch.setattr(offload, "flush", flush)
    monkeypatch.setattr(offload.tier, "commit", commit)
    monkeypatch.setattr(scheduler, "poll_host_tier", poll)
    monkeypatch.setattr(host_offload, "gather_chunks", gather)
    monkeypatch.setattr(host_offload, "scatter_chunks", scatter)
    assert conversations(llm, PARAMS) == recomputed
    assert checked["evicted"] > 50 and checked["restored"] > 20, checked


def test_the_batch_takes_single_steps_while_a_load_waits_to_be_written(recomputed, monkeypatch):
    """A load is written at the next step's poll: no multi-step run starts while one is pending (a run of
    decode_steps would hold the returning turn for all its steps), yet runs go on between loads."""
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
    engine = llm.engine
    real_plan, plans = engine.multi_step.plan, {"while_loading": 0, "runs": 0}

    def plan(chunks):
        active = real_plan(chunks)
        if engine.scheduler.loading:
            plans["while_loading"] += 1
            assert active is None, "a multi-step run started while a load waited"
        plans["runs"] += active is not None
        return active

    monkeypatch.setattr(engine.multi_step, "plan", plan)
    assert conversations(llm, PARAMS) == recomputed
    assert plans["while_loading"] > 0 and plans["runs"] > 0, plans


def test_pages_come_back_only_to_the_adapter_that_computed_them(tmp_path):
    """Multi-LoRA: conversations that begin with the same history under two adapters and the base model evict and
    restore pages of the same tokens; each gets its own adapter's K/V back (the adapter is in the page's key), so every
    turn is what recompute gives."""
    from lora_adapters import write_adapter

    from capstan import LoRARequest

    base = GOLDEN / "llama-s11"
    a = [LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp_path / f"a{i}", base, seed=20 + i, rank=4))) for i in (0, 1)]
    loras = [a[0], a[1], None, a[0]]
    opts = dict(SMALL_POOL, enable_lora=True, max_loras=2, max_lora_rank=8, warmup=False)
    # the reference caches nothing, so a page shared across adapters (in either tier) would change a turn
    recomputed = conversations(
        LLM(MODEL, enable_prefix_caching=False, **opts), PARAMS, turns=5, loras=loras, shared=True
    )
    assert len({tuple(recomputed[i]) for i in (0, 1, 2)}) == 3  # three different functions of the same history
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, **opts)
    assert conversations(llm, PARAMS, turns=5, loras=loras, shared=True) == recomputed
    s = llm.engine.stats()
    assert s.kv_offload_hit_tokens > 100 and s.kv_offload_failed_loads == 0
    llm.engine.pool.check_all_free()


SPLIT_RUN = """
import json
import os
from test_host_tier import MODEL, PARAMS, SMALL_POOL, TIER_GIB, conversations
from capstan.runtime.engine.llm import LLM
recomputed = conversations(LLM(MODEL, tensor_parallel_size=2, warmup=False, **SMALL_POOL), PARAMS)
llm = LLM(MODEL, tensor_parallel_size=2, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
got = conversations(llm, PARAMS)
offload = llm.engine.scheduler.offload
chunk = next(d for d in offload.tier._data if d is not None)
os.environ["CAPSTAN_KV_OFFLOAD_SIDE_STREAM"] = "1"  # copies outside the queue: each device its own shards
side = LLM(MODEL, tensor_parallel_size=2, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
print(json.dumps(dict(
    same=got == recomputed,
    side_same=conversations(side, PARAMS) == recomputed,
    side_copied=side.engine.scheduler.offload.side_copied_chunks,
    hits=llm.engine.stats().kv_offload_hit_tokens,
    shape=list(chunk.shape),
    shard_shapes=[list(sh.data.shape) for sh in chunk.addressable_shards],
)))
"""


def test_split_over_two_devices_each_device_keeps_its_own_heads_in_host_memory():
    """Tensor parallelism (two CPU devices, in a process of its own): llama-s11's two KV heads one per device; the
    tier's chunks keep that split in host memory (each device's shard holds its own head), and every turn is what
    recompute on the same split gives, with the copies outside the queue too (each device copies its own shards)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SPLIT_RUN],
        env=env,
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["same"] and got["hits"] > 100, got
    assert got["side_same"] and got["side_copied"] > 0, got
    heads = [
        i for i, (whole, part) in enumerate(zip(got["shape"], got["shard_shapes"][0], strict=True)) if whole != part
    ]
    assert len(got["shard_shapes"]) == 2 and len(heads) == 1, got  # split along one axis: the KV heads
    assert got["shape"][heads[0]] == 2 and got["shard_shapes"][0][heads[0]] == 1, got


def test_late_copies_fall_back_to_recompute(recomputed, monkeypatch):
    monkeypatch.setattr(host_offload, "LOAD_WAY", "eager")  # (same-step writes a load in the step it starts)
    monkeypatch.setattr(host_offload, "LOAD_DEADLINE_S", -1.0)  # every copy back is late
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
    assert conversations(llm, PARAMS) == recomputed
    s = llm.engine.stats()
    assert s.kv_offload_failed_loads > 0 and s.kv_offload_hit_tokens == 0
    llm.engine.pool.check_all_free()


def test_copies_that_fail_to_start_are_recomputed_in_the_same_step(recomputed):
    """same-step: a load whose device_put raises is cancelled in the schedule that started it (its pages go back
    unwritten and unnamed) and the sequence is admitted to recompute them: the same tokens, nothing leaked."""
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
    offload = llm.engine.scheduler.offload
    assert offload.at_once
    offload._on_device = "not a sharding"  # every copy to the device fails to start
    assert conversations(llm, PARAMS) == recomputed
    s = llm.engine.stats()
    assert s.kv_offload_hit_tokens == 0 and offload.tier.num_pinned == 0 and not llm.engine.scheduler.writing
    assert s.kv_offload_failed_loads > 0  # loads were tried
    llm.engine.pool.check_all_free()


@pytest.mark.parametrize("way", ["same-step", "arrival", "same-step+side", "arrival+side"])
def test_aborts_while_pages_are_copied_back_leak_nothing(monkeypatch, way):
    way, _, side = way.partition("+")
    if side:  # a few staging buffers: loads take them, give them back, and copy by device_put when none is free
        monkeypatch.setenv(host_offload.SIDE_STREAM_SETTING, "1")
        monkeypatch.setenv(host_offload.STAGING_SETTING, str(STAGING_MIB))
    monkeypatch.setattr(host_offload, "LOAD_WAY", way)  # arrival: waiting sequences hold copies started for them
    llm = LLM(MODEL, kv_offloading_size=8 * TIER_GIB, warmup=False, **SMALL_POOL)  # room for every prompt's pages
    engine, rng = llm.engine, np.random.default_rng(5)
    prompts = [rng.integers(10, 500, size=int(rng.integers(20, 120))).tolist() for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts, greedy, use_tqdm=False)  # the pool (48 pages) keeps few of them: the tier has the rest
    aborted = 0
    for round_ in range(3):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{round_}-{i}", p, greedy)
        steps = 0
        while engine.has_unfinished() and steps < 2000:
            engine.step()
            for seq in [*engine.scheduler.loading, *engine.scheduler.waiting]:  # its copy may be in flight: abort it
                if rng.random() < 0.3:
                    engine.abort(seq.request_id)
                    aborted += 1
            steps += 1
        assert not engine.has_unfinished()
    assert aborted > 0
    offload = engine.scheduler.offload
    deadline = time.monotonic() + 30
    while offload.busy and time.monotonic() < deadline:  # copies still in flight (on their threads) land
        engine.step()
        time.sleep(0.005)
    assert not offload.busy and not engine.scheduler.loading
    assert offload.tier.num_pinned == 0  # every load's slots were given back, the aborted ones' too
    assert not offload._prefetched and offload._prefetched_bytes == 0
    assert offload.tier.num_used == len(offload.tier._slot_of)  # no slot stays reserved
    assert (offload.side_copied_chunks > 0) == bool(side)
    assert_staging_all_given_back(offload)
    engine.pool.check_all_free()


def test_loads_that_land_before_the_engine_polls_each_write_their_own_pages():
    """Two loads land before the engine polls (it was busy, e.g. in a multi-step decode dispatch): each device page
    gets its own slot's bytes, and every slot is unpinned after."""
    import jax

    kv = KVCache.allocate(num_layers=2, num_pages=8, page_size=4, kv_heads=2, head_dim=16, dtype=np.float32)
    offload = HostOffload(kv, 4 * KVCache.bytes_per_page(2, 4, 2, 16, np.float32) / (1 << 30))
    assert offload.chunk_pages == 1  # a tier of 4 pages
    pages = np.stack([np.full(offload.page_shape, i + 1.0, np.float32) for i in range(2)])
    slots = []
    for i in range(2):
        [slot] = offload.tier.reserve([page_hash(None, [i])])
        offload.tier.commit([slot], jax.device_put(pages[i : i + 1], offload._on_host))
        slots.append(slot)
    for key, slot in enumerate(slots):
        offload.start_load(key, [3 + key], [slot])
    jax.block_until_ready([load.staged for load in offload._to_device.values()])
    assert offload.landed
    kv, ended = offload.poll(lambda: kv)
    assert ended == [(0, True), (1, True)] and kv is not None
    restored = np.asarray(gather_pages(kv, np.array([3, 4], np.int32), page_axis=offload.page_axis))
    np.testing.assert_array_equal(restored, pages)  # each device page holds its own slot's bytes
    assert offload.tier.num_pinned == 0 and not offload.busy


def test_a_poll_writes_its_loads_in_a_few_calls_of_a_power_of_two_of_chunks(monkeypatch):
    """Eleven loads land before a poll: it writes them in one scatter call of 16 chunks (padded with chunks whose
    pages are past the pool: each power of two is compiled at warm-up), not one call per chunk, every device page
    gets its own slot's bytes and no other page is written."""
    import jax

    kv = KVCache.allocate(num_layers=2, num_pages=16, page_size=4, kv_heads=2, head_dim=16, dtype=np.float32)
    kv = jax.device_put(kv, jax.devices()[0])  # committed, as the engine's cache is
    page_bytes = KVCache.bytes_per_page(2, 4, 2, 16, np.float32)
    offload = HostOffload(kv, 16 * page_bytes / (1 << 30))
    assert offload.chunk_pages == 1 and offload.max_call_chunks == host_offload.MAX_CALL_CHUNKS
    kv = offload.warmup(kv)
    pages = np.stack([np.full(offload.page_shape, i + 1.0, np.float32) for i in range(11)])
    for i in range(11):
        [slot] = offload.tier.reserve([page_hash(None, [i])])
        offload.tier.commit([slot], jax.device_put(pages[i : i + 1], offload._on_host))
        offload.start_load(i, [i + 2], [slot])
    calls, real = [], host_offload.scatter_chunks

    def scatter(kv, pages, chunks, rows, page_axis, from_host):
        calls.append(len(chunks))
        return real(kv, pages, chunks, rows, page_axis=page_axis, from_host=from_host)

    monkeypatch.setattr(host_offload, "scatter_chunks", scatter)
    compiled = real._cache_size()
    kv, ended = offload.poll(lambda: kv)
    assert calls == [16] and len(ended) == 11 and real._cache_size() == compiled  # all compiled at warm-up
    everything = np.asarray(gather_pages(kv, np.arange(16, dtype=np.int32), page_axis=offload.page_axis))
    np.testing.assert_array_equal(everything[2:13], pages)
    assert not everything[:2].any() and not everything[13:].any()
    # a call's chunk bytes stay within MAX_CALL_BYTES: fewer chunks a call, still a power of two
    monkeypatch.setattr(host_offload, "MAX_CALL_BYTES", 5 * page_bytes)
    assert HostOffload(kv, 16 * page_bytes / (1 << 30)).max_call_chunks == 4


def test_the_tier_keeps_its_size_and_evicts_least_recently_used_chunks():
    tier = HostTier(page_bytes=24, capacity_pages=6, chunk_pages=2)  # 3 chunks of 2 pages
    h = [page_hash(None, [i]) for i in range(6)]
    a = tier.reserve(h[0:2])
    assert a is not None and tier.match(h[:1]) == []  # in flight: not findable yet
    tier.commit(a, "A")
    b, c = tier.reserve(h[2:4]), tier.reserve([h[4]])
    assert b is not None and c is not None
    tier.commit(b, "B")
    tier.commit(c, "C")
    assert tier.match(h[:4]) == a + b and tier.holds(h[4])  # A and B are now more recent than C
    assert tier.match([h[0]]) == [a[0]]  # A the most recent, C the least
    d = tier.reserve([h[5]])
    assert d == c and not tier.holds(h[4]) and tier.evictions == 1  # C's chunk, page and bytes, went
    tier.abandon(d)  # a failed copy gives its chunk back
    assert not tier.holds(h[5]) and tier.num_used == 4 and tier.num_held == 2
    assert tier.read([a[1]]) == [(a[1] // 2, "A", 1)]
    assert tier.match([h[4], h[0]]) == []  # a run stops at its first miss
    tier.commit(tier.reserve(h[4:6]), "E")  # the free chunk; then every chunk is full:
    assert tier.reserve([h[0]]) is not None and not tier.holds(h[2])  # B, least recent, goes with both its pages
    assert tier.evictions == 3 and tier.num_held == 2


def test_a_chunk_being_copied_back_is_not_evicted_until_the_load_is_done():
    tier = HostTier(page_bytes=8, capacity_pages=2)
    h = [page_hash(None, [i]) for i in range(4)]
    a, b = tier.reserve([h[0]]), tier.reserve([h[1]])
    assert a is not None and b is not None
    tier.commit(a, "A")
    tier.commit(b, "B")
    tier.pin(a)  # the least recently used, but a load reads it
    c = tier.reserve([h[2]])
    assert c == b and tier.holds(h[0]) and not tier.holds(h[1])
    assert tier.reserve([h[3]]) is None  # every other chunk in flight or pinned: the page is not kept
    assert tier.read(a) == [(0, "A", 0)]
    tier.unpin(a)
    tier.abandon(c)
    assert tier.reserve([h[3]]) == c  # (the free chunk first; the unpinned one is evictable again)


def test_evicting_a_chunk_keeps_a_page_a_later_copy_holds():
    tier = HostTier(page_bytes=8, capacity_pages=2)
    h = [page_hash(None, [i]) for i in range(3)]
    a = tier.reserve([h[0]])
    assert a is not None
    tier.commit(a, "A")
    b = tier.reserve([h[0]])  # the same page copied again (a caller that did not ask `holds`)
    assert b is not None
    tier.commit(b, "B")
    assert tier.match([h[0]]) == b
    tier.reserve([h[1]])  # evicts A, the least recently used chunk
    assert tier.match([h[0]]) == b and tier.read(b) == [(b[0], "B", 0)]


@pytest.mark.parametrize(
    "size, message",
    [
        ("-1", "kv_offloading_size must be between 0"),
        ("nan", "kv_offloading_size must be between 0"),
        ("1e9", "kv_offloading_size must be between 0"),
    ],
)
def test_a_bad_size_is_refused_naming_the_flag(size, message, capsys):
    assert main(["generate", MODEL, "--prompt", "hi", "--kv-offloading-size", size]) == 2
    assert message in capsys.readouterr().err


def test_a_tier_too_small_for_one_page_is_refused():
    with pytest.raises(ValueError, match="kv_offloading_size: 1e-09 GiB holds no K/V page"):
        LLM(MODEL, kv_offloading_size=1e-9, warmup=False, **SMALL_POOL)
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(MODEL, kv_offloading_size=TIER_GIB, enable_prefix_caching=False, warmup=False, **SMALL_POOL)


def test_the_pinned_pool_is_taken_at_warm_up_and_a_refusal_names_the_flag(monkeypatch):
    """Warm-up takes the tier's pinned memory once (on GPUs; called directly here); a runtime that refuses it fails
    the start with the flag named, not a stack trace mid-serving."""
    import jax

    kv = KVCache.allocate(num_layers=2, num_pages=8, page_size=4, kv_heads=2, head_dim=16, dtype=np.float32)
    offload = HostOffload(kv, 4 * KVCache.bytes_per_page(2, 4, 2, 16, np.float32) / (1 << 30))
    chunk = gather_pages(kv, np.zeros(offload.chunk_pages, np.int32), page_axis=offload.page_axis)
    offload._grow_pinned_pool(chunk)
    assert offload.timings["warmup_pinned_pool"] > 0

    def refuse(*_a, **_k):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")

    monkeypatch.setattr(jax, "device_put", refuse)
    with pytest.raises(ValueError, match=r"kv_offloading_size: 0\.0 GiB of pinned host memory could not be allocated"):
        offload._grow_pinned_pool(chunk)


def test_a_load_with_headroom_leaves_the_running_their_pages_and_the_same_tokens(recomputed, monkeypatch):
    """CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM=1: a load takes pages only while one stays free per running sequence
    (their next decode pages), and the tokens are recompute's."""
    monkeypatch.setenv("CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM", "1")
    llm = LLM(MODEL, kv_offloading_size=TIER_GIB, warmup=False, **SMALL_POOL)
    engine = llm.engine
    offload, scheduler = engine.scheduler.offload, engine.scheduler
    real_start, left = offload.start_load, []

    def start_load(key, pages, slots):  # (called right after the load's pages were allocated)
        left.append(engine.pool.num_free - len(scheduler.running))
        return real_start(key, pages, slots)

    monkeypatch.setattr(offload, "start_load", start_load)
    assert conversations(llm, PARAMS) == recomputed
    assert left and min(left) >= 0 and engine.stats().kv_offload_hit_tokens > 0
    engine.pool.check_all_free()


def test_restore_headroom_setting_takes_pages_and_names_the_variable_otherwise():
    from capstan.runtime.kv.host_offload import restore_headroom_setting

    assert restore_headroom_setting(None) == restore_headroom_setting("") == 0
    assert restore_headroom_setting("2") == 2
    for bad in ("-1", "1.5", "lots", "1025", str(2**63), "\u00b2", " 1"):
        with pytest.raises(ValueError, match="CAPSTAN_KV_OFFLOAD_RESTORE_HEADROOM"):
            restore_headroom_setting(bad)


def test_chunk_pages_setting_takes_a_page_count_and_names_the_variable_otherwise():
    from capstan.runtime.kv.host_offload import chunk_pages_setting

    assert chunk_pages_setting(None) == chunk_pages_setting("") == 16
    assert chunk_pages_setting("64") == 64
    for bad in ("0", "-4", "8.5", "lots", "4097", str(2**63), "\u00b2", " 16"):
        with pytest.raises(ValueError, match="CAPSTAN_KV_OFFLOAD_CHUNK_PAGES"):
            chunk_pages_setting(bad)
