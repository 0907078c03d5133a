// Torch binding of the zero-copy gather (kernels in unified_gather.cu).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <optional>

#include "unified_gather.h"

namespace {

// The device-side address of a registered host table's first row (equal to the host address on UVA systems
// with canUseHostPointerForRegisteredMem, but asking keeps us right where it is not).
const uint8_t* device_view(const at::Tensor& table) {
  TORCH_CHECK(table.device().is_cpu(), "unified gather: the table must be a CPU tensor, got ", table.device());
  void* dptr = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dptr, table.data_ptr(), 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // handled here; do not leak into torch's next launch check
    TORCH_CHECK(false, "unified gather: the table's memory is not registered with CUDA (",
                cudaGetErrorString(err), "); create it with dsx.unified(tensor)");
  }
  return static_cast<const uint8_t*>(dptr);
}

// Bytes from one row of the table to the next, after checking that each row is contiguous and row_bytes long
// (a contiguous table, or the leading bytes of each row of a wider one).
int64_t table_row_stride(const at::Tensor& table, int64_t row_bytes) {
  TORCH_CHECK(table.dim() >= 1, "unified gather: the table needs at least one dimension");
  int64_t inner = 1;
  for (int64_t d = table.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(table.size(d) <= 1 || table.stride(d) == inner,
                "unified gather: each row of the table must be contiguous (dimension ", d, " has stride ",
                table.stride(d), ", expected ", inner, ")");
    inner *= table.size(d);
  }
  TORCH_CHECK(inner * table.element_size() == row_bytes, "unified gather: the table's rows hold ",
              inner * table.element_size(), " bytes, not row_bytes=", row_bytes);
  if (table.size(0) <= 1) return row_bytes;
  const int64_t stride = table.stride(0) * table.element_size();
  TORCH_CHECK(stride >= row_bytes, "unified gather: the table's rows overlap (", stride, " bytes apart, ",
              row_bytes, " bytes each)");
  return stride;
}

dsx::GatherArgs make_args(const at::Tensor& table, const at::Tensor& index, const std::optional<at::Tensor>& perm,
                          const at::Tensor& out, const at::Tensor& flag, int64_t row_bytes, int64_t row_stride,
                          int64_t num_rows, bool dedup) {
  TORCH_CHECK(index.is_cuda() && index.is_contiguous() && index.dim() == 1,
              "unified gather: index must be a contiguous 1-d CUDA tensor");
  TORCH_CHECK(index.scalar_type() == at::kInt || index.scalar_type() == at::kLong,
              "unified gather: index dtype must be int32 or int64, got ", index.scalar_type());
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.device() == index.device(),
              "unified gather: out must be a contiguous CUDA tensor on the index's device");
  TORCH_CHECK(out.numel() * out.element_size() == index.numel() * row_bytes,
              "unified gather: out holds ", out.numel() * out.element_size(), " bytes, expected ",
              index.numel() * row_bytes);
  TORCH_CHECK(flag.is_cuda() && flag.scalar_type() == at::kLong && flag.numel() == 2 && flag.is_contiguous(),
              "unified gather: flag must be a contiguous int64 CUDA tensor of 2 elements");
  TORCH_CHECK(table_row_stride(table, row_bytes) == row_stride, "unified gather: row_stride=", row_stride,
              " but the table's rows lie ", table_row_stride(table, row_bytes), " bytes apart");
  // Rows are row_stride bytes apart (a padded table is a view of its wider storage): every byte of the last
  // row must lie in the table's storage.
  const int64_t held =
      static_cast<int64_t>(table.storage().nbytes()) - table.storage_offset() * table.element_size();
  TORCH_CHECK(num_rows == 0 || (num_rows - 1) * row_stride + row_bytes <= held, "unified gather: ", num_rows,
              " rows of ", row_bytes, " bytes, ", row_stride, " bytes apart, do not fit the table's ", held,
              " bytes");
  if (perm.has_value()) {
    TORCH_CHECK(perm->is_cuda() && perm->scalar_type() == at::kLong && perm->is_contiguous() &&
                    perm->numel() == index.numel(),
                "unified gather: perm must be a contiguous int64 CUDA tensor as long as index");
  }
  dsx::GatherArgs a{};
  a.table = num_rows > 0 ? device_view(table) : nullptr;
  a.out = static_cast<uint8_t*>(out.data_ptr());
  a.index = index.data_ptr();
  a.perm = perm.has_value() ? perm->data_ptr<int64_t>() : nullptr;
  a.n = index.numel();
  a.row_bytes = row_bytes;
  a.row_stride = row_stride;
  a.num_rows = num_rows;
  a.flag = reinterpret_cast<unsigned long long*>(flag.data_ptr<int64_t>());
  a.index_is_int64 = index.scalar_type() == at::kLong;
  a.dedup = dedup;
  return a;
}

void gather(const at::Tensor& table, const at::Tensor& index, const std::optional<at::Tensor>& perm,
            at::Tensor& out, at::Tensor& flag, int64_t row_bytes, int64_t row_stride, int64_t num_rows,
            int64_t max_sms, bool dedup) {
  const c10::cuda::CUDAGuard guard(index.device());
  if (index.numel() == 0 || row_bytes == 0) return;
  const dsx::GatherArgs a = make_args(table, index, perm, out, flag, row_bytes, row_stride, num_rows, dedup);
  C10_CUDA_CHECK(dsx::launch_gather(a, static_cast<int>(max_sms), c10::cuda::getCurrentCUDAStream().stream()));
}

void naive_gather(const at::Tensor& table, const at::Tensor& index, at::Tensor& out, at::Tensor& flag,
                  int64_t row_bytes, int64_t num_rows) {
  const c10::cuda::CUDAGuard guard(index.device());
  if (index.numel() == 0 || row_bytes == 0) return;
  const dsx::GatherArgs a =
      make_args(table, index, std::nullopt, out, flag, row_bytes, table_row_stride(table, row_bytes), num_rows, false);
  C10_CUDA_CHECK(dsx::launch_naive_gather(a, c10::cuda::getCurrentCUDAStream().stream()));
}

std::vector<int64_t> launch_shape(const at::Tensor& table, const at::Tensor& out, int64_t row_bytes,
                                  int64_t row_stride) {
  const int w = dsx::pick_vector_bytes(table.data_ptr(), out.data_ptr(), row_bytes, row_stride);
  const bool wide = dsx::use_wide_loads(row_bytes, w);
  return {wide ? 16 : w, dsx::pick_group_lanes(row_bytes, wide ? 16 : w), w};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dsx zero-copy gather from pinned host memory";
  m.def("gather", &gather, "sorted/deduplicated zero-copy gather (index sorted when dedup)", py::arg("table"),
        py::arg("index"), py::arg("perm"), py::arg("out"), py::arg("flag"), py::arg("row_bytes"),
        py::arg("row_stride"), py::arg("num_rows"), py::arg("max_sms"), py::arg("dedup"));
  m.def("naive_gather", &naive_gather, "baseline: warp per row, index order", py::arg("table"), py::arg("index"),
        py::arg("out"), py::arg("flag"), py::arg("row_bytes"), py::arg("num_rows"));
  m.def("launch_shape", &launch_shape, "(load bytes, lanes per row, store bytes) the kernel picks; the host emulation reports (store bytes, lanes, blocks, wide)");
}
