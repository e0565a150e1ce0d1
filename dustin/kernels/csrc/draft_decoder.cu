// One persistent kernel for a draft forward's decoder layers (sm_90): every layer's q/k/v projection with RoPE
// and the KV-cache write, the streaming attention, o_proj, gate/up with SiLU, down_proj and the residual adds,
// for up to MAXM (32 or 64) token rows, in one launch of one program per SM.
//
// Why: a draft forward launched as ~5 kernels a layer costs ~4 us a kernel besides its bytes (docs/benchmarks.md),
// so the draft ran at ~4.5x its weight-read time. Here each program walks an instruction list planned on the host
// (dustin/kernels/draft_decoder.py), streams the weight tiles of its next instructions into a ring of shared-memory
// slots with bulk copies *before* it waits for their inputs, and waits on counters of what it reads in global
// memory instead of kernel boundaries. The weight stream never stops at a layer's stages.
//
// Stages of layer l and what each waits for (`dependency`, `counter_of`; counts in `need`):
//   QKV  (head, 4 half-dims, split)  waits all of DOWN(l-1): RMSNorm(h) in shared memory, q/k/v + bias, RoPE, q out,
//                                    k/v to the cache
//   ATT  (row, kv head, chunk)       waits QKV(l) of that KV head's q, k and v heads: attention over <= CH positions
//                                    of the row's streaming window; the chunk that arrives last merges the chunks
//   O    (8 columns, split)          waits all of ATT(l): h += o_proj(attention)
//   GU   (8 columns of gate & up, split) waits all of O(l): act = SiLU(gate) * up of RMSNorm(h)
//   DOWN (DOWN_N columns, split)     waits GU(l) of its split's columns: h += down_proj(act)
//   HEAD (16 vocabulary rows)        optional, after the last layer (builds with K whole): waits all of DOWN(L-1):
//                                    the final RMSNorm of each batch row's last token, 16 logits (bf16, as the
//                                    model's lm_head rounds), and their greedy argmax folded into the program's
//                                    running best per row; each program publishes its best with one 64-bit
//                                    atomicMax per row at its end (value first, then the smallest index: the first
//                                    maximum, as torch.argmax). No other stage reads what it writes.
// A GEMM instruction covers 1/KSPLIT of K (1/DSPLIT for down_proj): with more than one split, each writes its
// partial sums and the split that arrives last adds them in split order, then runs the epilogue. Every reduction
// has a fixed order: the result does not depend on which program finished first.
//
// Shapes and the tiling are compile-time (-D flags, one build per draft shape, tiling and MAXM). Rounding follows
// the PyTorch model: each projection's output (bias included) rounds to bf16 before RoPE / SiLU / the residual add
// (done in fp32, rounded once).

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef DIM
#define DIM 896
#define N_HEADS 14
#define N_KV_HEADS 2
#define HEAD_DIM 64
#define INTER 4864
#endif
#ifndef DSPLIT
#define DSPLIT 8
#endif
#ifndef KSPLIT
#define KSPLIT 1
#endif
#ifndef DOWN_COLS
#define DOWN_COLS 32
#endif
#ifndef CHUNK_POS
#define CHUNK_POS 128
#endif
#ifndef MAX_TOKEN_ROWS
#define MAX_TOKEN_ROWS 32
#endif
#ifndef NSLOT
#define NSLOT 4
#endif

