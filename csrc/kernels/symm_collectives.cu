// Symmetric-memory collectives: flag wait / signal, all-gather pull, reduce-scatter pull.
// torch-free: only the CUDA runtime and the fp16/bf16 headers. See symm_collectives.h for
// the signal-pad protocol and the launcher contracts.
#include "symm_collectives.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fusedpar {
namespace {

using layout::EPOCH;
using layout::META;
using layout::META_MISMATCH;
using layout::MIRROR;
using layout::PAD_BYTES;
using layout::READY;
using layout::STATUS;
using layout::TIMEOUT_READY;

constexpr int kThreads = 256;       // block size of the copy / reduce kernels
constexpr int kSignalThreads = 256;  // one-block kernels: one thread per peer (W <= 256)
constexpr int kStatusPollMask = 31;  // spin loops re-check STATUS and the clock every 32 polls

// ---------------------------------------------------------------------------------------
// Memory-model helpers (system scope: peers are other GPUs / processes)

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  v = *reinterpret_cast<const volatile uint32_t*>(p);
  __threadfence_system();
#else
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  v = *reinterpret_cast<const volatile uint32_t*>(p);
#else
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
#endif
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 700
  __threadfence_system();
  *reinterpret_cast<volatile uint32_t*>(p) = v;
#else
  asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
#endif
}

__device__ __forceinline__ uint32_t* pad_of(const int64_t* pad_table, int r) {
  return reinterpret_cast<uint32_t*>(static_cast<uintptr_t>(pad_table[r]));
}

__device__ __forceinline__ bool status_set(const uint32_t* own_pad) {
  return ld_relaxed_sys(own_pad + STATUS) != 0u;
}

// First failure wins: CAS STATUS+0 from 0 to `code`; the winner fills in src and epoch, and
// copies the three words to the host's status mirror (pinned host memory) where it has one.
__device__ void record_status(uint32_t* own_pad, uint32_t code, uint32_t src, uint32_t epoch) {
  const uint32_t old = atomicCAS_system(own_pad + STATUS, 0u, code);
  if (old == 0u) {
    atomicExch_system(own_pad + STATUS + 1, src);
    atomicExch_system(own_pad + STATUS + 2, epoch);
    const uint64_t host = *reinterpret_cast<const volatile uint64_t*>(own_pad + MIRROR);
    if (host != 0u) {
      // plain stores: atomics on host memory are not atomic over PCIe, and only we write it
      volatile uint32_t* mirror = reinterpret_cast<volatile uint32_t*>(static_cast<uintptr_t>(host));
      mirror[1] = src;
      mirror[2] = epoch;
      __threadfence_system();
      mirror[0] = code;  // last: the host reads the code first
    }
    __threadfence_system();
  }
}

__device__ __forceinline__ int64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<int64_t>(t);
}

// Bounded wait for own_pad[word] >= epoch (acquire, system scope). Returns true once the
// flag has reached the epoch; false when STATUS is (or becomes) set or when timeout_ns of
// wall-clock time (%globaltimer) have passed, in which case (code, src, epoch) is recorded
// (first failure wins).
__device__ bool wait_flag(uint32_t* own_pad, int word, uint32_t epoch, int64_t timeout_ns,
                          uint32_t code, uint32_t src) {
  if (status_set(own_pad)) return false;
  const uint32_t* flag = own_pad + word;
  const int64_t start = global_timer_ns();
  for (int64_t i = 0;; ++i) {
    if (ld_acquire_sys(flag) >= epoch) return true;
    if ((i & kStatusPollMask) == kStatusPollMask) {
      if (status_set(own_pad)) return false;
      if (global_timer_ns() - start > timeout_ns) break;
    }
  }
  record_status(own_pad, code, src, epoch);
  return false;
}

// Wait READY+src, then compare the peer's META with ours (meta < 0: no check).
__device__ bool wait_ready_and_meta(uint32_t* own_pad, const uint32_t* peer_pad, int src,
                                    uint32_t epoch, int64_t meta, int64_t timeout_ns) {
  if (!wait_flag(own_pad, READY + src, epoch, timeout_ns, TIMEOUT_READY, src)) return false;
  if (meta >= 0 && ld_acquire_sys(peer_pad + META) != static_cast<uint32_t>(meta)) {
    record_status(own_pad, META_MISMATCH, src, epoch);
    return false;
  }
  return true;
}

// The epoch an `epoch` argument stands for: itself, or, when <= 0 (a call on device-held
// epochs, e.g. replayed from a CUDA graph), this rank's EPOCH word plus it.
__device__ __forceinline__ uint32_t call_epoch(const uint32_t* own_pad, int32_t epoch) {
  return epoch > 0 ? static_cast<uint32_t>(epoch)
                   : ld_relaxed_sys(own_pad + EPOCH) + static_cast<uint32_t>(epoch);
}

