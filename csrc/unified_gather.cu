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

#include <cstring>
#include <type_traits>

namespace dsx {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int64_t kShortRowBytes = 512;
constexpr int kShortRowSms = 8;
// Rows of at least this many bytes whose size or alignment rules out 16-byte accesses (300 B, 1000 B) are
// still read 16 bytes at a time, from 16-byte aligned addresses, and stored W bytes at a time: the
// request rate, not the stores into device memory, bounds the gather.
constexpr int64_t kWideRowBytes = 256;

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

#if defined(__CUDA_ARCH__)
#define DSX_HD __device__ __forceinline__
#define DSX_UNROLL _Pragma("unroll")
#else
#define DSX_HD inline  // the same thread bodies run on the host in the CPU emulation test
#define DSX_UNROLL
#endif

DSX_HD int64_t out_pos(const int64_t* __restrict__ perm, int64_t j) { return perm != nullptr ? perm[j] : j; }

DSX_HD unsigned long long atomic_add(unsigned long long* p, unsigned long long v) {
#if defined(__CUDA_ARCH__)
  return atomicAdd(p, v);
#else
  return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

// Bad id: count it, remember one, zero the output rows so that nothing uninitialised is ever returned.
DSX_HD void report_bad(const GatherArgs& a, int64_t r, int64_t begin, int64_t end, int lane, int lanes) {
  if (lane == 0) {
    unsigned long long old = atomic_add(&a.flag[0], static_cast<unsigned long long>(end - begin));
    if (old == 0) a.flag[1] = static_cast<unsigned long long>(r);
  }
  for (int64_t j = begin; j < end; ++j) {
    uint8_t* dst = a.out + out_pos(a.perm, j) * a.row_bytes;
    for (int64_t k = lane; k < a.row_bytes; k += lanes) dst[k] = 0;
  }
}

// Index i's row r and the output positions [i, end) that ask for it (with dedup, the run of equal sorted ids
// that i heads); false where there is nothing to copy: i is not the head of its run, or r is a bad id (then
// reported, its outputs zeroed).
template <typename IdxT>
DSX_HD bool row_run(const GatherArgs& a, const IdxT* __restrict__ idx, int64_t i, int lane, int lanes, int64_t& r,
                    int64_t& end) {
  r = static_cast<int64_t>(idx[i]);
  if (a.dedup && i > 0 && static_cast<int64_t>(idx[i - 1]) == r) return false;
  end = i + 1;
  if (a.dedup) {
    while (end < a.n && static_cast<int64_t>(idx[end]) == r) ++end;
  }
  if (r < 0 || r >= a.num_rows) {
    report_bad(a, r, i, end, lane, lanes);
    return false;
  }
  return true;
}

// One thread of the tuned kernel (block, grid size in blocks, thread index in the block).
template <typename IdxT, int W, int GROUP>
DSX_HD void gather_thread(const GatherArgs& a, int64_t block, int64_t grid, int tid) {
  using VecT = typename Vec<W>::T;
  constexpr int kGroupsPerBlock = kThreads / GROUP;
  constexpr int64_t kStep = static_cast<int64_t>(GROUP) * W;  // bytes one instruction covers per row
  const IdxT* __restrict__ idx = static_cast<const IdxT*>(a.index);
  const int lane = tid % GROUP;
  const int64_t stride = grid * kGroupsPerBlock;
  for (int64_t i = block * kGroupsPerBlock + tid / GROUP; i < a.n; i += stride) {
    int64_t r = 0, end = 0;
    if (!row_run(a, idx, i, lane, GROUP, r, end)) continue;
    const uint8_t* __restrict__ src = a.table + r * a.row_stride;
    // Start at the 128-byte line boundary at or below the row, so each instruction asks for whole lines.
    int64_t head = 0;
    if (kStep >= 128 && a.row_bytes >= 128) head = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) & 127);
    for (int64_t k0 = lane * W - head; k0 < a.row_bytes; k0 += kStep * kUnroll) {
      VecT v[kUnroll] = {};
DSX_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = k0 + u * kStep;
        if (k >= 0 && k < a.row_bytes) v[u] = *reinterpret_cast<const VecT*>(src + k);
      }
      for (int64_t j = i; j < end; ++j) {
        uint8_t* __restrict__ dst = a.out + out_pos(a.perm, j) * a.row_bytes;
DSX_UNROLL
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t k = k0 + u * kStep;
          if (k >= 0 && k < a.row_bytes) *reinterpret_cast<VecT*>(dst + k) = v[u];
        }
      }
    }
  }
}

