// Decode-step matmuls on CPU with the weights in GGUF's blocks of 32 (Q4_1, Q8_0), as llama.cpp's vec_dot kernels
// do them: the activations quantized to int8 per block of 32 (with a scale, and for Q4_1 their sum: q8_1), int8
// dot products (AVX-512 VNNI / AVX-VNNI vpdpbusd, else AVX2, else plain C, picked at run time: one binary for any
// x86-64), every weight block read once per call for all of the call's rows, and the output columns split over a
// small persistent thread pool. Called from jitted programs through XLA FFI (runtime/kernels/cpu_block_matmul.py).
//
// y[r, j] = sum_b  d[j, b] * dx[r, b] * dot(w[j, b], xq[r, b])  +  sum_b  m[j, b] * sx[r, b]
//   Q4_1: w the block's nibbles 0..15 (value = d * w + m), sx = dx * sum(xq): the minimum times the block's sum.
//   Q8_0: w int8 (value = d * w); on VNNI the dot is u8 x s8, so x goes in as xq + 128, and 128 * m (m the block's
//         sum of w, an int16 computed at load) takes the bias back out of the integer dot; on AVX2 and in C the dot is
//         signed: no m term.
// The weight is laid out at load (cpu_block_matmul.pack) in groups of 8 output columns (n padded to a multiple of 8):
//   Q4_1 w [n / 8, nb, 4 (g), 8 (column), 4] bytes: byte t of column c holds input 4g + t low, 16 + 4g + t high;
//   Q8_0 w [n / 8, nb, 8 (g), 8 (column), 4] int8: inputs 4g .. 4g + 3 of each column;
//   d, m [n / 8, nb, 8 (column)] float16 as GGUF stores them (Q8_0's m int16): a step reads Q4_1's bytes as the file
//   holds them, and Q8_0's plus 6% (its block sums).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kQ4_1 = 0;
constexpr int kQ8_0 = 1;
constexpr int64_t kBlock = 32;
// A one-row step's matmuls wait on memory (their weights are ~100 MB a token, read once): each tile asks for the
// weight bytes this far ahead of its loads (~5% of a step's matmul time on a 2-core EPYC, benchmarks/RESULTS.md)
constexpr int64_t kPrefetchBytes = 16384;
// a call's chunks a thread: enough that a worker the host does not schedule for a while (the server's frontend shares
// the cores) leaves most of its run to the others (see Pool), who take them one at a time from its end
constexpr int64_t kChunksPerThread = 8;

struct Problem {
  int kind;
  int64_t rows, k, n, nb;  // n: the output's columns (the weight's, less its padding)
  const uint8_t* w;  // in groups of 8 columns: see the file's comment
  const uint16_t* d;  // [n / 8, nb, 8] weight scales, float16
  const uint16_t* m;  // [n / 8, nb, 8] Q4_1: the blocks' minimums, float16; Q8_0: the blocks' sums, int16
  const int8_t* xq;  // [rows, k] activations quantized per block
  const uint8_t* xu; // [rows, k] xq + 128 (Q8_0's u8 operand on VNNI)
  const float* dx;   // [rows, nb] activation scales
  const float* sx;   // [rows, nb] Q4_1: dx * sum(xq) (Q8_0: unused)
  float* y;          // [rows, n]
};

inline float half_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

// The portable path: the same arithmetic in plain C (any CPU; the tests compare it with the vector paths).
void columns_scalar(const Problem& p, int64_t g0, int64_t g1) {
  const int64_t nb = p.nb;
  for (int64_t j = g0 * 8; j < std::min(p.n, g1 * 8); ++j) {
    const int64_t g = j / 8, c = j % 8;
    for (int64_t r = 0; r < p.rows; ++r) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* x = p.xq + r * p.k + b * kBlock;
        int32_t dot = 0;
        for (int i = 0; i < 8; ++i) {  // 4-byte groups of the column's block
          for (int t = 0; t < 4; ++t) {
            if (p.kind == kQ4_1) {
              if (i >= 4) continue;
              const uint8_t v = p.w[(((g * nb + b) * 4 + i) * 8 + c) * 4 + t];
              dot += (v & 0x0f) * x[4 * i + t] + (v >> 4) * x[16 + 4 * i + t];
            } else {
              const int8_t v = static_cast<int8_t>(p.w[(((g * nb + b) * 8 + i) * 8 + c) * 4 + t]);
              dot += v * x[4 * i + t];
            }
          }
        }
        const int64_t at = (g * nb + b) * 8 + c;
        acc += half_to_float(p.d[at]) * p.dx[r * nb + b] * static_cast<float>(dot);
        if (p.kind == kQ4_1) acc += half_to_float(p.m[at]) * p.sx[r * nb + b];
      }
      p.y[r * p.n + j] = acc;
    }
  }
}

