"""LoRA adapters in the engine (docs/lora.md): an adapter gives what its merged checkpoint gives (W + scale * B @ A,
merged by tests/lora_adapters.py from PEFT's format alone), in mixed batches, through slot swapping and host-memory
eviction, with the prefix cache keyed by adapter; bad adapters are refused naming the field."""

import json
from pathlib import Path

import numpy as np
import pytest
from golden import GOLDEN, greedy_agreement_length, log_softmax, reference, reference_logits
from lora_adapters import ALL_MODULES, merge_adapter, write_adapter

from capstan import LLM, LoRARequest, SamplingParams
from capstan.runtime.lora.peft import read_adapter
from capstan.runtime.lora.request import LoRAError
from capstan.runtime.models.config import ModelConfig

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=4, dtype="float32", warmup=False)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def outputs(results):
    return [
        (
            r.outputs[0].token_ids,
            [lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids, strict=True)],
        )
        for r in results
    ]


def assert_same(got, expected, what: str, tolerance: float = 1e-4):
    for i, ((tokens, lps), (want_tokens, want_lps)) in enumerate(zip(got, expected, strict=True)):
        assert tokens == want_tokens, f"{what}: prompt {i}"
        assert np.max(np.abs(np.array(lps) - np.array(want_lps))) < tolerance, f"{what}: prompt {i}"


@pytest.mark.parametrize("case", ["llama-s11", "qwen2-s12", "qwen3-s13", "gemma3-s14"])
def test_an_adapter_gives_its_merged_checkpoint_and_base_rows_stay_the_golden_ones(case, tmp_path):
    """Two adapters (all seven projections at rank 8; an rsLoRA one on q and v at rank 4) and base rows in one batch:
    each adapter's rows equal the merged checkpoint's greedy tokens and logprobs, the base rows transformers'."""
    base, ref = GOLDEN / case, reference(case)
    prompts = ref["prompts"]
    full = write_adapter(tmp_path / "full", base, seed=1)
    rs = write_adapter(tmp_path / "rs", base, seed=2, rank=4, alpha=4.0, targets=("q_proj", "v_proj"), rslora=True)
    expected = {}
    for name, adapter in (("full", full), ("rs", rs)):
        merged = LLM(str(merge_adapter(base, adapter, tmp_path / f"merged-{name}")), **ENGINE)
        expected[name] = outputs(merged.generate(prompts, GREEDY, use_tqdm=False))
        del merged
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    requests = {"full": LoRARequest("full", 1, str(full)), "rs": LoRARequest("rs", 2, str(rs))}
    n = len(prompts)
    mixed = llm.generate(
        prompts * 3, GREEDY, use_tqdm=False, lora_request=[requests["full"]] * n + [requests["rs"]] * n + [None] * n
    )
    got = outputs(mixed)
    assert_same(got[:n], expected["full"], f"{case} full adapter vs merged")
    assert_same(got[n : 2 * n], expected["rs"], f"{case} rsLoRA adapter vs merged")
    assert got[:n] != got[2 * n :], "the adapter changed nothing: the test would prove nothing"
    for i, (tokens, lps) in enumerate(got[2 * n :]):  # base rows of the same batch: transformers' reference
        owed = min(greedy_agreement_length(ref, i), len(tokens))
        assert tokens[:owed] == ref["greedy_continuations"][i][:owed], f"{case} base prompt {i}"
        logp = log_softmax(reference_logits(case, i))
        for k in range(owed):
            assert abs(lps[k] - logp[len(prompts[i]) - 1 + k, tokens[k]]) < 1e-4, f"{case} base prompt {i} step {k}"
    llm.engine.pool.check_all_free()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = GOLDEN / "llama-s11"
    folder = tmp_path_factory.mktemp("adapters")
    targets = [
        ("q_proj", "v_proj"),
        ALL_MODULES,
        ("gate_proj", "up_proj", "down_proj"),
        ("o_proj",),
        ("k_proj", "down_proj"),
        ("q_proj", "up_proj"),
    ]
    return [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(write_adapter(folder / f"a{i}", base, seed=10 + i, rank=4 + 2 * (i % 3), targets=t, rslora=i == 3)),
        )
        for i, t in enumerate(targets)
    ]