// One thread of the wide-load kernel: 16-byte loads from aligned addresses over the 128-byte lines a row
// touches, W-byte stores of the row's bytes (W divides the row size and both bases, so each stored word is
// aligned). A loaded chunk may hold bytes of the neighbouring rows: they share a 16-byte block, and so a
// page, with bytes of this row, so reading them never faults; they are never stored.
template <typename IdxT, int W, int GROUP>
DSX_HD void gather_wide_thread(const GatherArgs& a, int64_t block, int64_t grid, int tid) {
  using WordT = typename Vec<W>::T;
  constexpr int kGroupsPerBlock = kThreads / GROUP;
  constexpr int64_t kStep = static_cast<int64_t>(GROUP) * 16;
  constexpr int kWords = 16 / W;
  const IdxT* __restrict__ idx = static_cast<const IdxT*>(a.index);
  const int lane = tid % GROUP;
  const int64_t stride = grid * kGroupsPerBlock;
  for (int64_t i = block * kGroupsPerBlock + tid / GROUP; i < a.n; i += stride) {
    int64_t r = 0, end = 0;
    if (!row_run(a, idx, i, lane, GROUP, r, end)) continue;
    const uint8_t* __restrict__ src = a.table + r * a.row_stride;
    const int64_t head = static_cast<int64_t>(reinterpret_cast<uintptr_t>(src) & 127);
    for (int64_t k0 = lane * 16 - head; k0 < a.row_bytes; k0 += kStep * kUnroll) {
      uint4 v[kUnroll] = {};
DSX_UNROLL
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = k0 + u * kStep;
        if (k + 16 > 0 && k < a.row_bytes) v[u] = *reinterpret_cast<const uint4*>(src + k);
      }
      for (int64_t j = i; j < end; ++j) {
        uint8_t* __restrict__ dst = a.out + out_pos(a.perm, j) * a.row_bytes;
DSX_UNROLL
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t k = k0 + u * kStep;
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&v[u]);
DSX_UNROLL
          for (int q = 0; q < kWords; ++q) {
            const int64_t kb = k + q * W;
            if (kb >= 0 && kb < a.row_bytes) {
              WordT word;  // (memcpy: no type punning; a register move once compiled)
              memcpy(&word, bytes + q * W, W);
              *reinterpret_cast<WordT*>(dst + kb) = word;
            }
          }
        }
      }
    }
  }
}

// One thread of the baseline: a warp per index, in the order given, no unrolling, no alignment.
template <typename IdxT, int W>
DSX_HD void naive_thread(const GatherArgs& a, int64_t block, int tid) {
  using VecT = typename Vec<W>::T;
  const IdxT* __restrict__ idx = static_cast<const IdxT*>(a.index);
  const int lane = tid % 32;
  const int64_t i = (block * kThreads + tid) / 32;
  if (i >= a.n) return;
  const int64_t r = static_cast<int64_t>(idx[i]);
  if (r < 0 || r >= a.num_rows) {
    report_bad(a, r, i, i + 1, lane, 32);
    return;
  }
  const uint8_t* src = a.table + r * a.row_stride;
  uint8_t* dst = a.out + out_pos(a.perm, i) * a.row_bytes;
  for (int64_t k = static_cast<int64_t>(lane) * W; k < a.row_bytes; k += 32 * W) {
    *reinterpret_cast<VecT*>(dst + k) = *reinterpret_cast<const VecT*>(src + k);
  }
}

