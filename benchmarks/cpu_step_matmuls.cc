// A one-token decode step's matmuls of SmolLM2-135M (30 layers of qkv 576x960, o 576x576, gate_up 576x3072, down
// 1536x576 in Q4_1, the LM head 576x49152 in Q8_0), each layer its own weights as in the model (so they come from
// memory, not the cache), through the native kernel's own multiply() (the file is included whole). Built and run by
// benchmarks/cpu_step_matmuls.py; args: levels (0: only read the bytes) threads rows distinct_layers tokens.
#include "../runtime/kernels/cpu/block_matmul.cc"

#pragma GCC target("avx2")

#include <array>
#include <cstdio>
#include <random>

namespace {

struct Weight {
  std::vector<uint8_t> w;
  std::vector<uint16_t> d, m;
  int kind;
  int64_t k, n;
};

uint16_t half_bits(float v) {
  const _Float16 h = static_cast<_Float16>(v);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

Weight random_weight(int64_t k, int64_t n, int kind, std::mt19937& rng) {
  Weight r{{}, {}, {}, kind, k, n};
  const int64_t groups = (n + 7) / 8, nb = k / kBlock;
  r.w.resize(groups * 8 * (kind == kQ4_1 ? k / 2 : k));
  for (auto& v : r.w) v = static_cast<uint8_t>(rng() & (kind == kQ4_1 ? 0xff : 0x7f));
  r.d.assign(groups * nb * 8, half_bits(0.01f));
  r.m.assign(groups * nb * 8, kind == kQ4_1 ? half_bits(-0.08f) : uint16_t{100});
  return r;
}

std::atomic<int64_t> sink{0};

// levels 0: only read the weight's bytes (w, d, m), split over the pool as the matmul splits them: the memory floor
void read_only(const Weight& w) {
  const int64_t chunks = 16, bytes = static_cast<int64_t>(w.w.size()), per = (bytes / chunks + 63) & ~int64_t{63};
  capstan_parallel_for(chunks, [&](int64_t i) {
    __m256i acc = _mm256_setzero_si256();
    const auto sum = [&](const uint8_t* from, int64_t n) {
      for (int64_t at = 0; at + 32 <= n; at += 32)
        acc = _mm256_add_epi8(acc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + at)));
    };
    const int64_t start = std::min(bytes, i * per), end = std::min(bytes, start + per);
    sum(w.w.data() + start, end - start);
    const int64_t scale_bytes = static_cast<int64_t>(w.d.size()) * 2, share = scale_bytes * start / bytes;
    const int64_t share_end = scale_bytes * end / bytes;
    sum(reinterpret_cast<const uint8_t*>(w.d.data()) + share, share_end - share);
    sum(reinterpret_cast<const uint8_t*>(w.m.data()) + share, share_end - share);
    alignas(32) int8_t lanes[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    sink += lanes[0];
  });
}

void run(const Weight& w, const float* x, int64_t rows, int levels, float* y) {
  if (levels == 0) return read_only(w);
  Problem p;
  p.kind = w.kind;
  p.rows = rows;
  p.k = w.k;
  p.n = w.n;
  p.nb = w.k / kBlock;
  p.w = w.w.data();
  p.d = w.d.data();
  p.m = w.m.data();
  multiply(p, x, levels, y);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int levels = argc > 1 ? atoi(argv[1]) : 2, threads = argc > 2 ? atoi(argv[2]) : 2;
  const int rows = argc > 3 ? atoi(argv[3]) : 1, distinct = argc > 4 ? atoi(argv[4]) : 30;
  const int tokens = argc > 5 ? atoi(argv[5]) : 300;
  capstan_cpu_block_matmul_configure("", threads, 200, 1 << 16);
  std::mt19937 rng(0);
  std::vector<std::array<Weight, 4>> layers;
  for (int i = 0; i < distinct; ++i)
    layers.push_back({random_weight(576, 960, kQ4_1, rng), random_weight(576, 576, kQ4_1, rng),
                      random_weight(576, 3072, kQ4_1, rng), random_weight(1536, 576, kQ4_1, rng)});
  const Weight head = random_weight(576, 49152, kQ8_0, rng);
  std::vector<float> x(rows * 1536), y(rows * 49152);
  std::normal_distribution<float> normal;
  for (auto& v : x) v = normal(rng);
  std::vector<double> layer_ms, head_ms;
  for (int t = 0; t < tokens; ++t) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 30; ++i)
      for (const Weight& w : layers[i % distinct]) run(w, x.data(), rows, levels, y.data());
    const auto mid = std::chrono::steady_clock::now();
    run(head, x.data(), rows, levels, y.data());
    const auto end = std::chrono::steady_clock::now();
    layer_ms.push_back(std::chrono::duration<double, std::milli>(mid - start).count());
    head_ms.push_back(std::chrono::duration<double, std::milli>(end - mid).count());
  }
  printf("%d %d %d %d %.3f %.3f %.3f %.3f\n", levels, threads, rows, distinct, median(layer_ms),
         *std::min_element(layer_ms.begin(), layer_ms.end()), median(head_ms),
         *std::min_element(head_ms.begin(), head_ms.end()));
}