PROMPTS = [[5, 17, 99, 3, 250, 41, 8, 19, 77, 301, 12], [400, 2, 33], [9] * 23, [120, 121, 122, 123, 124, 125, 126]]
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, logprobs=0, seed=7)


def alone(llm, adapters, params):
    """Each (prompt, adapter) run by itself, one generate call at a time."""
    return {
        (i, a.lora_name if a else None): outputs(llm.generate([p], params, use_tqdm=False, lora_request=a))[0]
        for a in [None, *adapters]
        for i, p in enumerate(PROMPTS)
    }


def test_a_mixed_batch_of_four_adapters_and_base_rows_equals_each_run_alone(adapters):
    llm = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=4, max_lora_rank=8, **ENGINE)
    four = adapters[:4]
    for params in (GREEDY, SAMPLED):
        single = alone(llm, four, params)
        pairs = [(i, a) for a in [None, *four] for i in range(len(PROMPTS))]
        batch = outputs(
            llm.generate([PROMPTS[i] for i, _ in pairs], params, use_tqdm=False, lora_request=[a for _, a in pairs])
        )
        expected = [single[(i, a.lora_name if a else None)] for i, a in pairs]
        assert_same(batch, expected, f"mixed batch, temperature {params.temperature}")
    assert len({tuple(single[(0, a.lora_name)][0]) for a in four}) == 4  # four different functions
    llm.engine.pool.check_all_free()


