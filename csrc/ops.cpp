// The only torch glue of fusedpar._C: op schemas (TORCH_LIBRARY_FRAGMENT(fusedpar)), their
// CUDA implementations (argument checks + a launch on the current CUDA stream), and a
// minimal Python module so that `import fusedpar._C` loads the library and registers them.
//
// Kept light for compile time: torch/library.h + c10/cuda headers only (no
// torch/extension.h, no pybind11, no ATen/cuda/CUDAContext.h).
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/symm_collectives.h"

namespace fusedpar {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

void check_cuda_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), "fusedpar::", op, ": '", name, "' is undefined");
  TORCH_CHECK(t.is_cuda(), "fusedpar::", op, ": '", name, "' must be a CUDA tensor, got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), "fusedpar::", op, ": '", name, "' must be contiguous");
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op,
                       const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "fusedpar::", op, ": '", name, "' is on ",
              t.device(), " but 'pad_table' is on ", ref.device());
}

void check_group(const at::Tensor& pad_table, int64_t rank, int64_t world_size,
                 const char* op) {
  TORCH_CHECK(world_size >= 1 && world_size <= layout::MAX_WORLD, "fusedpar::", op,
              ": 'world_size' must be in [1, ", layout::MAX_WORLD, "], got ", world_size);
  TORCH_CHECK(rank >= 0 && rank < world_size, "fusedpar::", op, ": 'rank' must be in [0, ",
              world_size, "), got ", rank);
  check_cuda_tensor(pad_table, op, "pad_table");
  TORCH_CHECK(pad_table.scalar_type() == at::kLong, "fusedpar::", op,
              ": 'pad_table' must be int64, got ", pad_table.scalar_type());
  TORCH_CHECK(pad_table.dim() == 1 && pad_table.numel() == world_size, "fusedpar::", op,
              ": 'pad_table' must have shape [world_size=", world_size, "], got ",
              pad_table.sizes());
}

// An epoch <= 0 is relative to the rank's device-held EPOCH word (CUDA graphs).
void check_epoch(int64_t epoch, const char* op) {
  TORCH_CHECK(epoch >= -kInt32Max && epoch <= kInt32Max, "fusedpar::", op,
              ": 'epoch' must be in [-(2^31-1), 2^31-1], got ", epoch);
}

void check_timeout_ns(int64_t timeout_ns, const char* op) {
  TORCH_CHECK(timeout_ns >= 1, "fusedpar::", op, ": 'timeout_ns' must be >= 1 ns, got ", timeout_ns);
}

void check_meta(int64_t meta, const char* op) {
  TORCH_CHECK(meta <= kInt32Max, "fusedpar::", op,
              ": 'meta' must be < 2^31 (negative: no META), got ", meta);
}

void check_stats(const at::Tensor& stats, const at::Tensor& pad_table, const char* op) {
  check_cuda_tensor(stats, op, "stats");
  check_same_device(stats, pad_table, op, "stats");
  TORCH_CHECK(stats.scalar_type() == at::kLong, "fusedpar::", op,
              ": 'stats' must be int64, got ", stats.scalar_type());
  TORCH_CHECK(stats.numel() == 1, "fusedpar::", op, ": 'stats' must have 1 element, got ",
              stats.numel());
}

void check_outer_inner(int64_t outer, int64_t inner, const char* op) {
  TORCH_CHECK(outer >= 0, "fusedpar::", op, ": 'outer' must be >= 0, got ", outer);
  TORCH_CHECK(inner >= 0, "fusedpar::", op, ": 'inner' must be >= 0, got ", inner);
}

// What the flag ops share: the group, its words [word_base, word_base + world_size) of the
// pad, the epoch.
void check_flags(const at::Tensor& pad_table, int64_t word_base, int64_t rank,
                 int64_t world_size, int64_t epoch, const char* op) {
  check_group(pad_table, rank, world_size, op);
  TORCH_CHECK(word_base >= 0 && word_base + world_size <= layout::PAD_WORDS, "fusedpar::", op,
              ": 'word_base' must be in [0, ", layout::PAD_WORDS, " - world_size], got ",
              word_base);
  check_epoch(epoch, op);
}