template <typename IdxT, int W, int GROUP>
__global__ void __launch_bounds__(kThreads) gather_kernel(const GatherArgs a) {
  gather_thread<IdxT, W, GROUP>(a, blockIdx.x, gridDim.x, threadIdx.x);
}

template <typename IdxT, int W, int GROUP>
__global__ void __launch_bounds__(kThreads) gather_wide_kernel(const GatherArgs a) {
  gather_wide_thread<IdxT, W, GROUP>(a, blockIdx.x, gridDim.x, threadIdx.x);
}

template <typename IdxT, int W>
__global__ void __launch_bounds__(kThreads) naive_kernel(const GatherArgs a) {
  naive_thread<IdxT, W>(a, blockIdx.x, threadIdx.x);
}

// Compile-time dispatch: f(integral_constant<W>) etc. One instantiation per (index type, width, lanes).
template <typename F>
void with_width(int w, F&& f) {
  switch (w) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

template <typename F>
void with_lanes(int g, F&& f) {
  switch (g) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
}

template <typename F>
void with_index(bool is64, F&& f) {
  if (is64) {
    f(int64_t{});
  } else {
    f(int32_t{});
  }
}

int next_pow2(int64_t x) {
  int p = 1;
  while (p < x && p < 32) p <<= 1;
  return p;
}

struct Plan {
  int w, lanes;
  bool wide;  // 16-byte aligned loads, w-byte stores (gather_wide_thread)
  int64_t blocks;
};

}  // namespace

int pick_vector_bytes(const void* table, const void* out, int64_t row_bytes, int64_t row_stride) {
  const auto t = reinterpret_cast<uintptr_t>(table), o = reinterpret_cast<uintptr_t>(out);
  for (int w : {16, 8, 4, 2}) {
    if (row_bytes % w == 0 && row_stride % w == 0 && t % w == 0 && o % w == 0) return w;
  }
  return 1;
}

bool use_wide_loads(int64_t row_bytes, int vec_bytes) { return vec_bytes < 16 && row_bytes >= kWideRowBytes; }

int pick_group_lanes(int64_t row_bytes, int vec_bytes) {
  const int64_t chunks = (row_bytes + vec_bytes - 1) / vec_bytes;
  if (row_bytes < 128) return next_pow2(chunks);  // one load per lane, several rows per warp
  // Enough lanes that one instruction covers a whole 128-byte line, few enough that each lane keeps
  // kUnroll loads in flight.
  int lanes = next_pow2((chunks + kUnroll - 1) / kUnroll);
  const int line_lanes = 128 / vec_bytes > 32 ? 32 : 128 / vec_bytes;
  return lanes < line_lanes ? line_lanes : lanes;
}

namespace {

Plan plan_gather(const GatherArgs& a, int max_blocks) {
  Plan p{};
  p.w = pick_vector_bytes(a.table, a.out, a.row_bytes, a.row_stride);
  p.wide = use_wide_loads(a.row_bytes, p.w);
  p.lanes = pick_group_lanes(a.row_bytes, p.wide ? 16 : p.w);
  const int64_t groups_per_block = kThreads / p.lanes;
  p.blocks = (a.n + groups_per_block - 1) / groups_per_block;
  if (max_blocks > 0 && p.blocks > max_blocks) p.blocks = max_blocks;
  if (p.blocks > (1LL << 30)) p.blocks = 1LL << 30;  // grid-stride covers the rest
  return p;
}

}  // namespace