#define BODY_CAT2(a, b) a##b
#define BODY_CAT(a, b) BODY_CAT2(a, b)
#define BODY_FN(suffix) BODY_CAT(BODY_NAME, suffix)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define BODY_NAME columns_avx2
#define BODY_VNNI 0
#include "block_matmul_body.inc"
#undef BODY_NAME
#undef BODY_VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define BODY_NAME columns_avxvnni
#define BODY_VNNI 1
#define BODY_DPBUSD _mm256_dpbusd_avx_epi32
#include "block_matmul_body.inc"
#undef BODY_NAME
#undef BODY_VNNI
#undef BODY_DPBUSD
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#define BODY_NAME columns_avx512vnni
#define BODY_VNNI 1
#define BODY_DPBUSD _mm256_dpbusd_epi32
#include "block_matmul_body.inc"
#undef BODY_NAME
#undef BODY_VNNI
#undef BODY_DPBUSD
#pragma GCC pop_options

using Columns = void (*)(const Problem&, int64_t, int64_t);

struct Isa {
  const char* name;
  Columns columns;
  bool vnni;  // Q8_0's dot is u8 x s8 (x + 128, the m term) rather than signed
  bool supported;
};

std::vector<Isa> isas() {  // best first
  __builtin_cpu_init();
  return {
      {"avx512vnni", columns_avx512vnni, true,
       __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")},
      {"avxvnni", columns_avxvnni, true,
       __builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")},
      {"avx2", columns_avx2, false, __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")},
      {"scalar", columns_scalar, false, true},
  };
}

// A few threads that stay alive between calls (a decode step makes ~120 of these calls). A call's chunks are dealt
// out as one contiguous run a thread (its weight bytes one stream, which the prefetches and the hardware follow);
// a thread that finishes its run takes chunks from the end of another's, so on a shared machine a worker that is not
// scheduled leaves most of its run to the others instead of holding the call up. Idle workers spin briefly (a step's
// next matmul follows within microseconds), then sleep on a condition variable (between steps).
class Pool {
 public:
  explicit Pool(int threads, int spin_us) : threads_(std::max(1, threads)), spin_us_(spin_us), runs_(threads_) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { work(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return threads_; }

  // fn(chunk) for chunk in [0, chunks), on the caller and the workers; all on the caller when another call holds
  // the pool (XLA may run independent matmuls at once: they share the cores instead of queueing).
  void run(int64_t chunks, const std::function<void(int64_t)>& fn) {
    if (chunks > kMaxChunks) {  // more than a run's word counts: claims of `per` consecutive chunks
      const int64_t per = (chunks + kMaxChunks - 1) / kMaxChunks;
      const std::function<void(int64_t)> ranges = [&](int64_t i) {
        for (int64_t c = i * per; c < std::min(chunks, (i + 1) * per); ++c) fn(c);
      };
      return run((chunks + per - 1) / per, ranges);
    }
    if (chunks <= 1 || threads_ == 1 || busy_.test_and_set(std::memory_order_acquire)) {
      for (int64_t i = 0; i < chunks; ++i) fn(i);
      return;
    }
    const uint64_t generation = (generation_.load(std::memory_order_relaxed) + 1) & kGenerationMask;
    for (int t = 0; t < threads_; ++t)  // thread t's run: [chunks * t / threads, chunks * (t + 1) / threads)
      runs_[t].v.store(pack(generation, chunks * t / threads_, chunks * (t + 1) / threads_), std::memory_order_relaxed);
    task_.store(&fn, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);  // pairs with a worker's check before it sleeps
      generation_.store(generation, std::memory_order_seq_cst);
    }
    if (sleeping_.load(std::memory_order_seq_cst) > 0) wake_.notify_all();
    drain(0, generation, &fn);
    while (done_.load(std::memory_order_acquire) < chunks) _mm_pause();
    busy_.clear(std::memory_order_release);
  }

 private:
  // a run's word: the call's generation (a late worker's claims fail on a later call's runs), then [lo, hi)
  static constexpr int64_t kMaxChunks = (1 << 16) - 1;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << 32) - 1;
  static uint64_t pack(uint64_t generation, int64_t lo, int64_t hi) {
    return generation << 32 | static_cast<uint64_t>(lo) << 16 | static_cast<uint64_t>(hi);
  }
  struct alignas(64) Run {
    std::atomic<uint64_t> v{0};
  };

  // Claims one chunk of run t, from its front (its owner) or its back (a thief); -1 when it is empty or not this
  // generation's.
  int64_t claim(int t, uint64_t generation, bool front) {
    uint64_t v = runs_[t].v.load(std::memory_order_acquire);
    for (;;) {
      const int64_t lo = (v >> 16) & 0xffff, hi = v & 0xffff;
      if ((v >> 32) != generation || lo >= hi) return -1;
      const uint64_t next = front ? pack(generation, lo + 1, hi) : pack(generation, lo, hi - 1);
      if (runs_[t].v.compare_exchange_weak(v, next, std::memory_order_acq_rel)) return front ? lo : hi - 1;
    }
  }

  // Runs thread `self`'s run, then what is left of the others'.
  void drain(int self, uint64_t generation, const std::function<void(int64_t)>* fn) {
    for (int k = 0; k < threads_; ++k) {
      const int t = (self + k) % threads_;
      for (int64_t c; (c = claim(t, generation, k == 0)) >= 0;) {
        (*fn)(c);
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  void work(int self) {
    uint64_t seen = 0;
    for (;;) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      auto current = [&] { return generation_.load(std::memory_order_acquire); };
      while (current() == seen) {
        _mm_pause();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleeping_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return current() != seen; });
          sleeping_.fetch_sub(1, std::memory_order_seq_cst);
        }
      }
      seen = current();
      if (stop_.load()) return;
      drain(self, seen, task_.load(std::memory_order_relaxed));  // this generation's: see claim
    }
  }

  const int threads_;
  const int spin_us_;
  std::vector<Run> runs_;
  std::vector<std::thread> workers_;
  std::atomic_flag busy_ = ATOMIC_FLAG_INIT;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<const std::function<void(int64_t)>*> task_{nullptr};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

Pool* pool = nullptr;
Isa chosen = {"scalar", columns_scalar, false, true};
// Below this many multiply-adds a call runs on the caller alone (waking a worker costs more than it saves).
int64_t min_parallel_macs = 1 << 17;

inline float to_half(float v) { return static_cast<float>(static_cast<_Float16>(v)); }  // rounded to nearest even
// v rounded to the nearest integer, ties to even (as nearbyint in the default mode) for |v| < 2^22: adding and taking
// back 1.5 * 2^23 leaves no fraction bits. Inline arithmetic the compiler vectorizes, where nearbyint is a libm call
inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

// One block of 32 as int8 (q, and q + 128 for Q8_0's u8 operand on VNNI); returns its scale amax / 127 and sets
// the sum of q.
inline float quantize_block(const float* v, int8_t* q, uint8_t* u, int32_t* sum) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float id = amax != 0.f ? 127.f / amax : 0.f;
  *sum = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(round_even(v[i] * id));
    u[i] = static_cast<uint8_t>(q[i] + 128);
    *sum += q[i];
  }
  return amax / 127.f;
}