namespace {

constexpr int D = DIM, NQ = N_HEADS, NKV = N_KV_HEADS, HD = HEAD_DIM, I = INTER;
constexpr int GQ = NQ / NKV;            // query heads per KV head
constexpr int NHEADS = NQ + 2 * NKV;    // q | k | v heads of the fused projection
constexpr int MAXM = MAX_TOKEN_ROWS;    // token rows (32 or 64: a build each)
constexpr int NT = 256, NW = 8;         // threads, warps
constexpr int PAD = 8;                  // bf16 of padding per shared-memory row: rows 16 B apart in banks
constexpr int KQ = D / KSPLIT;          // q/k/v, o_proj and gate/up's K per split
constexpr int KC = I / DSPLIT;          // down_proj's K per split
constexpr int DOWN_N = DOWN_COLS;       // down_proj columns per instruction
constexpr int CH = CHUNK_POS;           // attention positions per chunk
constexpr int KST = HD + 2;             // K/V rows in shared memory: an odd number of words apart, conflict-free

static_assert(NQ % NKV == 0, "query heads must be a multiple of KV heads");
static_assert(MAXM % 16 == 0 && MAXM <= 64, "token rows: 16, 32, 48 or 64");
static_assert(NQ * HD == D, "o_proj's K (query heads x head_dim) must equal the hidden size");
static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
static_assert(D % KSPLIT == 0 && KQ % 16 == 0 && I % DSPLIT == 0 && KC % 16 == 0 && I % 8 == 0, "K splits");
static_assert((DOWN_N == 8 || DOWN_N == 16 || DOWN_N == 32) && D % DOWN_N == 0, "down_proj columns");

constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int SLOT_BYTES = cmax(16 * (KQ + PAD), DOWN_N * (KC + PAD)) * 2;
constexpr int A_COLS = cmax(KQ, KC) + PAD;
constexpr int A_BYTES = MAXM * A_COLS * 2;
constexpr int ATT_BYTES = (GQ * HD + GQ * CH) * 4 + 2 * CH * KST * 2;
static_assert(ATT_BYTES <= A_BYTES, "attention scratch must fit the activation buffer");
constexpr int RED_BYTES = NW * 32 * 4 * 4;  // each warp's 16x8 accumulator fragment
constexpr int OUT_BYTES = MAXM * 32 * 4;    // an instruction's [M, N <= 32] fp32 result
constexpr int BEST_BYTES = MAXM * 8;        // HEAD: the program's running (logit, index) best per batch row
constexpr int SMEM_BYTES = NSLOT * SLOT_BYTES + A_BYTES + RED_BYTES + OUT_BYTES + 64 + NSLOT * 8 + BEST_BYTES;
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory: a larger KSPLIT or fewer down_proj columns");

enum Op : int { OP_QKV = 0, OP_ATT = 1, OP_O = 2, OP_GU = 3, OP_DOWN = 4, OP_HEAD = 5 };
constexpr int HEAD_ROWS = 16;  // vocabulary rows of a HEAD instruction

// each GEMM stage's output groups (one per instruction column block) and their widths (columns per instruction)
constexpr int G_QKV = NHEADS * (HD / 8), G_O = D / 8, G_GU = I / 8, G_DOWN = D / DOWN_N;
constexpr int W_QKV = 8, W_O = 8, W_GU = 16, W_DOWN = DOWN_N;
// A layer's dependency counters, as fine as the data allows: the attention of KV head g waits only for the q/k/v of
// its heads (C_QKV + g); down_proj's split s only for the gate/up columns of its K piece (C_GU + s). o_proj needs
// every head's attention, and the norms before q/k/v and gate/up need whole rows of h: those wait for a stage.
constexpr int C_QKV = 0, C_ATT = NKV, C_O = NKV + 1, C_GU = NKV + 2, C_DOWN = C_GU + DSPLIT, C_LAYER = C_DOWN + 1;
constexpr int NEED_ATT = (GQ + 2) * (HD / 8);  // q/k/v column groups of one KV head's heads
// a layer's arrival counters: the attention's (row, kv head), then each GEMM stage's groups
constexpr int ARR_QKV = MAXM * NKV, ARR_O = ARR_QKV + G_QKV, ARR_GU = ARR_O + G_O, ARR_DOWN = ARR_GU + G_GU;
constexpr int ARR_LAYER = ARR_DOWN + G_DOWN;

struct Layer {  // device pointers of one layer's weights (fused projections, nn.Linear's [N, K] layout)
  const __nv_bfloat16 *wqkv, *bqkv, *wo, *wgu, *wd, *ln1, *ln2;
};

struct Params {
  const Layer* layers;
  const int4* ins;        // [nsm, ins_stride]: (op, layer, a, b)
  const int* n_ins;       // [nsm]
  const int4* wins;       // [nsm, ins_stride]: the instructions that read weights, in order
  const int* n_wins;      // [nsm]
  int ins_stride;
  int n_layers;
  int M, T;               // token rows (M = rows of the batch x T), tokens per batch row
  __nv_bfloat16* h;       // [M, D] residual stream: the embeddings in, the last layer's output out
  const int64_t* pos;     // [M] positions
  const float* cos;       // [M, HD]
  const float* sin;
  __nv_bfloat16* kc;      // [n_layers, B, NKV, S, HD]
  __nv_bfloat16* vc;
  int64_t cache_b, cache_s;  // the cache's batch and capacity
  int sinks, window;      // streaming attention: j < sinks or p - window < j <= p
  int nchunk;             // attention chunks per (row, kv head)
  float eps, scale;
  __nv_bfloat16* q;       // [M, NQ * HD] scratch
  __nv_bfloat16** q_capture;  // [n_layers]: where a layer's rotated q is also written (null: not captured)
  __nv_bfloat16* attn;    // [M, NQ * HD]
  __nv_bfloat16* act;     // [M, I]
  float* att_part;        // [M, NKV, nchunk, GQ, HD + 2]: o, then (max, sum)
  float* down_part;       // [DSPLIT, M, D]
  float* qkv_part;        // with KSPLIT > 1: [KSPLIT, M, G_QKV * 8]
  float* o_part;          // [KSPLIT, M, D]
  float* gu_part;         // [KSPLIT, M, 2 * I]
  int* counters;          // [n_layers, C_LAYER] zeroed before each launch
  int* arrivals;          // [n_layers, ARR_LAYER] zeroed before each launch
  // HEAD (null lm_head: the plan has no HEAD instruction)
  const __nv_bfloat16* lm_head;  // [vocab_rows, D]
  const __nv_bfloat16* norm_w;   // [D]: the final RMSNorm's weight
  int vocab;                      // logits of token ids < vocab take part in the argmax
  int vocab_rows;                 // rows of lm_head
  unsigned long long* best;       // [MAXM]: per batch row, (ordered logit << 32) | (0xffffffff - index); zeroed
  // builds with -DDRAFT_TIMELINE only (profiling; null and unused otherwise): [grid, ins_stride, TL_FIELDS], when
  // each instruction of each program reached its marks (`Mark`)
  unsigned long long* timeline;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Profiling builds (-DDRAFT_TIMELINE): per instruction, thread 0 writes the SM clock (clock64) at each mark, and
// %globaltimer and %smid once, so a host script can split each program's time into waiting for inputs, staging
// activations, waiting for weights, the MMAs and the epilogue (scripts/gpu_draft_timeline.py). Other builds
// compile the marks away.
enum Mark : int { MK_START = 0, MK_INPUTS = 1, MK_STAGED = 2, MK_WEIGHTS = 3, MK_GEMM = 4, MK_END = 5, MK_GLOBAL = 6,
                  MK_SM = 7, TL_FIELDS = 8 };

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A wait that cannot hang the GPU: past 5 s (a bug, never a slow input) the kernel traps, and the launch fails.
constexpr uint64_t WAIT_LIMIT_NS = 5000000000ull;

__device__ __forceinline__ bool mbar_try(uint64_t* bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(ok)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return ok;
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try(bar, parity)) return;
  const uint64_t t0 = now_ns();
  while (!mbar_try(bar, parity))
    if (now_ns() - t0 > WAIT_LIMIT_NS) __trap();
}

// global -> shared bulk copy, completion counted in bytes on `bar`; bytes and addresses multiples of 16
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {  // L2 only: data other SMs wrote
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

// ---- weight tiles ---------------------------------------------------------------------------------------------
// The rows an instruction reads: row r of the tile is weight row `row_of(ins, r)`, columns [k0, k0 + kw).
struct Tile {
  const __nv_bfloat16* w;
  int rows, kw, k0, ld;  // tile rows, their width, first column, the weight's row length
};

__device__ __forceinline__ Tile tile_of(const Params& p, int4 ins) {
  if (ins.x == OP_HEAD) return {p.lm_head, HEAD_ROWS, D, 0, D};
  const Layer& L = p.layers[ins.y];
  switch (ins.x) {
    case OP_QKV: return {L.wqkv, 8, KQ, ins.w * KQ, D};
    case OP_O: return {L.wo, 8, KQ, ins.w * KQ, D};
    case OP_GU: return {L.wgu, 16, KQ, ins.w * KQ, D};
    default: return {L.wd, DOWN_N, KC, ins.w * KC, I};
  }
}

__device__ __forceinline__ int row_of(const Params& p, int4 ins, int r) {
  switch (ins.x) {
    case OP_HEAD: return min(ins.z + r, p.vocab_rows - 1);  // a last tile past the weight re-reads its last row
    case OP_QKV: {  // z = head * HD / 2 + j0; RoPE's pairs are tile rows r and r + 4
      const int head = ins.z / (HD / 2), j0 = ins.z % (HD / 2);
      return head * HD + (r < 4 ? j0 + r : HD / 2 + j0 + r - 4);
    }
    case OP_O: return ins.z + r;
    case OP_GU: return r < 8 ? ins.z + r : I + ins.z + r - 8;  // gate rows, then up rows
    default: return ins.z + r;
  }
}

// warp 0 fills slot `slot` with the weight tile of `ins` (one bulk copy a row, rows PAD apart)
__device__ void issue_tile(const Params& p, int4 ins, char* slot, uint64_t* bar) {
  const int lane = threadIdx.x & 31;
  Tile t = tile_of(p, ins);
  if (lane == 0) mbar_expect_tx(bar, t.rows * t.kw * 2);
  __syncwarp();
  __nv_bfloat16* dst = reinterpret_cast<__nv_bfloat16*>(slot);
  for (int r = lane; r < t.rows; r += 32)
    bulk_copy(dst + r * (t.kw + PAD), t.w + (int64_t)row_of(p, ins, r) * t.ld + t.k0, t.kw * 2, bar);
}

// ---- the GEMM of one instruction: out[M, N] = A[M, K] @ W[N, K]^T, A and W in shared memory -------------------
// One (16-row m tile, 8-column n block) pair's fragment, over the k steps part, part + per, ...
__device__ __forceinline__ void mma_pair(const __nv_bfloat16* A, int a_ld, const __nv_bfloat16* W, int w_ld, int m0,
                                         int n0, int K, int part, int per, float* c) {
  const int lane = threadIdx.x & 31, g = lane >> 2, cc = (lane & 3) * 2;
  const __nv_bfloat16* a0 = A + (m0 + g) * a_ld + cc;
  const __nv_bfloat16* a1 = a0 + 8 * a_ld;
  const __nv_bfloat16* w0 = W + (n0 + g) * w_ld + cc;
  const int steps = K / 16;
#pragma unroll 4
  for (int s = part; s < steps; s += per) {
    const int k = s * 16;
    uint32_t a[4];
    a[0] = *reinterpret_cast<const uint32_t*>(a0 + k);
    a[1] = *reinterpret_cast<const uint32_t*>(a1 + k);
    a[2] = *reinterpret_cast<const uint32_t*>(a0 + k + 8);
    a[3] = *reinterpret_cast<const uint32_t*>(a1 + k + 8);
    uint32_t b0 = *reinterpret_cast<const uint32_t*>(w0 + k);
    uint32_t b1 = *reinterpret_cast<const uint32_t*>(w0 + k + 8);
    mma16816(c, a, b0, b1);
  }
}

__device__ __forceinline__ void store_pair(float* out, int m0, int n0, const float* s) {
  const int lane = threadIdx.x & 31, g = lane >> 2, cc = (lane & 3) * 2;
  out[(m0 + g) * 32 + n0 + cc] = s[0];
  out[(m0 + g) * 32 + n0 + cc + 1] = s[1];
  out[(m0 + g + 8) * 32 + n0 + cc] = s[2];
  out[(m0 + g + 8) * 32 + n0 + cc + 1] = s[3];
}

// Warps take (m tile, n block) pairs; with fewer pairs than warps, `per` warps split each pair's K and their
// fragments are added in warp order (deterministic).
__device__ void gemm(const __nv_bfloat16* A, int a_ld, const __nv_bfloat16* W, int w_ld, int M, int N, int K,
                     float* red, float* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int mt = (M + 15) / 16, nb = N / 8, pairs = mt * nb;
  const int per = pairs >= NW ? 1 : NW / pairs;
  if (per == 1) {  // whole pairs a warp: no reduction
    for (int pair = warp; pair < pairs; pair += NW) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      mma_pair(A, a_ld, W, w_ld, (pair / nb) * 16, (pair % nb) * 8, K, 0, 1, c);
      store_pair(out, (pair / nb) * 16, (pair % nb) * 8, c);
    }
    __syncthreads();
    return;
  }
  const int pair = warp / per, part = warp % per;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  if (pair < pairs) mma_pair(A, a_ld, W, w_ld, (pair / nb) * 16, (pair % nb) * 8, K, part, per, c);
  reinterpret_cast<float4*>(red)[warp * 32 + lane] = make_float4(c[0], c[1], c[2], c[3]);
  __syncthreads();
  if (part == 0 && pair < pairs) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    for (int w = warp; w < warp + per; ++w) {
      float4 v = reinterpret_cast<float4*>(red)[w * 32 + lane];
      s[0] += v.x; s[1] += v.y; s[2] += v.z; s[3] += v.w;
    }
    store_pair(out, (pair / nb) * 16, (pair % nb) * 8, s);
  }
  __syncthreads();
}

