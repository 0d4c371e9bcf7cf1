// Symmetric-memory collectives on raw pointers (no torch headers).
//
// Signal-pad protocol: each rank's symmetric segment is [pad: PAD_BYTES][data]. The pad is
// an array of 32-bit words with fixed offsets (mirrors fusedpar/comm/layout.py; a test
// keeps the numbers equal):
//   READY + src   epoch whose input `src` has staged in its data region (written by src
//                 into every peer's pad with a system-scope release; read with acquire)
//   DONE + src    epoch up to which `src` has finished reading its peers' data
//   META          31-bit fingerprint of the owner's staged input
//   STATUS..+3    local only: [code, src, epoch, 0] of the first failure
// Flags carry epochs and only grow: "flag reached epoch" means flag >= epoch (unsigned).
// An `epoch` argument <= 0 is relative: this rank's EPOCH word plus it (CUDA graphs).
// Every spin-wait is bounded by `timeout_ns` of wall-clock time (%globaltimer); then the waiting thread
// records STATUS in its OWN pad (atomicCAS on STATUS+0 from 0: the first failure wins)
// and gives up. Every wait first checks STATUS+0 and gives up at once when it is set.
//
// Peers are reached through int64 address tables in device memory: pad_table[r] is the
// address of rank r's pad as mapped in THIS process; rank r's data region starts at
// pad_table[r] + PAD_BYTES.
//
// Launchers are plain host functions: they enqueue on `stream` and return
// cudaGetLastError(). They do no argument checking (csrc/ops.cpp does).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace fusedpar {
namespace layout {

constexpr int32_t MAX_WORLD = 256;
constexpr int32_t READY = 0;
constexpr int32_t DONE = 256;
constexpr int32_t META = 512;
constexpr int32_t STATUS = 516;
constexpr int32_t DEADLINE = 520;      // local: epoch whose time ran out (interpreter watchdog only)
constexpr int32_t EPOCH = 524;         // local: the epoch of this rank's latest call
constexpr int32_t DESC = 528;          // owner's input description, read after a META mismatch
constexpr int32_t DESC_WORDS = 16;
constexpr int32_t MIRROR = 560;        // local: int64 address of the host's status mirror, or 0
constexpr int32_t STAGE_TICKET = 564;  // local: finished programs of a Triton stage kernel
constexpr int32_t END_TICKET = 565;    // local: finished programs of a Triton kernel's end
constexpr int32_t GATHERED = 768;      // local flags of the fused all-gather + matmul
constexpr int32_t CHUNK_TILES = 1024;  // local tile counters of the fused matmul + reduce-scatter
constexpr int32_t PAD_WORDS = 2048;
constexpr int32_t PAD_BYTES = 8192;

// STATUS[0] codes
constexpr int32_t OK = 0;
constexpr int32_t TIMEOUT_READY = 1;
constexpr int32_t TIMEOUT_DONE = 2;
constexpr int32_t META_MISMATCH = 3;
constexpr int32_t CAPACITY_EXCEEDED = 4;  // moe_dispatch (Triton) only: a count above max_tokens_per_rank

static_assert(DONE == MAX_WORLD, "DONE = MAX_WORLD");
static_assert(META == 2 * MAX_WORLD, "META = 2 * MAX_WORLD");
static_assert(STATUS == 2 * MAX_WORLD + 4, "STATUS = 2 * MAX_WORLD + 4");
static_assert(PAD_BYTES == 4 * PAD_WORDS, "PAD_BYTES = 4 * PAD_WORDS");
static_assert(STATUS + 4 <= DEADLINE && DEADLINE < EPOCH && EPOCH < DESC,
              "STATUS, DEADLINE, EPOCH, DESC overlap");
static_assert(DESC + DESC_WORDS <= MIRROR && MIRROR % 2 == 0 && MIRROR + 2 <= STAGE_TICKET,
              "DESC, MIRROR (an aligned int64), STAGE_TICKET overlap");
static_assert(END_TICKET < GATHERED, "END_TICKET overlaps GATHERED");

}  // namespace layout

// Element types understood by the reducing kernels.
enum class ScalarKind : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// One block. Waits until own pad (pad_table[rank]) word `word_base + src` >= epoch for
// every src != rank; on timeout records status (code, src, epoch).
cudaError_t launch_wait_flags(const int64_t* pad_table, int32_t word_base, int32_t rank,
                              int32_t world_size, int32_t epoch, int64_t timeout_ns,
                              int32_t code, cudaStream_t stream);

// One block. If meta >= 0, stores own pad[META] = meta; then, after a system-scope fence,
// release-stores pad_p[word_base + rank] = epoch for every peer p != rank.
cudaError_t launch_signal_peers(const int64_t* pad_table, int32_t word_base, int32_t rank,
                                int32_t world_size, int32_t epoch, int64_t meta,
                                cudaStream_t stream);

// out: [outer, W, row_bytes] bytes; x: [outer, row_bytes] bytes (the local shard).
// out[o, rank, :] = x[o, :]; for every src != rank (rank-rotated order) wait READY+src
// (code TIMEOUT_READY), check peer pad[META] == meta (code META_MISMATCH; meta < 0 skips
// the check), then copy src's data region ([outer, row_bytes]) into out[o, src, :].
// stats[0] += bytes read from peers. sm_count sizes the grid (<= 0: a default).
cudaError_t launch_all_gather_pull(void* out, const void* x, const int64_t* pad_table,
                                   int32_t rank, int32_t world_size, int32_t epoch,
                                   int64_t meta, int64_t outer, int64_t row_bytes,
                                   int64_t timeout_ns, unsigned long long* stats,
                                   int32_t sm_count, cudaStream_t stream);

// Every rank staged [outer, W, inner] elements of `kind` in its data region.
// out[o, i] = sum over src = 0..W-1 (in that order, fp32 accumulation, one final
// round-to-nearest-even, after dividing by `divisor`: 1 for a sum, W for an average)
// of staged_src[o, rank, i]. Waits READY / checks META for every
// src != rank first. stats[0] += bytes read from peers.
cudaError_t launch_reduce_scatter_pull(void* out, const int64_t* pad_table, int32_t rank,
                                       int32_t world_size, int32_t epoch, int64_t meta,
                                       int64_t outer, int64_t inner, ScalarKind kind,
                                       int64_t timeout_ns, unsigned long long* stats,
                                       float divisor, int32_t sm_count, cudaStream_t stream);

}  // namespace fusedpar