// What the pull ops share: the group, epoch, META word, timeout and [outer, inner] layout,
// and the 'out' and 'stats' tensors on the pad table's device.
void check_pull(const at::Tensor& out, const at::Tensor& pad_table, int64_t rank,
                int64_t world_size, int64_t epoch, int64_t meta, int64_t outer, int64_t inner,
                int64_t timeout_ns, const at::Tensor& stats, const char* op) {
  check_group(pad_table, rank, world_size, op);
  check_epoch(epoch, op);
  check_meta(meta, op);
  check_timeout_ns(timeout_ns, op);
  check_outer_inner(outer, inner, op);
  check_cuda_tensor(out, op, "out");
  check_same_device(out, pad_table, op, "out");
  check_stats(stats, pad_table, op);
}

int32_t sm_count(c10::DeviceIndex device) {
  static std::mutex mu;
  static std::vector<int32_t> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<size_t>(device) >= cache.size()) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cache[device] = n;
  }
  return cache[device];
}

const int64_t* table_ptr(const at::Tensor& pad_table) {
  return static_cast<const int64_t*>(pad_table.const_data_ptr());
}

unsigned long long* stats_ptr(const at::Tensor& stats) {
  return reinterpret_cast<unsigned long long*>(stats.data_ptr());
}

// ---------------------------------------------------------------------------------------

void cuda_wait_flags(const at::Tensor& pad_table, int64_t word_base, int64_t rank,
                     int64_t world_size, int64_t epoch, int64_t timeout_ns, int64_t code) {
  const char* op = "_cuda_wait_flags";
  check_flags(pad_table, word_base, rank, world_size, epoch, op);
  check_timeout_ns(timeout_ns, op);
  TORCH_CHECK(code >= 1 && code <= kInt32Max, "fusedpar::", op,
              ": 'code' must be a nonzero status code, got ", code);
  const c10::cuda::CUDAGuard guard(pad_table.device());
  C10_CUDA_CHECK(launch_wait_flags(table_ptr(pad_table), static_cast<int32_t>(word_base),
                                   static_cast<int32_t>(rank), static_cast<int32_t>(world_size),
                                   static_cast<int32_t>(epoch), timeout_ns,
                                   static_cast<int32_t>(code),
                                   c10::cuda::getCurrentCUDAStream().stream()));
}

void cuda_signal_peers(const at::Tensor& pad_table, int64_t word_base, int64_t rank,
                       int64_t world_size, int64_t epoch, int64_t meta) {
  const char* op = "_cuda_signal_peers";
  check_flags(pad_table, word_base, rank, world_size, epoch, op);
  check_meta(meta, op);
  const c10::cuda::CUDAGuard guard(pad_table.device());
  C10_CUDA_CHECK(launch_signal_peers(table_ptr(pad_table), static_cast<int32_t>(word_base),
                                     static_cast<int32_t>(rank),
                                     static_cast<int32_t>(world_size),
                                     static_cast<int32_t>(epoch), meta,
                                     c10::cuda::getCurrentCUDAStream().stream()));
}

void cuda_all_gather_pull(const at::Tensor& out, const at::Tensor& x, const at::Tensor& pad_table,
                          int64_t rank, int64_t world_size, int64_t epoch, int64_t meta,
                          int64_t outer, int64_t inner, int64_t timeout_ns,
                          const at::Tensor& stats) {
  const char* op = "_cuda_all_gather_pull";
  check_pull(out, pad_table, rank, world_size, epoch, meta, outer, inner, timeout_ns, stats, op);
  check_cuda_tensor(x, op, "x");
  check_same_device(x, pad_table, op, "x");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "fusedpar::", op, ": 'x' has dtype ",
              x.scalar_type(), " but 'out' has dtype ", out.scalar_type());
  TORCH_CHECK(x.numel() == outer * inner, "fusedpar::", op, ": 'x' must have outer*inner = ",
              outer * inner, " elements, got ", x.numel());
  TORCH_CHECK(out.numel() == outer * world_size * inner, "fusedpar::", op,
              ": 'out' must have outer*world_size*inner = ", outer * world_size * inner,
              " elements, got ", out.numel());
  const int64_t row_bytes = inner * static_cast<int64_t>(out.element_size());
  const c10::cuda::CUDAGuard guard(pad_table.device());
  C10_CUDA_CHECK(launch_all_gather_pull(
      out.data_ptr(), x.const_data_ptr(), table_ptr(pad_table), static_cast<int32_t>(rank),
      static_cast<int32_t>(world_size), static_cast<int32_t>(epoch), meta, outer, row_bytes,
      timeout_ns, stats_ptr(stats), sm_count(pad_table.device().index()),
      c10::cuda::getCurrentCUDAStream().stream()));
}