// A[m, :] = rows of a global bf16 matrix (columns [k0, k0 + K) of rows `ld` apart), through L2; rows >= M zero
__device__ void load_rows(__nv_bfloat16* A, const __nv_bfloat16* src, int ld, int k0, int K, int M) {
  const int per_row = K / 8, rows = ((M + 15) / 16) * 16;
  for (int i = threadIdx.x; i < rows * per_row; i += NT) {
    const int m = i / per_row, k = (i % per_row) * 8;
    __nv_bfloat16* dst = A + m * A_COLS + k;
    if (m < M) cp_async16(dst, src + (int64_t)m * ld + k0 + k);
    else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  cp_async_wait_all();
  __syncthreads();
}

// A (columns k0 .. k0 + KQ of h) = RMSNorm(h) there, in place: weight * bf16(x * rstd), as the PyTorch model
// rounds; rstd from the whole row (A itself when it holds the whole row, else h through L2)
__device__ void norm_rows(__nv_bfloat16* A, const __nv_bfloat16* h, const __nv_bfloat16* g, int k0, int M, float eps,
                          float* scratch) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int m = warp; m < M; m += NW) {
    float ss = 0.f;
    if (KSPLIT == 1) {
      for (int k = lane; k < D; k += 32) {
        const float x = __bfloat162float(A[m * A_COLS + k]);
        ss += x * x;
      }
    } else {  // the whole row through L2, 8 values a load
      for (int k = lane * 8; k < D; k += 256) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(h + (int64_t)m * D + k));
        const __nv_bfloat162* x2 = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float2 x = __bfloat1622float2(x2[i]);
          ss += x.x * x.x + x.y * x.y;
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) scratch[m] = rsqrtf(ss / D + eps);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * KQ; i += NT) {
    const int m = i / KQ, k = i % KQ;
    float x = __bfloat162float(A[m * A_COLS + k]) * scratch[m];
    A[m * A_COLS + k] = __float2bfloat16(__bfloat162float(g[k0 + k]) * bf(x));
  }
  __syncthreads();
}