cudaError_t launch_gather(const GatherArgs& a, int max_sms, cudaStream_t stream) {
  if (a.n == 0 || a.row_bytes == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  int use_sms = (max_sms > 0 && max_sms < sms) ? max_sms : sms;
  // Rows under 512 bytes: fewer requests in flight read faster (measured on an H100: docs/unified.md, "Bounded
  // SMs"); 512-byte rows and longer are as fast or faster on 16. max_sms stays an upper bound.
  if (a.row_bytes < kShortRowBytes && use_sms > kShortRowSms) use_sms = kShortRowSms;
  const Plan shape = plan_gather(a, 0);
  with_index(a.index_is_int64, [&](auto idx_tag) {
    using IdxT = decltype(idx_tag);
    with_width(shape.w, [&](auto wc) {
      with_lanes(shape.lanes, [&](auto gc) {
        constexpr int W = decltype(wc)::value, G = decltype(gc)::value;
        auto launch = [&](auto kernel) {
          // As many blocks as use_sms SMs hold at once: one wave, grid-strided; the thread slots it takes
          // are use_sms SMs' worth (the block scheduler places them where it likes).
          int per_sm = 0;
          err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
          if (err != cudaSuccess) return;
          const Plan p = plan_gather(a, (per_sm > 0 ? per_sm : 1) * use_sms);
          kernel<<<static_cast<unsigned>(p.blocks), kThreads, 0, stream>>>(a);
          err = cudaGetLastError();
        };
        // wide plans have W < 16 and cover a 128-byte line per instruction (>= 8 lanes): only those
        // instantiations exist
        if constexpr (W < 16 && G >= 8) {
          if (shape.wide) return launch(gather_wide_kernel<IdxT, W, G>);
        }
        launch(gather_kernel<IdxT, W, G>);
      });
    });
  });
  return err;
}

cudaError_t launch_naive_gather(const GatherArgs& a, cudaStream_t stream) {
  if (a.n == 0 || a.row_bytes == 0) return cudaSuccess;
  const int w = pick_vector_bytes(a.table, a.out, a.row_bytes, a.row_stride);
  const int64_t blocks = (a.n * 32 + kThreads - 1) / kThreads;
  if (blocks > (1LL << 31) - 1) return cudaErrorInvalidConfiguration;
  with_index(a.index_is_int64, [&](auto idx_tag) {
    using IdxT = decltype(idx_tag);
    with_width(w, [&](auto wc) {
      naive_kernel<IdxT, decltype(wc)::value><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
    });
  });
  return cudaGetLastError();
}

#if defined(DSX_HOST_EMULATION)
// CPU emulation for tests on machines without a GPU: runs every thread of the same grid, one after the
// other, through the same thread bodies the kernels run (threads never synchronise, so any order is a
// valid schedule). Returns the (vector bytes, lanes, blocks, wide loads) it used through plan_out.
extern "C" int dsx_emulate_gather(const GatherArgs* args, int max_blocks, int naive, int64_t* plan_out) {
  const GatherArgs& a = *args;
  if (a.n == 0 || a.row_bytes == 0) return 0;
  if (naive) {
    const int w = pick_vector_bytes(a.table, a.out, a.row_bytes, a.row_stride);
    const int64_t blocks = (a.n * 32 + kThreads - 1) / kThreads;
    plan_out[0] = w, plan_out[1] = 32, plan_out[2] = blocks;
    with_index(a.index_is_int64, [&](auto idx_tag) {
      using IdxT = decltype(idx_tag);
      with_width(w, [&](auto wc) {
        for (int64_t b = 0; b < blocks; ++b)
          for (int t = 0; t < kThreads; ++t) naive_thread<IdxT, decltype(wc)::value>(a, b, t);
      });
    });
    return 0;
  }
  const Plan p = plan_gather(a, max_blocks);
  plan_out[0] = p.w, plan_out[1] = p.lanes, plan_out[2] = p.blocks, plan_out[3] = p.wide;
  with_index(a.index_is_int64, [&](auto idx_tag) {
    using IdxT = decltype(idx_tag);
    with_width(p.w, [&](auto wc) {
      with_lanes(p.lanes, [&](auto gc) {
        constexpr int W = decltype(wc)::value, G = decltype(gc)::value;
        for (int64_t b = 0; b < p.blocks; ++b)
          for (int t = 0; t < kThreads; ++t) {
            if constexpr (W < 16 && G >= 8) {
              if (p.wide) {
                gather_wide_thread<IdxT, W, G>(a, b, p.blocks, t);
                continue;
              }
            }
            gather_thread<IdxT, W, G>(a, b, p.blocks, t);
          }
      });
    });
  });
  return 0;
}
#endif

}  // namespace dsx
