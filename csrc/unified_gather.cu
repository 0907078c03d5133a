// Zero-copy row gather from pinned host memory (PyTorch-Direct's unified tensor access, dsx flavour).
//
// Why it is shaped this way (H100, PCIe Gen5, 55 GB/s pinned copy):
//  * Host reads cross PCIe as requests of at most one 128-byte line; a request for part of a line costs
//    about as much as a whole one. So every warp instruction reads whole, aligned lines where it can: rows
//    of >= 128 bytes are read by >= 8 lanes x 16 bytes starting at the 128-byte boundary below the row.
//  * Latency is ~1-2 us, so bandwidth needs many bytes in flight: each lane issues UNROLL independent
//    loads before its stores, and short rows get sub-warps (one lane for a 16-byte row) instead of a warp.
//  * Indices arrive sorted (torch.sort on the GPU, done by the caller and counted in every figure): warps
//    that run together read neighbouring host addresses, and a repeated row is read once and written to
//    every output position that asked for it (perm gives the positions: the output is un-permuted here).
//  * The grid is bounded (max_blocks) and grid-strided, so the gather can run on a side stream on a few
//    SMs beside training.
//  * An id outside [0, num_rows) is never dereferenced (that would fault or read foreign memory): its output
//    rows are zeroed and flag = {count, id} is set; the caller checks the flag behind an event.
#include "unified_gather.h"

namespace dsx {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

template <int W>
struct Vec;
template <>
struct Vec<16> { using T = uint4; };
template <>
struct Vec<8> { using T = uint2; };
template <>
struct Vec<4> { using T = uint32_t; };
template <>
struct Vec<2> { using T = uint16_t; };
template <>
struct Vec<1> { using T = uint8_t; };

__device__ __forceinline__ int64_t out_pos(const int64_t* __restrict__ perm, int64_t j) {
  return perm != nullptr ? perm[j] : j;
}

// Bad id: count it, remember one, zero the output rows so that nothing uninitialised is ever returned.
__device__ void report_bad(const GatherArgs& a, int64_t r, int64_t begin, int64_t end, int lane, int lanes) {
  if (lane == 0) {
    unsigned long long old = atomicAdd(&a.flag[0], static_cast<unsigned long long>(end - begin));
    if (old == 0) a.flag[1] = static_cast<unsigned long long>(r);
  }
  for (int64_t j = begin; j < end; ++j) {
    uint8_t* dst = a.out + out_pos(a.perm, j) * a.row_bytes;
    for (int64_t k = lane; k < a.row_bytes; k += lanes) dst[k] = 0;
  }
}

template <typename IdxT, int W, int GROUP>
__global__ void __launch_bounds__(kThreads) gather_kernel(const GatherArgs a) {
  using VecT = typename Vec<W>::T;
  constexpr int kGroupsPerBlock = kThreads / GROUP;
  constexpr int64_t kStep = static_cast<int64_t>(GROUP) * W;  // bytes one instruction covers per row
  const IdxT* __restrict__ idx = static_cast<const IdxT*>(a.index);
  const int lane = threadIdx.x % GROUP;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kGroupsPerBlock;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + threadIdx.x / GROUP; i < a.n;
       i += stride) {
    const int64_t r = static_cast<int64_t>(idx[i]);
    if (a.dedup && i > 0 && static_cast<int64_t>(idx[i - 1]) == r) continue;  // not the head of its run
    int64_t end = i + 1;
    if (a.dedup) {
      while (end < a.n && static_cast<int64_t>(idx[end]) == r) ++end;
    }
    if (r < 0 || r >= a.num_rows) {
      report_bad(a, r, i, end, lane, GROUP);
      continue;
    }
    const uint8_t* __restrict__ src = a.table + r * a.row_bytes;
    // Start at the 128-byte line boundary at or below the row, so each instruction asks for whole lines.
    int64_t head = 0;
    if (kStep >= 128 && a.row_bytes >= 128) head = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) & 127);
    for (int64_t k0 = lane * W - head; k0 < a.row_bytes; k0 += kStep * kUnroll) {
      VecT v[kUnroll] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = k0 + u * kStep;
        if (k >= 0 && k < a.row_bytes) v[u] = *reinterpret_cast<const VecT*>(src + k);
      }
      for (int64_t j = i; j < end; ++j) {
        uint8_t* __restrict__ dst = a.out + out_pos(a.perm, j) * a.row_bytes;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t k = k0 + u * kStep;
          if (k >= 0 && k < a.row_bytes) *reinterpret_cast<VecT*>(dst + k) = v[u];
        }
      }
    }
  }
}

// The baseline the benchmark compares against: a warp per index, in the order given.
template <typename IdxT, int W>
__global__ void __launch_bounds__(kThreads) naive_kernel(const GatherArgs a) {
  using VecT = typename Vec<W>::T;
  const IdxT* __restrict__ idx = static_cast<const IdxT*>(a.index);
  const int lane = threadIdx.x % 32;
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  if (i >= a.n) return;
  const int64_t r = static_cast<int64_t>(idx[i]);
  if (r < 0 || r >= a.num_rows) {
    report_bad(a, r, i, i + 1, lane, 32);
    return;
  }
  const uint8_t* src = a.table + r * a.row_bytes;
  uint8_t* dst = a.out + out_pos(a.perm, i) * a.row_bytes;
  for (int64_t k = static_cast<int64_t>(lane) * W; k < a.row_bytes; k += 32 * W) {
    *reinterpret_cast<VecT*>(dst + k) = *reinterpret_cast<const VecT*>(src + k);
  }
}