// Each row's blocks of 32 as int8 with one scale, as llama.cpp's quantize_row_q8_1 / q8_0 do it (to the bit, so its
// rounding noise and ours are the same noise: tests/test_gguf_parity.py): q = round-to-even(x * 127 / amax), the
// scale amax / 127 and Q4_1's block sum scale * sum(q) both stored as float16.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* xq, uint8_t* xu, float* dx, float* sx,
                   bool q4_1) {
  const int64_t nb = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = r * k + b * kBlock;
      int32_t sum;
      const float d = quantize_block(x + at, xq + at, xu + at, &sum);
      dx[r * nb + b] = to_half(d);
      sx[r * nb + b] = q4_1 ? to_half(d * static_cast<float>(sum)) : to_half(d);
    }
  }
}

// Two levels (the default): each row becomes two rows of the kernel, its blocks as above and then what that
// rounding left (x - d * q, at most half a step) quantized the same way, with float32 scales; the two rows' outputs
// are added. The int8 dot products stay, but the activations carry ~16 bits: the answers are the float path's
// (a rounding to int8 flips on the last bit of its input, so one level's noise is a draw of its own, and it turned
// the default model's greedy answer to "What is the capital of France?" into llama.cpp's "L'Etoile, la ...": its
// Q4_1 arithmetic's, where the float path says "The capital of France is Paris."). Twice the dot products, the same
// weight bytes (the two rows share each weight load).
void quantize_rows_two_levels(const float* x, int64_t rows, int64_t k, int8_t* xq, uint8_t* xu, float* dx, float* sx,
                              bool q4_1) {
  const int64_t nb = k / kBlock;
  float rest[kBlock];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + r * k + b * kBlock;
      const int64_t first = (2 * r) * k + b * kBlock, second = (2 * r + 1) * k + b * kBlock;
      int32_t sum;
      const float d0 = quantize_block(v, xq + first, xu + first, &sum);
      dx[2 * r * nb + b] = d0;
      sx[2 * r * nb + b] = q4_1 ? d0 * static_cast<float>(sum) : d0;
      for (int i = 0; i < kBlock; ++i) rest[i] = v[i] - d0 * static_cast<float>(xq[first + i]);  // what it left
      const float d1 = quantize_block(rest, xq + second, xu + second, &sum);
      dx[(2 * r + 1) * nb + b] = d1;
      sx[(2 * r + 1) * nb + b] = q4_1 ? d1 * static_cast<float>(sum) : d1;
    }
  }
}