def test_speculative_decoding_with_adapters_keeps_the_outputs(adapters):
    """Proposals verified for rows of two adapters and the base (each step's model with or without the slots,
    LLMEngine.model_for): the outputs of decoding without speculation."""
    from capstan.runtime.speculative_config import SpeculativeConfig

    pairs = [(i, a) for a in (None, *adapters[:2]) for i in range(len(PROMPTS))]
    prompts, loras = [PROMPTS[i] for i, _ in pairs], [a for _, a in pairs]
    plain = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    expected = outputs(plain.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    del plain
    spec = LLM(
        str(GOLDEN / "llama-s11"),
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        speculative_config=SpeculativeConfig(num_speculative_tokens=3),
        **ENGINE,
    )
    # proposals from the plain outputs (prompts repeat across adapters, so some are another adapter's: rejected)
    futures = [list(p) + tokens for p, (tokens, _) in zip(prompts, expected, strict=True)]

    def propose(tokens, k):
        future = next((f for f in futures if f[: len(tokens)] == tokens and len(f) > len(tokens)), None)
        return [] if future is None else future[len(tokens) : len(tokens) + k]

    spec.engine.speculator.proposer = propose
    got = outputs(spec.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert_same(got, expected, "speculative vs plain")
    assert spec.engine.stats().spec_draft_tokens > 0
    only_base = outputs(spec.generate(PROMPTS, GREEDY, use_tqdm=False))  # a batch without adapters: the base program
    assert_same(only_base, expected[: len(PROMPTS)], "a base-only batch on the LoRA engine")


def _same_as_the_dense_way(adapters, monkeypatch, patch, label: str, max_loras: int, max_num_seqs: int = 8) -> None:
    """Base rows and three adapters in one batch, generated the dense way, then again after patch() (which switches
    the way the deltas are computed; monkeypatch undoes it): the same outputs."""
    import jax

    from capstan.runtime.models import lora

    monkeypatch.setattr(lora, "GATHER_MAX_TOKENS", 0)  # every step the dense way (decode steps gather by default)
    jax.clear_caches()
    pairs = [(i, a) for a in (None, *adapters[:3]) for i in range(len(PROMPTS))]
    prompts, loras = [PROMPTS[i] for i, _ in pairs], [a for _, a in pairs]
    engine = {**ENGINE, "max_num_seqs": max_num_seqs}
    llm = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=max_loras, max_lora_rank=8, **engine)
    dense = outputs(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    patch()
    jax.clear_caches()  # the steps traced the dense way must be traced again
    try:
        other = outputs(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    finally:
        jax.clear_caches()
    assert_same(other, dense, label)


def test_gathering_each_tokens_slot_equals_every_slots_rank_space(adapters, monkeypatch):
    """CAPSTAN_LORA_GATHER_MAX_TOKENS: steps that gather each token's own A and B give what the dense way gives."""
    from capstan.runtime.models import lora

    _same_as_the_dense_way(
        adapters,
        monkeypatch,
        lambda: monkeypatch.setattr(lora, "GATHER_MAX_TOKENS", 1 << 20),
        "gathered vs dense",
        max_loras=3,
    )


def test_gathered_steps_contracted_by_einsum_equal_every_slots_rank_space(adapters, monkeypatch):
    """CAPSTAN_LORA_GATHER_WAY=einsum: the gathered weights contracted by XLA's matmuls instead of products summed."""
    from capstan.runtime.models import lora

    def gathered_by_einsum():
        monkeypatch.setattr(lora, "GATHER_MAX_TOKENS", 1 << 20)
        monkeypatch.setattr(lora, "GATHER_WAY", "einsum")

    _same_as_the_dense_way(adapters, monkeypatch, gathered_by_einsum, "gathered by einsum vs dense", max_loras=4)


def test_shrinks_folded_into_the_base_matmul_equal_every_slots_rank_space(adapters, monkeypatch):
    """CAPSTAN_LORA_FOLD: every slot's A read by the base weight's own matmul, the token's slot picked after it."""
    from capstan.runtime.models import lora

    def folded():
        monkeypatch.setattr(lora, "GATHER_MAX_TOKENS", 1 << 20)
        monkeypatch.setattr(lora, "FOLD", frozenset(lora.SPECS))

    _same_as_the_dense_way(adapters, monkeypatch, folded, "shrinks folded vs dense", max_loras=4)
    # one sequence at a time: decode steps of one token (every slot's A read, the token's picked)
    _same_as_the_dense_way(
        adapters, monkeypatch, folded, "one token's slot folded vs dense", max_loras=4, max_num_seqs=1
    )


def test_q_k_v_delta_inside_the_fused_decode_kernel_equals_every_slots_rank_space(adapters, monkeypatch):
    """CAPSTAN_LORA_QKV_IN_KERNEL=1: decode steps through the fused decode kernel (interpreted here) add the q/k/v
    delta inside it; base rows and three adapters give what the dense way gives with the delta added apart."""
    from capstan.runtime import attention
    from capstan.runtime.models import lora

    monkeypatch.setattr(attention, "KERNELS_INTERPRETED_ON_CPU", True)

    def in_kernel():
        monkeypatch.setattr(lora, "GATHER_MAX_TOKENS", 1 << 20)
        monkeypatch.setattr(lora, "QKV_IN_KERNEL", True)

    _same_as_the_dense_way(adapters, monkeypatch, in_kernel, "q/k/v delta in the kernel vs dense", max_loras=4)


def test_projections_stored_with_the_slots_a_rows_give_the_unfolded_outputs(adapters, monkeypatch):
    """CAPSTAN_LORA_FOLD_STORED=1: each projection's weight holds every slot's A rows after its own, so one matmul
    gives the base output and the rank spaces. Two slots for six adapters (slots rewritten in place as they swap) and
    base rows give what the unfolded engine gives, in decode steps (each token's slot) and prefill (every slot's)."""
    from capstan.runtime.models import lora

    pairs = [(i, a) for a in (*adapters, None) for i in range(len(PROMPTS))]
    prompts, loras = [PROMPTS[i] for i, _ in pairs], [a for _, a in pairs]
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setattr(lora, "FOLD_STORED", setting)
        llm = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
        assert lora.is_folded(llm.engine.model) == (setting == "1")
        runs[setting] = outputs(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
        del llm
    assert_same(runs["1"], runs["0"], "stored folded vs unfolded")


def test_products_summed_equal_einsum_for_every_spec_the_layers_use():
    """_products is einsum's contraction written as a broadcast product and a sum: same values for the specs
    LayerAdapters gathers with (shrink and expand of q/k/v, o, gate/up and down), axes in einsum's order."""
    import jax.numpy as jnp
    import numpy as np

    from capstan.runtime.models.lora import _gathered, _products

    rng = np.random.default_rng(0)
    sizes = dict(t=3, l=4, e=8, p=3, r=2, k=2, q=3, d=4, g=2, i=6)
    for spec in (
        "te,lpre->tlpr",
        "tlpr,lprkqd->tkqd",
        "tkgd,lrkgd->tlr",
        "tlr,lre->te",
        "tlpr,lpri->tpi",
        "ti,lri->tlr",
    ):
        for s in (spec, _gathered(spec, 1)):
            ins = s.split("->")[0].split(",")
            p, q = (jnp.asarray(rng.normal(size=[sizes[c] for c in sub]), jnp.float32) for sub in ins)
            np.testing.assert_allclose(_products(s, p, q), jnp.einsum(s, p, q), rtol=1e-5, atol=1e-5, err_msg=s)


def test_two_slots_for_six_adapters_swap_without_changing_any_output(adapters):
    """--max-loras 2 and --max-cpu-loras 2 with six adapters: adapters wait for slots, are swapped in and out, and are
    read again from their files after leaving host memory; every output equals the one from six slots."""
    roomy = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=6, max_lora_rank=8, **ENGINE)
    pairs = [(i, a) for a in adapters for i in range(len(PROMPTS))] + [(i, None) for i in range(len(PROMPTS))]
    prompts, loras = [PROMPTS[i] for i, _ in pairs], [a for _, a in pairs]
    expected = outputs(roomy.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    del roomy
    tight = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8, **ENGINE)
    for a in adapters:  # registered first, so most have left host memory when their turn comes
        tight.engine.add_lora(a)
    got = outputs(tight.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    assert_same(got, expected, "two slots vs six")
    assert tight.engine.loras.slot_loads >= 6
    tight.engine.pool.check_all_free()
    assert not tight.engine.loras._refs.count(1)  # every slot released


def test_the_prefix_cache_never_shares_pages_across_adapters(adapters):
    llm = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    prompt = list(range(30, 70))  # ten full pages of 4
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    under_a0 = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[0])[0]
    under_a1 = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=adapters[1])[0]
    assert under_a0.num_cached_tokens == 0 and under_a1.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    assert_same(outputs([again]), outputs([under_a0]), "a cached prefix under the same adapter")
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    assert outputs([first]) != outputs([under_a0])


def test_unloading_or_replacing_an_adapter_lets_admitted_requests_finish_with_it(adapters):
    from capstan.runtime.engine.errors import ModelNotFoundError

    llm = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=2, max_lora_rank=8, **ENGINE)
    a0, a1 = adapters[0], adapters[1]
    alone = {
        a.lora_name: outputs(llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False, lora_request=a))[0] for a in (a0, a1)
    }
    engine = llm.engine
    from capstan.runtime.engine.llm import merge

    results: dict = {}
    engine.add_request("r0", PROMPTS[0], GREEDY, lora_request=a0)
    for delta in engine.step():  # admitted: its slot is held
        results[delta.request_id] = merge(results.get(delta.request_id), delta)
    engine.remove_lora(a0.lora_name)
    with pytest.raises(ModelNotFoundError):  # new requests can no longer name it
        engine.enqueue(engine.prepare("r1", PROMPTS[0], GREEDY, a0.lora_name))
    # the same name now another adapter's files: new requests get the new one, the admitted one keeps its own
    engine.add_lora(LoRARequest(a0.lora_name, 99, a1.lora_path))
    engine.add_request("r2", PROMPTS[0], GREEDY, lora_request=None)
    engine.enqueue(engine.prepare("r3", PROMPTS[0], GREEDY, a0.lora_name))
    while engine.has_unfinished():
        for delta in engine.step():
            results[delta.request_id] = merge(results.get(delta.request_id), delta)
    assert_same(outputs([results["r0"]]), [alone[a0.lora_name]], "admitted before the unload")
    assert_same(outputs([results["r3"]]), [alone[a1.lora_name]], "the name's new adapter")
    engine.pool.check_all_free()
    assert engine.loras.slots_used == 0