__device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------
// wait / signal

__global__ void wait_flags_kernel(const int64_t* pad_table, int32_t word_base, int32_t rank,
                                  int32_t world_size, int32_t epoch_arg, int64_t timeout_ns,
                                  uint32_t code) {
  uint32_t* own = pad_of(pad_table, rank);
  const uint32_t epoch = call_epoch(own, epoch_arg);
  for (int src = threadIdx.x; src < world_size; src += blockDim.x) {
    if (src == rank) continue;
    wait_flag(own, word_base + src, epoch, timeout_ns, code, static_cast<uint32_t>(src));
  }
}

__global__ void signal_peers_kernel(const int64_t* pad_table, int32_t word_base, int32_t rank,
                                    int32_t world_size, int32_t epoch_arg, int64_t meta) {
  uint32_t* own = pad_of(pad_table, rank);
  const uint32_t epoch = call_epoch(own, epoch_arg);
  if (threadIdx.x == 0 && meta >= 0) {
    *reinterpret_cast<volatile uint32_t*>(own + META) = static_cast<uint32_t>(meta);
  }
  // Everything written before this point (earlier stream work, the META store above)
  // must be visible system-wide before any peer can observe the new epoch.
  __threadfence_system();
  __syncthreads();
  for (int p = threadIdx.x; p < world_size; p += blockDim.x) {
    if (p == rank) continue;
    uint32_t* peer = pad_of(pad_table, p);
    st_release_sys(peer + word_base + rank, epoch);
  }
}

// ---------------------------------------------------------------------------------------
// all-gather (pull)

template <typename V>
__device__ __forceinline__ V load_unit(const V* p, bool from_peer) {
  return from_peer ? __ldcg(p) : *p;
}

// Copies units [begin, end) of a [outer, row_units] source into rows of stride
// out_row_stride (bytes) of dst.
template <typename V>
__device__ void copy_rows(char* dst, const char* src, int64_t row_units, int64_t out_row_stride,
                          int64_t begin, int64_t end, bool from_peer) {
  const V* s = reinterpret_cast<const V*>(src);
  for (int64_t u = begin + threadIdx.x; u < end; u += blockDim.x) {
    const int64_t o = u / row_units;
    const int64_t j = u - o * row_units;
    V* d = reinterpret_cast<V*>(dst + o * out_row_stride) + j;
    *d = load_unit<V>(s + u, from_peer);
  }
}

template <typename V>
__device__ void copy_block_share(char* dst, const char* src, int64_t outer, int64_t row_bytes,
                                 int64_t out_row_stride, bool from_peer,
                                 unsigned long long* stats) {
  const int64_t row_units = row_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t total = outer * row_units;
  const int64_t chunk = ceil_div(total, gridDim.x);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < total ? begin + chunk : total;
  if (begin >= end) return;
  if (from_peer && stats != nullptr && threadIdx.x == 0) {
    atomicAdd(stats, static_cast<unsigned long long>((end - begin) * sizeof(V)));
  }
  copy_rows<V>(dst, src, row_units, out_row_stride, begin, end, from_peer);
}

// grid = (blocks per source, W): blockIdx.y = s handles src = (rank + s) % W; s = 0 is the
// local shard (no wait), s >= 1 pull from peers in rank-rotated order.
__global__ void all_gather_pull_kernel(char* out, const char* x, const int64_t* pad_table,
                                       int32_t rank, int32_t world_size, int32_t epoch_arg,
                                       int64_t meta, int64_t outer, int64_t row_bytes,
                                       int64_t timeout_ns, unsigned long long* stats) {
  __shared__ int go;
  const int s = blockIdx.y;
  const int src = (rank + s) % world_size;
  const char* from;
  const bool from_peer = s != 0;
  if (from_peer) {
    uint32_t* own = pad_of(pad_table, rank);
    const uint32_t* peer = pad_of(pad_table, src);
    if (threadIdx.x == 0) {
      bool ok = wait_ready_and_meta(own, peer, src, call_epoch(own, epoch_arg), meta, timeout_ns);
      go = (ok && !status_set(own)) ? 1 : 0;
    }
    __syncthreads();
    if (!go) return;
    from = reinterpret_cast<const char*>(peer) + PAD_BYTES;
  } else {
    from = x;
  }
  char* dst = out + static_cast<int64_t>(src) * row_bytes;
  const int64_t out_row_stride = static_cast<int64_t>(world_size) * row_bytes;
  const uintptr_t align = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(from) |
                          static_cast<uintptr_t>(row_bytes);
  if (align % 16 == 0) {
    copy_block_share<uint4>(dst, from, outer, row_bytes, out_row_stride, from_peer, stats);
  } else if (align % 8 == 0) {
    copy_block_share<uint2>(dst, from, outer, row_bytes, out_row_stride, from_peer, stats);
  } else if (align % 4 == 0) {
    copy_block_share<unsigned int>(dst, from, outer, row_bytes, out_row_stride, from_peer, stats);
  } else if (align % 2 == 0) {
    copy_block_share<unsigned short>(dst, from, outer, row_bytes, out_row_stride, from_peer,
                                     stats);
  } else {
    copy_block_share<unsigned char>(dst, from, outer, row_bytes, out_row_stride, from_peer,
                                    stats);
  }
}