// y [rows, n] = x [rows, k] times p's weight (p: kind, rows, k, n, nb, w, d, m set): BlockMatmul's work once its
// buffers are checked (also called by benchmarks' harnesses, which include this file)
void multiply(Problem p, const float* x, int32_t levels, float* out_y) {
  const bool q4_1 = p.kind == kQ4_1;
  const int64_t groups = (p.n + 7) / 8;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<uint8_t> xu;
  thread_local std::vector<float> dx, sx, y2;
  const int64_t rows = p.rows;
  p.rows *= levels;  // the kernel's rows: each of x's, once per level
  xq.resize(p.rows * p.k);
  xu.resize(p.rows * p.k);
  dx.resize(p.rows * p.nb);
  sx.resize(p.rows * p.nb);
  if (levels == 2)
    quantize_rows_two_levels(x, rows, p.k, xq.data(), xu.data(), dx.data(), sx.data(), q4_1);
  else
    quantize_rows(x, rows, p.k, xq.data(), xu.data(), dx.data(), sx.data(), q4_1);
  p.xq = xq.data();
  p.xu = xu.data();
  p.dx = dx.data();
  p.sx = sx.data();
  if (levels == 2) y2.resize(p.rows * p.n);
  p.y = levels == 2 ? y2.data() : out_y;
  const Columns columns = chosen.columns;
  const int threads = pool ? pool->threads() : 1;
  const bool parallel = threads > 1 && p.rows * p.n * p.k >= min_parallel_macs;
  // chunks of an even number of column groups (one row pairs them), kChunksPerThread a thread
  const int64_t per_chunk =
      parallel ? std::max<int64_t>(2, (groups / (threads * kChunksPerThread) + 1) & ~int64_t{1}) : groups;
  const int64_t chunks = (groups + per_chunk - 1) / per_chunk;
  auto chunk = [&](int64_t i) { columns(p, i * per_chunk, std::min(groups, (i + 1) * per_chunk)); };
  if (pool && chunks > 1)
    pool->run(chunks, chunk);
  else
    chunk(0);
  if (levels == 2) {  // each row's two levels added
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < p.n; ++j) out_y[r * p.n + j] = y2[(2 * r) * p.n + j] + y2[(2 * r + 1) * p.n + j];
  }
}