def registered_past_the_checks(llm, name: str, like: LoRARequest, value: float) -> LoRARequest:
    """An adapter with `like`'s files but every A and B weight `value` (NaN, Inf, or finite and huge), registered with
    those weights as they are: the loader's own checks (peft.py) never see them."""
    from capstan.runtime.models.lora import slot_weights

    manager = llm.engine.lora_manager()
    modules = read_adapter(Path(like.lora_path), manager.cfg, manager.max_lora_rank)
    bad = {k: (np.full_like(a, value), np.full_like(b, value)) for k, (a, b) in modules.items()}
    request = LoRARequest(name, like.lora_int_id + 100, like.lora_path)
    llm.engine.add_lora(request, slot_weights(manager.layout, manager.max_lora_rank, bad, manager.dtype))
    return request


@pytest.mark.parametrize(
    "value, fold_stored", [(float("nan"), "0"), (float("inf"), "0"), (3e38, "0"), (float("nan"), "1"), (3e38, "1")]
)
def test_an_adapter_with_non_finite_weights_or_activations_changes_no_other_row(
    adapters, value, fold_stored, monkeypatch
):
    """Issue 69: one row never changes another's tokens. An adapter whose weights are NaN or Inf (past the loader's
    check), or finite but so large its activations overflow, shares batches with base rows and a good adapter: in
    prefill steps (every slot's rank space, the dense way) and decode steps (each token's own slot gathered), its
    slot first, the others' rows give what they give alone, and so do requests after it on its freed pages. Also with
    every slot's A rows stored in the projections' weights (CAPSTAN_LORA_FOLD_STORED, a GPU's default)."""
    from capstan.runtime.models import lora

    monkeypatch.setattr(lora, "FOLD_STORED", fold_stored)
    llm = LLM(str(GOLDEN / "llama-s11"), enable_lora=True, max_loras=3, max_lora_rank=8, **ENGINE)
    good, n = adapters[1], len(PROMPTS)
    single = {params.temperature: alone(llm, [good], params) for params in (GREEDY, SAMPLED)}
    poisoned = registered_past_the_checks(llm, "poisoned", adapters[0], value)
    pairs = [(i, a) for a in (poisoned, None, good) for i in range(n)]
    for params in (GREEDY, SAMPLED):  # greedy, and seeded sampling (top_p): the sampler must not cross rows either
        batch = outputs(
            llm.generate([PROMPTS[i] for i, _ in pairs], params, use_tqdm=False, lora_request=[a for _, a in pairs])
        )
        expected = [single[params.temperature][(i, a.lora_name if a else None)] for i, a in pairs[n:]]
        assert_same(batch[n:], expected, f"rows beside an adapter of {value}, temperature {params.temperature}")
    after = outputs(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert_same(after, [single[0.0][(i, None)] for i in range(n)], f"base rows after an adapter of {value}")
    assert lora.is_folded(llm.engine.model) == (fold_stored == "1")
    llm.engine.pool.check_all_free()


def test_an_adapter_without_enable_lora_is_refused(adapters):
    llm = LLM(str(GOLDEN / "llama-s11"), **ENGINE)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=adapters[0])


