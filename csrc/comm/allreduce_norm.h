// The fused all-reduce + residual add + RMSNorm (+ dynamic or static per-token int8 quant) of
// tensor parallelism's row-parallel outputs, one-shot over peer-to-peer loads (torch-free).
//
// Every rank of a group holds a workspace buffer that every other rank can address (symmetric
// memory: CUDA IPC / VMM mappings, e.g. torch.distributed._symmetric_memory): a flags area, then
// room for max_tokens rows. One call per rank, the same T and H on every rank:
//   1. block b copies its rows (b, b + grid, ...) of this rank's partial sums into its buffer;
//   2. block b meets block b of every rank: each rank's block b counts its calls (an epoch word in
//      its own buffer, written by it alone); it stores the call's epoch into its flag in every
//      peer's buffer with a system-scope release store, and waits until the flag of every peer in
//      its own buffer holds it (acquire loads). Every flag has one writer and only loads and stores
//      cross the link, so it needs no peer-to-peer atomics (PCIe pairs often lack them);
//   3. it reads its rows from every rank's buffer, adds them in rank order in float32 (the same
//      order on every rank: every rank computes bit-identical outputs), rounds the sum to the
//      activation dtype (as an all-reduce's output would be), adds the residual (rounded, stored
//      back), and normalizes, quantizes and stores the row exactly as qops.fused_add_rms_norm_quant
//      (or qops.fused_add_rms_norm) does on that sum;
//   4. block b meets block b of every rank again (no rank overwrites its buffer in the next call
//      while a peer still reads it).
// Launched without programmatic dependent launch: it reads the previous kernel's output and peers'
// memory. Grid: min(T, kMaxBlocks) blocks of 256 threads (two fit an SM). Every block of every
// rank must be resident at once for the barriers to complete: true for one kernel per GPU; ranks
// simulated as streams of one GPU (the tests) must keep world x grid within what fits.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace qops {
namespace comm {

enum class Dtype : int { kFloat16 = 0, kBFloat16 = 1 };

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kMaxHidden = 16384;  // a row lives in registers: 8 x 16 B per thread at 256 threads
// The flags area at the start of every workspace buffer: [2 phases][kMaxBlocks][kMaxRanks] uint32
// flags (written by the source rank), then [kMaxBlocks] uint32 epochs (this rank's calls per
// block). Zero it once, with every rank's, before the first call.
constexpr size_t kFlagsBytes = (2 * kMaxBlocks * kMaxRanks + kMaxBlocks) * sizeof(uint32_t);

struct ArNormProblem {
  const uint64_t* buffers = nullptr;  // device array [world]: each rank's workspace buffer
  int rank = 0, world = 1;
  size_t buffer_bytes = 0;      // each buffer's size (flags + rows)
  const void* input = nullptr;  // this rank's partial sums [T, H] (Dtype), row stride in_stride
  int64_t in_stride = 0;
  void* residual = nullptr;  // [T, H], updated in place, row stride res_stride
  int64_t res_stride = 0;
  const void* weight = nullptr;  // [H]
  float eps = 0.0f;
  int t = 0, h = 0;
  Dtype dtype = Dtype::kFloat16;
  int8_t* out_q = nullptr;              // [T, H] int8 (quantizing), or nullptr
  float* out_scale = nullptr;           // [T] (quantizing, dynamic scales)
  const float* static_scale = nullptr;  // one float32 (static per-tensor scale), or nullptr
  void* out_f = nullptr;                // [T, H] in Dtype (not quantizing), or nullptr
};

// Launches the call on `stream`; cudaErrorInvalidValue for a problem outside the limits above
// (H % 8 != 0, H > kMaxHidden, world > kMaxRanks, rows that do not fit the buffer, misaligned
// pointers).
cudaError_t allreduce_add_rms_norm(const ArNormProblem& p, cudaStream_t stream);

}  // namespace comm
}  // namespace qops