// every thread's writes, then one arrival: the barrier orders every thread's writes before thread 0's (CTA scope),
// and thread 0's fence is cumulative: it releases what the barrier ordered before it too, so its atomic publishes
// the program's writes (the pattern of cooperative groups' grid sync; one fence a program, not one a thread). The
// consumer acquires with ld.acquire.gpu in thread 0, then a barrier, and reads through L2.
__device__ __forceinline__ void signal(int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1);
  }
}

// the program that arrives last at `arrival` (of `total`) returns true, with every other arrival's writes visible
// (released as `signal` releases them; thread 0's fence after its atomic acquires them for the barrier after it)
__device__ bool arrive_last(int* arrival, int total, int* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    *flag = atomicAdd(arrival, 1) == total - 1;
    __threadfence();
  }
  __syncthreads();
  return *flag;
}

// ---- the attention of one (row, kv head, chunk) --------------------------------------------------------------
__device__ void attention(const Params& p, int layer, int m, int g, int chunk, char* scratch, int* flag) {
  float* qs = reinterpret_cast<float*>(scratch);         // [GQ, HD]
  float* sc = qs + GQ * HD;                               // [GQ, CH]
  __nv_bfloat16* ks = reinterpret_cast<__nv_bfloat16*>(sc + GQ * CH);  // [CH, KST]
  __nv_bfloat16* vs = ks + CH * KST;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t pos = p.pos[m];
  const int b = m / p.T;
  const int s0 = (int)min((int64_t)p.sinks, pos + 1);
  const int64_t start = p.window > 0 ? max((int64_t)s0, pos - p.window + 1) : (int64_t)s0;
  const int n = s0 + (int)(pos - start + 1);
  const int i0 = chunk * CH, cnt = max(0, min(n - i0, CH));
  const int64_t base = ((((int64_t)layer * p.cache_b + b) * NKV + g) * p.cache_s) * HD;
  for (int i = tid; i < GQ * HD; i += NT)
    qs[i] = __bfloat162float(__ldcg(p.q + (int64_t)m * NQ * HD + g * GQ * HD + i)) * p.scale;
  for (int i = tid; i < cnt * (HD / 8); i += NT) {  // 16-byte pieces of the chunk's K and V rows (rows 16-byte
    const int j = i / (HD / 8), d = (i % (HD / 8)) * 8;  // aligned in the cache; 4-byte stores: KST is odd words)
    const int li = i0 + j;
    const int64_t at = li < s0 ? li : start + (li - s0);
    const int64_t off = base + at * HD + d;
    const uint4 kv = __ldcg(reinterpret_cast<const uint4*>(p.kc + off));
    const uint4 vv = __ldcg(reinterpret_cast<const uint4*>(p.vc + off));
    uint32_t* kd = reinterpret_cast<uint32_t*>(ks + j * KST + d);
    uint32_t* vd = reinterpret_cast<uint32_t*>(vs + j * KST + d);
    kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
    vd[0] = vv.x; vd[1] = vv.y; vd[2] = vv.z; vd[3] = vv.w;
  }
  __syncthreads();
  for (int i = tid; i < GQ * CH; i += NT) {
    const int hh = i / CH, j = i % CH;
    float s = -INFINITY;
    if (j < cnt) {
      s = 0.f;
      const float* qh = qs + hh * HD;
      const __nv_bfloat16* kr = ks + j * KST;
#pragma unroll 8
      for (int d = 0; d < HD; d += 2) {
        float2 kk = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(kr + d));
        s += qh[d] * kk.x + qh[d + 1] * kk.y;
      }
    }
    sc[i] = s;
  }
  __syncthreads();
  float* part = p.att_part + ((((int64_t)m * NKV + g) * p.nchunk + chunk) * GQ) * (HD + 2);
  for (int hh = warp; hh < GQ; hh += NW) {  // max and sum of each head's chunk
    float mx = -INFINITY;
    for (int j = lane; j < CH; j += 32) mx = fmaxf(mx, sc[hh * CH + j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int j = lane; j < CH; j += 32) {
      float e = cnt > 0 ? __expf(sc[hh * CH + j] - mx) : 0.f;
      sc[hh * CH + j] = e;
      sum += e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      part[hh * (HD + 2) + HD] = mx;
      part[hh * (HD + 2) + HD + 1] = sum;
    }
  }
  __syncthreads();
  for (int i = tid; i < GQ * HD; i += NT) {
    const int hh = i / HD, d = i % HD;
    float o = 0.f;
    for (int j = 0; j < cnt; ++j) o += sc[hh * CH + j] * __bfloat162float(vs[j * KST + d]);
    part[hh * (HD + 2) + d] = o;
  }
  int* arrival = p.arrivals + (int64_t)layer * ARR_LAYER + m * NKV + g;
  if (!arrive_last(arrival, p.nchunk, flag)) return;
  const float* parts = p.att_part + (((int64_t)m * NKV + g) * p.nchunk) * GQ * (HD + 2);
  for (int i = tid; i < GQ * HD; i += NT) {  // merge the chunks in chunk order
    const int hh = i / HD, d = i % HD;
    float mx = -INFINITY;
    for (int c = 0; c < p.nchunk; ++c) mx = fmaxf(mx, __ldcg(parts + (c * GQ + hh) * (HD + 2) + HD));
    float num = 0.f, den = 0.f;
    for (int c = 0; c < p.nchunk; ++c) {
      const float* pc = parts + (c * GQ + hh) * (HD + 2);
      const float l = __ldcg(pc + HD + 1);
      if (l == 0.f) continue;
      const float w = __expf(__ldcg(pc + HD) - mx);
      num += w * __ldcg(pc + d);
      den += w * l;
    }
    p.attn[(int64_t)m * NQ * HD + (g * GQ + hh) * HD + d] = __float2bfloat16(num / den);
  }
  signal(p.counters + layer * C_LAYER + C_ATT);
}

