// The library's thread pool (block_matmul.cc's), shared by its kernels so they never oversubscribe the host's cores.
#pragma once

#include <cstdint>
#include <functional>

// fn(chunk) for chunk in [0, chunks) on the caller and the pool's workers (all on the caller when the pool is busy
// with another call, or has one thread).
void capstan_parallel_for(int64_t chunks, const std::function<void(int64_t)>& fn);