void cuda_reduce_scatter_pull(const at::Tensor& out, const at::Tensor& pad_table, int64_t rank,
                              int64_t world_size, int64_t epoch, int64_t meta, int64_t outer,
                              int64_t inner, int64_t timeout_ns, const at::Tensor& stats,
                              double divisor) {
  const char* op = "_cuda_reduce_scatter_pull";
  check_pull(out, pad_table, rank, world_size, epoch, meta, outer, inner, timeout_ns, stats, op);
  ScalarKind kind;
  switch (out.scalar_type()) {
    case at::kFloat:
      kind = ScalarKind::kFloat32;
      break;
    case at::kHalf:
      kind = ScalarKind::kFloat16;
      break;
    case at::kBFloat16:
      kind = ScalarKind::kBFloat16;
      break;
    default:
      TORCH_CHECK(false, "fusedpar::", op,
                  ": 'out' must be float32, float16 or bfloat16, got ", out.scalar_type());
  }
  TORCH_CHECK(out.numel() == outer * inner, "fusedpar::", op,
              ": 'out' must have outer*inner = ", outer * inner, " elements, got ", out.numel());
  const c10::cuda::CUDAGuard guard(pad_table.device());
  C10_CUDA_CHECK(launch_reduce_scatter_pull(
      out.data_ptr(), table_ptr(pad_table), static_cast<int32_t>(rank),
      static_cast<int32_t>(world_size), static_cast<int32_t>(epoch), meta, outer, inner, kind,
      timeout_ns, stats_ptr(stats), static_cast<float>(divisor), sm_count(pad_table.device().index()),
      c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace
}  // namespace fusedpar

TORCH_LIBRARY_FRAGMENT(fusedpar, m) {
  m.def(
      "_cuda_wait_flags(Tensor pad_table, int word_base, int rank, int world_size, int epoch, "
      "int timeout_ns, int code) -> ()");
  m.def(
      "_cuda_signal_peers(Tensor pad_table, int word_base, int rank, int world_size, int epoch, "
      "int meta) -> ()");
  m.def(
      "_cuda_all_gather_pull(Tensor(a!) out, Tensor x, Tensor pad_table, int rank, "
      "int world_size, int epoch, int meta, int outer, int inner, int timeout_ns, "
      "Tensor(b!) stats) -> ()");
  m.def(
      "_cuda_reduce_scatter_pull(Tensor(a!) out, Tensor pad_table, int rank, int world_size, "
      "int epoch, int meta, int outer, int inner, int timeout_ns, Tensor(b!) stats, "
      "float divisor=1.0) -> ()");
}

TORCH_LIBRARY_IMPL(fusedpar, CUDA, m) {
  m.impl("_cuda_wait_flags", &fusedpar::cuda_wait_flags);
  m.impl("_cuda_signal_peers", &fusedpar::cuda_signal_peers);
  m.impl("_cuda_all_gather_pull", &fusedpar::cuda_all_gather_pull);
  m.impl("_cuda_reduce_scatter_pull", &fusedpar::cuda_reduce_scatter_pull);
}

// Minimal Python module: importing it loads this library, whose static initialisers above
// register the ops with the dispatcher.
static PyModuleDef fusedpar_c_module = {
    PyModuleDef_HEAD_INIT,
    "fusedpar._C",
    "fusedpar CUDA ops (registered in torch.ops.fusedpar on import).",
    -1,
    nullptr,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&fusedpar_c_module); }