// ---- epilogues ---------------------------------------------------------------------------------------------
__device__ void qkv_out(const Params& p, int layer, int z, const float* out) {
  const int head = z / (HD / 2), j0 = z % (HD / 2);
  const Layer& L = p.layers[layer];
  for (int i = threadIdx.x; i < p.M * 4; i += NT) {
    const int m = i / 4, r = i % 4, d = j0 + r;
    const int c1 = head * HD + d, c2 = c1 + HD / 2;
    float x1 = out[m * 32 + r], x2 = out[m * 32 + r + 4];
    if (L.bqkv) {  // the bias added before the one rounding, as a Linear with bias does
      x1 += __bfloat162float(L.bqkv[c1]);
      x2 += __bfloat162float(L.bqkv[c2]);
    }
    x1 = bf(x1);
    x2 = bf(x2);
    float y1 = x1, y2 = x2;
    if (head < NQ + NKV) {  // RoPE (rotate-half): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
      const float cs = p.cos[m * HD + d], sn = p.sin[m * HD + d];
      y1 = x1 * cs - x2 * sn;
      y2 = x2 * cs + x1 * sn;
    }
    const __nv_bfloat16 o1 = __float2bfloat16(y1), o2 = __float2bfloat16(y2);
    if (head < NQ) {
      const int64_t at = (int64_t)m * NQ * HD + c1;
      p.q[at] = o1;
      p.q[at + HD / 2] = o2;
      __nv_bfloat16* cap = p.q_capture[layer];
      if (cap) {
        cap[at] = o1;
        cap[at + HD / 2] = o2;
      }
    } else {
      const bool is_k = head < NQ + NKV;
      const int gh = is_k ? head - NQ : head - NQ - NKV;
      const int b = m / p.T;
      const int64_t at = ((((int64_t)layer * p.cache_b + b) * NKV + gh) * p.cache_s + p.pos[m]) * HD + d;
      __nv_bfloat16* c = is_k ? p.kc : p.vc;
      c[at] = o1;
      c[at + HD / 2] = o2;
    }
  }
}