def refusal(folder, max_rank=16):
    with pytest.raises(LoRAError) as e:
        read_adapter(folder, ModelConfig.from_pretrained(GOLDEN / "llama-s11"), max_rank)
    return e.value


def test_bad_adapters_are_refused_naming_the_field(tmp_path):
    base = GOLDEN / "llama-s11"
    e = refusal(write_adapter(tmp_path / "big", base, seed=0, rank=32))
    assert e.field == "r" and "--max-lora-rank=16" in str(e)
    e = refusal(write_adapter(tmp_path / "dora", base, seed=0, extra_config={"use_dora": True}))
    assert e.field == "use_dora"
    e = refusal(write_adapter(tmp_path / "head", base, seed=0, extra_config={"target_modules": ["q_proj", "lm_head"]}))
    assert e.field == "target_modules" and "lm_head" in str(e)
    assert refusal(tmp_path / "missing").field == "lora_path"
    # a tensor for a module no block has, and shapes for another model
    from safetensors.numpy import load_file, save_file

    folder = write_adapter(tmp_path / "embed", base, seed=0, targets=("q_proj",))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = np.zeros((8, 64), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    assert refusal(folder).field == "target_modules"
    folder = write_adapter(tmp_path / "shape", base, seed=0, targets=("k_proj",))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"] = np.zeros((64, 8), np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    e = refusal(folder)
    assert e.field == "layers.1.k_proj" and "lora_B [32, r]" in str(e)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": "high"}))
    assert refusal(folder).field == "lora_alpha"


def test_malformed_adapter_files_are_refused_naming_the_file_and_the_problem(tmp_path):
    """Issue 68/69: non-finite weights, truncated or corrupt safetensors and oversized files are LoRAErrors that name
    the file and what is wrong (not struct.error, KeyError or 'holds no LoRA weights'), read no more than bounded."""
    import struct

    from safetensors.numpy import load_file, save_file

    base = GOLDEN / "llama-s11"

    def adapter(name: str, **changes) -> Path:
        folder = write_adapter(tmp_path / name, base, seed=0, targets=("q_proj",))
        weights = folder / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        for key, value in changes.items():
            tensors[f"base_model.model.model.layers.0.self_attn.q_proj.{key}.weight"].flat[3] = value
        save_file(tensors, str(weights))
        return folder

    def says(folder: Path, *parts: str, file: str = "adapter_model.safetensors") -> None:
        message = str(refusal(folder))
        assert str(folder / file) in message and all(p in message for p in parts), message

    says(adapter("nan", lora_A=np.nan), "layers.0.q_proj.lora_A", "1 NaN or infinite value(s)")
    says(adapter("inf", lora_B=-np.inf), "layers.0.q_proj.lora_B", "NaN or infinite")
    overflow = adapter("overflow", lora_B=3e38)
    config = json.loads((overflow / "adapter_config.json").read_text())
    (overflow / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e6}))
    says(overflow, "lora_B times the scale 125000 (lora_alpha / r) overflows")

    weights = adapter("short") / "adapter_model.safetensors"
    weights.write_bytes(b"\x01\x02\x03")
    says(weights.parent, "3 bytes: not a safetensors file")
    weights.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    says(weights.parent, f"header length {1 << 62} is more than the file's 2 bytes")
    weights.write_bytes(struct.pack("<Q", 5) + b"{nope")
    says(weights.parent, "header is not valid JSON")
    header = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {"shape": [8, 64], "data_offsets": [0, 4]}
    }
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(4))
    says(weights.parent, "q_proj.lora_A.weight: expected dtype, shape and data_offsets")
    header = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
            "dtype": "F32",
            "shape": [8, 64],
            "data_offsets": [0, 2048],
        }
    }
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(100))
    says(weights.parent, "data_offsets [0, 2048] do not hold its F32 [8, 64] within the 100 bytes")
    with weights.open("r+b") as f:  # sparse: nothing is written, and nothing may be read
        f.truncate(1 << 40)
    says(weights.parent, f"{1 << 40} bytes, more than an adapter of this model at --max-lora-rank can hold")

    config_file = adapter("big-config") / "adapter_config.json"
    config_file.write_text(config_file.read_text() + " " * (2 << 20))
    says(
        config_file.parent,
        f"{config_file.stat().st_size} bytes, more than an adapter config holds",
        file=config_file.name,
    )