template <typename IdxT, int W>
cudaError_t launch_w(const GatherArgs& a, int group, int blocks, cudaStream_t s) {
  switch (group) {
    case 1: gather_kernel<IdxT, W, 1><<<blocks, kThreads, 0, s>>>(a); break;
    case 2: gather_kernel<IdxT, W, 2><<<blocks, kThreads, 0, s>>>(a); break;
    case 4: gather_kernel<IdxT, W, 4><<<blocks, kThreads, 0, s>>>(a); break;
    case 8: gather_kernel<IdxT, W, 8><<<blocks, kThreads, 0, s>>>(a); break;
    case 16: gather_kernel<IdxT, W, 16><<<blocks, kThreads, 0, s>>>(a); break;
    default: gather_kernel<IdxT, W, 32><<<blocks, kThreads, 0, s>>>(a); break;
  }
  return cudaGetLastError();
}

template <typename IdxT>
cudaError_t launch_idx(const GatherArgs& a, int w, int group, int blocks, cudaStream_t s) {
  switch (w) {
    case 16: return launch_w<IdxT, 16>(a, group, blocks, s);
    case 8: return launch_w<IdxT, 8>(a, group, blocks, s);
    case 4: return launch_w<IdxT, 4>(a, group, blocks, s);
    case 2: return launch_w<IdxT, 2>(a, group, blocks, s);
    default: return launch_w<IdxT, 1>(a, group, blocks, s);
  }
}

template <typename IdxT>
cudaError_t launch_naive_idx(const GatherArgs& a, int w, int blocks, cudaStream_t s) {
  switch (w) {
    case 16: naive_kernel<IdxT, 16><<<blocks, kThreads, 0, s>>>(a); break;
    case 8: naive_kernel<IdxT, 8><<<blocks, kThreads, 0, s>>>(a); break;
    case 4: naive_kernel<IdxT, 4><<<blocks, kThreads, 0, s>>>(a); break;
    case 2: naive_kernel<IdxT, 2><<<blocks, kThreads, 0, s>>>(a); break;
    default: naive_kernel<IdxT, 1><<<blocks, kThreads, 0, s>>>(a); break;
  }
  return cudaGetLastError();
}

int next_pow2(int64_t x) {
  int p = 1;
  while (p < x && p < 32) p <<= 1;
  return p;
}

}  // namespace

int pick_vector_bytes(const void* table, const void* out, int64_t row_bytes) {
  const auto t = reinterpret_cast<uintptr_t>(table), o = reinterpret_cast<uintptr_t>(out);
  for (int w : {16, 8, 4, 2}) {
    if (row_bytes % w == 0 && t % w == 0 && o % w == 0) return w;
  }
  return 1;
}

int pick_group_lanes(int64_t row_bytes, int vec_bytes) {
  const int64_t chunks = (row_bytes + vec_bytes - 1) / vec_bytes;
  if (row_bytes < 128) return next_pow2(chunks);  // one load per lane, several rows per warp
  // Enough lanes that one instruction covers a whole 128-byte line, few enough that each lane keeps
  // kUnroll loads in flight.
  int lanes = next_pow2((chunks + kUnroll - 1) / kUnroll);
  const int line_lanes = 128 / vec_bytes > 32 ? 32 : 128 / vec_bytes;
  return lanes < line_lanes ? line_lanes : lanes;
}

cudaError_t launch_gather(const GatherArgs& a, int max_blocks, cudaStream_t stream) {
  if (a.n == 0 || a.row_bytes == 0) return cudaSuccess;
  const int w = pick_vector_bytes(a.table, a.out, a.row_bytes);
  const int group = pick_group_lanes(a.row_bytes, w);
  const int64_t groups_per_block = kThreads / group;
  int64_t blocks = (a.n + groups_per_block - 1) / groups_per_block;
  if (max_blocks > 0 && blocks > max_blocks) blocks = max_blocks;
  if (blocks > (1LL << 30)) blocks = 1LL << 30;
  return a.index_is_int64 ? launch_idx<int64_t>(a, w, group, static_cast<int>(blocks), stream)
                          : launch_idx<int32_t>(a, w, group, static_cast<int>(blocks), stream);
}

cudaError_t launch_naive_gather(const GatherArgs& a, cudaStream_t stream) {
  if (a.n == 0 || a.row_bytes == 0) return cudaSuccess;
  const int w = pick_vector_bytes(a.table, a.out, a.row_bytes);
  const int64_t blocks = (a.n * 32 + kThreads - 1) / kThreads;
  if (blocks > (1LL << 31) - 1) return cudaErrorInvalidConfiguration;
  return a.index_is_int64 ? launch_naive_idx<int64_t>(a, w, static_cast<int>(blocks), stream)
                          : launch_naive_idx<int32_t>(a, w, static_cast<int>(blocks), stream);
}

}  // namespace dsx
