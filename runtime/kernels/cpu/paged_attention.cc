// Paged attention on CPU for float32 pages, called from jitted programs through XLA FFI
// (runtime/kernels/cpu_paged_attention.py). XLA's loops (attention/chunked.py) cost a one-row decode step ~0.14 ms a
// layer on a 2-core machine, mostly the while loop's small ops around a few thousand multiply-adds; here each
// (token, kv head) pair reads its sequence's pages once, with the kv head's query heads side by side, in one call.
//
// The result is the reference's (attention/reference.py, paged_attention): token t of sequence token_seq[t] at
// position positions[t] attends keys lo .. positions[t] of its block table (lo = positions[t] - window + 1 with a
// window > 0, else 0), scores = q . k * scale, tanh-capped with a softcap > 0, an exact softmax (two passes over
// the scores), times v_scale. A token that sees no key (or whose row is out of range) gets zeros; a block-table
// entry out of the cache's pages masks its keys (never read).
//
// Layouts: q and the output [T, KVH, G, D]; k and v [KVH, pages, page_size, D] (one layer, HEADS_FIRST);
// block_tables [rows, max_pages]; token_seq, positions [T]; window a scalar (<= 0: none).
//
// RopeWriteAttend does a layer's whole path from its QKV projection: rope, the K/V write, then the same attention.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Layer {
  int64_t kv_heads, group, head_dim, pages, page_size, rows, max_pages;
  const float* k;
  const float* v;
  const int32_t* tables;
  float scale, softcap, v_scale;
};

// Below this many multiply-adds a call runs on the caller alone (waking the pool costs more than it saves).
constexpr int64_t kMinParallelMacs = 1 << 16;

// One token's attention for one kv head's `group` query heads over keys [lo, hi] of its block table `table`.
__attribute__((target_clones("avx2", "default"))) void attend(const Layer& s, int64_t h, const float* q,
                                                               const int32_t* table, int64_t lo, int64_t hi,
                                                               float* out, std::vector<float>& scores) {
  const int64_t G = s.group, D = s.head_dim, n = hi - lo + 1;
  std::fill(out, out + G * D, 0.f);
  if (n <= 0) return;
  scores.assign(G * n, -std::numeric_limits<float>::infinity());
  for (int64_t c = lo; c <= hi; ++c) {
    const int64_t page = table[c / s.page_size];
    if (page < 0 || page >= s.pages) continue;  // masked: never read
    const float* key = s.k + ((h * s.pages + page) * s.page_size + c % s.page_size) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight running sums: the compiler keeps them in one vector
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        for (int i = 0; i < 8; ++i) part[i] += qg[d + i] * key[d + i];
      float dot = 0.f;
      for (; d < D; ++d) dot += qg[d] * key[d];
      dot += ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      float score = dot * s.scale;
      if (s.softcap > 0.f) score = std::tanh(score / s.softcap) * s.softcap;
      scores[g * n + (c - lo)] = score;
    }
  }
  std::vector<float> total(G, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores.data() + g * n;
    const float top = *std::max_element(row, row + n);
    if (top == -std::numeric_limits<float>::infinity()) continue;  // every key masked: zeros
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - top);  // exp(-inf) = 0: masked keys weigh nothing
      sum += row[i];
    }
    total[g] = sum;
  }
  for (int64_t c = lo; c <= hi; ++c) {
    const int64_t page = table[c / s.page_size];
    if (page < 0 || page >= s.pages) continue;
    const float* value = s.v + ((h * s.pages + page) * s.page_size + c % s.page_size) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * n + (c - lo)];
      float* o = out + g * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p * value[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    if (total[g] <= 0.f) continue;
    const float factor = s.v_scale / total[g];
    for (int64_t d = 0; d < D; ++d) out[g * D + d] *= factor;
  }
}

// Every token's attention (out [T, KVH, G, D]) for queries qs laid out [T, KVH, qstride] (a token's kv head's G
// queries first in its qstride floats), over s's pages: on the pool when the call has enough work.
void attend_all(const Layer& s, int64_t T, const float* qs, int64_t qstride, const int32_t* seq, const int32_t* pos,
                int64_t win, float* os) {
  const int64_t last_key = s.max_pages * s.page_size - 1;
  auto item = [&](int64_t i) {  // one (token, kv head) pair
    thread_local std::vector<float> scores;
    const int64_t t = i / s.kv_heads, h = i % s.kv_heads;
    const int64_t at = (t * s.kv_heads + h) * s.group * s.head_dim;
    const int64_t hi = std::min<int64_t>(pos[t], last_key);
    const int64_t lo = win > 0 ? std::max<int64_t>(pos[t] - win + 1, 0) : 0;
    if (seq[t] < 0 || seq[t] >= s.rows) {
      std::fill(os + at, os + at + s.group * s.head_dim, 0.f);
      return;
    }
    attend(s, h, qs + (t * s.kv_heads + h) * qstride, s.tables + seq[t] * s.max_pages, lo, hi, os + at, scores);
  };
  const int64_t items = T * s.kv_heads;
  int64_t macs = 0;  // the call's work: each token's keys, twice (scores and values), for every query head
  for (int64_t t = 0; t < T; ++t) macs += 2 * (std::max<int64_t>(pos[t], 0) + 1) * s.kv_heads * s.group * s.head_dim;
  if (macs >= kMinParallelMacs)
    capstan_parallel_for(items, item);
  else
    for (int64_t i = 0; i < items; ++i) item(i);
}