// ---------------------------------------------------------------------------------------
// reduce-scatter (pull)

struct F32 {
  using storage = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float f) { return f; }
};
struct F16 {
  using storage = unsigned short;
  static __device__ __forceinline__ float to_float(unsigned short v) {
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ unsigned short from_float(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
};
struct BF16 {
  using storage = unsigned short;
  static __device__ __forceinline__ float to_float(unsigned short v) {
    return __bfloat162float(__ushort_as_bfloat16(v));
  }
  static __device__ __forceinline__ unsigned short from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

template <typename S, int VEC>
struct alignas(sizeof(S) * VEC) Pack {
  S v[VEC];
};

// L2-only (cache-global) load of a pack: peers' data is read once, never from a stale L1.
template <typename P>
__device__ __forceinline__ P ldcg_pack(const P* p) {
  P out;
  if constexpr (sizeof(P) == 16) {
    const uint4 r = __ldcg(reinterpret_cast<const uint4*>(p));
    memcpy(&out, &r, sizeof(P));
  } else if constexpr (sizeof(P) == 4) {
    const unsigned int r = __ldcg(reinterpret_cast<const unsigned int*>(p));
    memcpy(&out, &r, sizeof(P));
  } else {
    static_assert(sizeof(P) == 2, "unsupported pack size");
    const unsigned short r = __ldcg(reinterpret_cast<const unsigned short*>(p));
    memcpy(&out, &r, sizeof(P));
  }
  return out;
}

// Sums units [begin, end) (VEC elements each) over src = 0..W-1 in order, divided by `divisor`.
template <typename K, int VEC>
__device__ void reduce_units(typename K::storage* out, const int64_t* pad_table, int32_t rank,
                             int32_t world_size, int64_t inner, int64_t begin, int64_t end,
                             float divisor) {
  using S = typename K::storage;
  using P = Pack<S, VEC>;
  const int64_t inner_units = inner / VEC;
  for (int64_t u = begin + threadIdx.x; u < end; u += blockDim.x) {
    const int64_t o = u / inner_units;
    const int64_t j = u - o * inner_units;
    const int64_t src_off = (o * world_size + rank) * inner + j * VEC;  // elements
    float acc[VEC];
    for (int src = 0; src < world_size; ++src) {
      const char* base = reinterpret_cast<const char*>(static_cast<uintptr_t>(pad_table[src])) +
                         PAD_BYTES;
      const P p = ldcg_pack(reinterpret_cast<const P*>(reinterpret_cast<const S*>(base) + src_off));
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float f = K::to_float(p.v[k]);
        acc[k] = src == 0 ? f : acc[k] + f;
      }
    }
    P r;
#pragma unroll
    for (int k = 0; k < VEC; ++k) r.v[k] = K::from_float(acc[k] / divisor);
    *reinterpret_cast<P*>(out + o * inner + j * VEC) = r;
  }
}

template <typename K>
__global__ void reduce_scatter_pull_kernel(typename K::storage* out, const int64_t* pad_table,
                                           int32_t rank, int32_t world_size, int32_t epoch_arg,
                                           int64_t meta, int64_t outer, int64_t inner,
                                           int64_t timeout_ns, unsigned long long* stats,
                                           float divisor) {
  using S = typename K::storage;
  constexpr int VEC = 16 / sizeof(S);
  uint32_t* own = pad_of(pad_table, rank);
  const uint32_t epoch = call_epoch(own, epoch_arg);

  // One thread per peer waits (in parallel); every source must be ready before the
  // fixed-order sum starts.
  bool ok = true;
  bool aligned = true;
  for (int src = threadIdx.x; src < world_size; src += blockDim.x) {
    aligned = aligned && (static_cast<uint64_t>(pad_table[src]) % 16 == 0);
    if (src == rank) continue;
    ok = ok && wait_ready_and_meta(own, pad_of(pad_table, src), src, epoch, meta, timeout_ns);
  }
  if (threadIdx.x == 0) ok = ok && !status_set(own);
  if (!__syncthreads_and(ok)) return;
  aligned = __syncthreads_and(aligned) && (reinterpret_cast<uintptr_t>(out) % 16 == 0) &&
            (inner % VEC == 0);

  const int vec = aligned ? VEC : 1;
  const int64_t total = outer * (inner / vec);
  const int64_t chunk = ceil_div(total, gridDim.x);
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t end = begin + chunk < total ? begin + chunk : total;
  if (begin >= end) return;
  if (stats != nullptr && threadIdx.x == 0 && world_size > 1) {
    atomicAdd(stats, static_cast<unsigned long long>((end - begin) * vec * sizeof(S) *
                                                     (world_size - 1)));
  }
  if (aligned) {
    reduce_units<K, VEC>(out, pad_table, rank, world_size, inner, begin, end, divisor);
  } else {
    reduce_units<K, 1>(out, pad_table, rank, world_size, inner, begin, end, divisor);
  }
}

// ---------------------------------------------------------------------------------------
// grid sizing

int blocks_for(int64_t bytes, int32_t sm_count, int32_t sources) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * 16 * 4;  // 4 x 16 B per thread
  int64_t want = (bytes + per_block - 1) / per_block;
  const int64_t sms = sm_count > 0 ? sm_count : 108;
  int64_t cap = (4 * sms) / (sources > 0 ? sources : 1);
  if (cap < 1) cap = 1;
  if (want > cap) want = cap;
  if (want < 1) want = 1;
  return static_cast<int>(want);
}

int one_block_threads(int32_t world_size) {
  int t = ((world_size + 31) / 32) * 32;
  if (t < 32) t = 32;
  if (t > kSignalThreads) t = kSignalThreads;
  return t;
}

}  // namespace