ffi::Error BlockMatmul(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F16> d, ffi::AnyBuffer m,
                       ffi::ResultBuffer<ffi::F32> y, int32_t kind, int32_t levels) {
  auto xd = x.dimensions(), dd = d.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || dd.size() != 3 || yd.size() != 2 || dd[2] != 8)
    return ffi::Error::InvalidArgument("block_matmul: x [rows, k], d [n / 8, k / 32, 8], y [rows, n]");
  if (kind != kQ4_1 && kind != kQ8_0) return ffi::Error::InvalidArgument("block_matmul: kind is 0 (Q4_1) or 1 (Q8_0)");
  if (levels != 1 && levels != 2) return ffi::Error::InvalidArgument("block_matmul: levels is 1 or 2");
  Problem p;
  p.kind = kind;
  p.rows = xd[0];
  p.k = xd[1];
  p.n = yd[1];
  p.nb = dd[1];
  const int64_t groups = dd[0];
  if (p.k != p.nb * kBlock) return ffi::Error::InvalidArgument("block_matmul: x's last axis is not d's blocks x 32");
  if (yd[0] != p.rows || groups != (p.n + 7) / 8)
    return ffi::Error::InvalidArgument("block_matmul: y's shape does not match x's rows and d's columns");
  const int64_t wbytes = kind == kQ4_1 ? p.k / 2 : p.k;
  if (static_cast<int64_t>(w.size_bytes()) != groups * 8 * wbytes)
    return ffi::Error::InvalidArgument("block_matmul: the weight's size does not match its scales");
  if (m.size_bytes() != d.size_bytes()) return ffi::Error::InvalidArgument("block_matmul: m is 2 bytes a block, as d");
  p.w = static_cast<const uint8_t*>(w.untyped_data());
  p.d = reinterpret_cast<const uint16_t*>(d.typed_data());
  p.m = static_cast<const uint16_t*>(m.untyped_data());
  multiply(p, x.typed_data(), levels, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

void capstan_parallel_for(int64_t chunks, const std::function<void(int64_t)>& fn) {
  if (pool && chunks > 1)
    pool->run(chunks, fn);
  else
    for (int64_t i = 0; i < chunks; ++i) fn(i);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(CapstanCpuBlockMatmul, BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [rows, k]
                                  .Arg<ffi::AnyBuffer>()         // w: Q4_1 u8, Q8_0 s8 (the file's comment)
                                  .Arg<ffi::Buffer<ffi::F16>>()  // d [n / 8, k / 32, 8]
                                  .Arg<ffi::AnyBuffer>()         // m [n / 8, k / 32, 8]: Q4_1 f16, Q8_0 s16
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [rows, n]
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("levels"));  // 1: llama.cpp's q8 activations; 2: two levels

extern "C" {

// The instruction sets this CPU runs, best first, comma-separated (the tests run each).
const char* capstan_cpu_block_matmul_isas() {
  static std::string names;
  names.clear();
  for (const Isa& isa : isas())
    if (isa.supported) names += (names.empty() ? "" : ",") + std::string(isa.name);
  return names.c_str();
}

// Picks the instruction set (empty: the best this CPU runs) and the thread count (the host's cores the caller
// may use); 0 on success, -1 for an instruction set this CPU lacks. Called before the first matmul (and by tests).
int capstan_cpu_block_matmul_configure(const char* isa, int threads, int spin_us, long long min_macs) {
  const Isa* pick = nullptr;
  for (const Isa& candidate : isas()) {
    static std::vector<Isa> keep;
    if (!candidate.supported) continue;
    if ((isa == nullptr || *isa == 0) || std::strcmp(isa, candidate.name) == 0) {
      keep.assign(1, candidate);
      pick = &keep[0];
      break;
    }
  }
  if (pick == nullptr) return -1;
  chosen = *pick;
  if (pool == nullptr || pool->threads() != threads) {
    delete pool;
    pool = new Pool(threads, spin_us);
  }
  min_parallel_macs = min_macs;
  return 0;
}

// The instruction set the matmuls use now.
const char* capstan_cpu_block_matmul_isa() { return chosen.name; }
}
