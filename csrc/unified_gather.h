// Zero-copy row gather from pinned (cudaHostRegister'ed) host memory: launcher interface.
//
// Kept free of torch headers so that the kernels compile (and can be checked) with plain nvcc; the torch
// binding lives in unified_gather.cpp.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsx {

struct GatherArgs {
  const uint8_t* table;      // device-accessible address of row 0 (UVA view of the pinned host table)
  uint8_t* out;              // device output, row-major, n rows of row_bytes
  const void* index;         // n row ids (int32 or int64); sorted ascending when dedup is set
  const int64_t* perm;       // output position of index[i]; nullptr means position i
  int64_t n;                 // number of indices
  int64_t row_bytes;         // bytes per row (any value >= 1)
  int64_t row_stride;        // bytes from one row of the table to the next (>= row_bytes; padded tables)
  int64_t num_rows;          // rows in the table; ids outside [0, num_rows) are errors
  unsigned long long* flag;  // device [count of bad ids, one bad id]; zero before the launch
  bool index_is_int64;
  bool dedup;                // index is sorted: each distinct row is read once and written to every position
};

// Tuned kernel: sub-warp per row sized by row_bytes, 16/8/4/2/1-byte loads by alignment, 128-byte aligned
// line requests for rows of 128 bytes or more; rows of 256 bytes or more that cannot use 16-byte accesses
// are loaded 16 bytes at a time from aligned addresses and stored in the widest word that fits. One wave of
// 256-thread blocks, as many as max_sms SMs hold (occupancy-derived; max_sms <= 0 means every SM),
// grid-strided over the indices.
cudaError_t launch_gather(const GatherArgs& args, int max_sms, cudaStream_t stream);

// Baseline for benchmarks: one warp per row in index order, no alignment, no unrolling, no dedup.
cudaError_t launch_naive_gather(const GatherArgs& args, cudaStream_t stream);

// Vector width (bytes) and lanes per row the tuned kernel would use (exposed for tests and reports).
int pick_vector_bytes(const void* table, const void* out, int64_t row_bytes, int64_t row_stride);
int pick_group_lanes(int64_t row_bytes, int vec_bytes);
// Whether a row of row_bytes whose accesses can be vec_bytes wide is loaded 16 bytes at a time instead.
bool use_wide_loads(int64_t row_bytes, int vec_bytes);

}  // namespace dsx