def test_engine_flags_are_checked():
    from capstan import EngineConfig

    for kwargs, field in (
        (dict(enable_lora=True, max_loras=0), "max_loras"),
        (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank"),
        (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
        (dict(lora_modules={"a": "/x"}), "enable_lora"),
        (dict(enable_lora=True, lora_modules={"bad name": "/x"}), "lora_modules"),
    ):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model=str(GOLDEN / "llama-s11"), **kwargs).validate()


SPLIT_RUN = """
import json, sys
from capstan import LLM, LoRARequest, SamplingParams
model, paths = sys.argv[1], sys.argv[2:]
prompts = [[5, 17, 99, 3, 250, 41, 8, 19, 77, 301, 12], [400, 2, 33], [9] * 23]
loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
got = {}
for tp in (1, 2, 4):
    llm = LLM(model, tensor_parallel_size=tp, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=64, page_size=4, dtype="float32", warmup=False)
    outs = llm.generate(prompts * 3, greedy, use_tqdm=False, lora_request=[loras[0]] * 3 + [loras[1]] * 3 + [None] * 3)
    got[tp] = [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
               for o in outs]
print(json.dumps(got))
"""


def test_adapters_split_over_devices_equal_one_device(adapters):
    """Tensor parallelism: llama-s11's two KV heads one per device (2), and replicated twice (4): the adapters' rows
    and the base rows give one device's tokens and logprobs (run in a process with four CPU devices)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    paths = [adapters[1].lora_path, adapters[3].lora_path]  # all seven projections; o_proj alone (rsLoRA)
    proc = subprocess.run(
        [sys.executable, "-c", SPLIT_RUN, str(GOLDEN / "llama-s11"), *paths],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    one = [(t, lp) for t, lp in got["1"]]
    assert one[0] != one[6]  # the adapter changes the output
    for tp in ("2", "4"):
        assert_same([(t, lp) for t, lp in got[tp]], one, f"tensor parallel {tp}")