// -----------------------------------------------------------------------------------------
// launchers

cudaError_t launch_wait_flags(const int64_t* pad_table, int32_t word_base, int32_t rank,
                              int32_t world_size, int32_t epoch, int64_t timeout_ns,
                              int32_t code, cudaStream_t stream) {
  wait_flags_kernel<<<1, one_block_threads(world_size), 0, stream>>>(
      pad_table, word_base, rank, world_size, epoch, timeout_ns, static_cast<uint32_t>(code));
  return cudaGetLastError();
}

cudaError_t launch_signal_peers(const int64_t* pad_table, int32_t word_base, int32_t rank,
                                int32_t world_size, int32_t epoch, int64_t meta,
                                cudaStream_t stream) {
  signal_peers_kernel<<<1, one_block_threads(world_size), 0, stream>>>(
      pad_table, word_base, rank, world_size, epoch, meta);
  return cudaGetLastError();
}

cudaError_t launch_all_gather_pull(void* out, const void* x, const int64_t* pad_table,
                                   int32_t rank, int32_t world_size, int32_t epoch,
                                   int64_t meta, int64_t outer, int64_t row_bytes,
                                   int64_t timeout_ns, unsigned long long* stats,
                                   int32_t sm_count, cudaStream_t stream) {
  const dim3 grid(blocks_for(outer * row_bytes, sm_count, world_size),
                  static_cast<unsigned>(world_size));
  all_gather_pull_kernel<<<grid, kThreads, 0, stream>>>(
      static_cast<char*>(out), static_cast<const char*>(x), pad_table, rank, world_size, epoch,
      meta, outer, row_bytes, timeout_ns, stats);
  return cudaGetLastError();
}

cudaError_t launch_reduce_scatter_pull(void* out, const int64_t* pad_table, int32_t rank,
                                       int32_t world_size, int32_t epoch, int64_t meta,
                                       int64_t outer, int64_t inner, ScalarKind kind,
                                       int64_t timeout_ns, unsigned long long* stats,
                                       float divisor, int32_t sm_count, cudaStream_t stream) {
  const int64_t elem = kind == ScalarKind::kFloat32 ? 4 : 2;
  const int blocks = blocks_for(outer * inner * elem * world_size, sm_count, 1);
  switch (kind) {
    case ScalarKind::kFloat32:
      reduce_scatter_pull_kernel<F32><<<blocks, kThreads, 0, stream>>>(
          static_cast<float*>(out), pad_table, rank, world_size, epoch, meta, outer, inner,
          timeout_ns, stats, divisor);
      break;
    case ScalarKind::kFloat16:
      reduce_scatter_pull_kernel<F16><<<blocks, kThreads, 0, stream>>>(
          static_cast<unsigned short*>(out), pad_table, rank, world_size, epoch, meta, outer,
          inner, timeout_ns, stats, divisor);
      break;
    case ScalarKind::kBFloat16:
      reduce_scatter_pull_kernel<BF16><<<blocks, kThreads, 0, stream>>>(
          static_cast<unsigned short*>(out), pad_table, rank, world_size, epoch, meta, outer,
          inner, timeout_ns, stats, divisor);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fusedpar