ffi::Error PagedAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                          ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> token_seq,
                          ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::S32> window,
                          ffi::ResultBuffer<ffi::F32> out, float scale, float softcap, float v_scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged attention: q [T, KVH, G, D], k and v [KVH, pages, "
                                                        "page_size, D], block_tables [rows, max_pages]");
  const int64_t T = qd[0];
  Layer s{qd[1], qd[2], qd[3], kd[1], kd[2], td[0], td[1], k.typed_data(), v.typed_data(), block_tables.typed_data(),
          scale, softcap, v_scale};
  if (kd[0] != s.kv_heads || kd[3] != s.head_dim || token_seq.element_count() != T ||
      positions.element_count() != T || window.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "paged attention: shapes disagree");
  attend_all(s, T, q.typed_data(), s.group * s.head_dim, token_seq.typed_data(), positions.typed_data(),
             window.typed_data()[0], out->typed_data());
  return ffi::Error::Success();
}

// x [D] rotated in place as Hugging Face's rotate-half rope does it (models/rope.py): x * cos + rotate_half(x) * sin
void rope(float* x, const float* cos, const float* sin, int64_t D) {
  const int64_t half = D / 2;
  float rotated[512];  // D <= 512: checked by the caller
  for (int64_t i = 0; i < half; ++i) {
    rotated[i] = -x[i + half];
    rotated[i + half] = x[i];
  }
  for (int64_t i = 0; i < D; ++i) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

// A step's attention from its QKV projection on: rope on the queries and keys, the keys and values written to their
// slots, then paged attention over the pages (models/layers.py's unfused path in one call, without its ~10 small XLA
// ops a layer). k_out and v_out alias k_in and v_in (the caller's input_output_aliases): the pages are written in
// place; were XLA to give other buffers, the pages are copied over first.
ffi::Error RopeWriteAttend(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin,
                           ffi::Buffer<ffi::F32> k_in, ffi::Buffer<ffi::F32> v_in, ffi::Buffer<ffi::S32> block_tables,
                           ffi::Buffer<ffi::S32> token_seq, ffi::Buffer<ffi::S32> positions,
                           ffi::Buffer<ffi::S32> slot_mapping, ffi::Buffer<ffi::S32> window,
                           ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> k_out,
                           ffi::ResultBuffer<ffi::F32> v_out, float scale, float softcap) {
  const auto xd = qkv.dimensions(), kd = k_in.dimensions(), td = block_tables.dimensions();
  if (xd.size() != 4 || kd.size() != 4 || td.size() != 2 || xd[2] < 3 ||
      !std::equal(kd.begin(), kd.end(), v_in.dimensions().begin(), v_in.dimensions().end()))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rope, write and attend: qkv [T, KVH, G + 2, D], k and v "
                                                        "[KVH, pages, page_size, D], block_tables [rows, max_pages]");
  const int64_t T = xd[0], KVH = xd[1], G = xd[2] - 2, D = xd[3];
  if (kd[0] != KVH || kd[3] != D || D % 2 != 0 || D > 512 || cos.element_count() != T * D ||
      sin.element_count() != T * D || token_seq.element_count() != T || positions.element_count() != T ||
      slot_mapping.element_count() != T || window.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rope, write and attend: shapes disagree");
  float* k = k_out->typed_data();
  float* v = v_out->typed_data();
  const size_t cache_bytes = k_in.size_bytes();
  if (k != k_in.typed_data()) std::memcpy(k, k_in.typed_data(), cache_bytes);
  if (v != v_in.typed_data()) std::memcpy(v, v_in.typed_data(), cache_bytes);
  const int64_t pages = kd[1], page_size = kd[2];
  // rope on every token's queries and key (the step's copy of qkv: q and k rotated, v as it is)
  thread_local std::vector<float> x;
  x.assign(qkv.typed_data(), qkv.typed_data() + qkv.element_count());
  const float* cs = cos.typed_data();
  const float* sn = sin.typed_data();
  const int32_t* slots = slot_mapping.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < KVH; ++h) {
      float* head = x.data() + (t * KVH + h) * (G + 2) * D;
      for (int64_t g = 0; g <= G; ++g) rope(head + g * D, cs + t * D, sn + t * D, D);  // G queries, then the key
      const int64_t slot = slots[t], page = slot / page_size;
      if (slot < 0 || page >= pages) continue;  // padding (INVALID_SLOT): dropped, as write_kv drops it
      const int64_t at = ((h * pages + page) * page_size + slot % page_size) * D;
      std::memcpy(k + at, head + G * D, D * sizeof(float));
      std::memcpy(v + at, head + (G + 1) * D, D * sizeof(float));
    }
  }
  // v_scale 1: the pages are float32 (an FP8 cache's scales never reach this call)
  Layer s{KVH, G, D, pages, page_size, td[0], td[1], k, v, block_tables.typed_data(), scale, softcap, 1.f};
  attend_all(s, T, x.data(), (G + 2) * D, token_seq.typed_data(), positions.typed_data(), window.typed_data()[0],
             out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CapstanCpuPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, KVH, G, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [KVH, pages, page_size, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v, as k
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [rows, max_pages]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_seq [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (<= 0: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, KVH, G, D]
                                  .Attr<float>("scale")          // the scores' scale (times an FP8 k_scale)
                                  .Attr<float>("softcap")        // <= 0: none
                                  .Attr<float>("v_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(CapstanCpuRopeWriteAttend, RopeWriteAttend,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // qkv [T, KVH, G + 2, D]: G queries, k, v a head
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k [KVH, pages, page_size, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v, as k
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [rows, max_pages]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // token_seq [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window [] (<= 0: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [T, KVH, G, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // k, written (aliases the k argument)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // v, written
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap"));