__device__ void residual_out(const Params& p, int n0, int N, const float* out) {  // h += bf16(out)
  for (int i = threadIdx.x; i < p.M * N; i += NT) {
    const int m = i / N, n = i % N;
    __nv_bfloat16* h = p.h + (int64_t)m * D + n0 + n;
    *h = __float2bfloat16(__bfloat162float(__ldcg(h)) + bf(out[m * 32 + n]));
  }
}

__device__ void gate_up_out(const Params& p, int c0, const float* out) {
  for (int i = threadIdx.x; i < p.M * 8; i += NT) {
    const int m = i / 8, n = i % 8;
    const float g = bf(out[m * 32 + n]), u = bf(out[m * 32 + 8 + n]);
    p.act[(int64_t)m * I + c0 + n] = __float2bfloat16(g / (1.f + __expf(-g)) * u);
  }
}

// HEAD: each of the `rows` batch rows' best of the 16 logits in `out` (bf16-rounded; token ids >= vocab left out)
// folded into the program's running best. A key orders by the logit, then by the smaller index, so the largest
// key over every instruction is torch.argmax's answer (its first maximum).
__device__ __forceinline__ unsigned long long head_key(float v, int idx) {
  const unsigned int bits = __float_as_uint(v == 0.f ? 0.f : v);  // -0 == +0, as torch.argmax compares
  const unsigned int ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  return ((unsigned long long)ordered << 32) | (0xffffffffu - (unsigned int)idx);
}

__device__ void head_best(const Params& p, int v0, int rows, const float* out, unsigned long long* best) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int m = warp; m < rows; m += NW) {
    const int idx = v0 + lane;
    unsigned long long key = 0;
    if (lane < HEAD_ROWS && idx < p.vocab) key = head_key(bf(out[m * 32 + lane]), idx);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
      key = other > key ? other : key;
    }
    if (lane == 0 && key > best[m]) best[m] = key;
  }
  __syncthreads();
}

// With several splits: this split's partial sums to `part` [splits, M, groups * W], and the split that arrives last
// adds every split's in split order into `out`. Returns whether this program holds the sum (and runs the epilogue).
__device__ bool merge_splits(const Params& p, float* part, int* arrival, int group, int groups, int W, int split,
                             int splits, float* out, int* flag) {
  const int cols = groups * W;
  for (int i = threadIdx.x; i < p.M * W; i += NT) {
    const int m = i / W, n = i % W;
    part[((int64_t)split * p.M + m) * cols + group * W + n] = out[m * 32 + n];
  }
  if (!arrive_last(arrival, splits, flag)) return false;
  for (int i = threadIdx.x; i < p.M * W; i += NT) {
    const int m = i / W, n = i % W;
    float s = 0.f;
    for (int c = 0; c < splits; ++c) s += __ldcg(part + ((int64_t)c * p.M + m) * cols + group * W + n);
    out[m * 32 + n] = s;
  }
  __syncthreads();
  return true;
}

// the counter (of its layer) a GEMM instruction's epilogue advances
__device__ __forceinline__ int counter_of(int4 ins) {
  switch (ins.x) {
    case OP_QKV: {
      const int head = ins.z / (HD / 2);
      return C_QKV + (head < NQ ? head / GQ : head < NQ + NKV ? head - NQ : head - NQ - NKV);
    }
    case OP_O: return C_O;
    case OP_GU: return C_GU + ins.z / KC;
    default: return C_DOWN;
  }
}

// what (layer, stage) an instruction waits for, and how many arrivals that stage counts when done
__device__ __forceinline__ void dependency(const Params& p, int4 ins, int* stage_index, int* need) {
  const int l = ins.y;
  switch (ins.x) {
    case OP_HEAD:  // y = n_layers: after the last layer's down_proj, as a next layer's q/k/v would be
    case OP_QKV: *stage_index = l > 0 ? (l - 1) * C_LAYER + C_DOWN : -1; *need = G_DOWN; break;
    case OP_ATT: *stage_index = l * C_LAYER + C_QKV + ins.w / p.nchunk; *need = NEED_ATT; break;
    case OP_O: *stage_index = l * C_LAYER + C_ATT; *need = p.M * NKV; break;
    case OP_GU: *stage_index = l * C_LAYER + C_O; *need = G_O; break;
    default: *stage_index = l * C_LAYER + C_GU + ins.w; *need = KC / 8; break;
  }
}

