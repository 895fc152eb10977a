"""BatchBuilder: a step's rows laid out token by token, as worked out by hand here."""

import numpy as np
import pytest

from capstan.runtime.attention import INVALID_SLOT
from capstan.runtime.limits import MAX_LOGIT_BIAS
from capstan.runtime.sampling.sampling_params import SamplingParams
from capstan.runtime.scheduling.batch import MAX_BANNED, BatchBuilder
from capstan.runtime.scheduling.scheduler import ScheduledChunk
from capstan.runtime.scheduling.sequence import Sequence

V, PAGE = 100, 4


def builder() -> BatchBuilder:
    return BatchBuilder(
        max_num_seqs=4,
        max_num_batched_tokens=16,
        page_size=PAGE,
        max_model_len=16,
        vocab_size=V,
        eos_token_ids=frozenset({1}),
    )


def sequence(prompt: list[int], pages: list[int], **params) -> Sequence:
    p = SamplingParams(max_tokens=8, **params)
    seq = Sequence(
        request_id=str(prompt), index=0, prompt_ids=prompt, params=p, seed=0, arrival=0.0, text=None, max_tokens=8
    )
    seq.pages = pages
    return seq


def host(leaf) -> np.ndarray:
    return np.asarray(leaf)


def test_a_step_lays_out_each_rows_tokens_positions_slots_and_pages():
    # a prompt's second chunk (positions 4..9 of 10), then a decode row with two drafted tokens after it
    prefill = sequence(list(range(20, 30)), [7, 3, 9])
    decode = sequence([40, 41, 42, 43, 44], [2, 5], logit_bias={5: 1.5, 6: -2.0})
    decode.token_ids += [45, 46]  # two generated: position 6 is computed now, with drafts at 7 and 8
    decode.num_computed = 6
    decode.pages.append(8)
    chunks = [ScheduledChunk(prefill, 4, 6), ScheduledChunk(decode, 6, 1, draft=[50, 51])]
    x = builder().build(chunks).unpack()
    assert host(x.tokens).tolist() == [24, 25, 26, 27, 28, 29, 46, 50, 51] + [0] * 7  # padded to the 16 bucket
    assert host(x.meta.positions).tolist()[:9] == [4, 5, 6, 7, 8, 9, 6, 7, 8]
    # page p of a row's table holds its positions 4p..4p+3: slot = page * 4 + position % 4
    expected_slots = [3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 8 * 4 + 0]
    assert host(x.meta.slot_mapping).tolist() == expected_slots + [INVALID_SLOT] * 7
    assert host(x.meta.token_seq).tolist()[:9] == [0] * 6 + [1] * 3
    assert host(x.meta.block_tables)[:3].tolist() == [[7, 3, 9, 0], [2, 5, 8, 0], [0, 0, 0, 0]]
    assert host(x.meta.seq_lens).tolist() == [10, 9, 0, 0]
    assert host(x.sample_index).tolist() == [5, 8, 0, 0]
    assert host(x.draft_lens).tolist() == [0, 2, 0, 0]
    assert host(x.sampling.position).tolist() == [10, 7, 0, 0]
    ids, values = host(x.sampling.bias_ids), host(x.sampling.bias_values)
    assert ids.shape == (4, MAX_LOGIT_BIAS)
    assert ids[1, :2].tolist() == [5, 6] and values[1, :2].tolist() == [1.5, -2.0]
    assert (ids[[0, 2, 3]] == V).all() and (values[[0, 2, 3]] == 0).all() and (ids[1, 2:] == V).all()
    assert not host(x.sampling.plain_greedy)


def test_a_batch_without_bias_or_bans_reads_the_constants_and_is_plain_greedy():
    seq = sequence([20, 21, 22], [1], temperature=0.0)
    x = builder().build([ScheduledChunk(seq, 0, 3)]).unpack()
    assert (host(x.sampling.bias_ids) == V).all() and (host(x.sampling.bias_values) == 0).all()
    assert host(x.sampling.banned_ids).shape == (4, MAX_BANNED) and (host(x.sampling.banned_ids) == V).all()
    assert host(x.sampling.plain_greedy)


def test_a_row_below_min_tokens_bans_eos_and_its_stop_ids():
    seq = sequence([20, 21, 22], [1], min_tokens=2, stop_token_ids=[7])
    banned = host(builder().build([ScheduledChunk(seq, 0, 3)]).unpack().sampling.banned_ids)
    assert banned[0, :2].tolist() == [1, 7] and (banned[0, 2:] == V).all() and (banned[1:] == V).all()


def test_penalised_rows_name_their_stop_tokens_which_ignore_eos_leaves_out():
    """The repetition penalty leaves a row's stop tokens alone (issue 67): EOS and its stop_token_ids, but not EOS
    under ignore_eos, where it ends nothing."""
    rows = [
        sequence([20, 21, 22], [1], repetition_penalty=1.1, stop_token_ids=[7]),
        sequence([20, 21, 22], [2], repetition_penalty=1.1, stop_token_ids=[7], ignore_eos=True),
        sequence([20, 21, 22], [3]),  # no penalty
    ]
    x = builder().build([ScheduledChunk(q, 0, 3) for q in rows]).unpack()
    stop_ids = host(x.sampling.stop_ids)
    assert stop_ids.shape == (4, MAX_BANNED)
    assert stop_ids[0, :2].tolist() == [1, 7] and stop_ids[1, :1].tolist() == [7]
    assert (stop_ids[0, 2:] == V).all() and (stop_ids[1, 1:] == V).all() and (stop_ids[2:] == V).all()
    plain = builder().build([ScheduledChunk(rows[2], 0, 3)]).unpack()
    assert (host(plain.sampling.stop_ids) == V).all()


@pytest.mark.parametrize(
    "chunk",
    [
        lambda: ScheduledChunk(sequence([20, 21, 22], [1]), 0, 5),  # more tokens than the sequence holds
        lambda: ScheduledChunk(sequence(list(range(20, 30)), [1]), 0, 10),  # tokens past its one page
    ],
    ids=["tokens", "pages"],
)
def test_a_chunk_that_does_not_fit_its_sequence_is_refused(chunk):
    with pytest.raises(ValueError):
        builder().build([chunk()])


@pytest.mark.parametrize("rows, tokens, smallest", [(256, 512, 16), (8, 64, 16), (256, 2048, 256), (1, 64, 16)])
def test_queued_buckets_are_those_a_step_that_is_not_small_can_take(rows, tokens, smallest):
    """Asynchronous scheduling compiles its programs for these buckets only (a step of few rows and tokens is a
    small step, never queued): every step that is not small lands in one, and each is some such step's."""
    b = BatchBuilder(
        max_num_seqs=rows,
        max_num_batched_tokens=tokens,
        page_size=PAGE,
        max_model_len=16,
        vocab_size=V,
        eos_token_ids=frozenset({1}),
        smallest_bucket=smallest,
        decode_row_buckets=True,
    )
    seq, taken = sequence([5], [0]), set()  # (small_step reads only how many chunks and tokens)
    for n in range(1, tokens + 1):
        for count in {1, min(n, rows)}:  # one chunk of n tokens, or as many rows as fit
            chunks = [ScheduledChunk(seq, 0, n // count + (r < n % count)) for r in range(count)]
            if b.small_step(chunks) is None:
                taken.add(b.bucket_for(n))
    assert sorted(taken) == b.queued_buckets
    if (rows, tokens) == (256, 512):
        assert b.queued_buckets == [128, 256, 512]  # 16, 32 and 64 only ever hold small steps