__global__ void __launch_bounds__(NT, 1) draft_layers_kernel(const Params p) {
  extern __shared__ __align__(128) char smem[];
  char* slots = smem;
  __nv_bfloat16* A = reinterpret_cast<__nv_bfloat16*>(smem + NSLOT * SLOT_BYTES);
  float* red = reinterpret_cast<float*>(smem + NSLOT * SLOT_BYTES + A_BYTES);
  float* out = red + RED_BYTES / 4;
  int* misc = reinterpret_cast<int*>(out + OUT_BYTES / 4);  // [0]: arrive_last's flag
  uint64_t* bars = reinterpret_cast<uint64_t*>(misc + 16);
  unsigned long long* best = reinterpret_cast<unsigned long long*>(bars + NSLOT);  // [MAXM]

  const int sm = blockIdx.x;
  const int4* ins = p.ins + (int64_t)sm * p.ins_stride;
  const int4* wins = p.wins + (int64_t)sm * p.ins_stride;
  const int n_ins = p.n_ins[sm], n_w = p.n_wins[sm];
  if (threadIdx.x == 0) {
    for (int s = 0; s < NSLOT; ++s) mbar_init(bars + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int m = threadIdx.x; m < MAXM; m += NT) best[m] = 0ull;
  __syncthreads();
  const int head_rows = p.M / p.T;  // HEAD: each batch row's last token
  bool headed = false;

  int issued = 0, consumed = 0;
  int a_key = -1;  // what A holds: layer * 16 + op (+ split for DOWN)
#ifdef DRAFT_TIMELINE
  unsigned long long* tl = p.timeline + (int64_t)sm * p.ins_stride * TL_FIELDS;
#define MARK(k) \
  do { if (threadIdx.x == 0) tl[i * TL_FIELDS + (k)] = clock64(); } while (0)
#else
#define MARK(k) \
  do { } while (0)
#endif
  for (int i = 0; i < n_ins; ++i) {
    const int4 in = ins[i];
    MARK(MK_START);
#ifdef DRAFT_TIMELINE
    if (threadIdx.x == 0) {
      uint32_t smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      tl[i * TL_FIELDS + MK_GLOBAL] = now_ns();
      tl[i * TL_FIELDS + MK_SM] = smid;
    }
#endif
    if (threadIdx.x < 32) {  // keep NSLOT weight tiles in flight, before waiting for this instruction's inputs
      while (issued < n_w && issued < consumed + NSLOT) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue_tile(p, wins[issued], slots + (issued % NSLOT) * SLOT_BYTES, bars + issued % NSLOT);
        ++issued;
      }
    }
    int dep, need;
    dependency(p, in, &dep, &need);
    if (threadIdx.x == 0 && dep >= 0 && ld_acquire(p.counters + dep) < need) {
      const uint64_t t0 = now_ns();
      while (ld_acquire(p.counters + dep) < need) {
        __nanosleep(20);
        if (now_ns() - t0 > WAIT_LIMIT_NS) __trap();
      }
    }
    __syncthreads();
    MARK(MK_INPUTS);

    if (in.x == OP_HEAD) {
      if (KSPLIT > 1) __trap();  // the host plans HEAD only for builds with K whole (A and a slot hold whole rows)
      if (!headed) {  // A = the final RMSNorm of each batch row's last token (K whole: A holds whole rows)
        load_rows(A, p.h + (int64_t)(p.T - 1) * D, D * p.T, 0, D, head_rows);
        norm_rows(A, p.h, p.norm_w, 0, head_rows, p.eps, out);
        headed = true;
        a_key = -1;
      }
      MARK(MK_STAGED);
      const int slot = consumed % NSLOT;
      mbar_wait(bars + slot, (consumed / NSLOT) & 1);
      MARK(MK_WEIGHTS);
      const __nv_bfloat16* W = reinterpret_cast<const __nv_bfloat16*>(slots + slot * SLOT_BYTES);
      gemm(A, A_COLS, W, D + PAD, head_rows, HEAD_ROWS, D, red, out);
      MARK(MK_GEMM);
      head_best(p, in.z, head_rows, out, best);
      ++consumed;
      __syncthreads();  // the slot and `out` are free again
      MARK(MK_END);
      continue;
    }
    const int layer = in.y;
    const Layer& L = p.layers[layer];
    if (in.x == OP_ATT) {
      a_key = -1;  // the attention's scratch overwrites A
      attention(p, layer, in.z, in.w / p.nchunk, in.w % p.nchunk, reinterpret_cast<char*>(A), misc);
      __syncthreads();
      MARK(MK_END);  // (an attention instruction has no staged / weights / GEMM marks)
      continue;
    }
    const int split = in.w, key = layer * 256 + in.x * 32 + split;
    if (key != a_key) {
      switch (in.x) {
        case OP_QKV:
          load_rows(A, p.h, D, split * KQ, KQ, p.M);
          norm_rows(A, p.h, L.ln1, split * KQ, p.M, p.eps, out);
          break;
        case OP_O: load_rows(A, p.attn, D, split * KQ, KQ, p.M); break;
        case OP_GU:
          load_rows(A, p.h, D, split * KQ, KQ, p.M);
          norm_rows(A, p.h, L.ln2, split * KQ, p.M, p.eps, out);
          break;
        default: load_rows(A, p.act, I, split * KC, KC, p.M); break;
      }
      a_key = key;
    }
    MARK(MK_STAGED);
    const int slot = consumed % NSLOT;
    mbar_wait(bars + slot, (consumed / NSLOT) & 1);
    MARK(MK_WEIGHTS);
    const __nv_bfloat16* W = reinterpret_cast<const __nv_bfloat16*>(slots + slot * SLOT_BYTES);
    const bool down = in.x == OP_DOWN;
    const int N = in.x == OP_GU ? W_GU : down ? W_DOWN : 8, K = down ? KC : KQ;
    gemm(A, A_COLS, W, K + PAD, p.M, N, K, red, out);
    MARK(MK_GEMM);
    bool holds = true;  // this program has the instruction's whole sum in `out`
    int* arr = p.arrivals + (int64_t)layer * ARR_LAYER;
    switch (in.x) {
      case OP_QKV: {
        const int g = in.z / 4;
        if (KSPLIT > 1) holds = merge_splits(p, p.qkv_part, arr + ARR_QKV + g, g, G_QKV, W_QKV, split, KSPLIT, out, misc);
        if (holds) qkv_out(p, layer, in.z, out);
        break;
      }
      case OP_O: {
        const int g = in.z / 8;
        if (KSPLIT > 1) holds = merge_splits(p, p.o_part, arr + ARR_O + g, g, G_O, W_O, split, KSPLIT, out, misc);
        if (holds) residual_out(p, in.z, 8, out);
        break;
      }
      case OP_GU: {
        const int g = in.z / 8;
        if (KSPLIT > 1) holds = merge_splits(p, p.gu_part, arr + ARR_GU + g, g, G_GU, W_GU, split, KSPLIT, out, misc);
        if (holds) gate_up_out(p, in.z, out);
        break;
      }
      default: {
        const int g = in.z / DOWN_N;
        holds = merge_splits(p, p.down_part, arr + ARR_DOWN + g, g, G_DOWN, W_DOWN, split, DSPLIT, out, misc);
        if (holds) residual_out(p, in.z, DOWN_N, out);
        break;
      }
    }
    if (holds) signal(p.counters + layer * C_LAYER + counter_of(in));
    ++consumed;
    __syncthreads();  // the slot and `out` are free again
    MARK(MK_END);
  }
#undef MARK
  if (headed)
    for (int m = threadIdx.x; m < head_rows; m += NT) atomicMax(p.best + m, best[m]);
}

}  // namespace

extern "C" {

int draft_layers_smem_bytes() { return SMEM_BYTES; }

int draft_layers_arrivals_per_layer() { return ARR_LAYER; }

int draft_layers_counters_per_layer() { return C_LAYER; }

// once per process and device, before any launch (outside a CUDA graph capture)
int draft_layers_configure() {
  return cudaFuncSetAttribute(draft_layers_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES);
}

int draft_layers_shape(int* shape) {  // what this build was compiled for
  shape[0] = D; shape[1] = NQ; shape[2] = NKV; shape[3] = HD; shape[4] = I; shape[5] = DSPLIT;
  shape[6] = DOWN_N; shape[7] = CH; shape[8] = MAXM; shape[9] = NSLOT; shape[10] = KSPLIT;
  return 11;
}

// Launch on `stream` (a cudaStream_t) as a cooperative launch: every program waits on others, so all must be
// resident at once, which only a cooperative launch guarantees (it fails instead of hanging when they cannot be).
// Counters and arrivals are zeroed first on the same stream (one memset each). All of it is capturable in a CUDA
// graph. Returns a cudaError_t. `params_ptr` is a Params (the host's _Params): the exported signature names no
// type of the anonymous namespace, since nvcc gives a function whose parameters have internal linkage internal
// linkage too, extern "C" or not, and the symbol would be missing from the library (g++ exports it).
int draft_layers_launch(const void* params_ptr, int grid, void* stream, int counter_bytes, int arrival_bytes) {
  const Params* params = static_cast<const Params*>(params_ptr);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(params->counters, 0, counter_bytes, s);
  if (e != cudaSuccess) return e;
  e = cudaMemsetAsync(params->arrivals, 0, arrival_bytes, s);
  if (e != cudaSuccess) return e;
  if (params->lm_head != nullptr && (e = cudaMemsetAsync(params->best, 0, MAXM * 8, s)) != cudaSuccess) return e;
  int dev = 0, per_sm = 0, n_sm = 0;
  if ((e = cudaGetDevice(&dev)) != cudaSuccess) return e;
  if ((e = cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return e;
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, draft_layers_kernel, NT, SMEM_BYTES)) != cudaSuccess)
    return e;
  if (per_sm < 1 || grid > per_sm * n_sm) return cudaErrorCooperativeLaunchTooLarge;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(NT);
  cfg.dynamicSmemBytes = SMEM_BYTES;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, draft_layers_kernel, *params);
}

int draft_layers_params_bytes() { return sizeof(Params); }
}
