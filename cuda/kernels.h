// Host-side launchers of the CUDA backend's kernels (matmul.cu, attention.cu, ops.cu); all async on `st`.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/backend.h"

namespace dl::cuda {

// A weight matrix in device memory.
struct Mat {
  uint32_t type = 0;
  const uint8_t* w = nullptr;
  size_t row_bytes = 0;
  int64_t rows = 0, cols = 0;
};

bool matmul_type_ok(uint32_t type);

// Up to 3 matrices of one type and equal cols over the same n tokens of x, one launch:
// y[i][t][r] = s * sum_k W_i[r][k] xn[t][k], xn = x * norm_w when norm_w is set and
// s = 1 / rms(x[t]) when norm, else xn = x and s = 1; accumulate adds into y.
struct GemvJob {
  uint32_t type = 0;
  int count = 0;
  const uint8_t* w[3] = {};
  size_t rb[3] = {};
  int64_t rows[3] = {};
  float* y[3] = {};
  int64_t first_block[4] = {};  // filled by gemv_staged
  int64_t cols = 0;
  const float* x = nullptr;
  int n = 0;
  bool norm = false, accumulate = false;
  const float* norm_w = nullptr;
  float eps = 0.f;
  // Quantized activations (set: x is unused, norm is already applied): per token row,
  // cols int8 quants, then per 32-block the scale d and the sum of the block's quants.
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const int32_t* xs = nullptr;
  // One token whose quants are of x * norm_w, not yet RMS-normed (an rms GemvTail made them):
  // per 32-block the sum of squares of x; the q8 GEMV scales its sums by 1 / sqrt(mean + eps)
  // (eps above). Null: xq is the normed row's.
  const double* xn = nullptr;
};
// Bytes of n rows of quantized activations of `cols` (cols % 32 == 0): quants, scales, sums.
inline size_t qact_bytes(int64_t n, int64_t cols) { return (size_t)(n * cols + n * (cols / 32) * 8); }
// x (n rows of cols; RMS-normed first when norm, times norm_w when set) to 8-bit blocks of
// 32 at q: as the CPU's A8 rows (d = amax / 127, q = rint(x * 127 / amax)). Fills j's xq/xd/xs.
void quantize_act(const float* x, int64_t n, int64_t cols, bool norm, const float* norm_w, float eps, void* q,
                  cudaStream_t st);
// An activation as the kernels' int code (act.cuh's glu_value).
inline int act_code(Act a) {
  return a == Act::silu ? 0 : a == Act::gelu_tanh ? 1 : a == Act::swiglu_oai ? 2 : a == Act::sigmoid ? 3 : 4;
}
// The GLU (act as glu's int code) into out and, in the same pass, its q8 form into q (as
// quantize_act lays it out).
void glu_quantize(const float* gate, int64_t gs, const float* up, int64_t us, int act, float* out, int64_t n,
                  int64_t cols, void* q, cudaStream_t st);
void point_qact(GemvJob& j, void* q, int64_t n, int64_t cols);
// The q8 GEMV's blocks for j (one token, `rows` rows a warp group; fills first_block, as
// gemv_staged would) and the warps that split a row (its ks).
int gemv_q8_plan(GemvJob& j, int rows = 4);
// One token's q8 GEMV that rounds its own input x (RMS-normed times norm_w when norm) in each
// block, instead of a quantize_act launch before it; for matrices of at most kQuantBlocksMax
// blocks and cols <= 2048. Results equal quantize_act + gemv_staged's bit for bit; slower on
// the H200 so far (DASLLAMA_CUDA_QX=1 only).
constexpr int64_t kQuantBlocksMax = 1024;
bool gemv_q8_x_fits(const GemvJob& j);
void gemv_q8_x(GemvJob j, const float* x, bool norm, const float* norm_w, float eps, cudaStream_t st);
// Whether j can run on the staged GEMV (n <= 32, cols % 8 == 0, rows 4-byte aligned;
// 16-byte for float types), and the launch (first_block is filled there).
bool gemv_staged_fits(const GemvJob& j);
// gemv_k_i8_k (q8 mode's q4_K / q5_K / q6_K on int8 dot products): whether it is on for this
// type (DASLLAMA_CUDA_Q4K_I8 / DASLLAMA_CUDA_Q56K_I8, both on; read at each call), and whether a
// matrix's rows fit it (whole super-blocks; q4_K / q5_K rows 16-byte aligned, q6_K's 2 from a
// 4-aligned start: its 210-byte blocks are read as the aligned words around them).
bool k_i8_on(uint32_t type);
bool k_i8_rows_fit(uint32_t type, int64_t cols, int64_t rows, size_t rb, const void* w);
void gemv_staged(GemvJob j, cudaStream_t st);
// What a one-token q8 GEMV does once its outputs are written, instead of the launch that would
// follow it (the same arithmetic, so the same bits):
//   round: the block that finishes last rounds row x (RMS-normed times nw when norm; x is
//          usually the GEMV's own residual output) into q, as quantize_act does;
//   glu:   over gate = y[0], up = y[1] (count 2, equal rows), the block that completes a 32-row
//          chunk of both writes out = act(gate, up) and its q8 form into q, as glu_quantize does;
//   rms:   over x = y[0] (count 1, a residual row, rows = cols; sm_90), the blocks that make a
//          32-row chunk run as one thread-block cluster: they hand their outputs to rank 0 in its
//          shared memory, which writes the q8 form of x * nw (no RMS scale: a common factor of
//          the row, applied by the next GEMV, GemvJob::xn) into q and the chunk's sum of
//          squares into xn. Not quantize_act's bits: the row's quants before its norm's scale;
//   glu_cluster: glu's work with the blocks of a 32-row chunk of gate and of up as one cluster
//          (sm_90), their rows handed to rank 0 over shared memory: no counter (cnt unused).
// cnt: zeroed counters (one for round, rows / 32 for glu; rms none), left zeroed. A glu or rms
// tail's q is not the scratch its GEMV reads its own input from: chunks complete while other
// blocks still read it.
struct GemvTail {
  enum Kind : int { none = 0, round = 1, glu = 2, rms = 3, glu_cluster = 4 } kind = none;
  unsigned* cnt = nullptr;
  const float* x = nullptr;
  bool norm = false;
  const float* nw = nullptr;
  float eps = 0.f;
  int act = 0;
  float* out = nullptr;
  int64_t cols = 0;  // of the rounded row
  void* q = nullptr;
  double* xn = nullptr;  // rms: per 32-block sums of squares
};
constexpr int64_t kTailCounters = 4096;  // glu tails: rows up to 32 times this
bool gemv_tail_fits(const GemvJob& j, const GemvTail& t);
// The GLU cluster tail (glu_cluster; t.act, t.out, t.cols) on a float-activation gate / up GEMV
// (f16 / bf16 weights, one token): the chunk's GLU written to t.out as the glu op writes it, so
// no glu launch follows.
bool gemv_direct_glu_fits(const GemvJob& j, const GemvTail& t);
void gemv_direct_tailed(GemvJob j, const GemvTail& t, cudaStream_t st);
// Whether j (q8 mode, one token) can take an input an rms tail made (GemvJob::xn): the q8 GEMV
// kernels at 2 rows a group over the aligned split layouts.
bool gemv_xn_fits(const GemvJob& j);
void gemv_tailed(GemvJob j, const GemvTail& t, cudaStream_t st);
// The q8-mode matmul on tensor cores (sm_80 on): j with quantized activations (xq set) over
// T_Q8_0S / T_Q4_0S weights, any n; for batched decode and prefill.
// Prefill (many tokens) of f16 / bf16 weights on TF32 tensor cores, f32-accurate (mma.cu).
bool mma_f16_fits(const Mat& m, const float* x, int64_t n);
void mma_f16(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st);
// f16 weights past 64 tokens on f16 mmas (a power-of-two scale per token; split: x in two f16
// halves, f32-accurate, else x rounded to f16 once): scratch of mma_f16h_scratch(n, cols) bytes.
bool mma_f16h_fits(const Mat& m, const float* x, int64_t n);
size_t mma_f16h_scratch(int64_t n, int64_t cols);
void mma_f16h(const Mat& m, const float* x, int64_t n, float* y, void* scratch, bool split, cudaStream_t st);
// The same for count (1-3) matrices of equal cols over one x (Q / K / V, gate / up): x split or
// rounded once for all of them.
void mma_f16h_multi(const Mat* ms, float* const* ys, int count, const float* x, int64_t n, void* scratch, bool split,
                    cudaStream_t st);
// cuBLAS (dlopen'ed; DASLLAMA_CUDA_CUBLAS=0 turns it off, DASLLAMA_CUBLAS a path to it) for the rounded (not
// split) f16 products: xh is x rounded on each token's scale, inv those scales' inverses. False
// where cuBLAS is missing or refuses the first product (the tiles then run).
bool cublas_f16(const Mat* ms, float* const* ys, int count, const __half* xh, const float* inv, int64_t n,
                cudaStream_t st);
bool cublas_on();
std::string cublas_name();  // the library opened, or empty
// Makes this device's handle now (its workspace allocation), so a product recorded for a captured
// graph never makes it inside the capture; whether cuBLAS is on and the handle there.
bool cublas_prepare();
// q8 mode's block-format matmul on cuBLAS a slab of rows at a time (DASLLAMA_CUDA_DQF16_SLAB_KB):
// each slab of m decoded to f16 into dq (slab_rows x cols halves), its product written into y's
// rows r0.., then every token's row scaled back by inv. xh / inv: x rounded as for cublas_f16.
void cublas_f16_slabs(const Mat& m, void* dq, int64_t slab_rows, const __half* xh, const float* inv, int64_t n,
                      float* y, cudaStream_t st);
// q8 mode's block formats on cuBLAS a slab of rows at a time (cublas_f16_slabs), x rounded to f16
// once first; scratch as mma_f16h's.
void mma_f16h_slabs(const Mat& m, void* dq, int64_t slab_rows, const float* x, int64_t n, float* y, void* scratch,
                    cudaStream_t st);
// q8 mode's prefill of q4_1 / q5_0 / q5_1 / q4_K / q5_K / q6_K on the f16 tiles: m decoded to
// f16 rows (m.rows x m.cols halves, 16-aligned `out`) first.
bool dequant_f16_type(uint32_t type);
void dequant_f16(const Mat& m, void* out, cudaStream_t st);
bool mma_q8_fits(const GemvJob& j);
// q4_K / q5_K / q6_K steps of n tokens on int8 mmas (mma_q8 takes them: mma_k_i8_k) instead of
// gemv_k_i8_k: 9-16 tokens by default, DASLLAMA_CUDA_KMMA=1 from 2, =0 none; up to
// DASLLAMA_CUDA_KMMA_MAX (16; at most 32), read at each call.
bool k_mma_on(int64_t n);
void mma_q8(const GemvJob& j, cudaStream_t st);
// y[t][r] = sum_k W[r][k] x[t][k], t < n.
void matmul(const Mat& m, const float* x, int64_t n, float* y, cudaStream_t st);
void get_rows(const Mat& m, const int32_t* ids, int64_t n, float* out, cudaStream_t st);
// Backend::matmul_id over a stack of experts of expert_rows rows each (m.rows = all of them).
void matmul_id(const Mat& m, int64_t expert_rows, const float* x, int64_t x_div, const int32_t* ids, int64_t n_pairs,
               const float* bias, float* y, cudaStream_t st);
void moe_route(const float* logits, int64_t n, int n_expert, int k, int gate, bool norm, int32_t* ids, float* w,
               cudaStream_t st);
void moe_sum(const float* y, const float* w, int64_t n, int k, int64_t dim, float* out, cudaStream_t st);
// Backend::argmax: each row's first largest value's index, each row over `splits` blocks
// (argmax_splits) whose partials go to part_v / part_i (room for kArgmaxParts) and whose
// per-row counters (kArgmaxRows, zeroed, left zeroed) pick the joining block.
constexpr int64_t kArgmaxParts = 4096, kArgmaxRows = 1024;
int argmax_splits(int64_t n_rows, int64_t dim, int n_sm);
void argmax(const float* x, int64_t n_rows, int64_t dim, int32_t* out, int splits, float* part_v, int* part_i,
            int* cnt, cudaStream_t st);

// Attention: splits of the key range per (query, head) (flash-decoding) and the
// scratch floats they need; split > 1 needs that scratch, and rows * n_heads counters
// (ints, zero before the first call; each call leaves them zero).
int attn_splits(const AttnArgs& a, int n_sm);
int attn_splits(int64_t rows, int n_heads, int64_t n_kv, int n_sm);
size_t attn_scratch_floats(const AttnArgs& a, int splits);
void attn_check(const AttnArgs& a);  // throws what attention() would refuse
// gqa: the grouped-query decode kernel (below) instead of attn_k; splits then from attn_gqa_splits.
void attention(const AttnArgs& a, int splits, float* scratch, int* counters, cudaStream_t st, bool gqa = false);
// The grouped-query decode kernel (default; DASLLAMA_CUDA_ATTN_GQA=0 turns it off): a block per
// (row, GH query heads of one KV head, key split), each K / V row loaded once for the GH heads
// in 16-byte pieces. It takes head_dim 64 / 128 / 256 over f32, f16 or q8_0 caches whose rows
// are 16-byte (q8_0: 2-byte) aligned, any group size, windows, softcaps, sinks and the output's
// rounding (AttnQuant); the same f32 arithmetic as attn_k up to the order of sums. Its split
// partials and counters are attn_k's (attn_scratch_floats), with at most 64 splits.
bool attn_gqa_on();                       // the switch, read at each call
int attn_gqa_heads(const AttnArgs& a);    // GH (1, 2 or 4) where the kernel takes a, else 0
int attn_gqa_splits(int64_t rows, const AttnArgs& a, int64_t n_kv, int n_sm);  // a: the shape
// A one-row step whose keys fit N batches of a 16-warp block takes one such block an item,
// unsplit (no partials, counter or merge by a last block): DASLLAMA_CUDA_ATTN_WIDE=N (default 2;
// 0 off), read at each launch.
int attn_gqa_wide();
// Whether a launch of `rows` query rows in `splits` key splits takes the wide block (the launcher
// and the backend's path_count agree through this one test).
bool attn_gqa_on_wide(int64_t rows, int splits);
// Where attention also writes its output rounded to q8 blocks, as quantize_act (no norm) would
// round it for the next matmul: element e of the rows from `base` (the output's first row,
// rows `cols` apart; head_dim a multiple of 32) goes to xq[e], block e / 32 to xd / xs.
struct AttnQuant {
  int8_t* xq = nullptr;
  float* xd = nullptr;
  int32_t* xs = nullptr;
  const float* base = nullptr;
};
// count sessions' attentions in one launch: their args in device memory (dargs), all
// with shape's n_heads, head_dim and KV type; rows z = session * maxtok + token; the
// scratch holds count * maxtok rows of partials.
void attention_group(const AttnArgs& shape, const AttnArgs* dargs, int count, int maxtok, int splits, float* scratch,
                     int* counters, cudaStream_t st, const AttnQuant& qo = AttnQuant(), bool gqa = false);
// flash.cu: attention of many query rows (prefill, encoders) in key tiles shared by a block's
// rows; one launch, no splits. Fits: head_dim <= 256 and the tiles' shared memory on the device.
bool flash_fits(const AttnArgs& a, int max_smem_optin);
void flash_attention(const AttnArgs& a, cudaStream_t st);
void kv_store(const KVView& kv, int64_t first, const float* k, const float* v, int64_t n, int64_t src_stride,
              int64_t dim, cudaStream_t st);
// One session's store for kv_store_group (in device memory).
struct KVStoreDesc {
  KVView kv;
  int64_t first = 0;
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t n = 0;
};
void kv_store_group(const KVStoreDesc* d, int count, int64_t max_n, int64_t src_stride, int64_t dim, cudaStream_t st);
// A Q / K / V GEMV (j: three matrices, 1-4 tokens, q8 mode's q8_0 / q4_0 or a direct layout)
// that also does what rope_store_group would after it: Q's and K's rows turned by normal (adjacent
// pairs) rope at pos, K's and V's rows stored into the cache rows of the count descriptors d
// (device memory; f16 / f32 caches: the caller checks), whose k point into x2 = j.y[1] (stride2 =
// its rows). One launch instead of two; the same bits.
struct GemvRope {
  const int32_t* pos = nullptr;
  RopeParams p{};
  int head_dim = 0;
  const KVStoreDesc* d = nullptr;
  int count = 0;
  const float* x2 = nullptr;
  int64_t stride2 = 0;
  bool early_cs = false;  // the angles at the block's start (RopeOut::prepare)
};
bool gemv_rope_fits(const GemvJob& j, const GemvRope& r);
void gemv_roped(GemvJob j, const GemvRope& r, cudaStream_t st);
// rope2(x, x2) at positions pos, then kv_store_group, in one launch: every token of x2 is one
// descriptor's row (its k points into x2, src_stride == stride2).
struct RopeStore {
  float* x = nullptr;
  int64_t stride = 0;
  int n_heads = 0;
  float* x2 = nullptr;
  int64_t stride2 = 0;
  int n_heads2 = 0, head_dim = 0;
  const int32_t* pos = nullptr;
  RopeParams p{};
};
void rope_store_group(const RopeStore& r, const KVStoreDesc* d, int count, int64_t max_n, int64_t src_stride,
                      int64_t dim, cudaStream_t st);

void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps, cudaStream_t st);
void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t n_rows, int64_t dim, float eps,
                cudaStream_t st);
void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos, const RopeParams& p,
          cudaStream_t st);
// Two tensors at the same positions (Q and K of a layer) in one launch.
void rope2(float* x, int64_t stride, int n_heads, float* x2, int64_t stride2, int n_heads2, int64_t n_tok,
           int head_dim, const int32_t* pos, const RopeParams& p, cudaStream_t st);
void glu(const float* gate, int64_t gs, const float* up, int64_t us, float* out, int64_t n_rows, int64_t dim, Act act,
         cudaStream_t st);
void add(float* y, const float* x, int64_t n, cudaStream_t st);
void add_bias(float* y, const float* b, int64_t n_rows, int64_t dim, cudaStream_t st);
void scale(float* y, float s, int64_t n, cudaStream_t st);
void softcap(float* y, float cap, int64_t n, cudaStream_t st);
void gelu_erf(float* y, int64_t n, cudaStream_t st);
void copy_rows(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t width, cudaStream_t st);
void im2col_1d(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad, float* out,
               int64_t T_out, cudaStream_t st);
void im2col_rows(const float* x, int64_t C, int64_t T, int k, int stride, int pad, float* out, int64_t T_out,
                 cudaStream_t st);
void im2col_2d(const float* x, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh, int64_t sw, int kh, int kw,
               int stride, int pad, float* out, int64_t H_out, int64_t W_out, cudaStream_t st);
void avg_pool_rows(const float* x, int64_t n_rows, int64_t dim, int k, float* out, cudaStream_t st);

// fused.cu: a one-token decode step of a whole dense layer in q8 mode (Backend::decode_layer)
// as one persistent kernel whose phases meet at grid-wide barriers.
struct FusedLayerArgs {
  float* x = nullptr;
  int64_t dim = 0, q_dim = 0, kv_dim = 0, ffn = 0;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  float eps = 0.f;
  int act = 0;  // act_code
  // The four GEMVs, planned (gemv_q8_plan); the kernel points qkv, o and gu at the
  // activations it quantizes into shared memory, down at h (global).
  GemvJob qkv, o, gu, down;
  int ks_qkv = 0, ks_o = 0, ks_gu = 0, ks_down = 0;
  float *q = nullptr, *k = nullptr, *v = nullptr, *att = nullptr, *gate = nullptr, *up = nullptr;
  void* h = nullptr;  // the GLU's q8 form (qact_bytes(1, ffn))
  RopeParams rope;
  const int32_t* pos = nullptr;
  const AttnArgs* attn = nullptr;  // device memory: this step's attention (n_kv, pages, q_pos)
  int splits = 1;
  float* part = nullptr;
  int* cnt = nullptr;
  unsigned* bar = nullptr;  // two counters, zero between launches
  int blocks_per_sm = 0;    // 0: as many as fit
  bool prefetch = true;     // O, gate/up and down weights into L2 during the latency-bound phases
  int trace = -1;           // >= 0: print the phases' times at this rope position
};
// Whether the fused kernel takes this layer (weights' type, head size, KV type; the rows it
// rounds into shared memory are at most 2048 wide).
bool fused_layer_fits(uint32_t type, int head_dim, KVType kv, int64_t dim, int64_t q_dim);
// The kernel's launch; f.attn is read when it runs.
void fused_layer(const FusedLayerArgs& f, uint32_t type, int head_dim, KVType kv, cudaStream_t st);

// recurrent.cu: gated-DeltaNet layers (see Backend::conv1d_causal / delta_rule).
void conv1d_causal(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C, const float* w, int k,
                   bool silu, float* y, cudaStream_t st);
void delta_rule(const DeltaRuleArgs& a, cudaStream_t st);
// Whether the chunked form's shared memory (q, k of a chunk, a state tile) fits for this dk.
// Whether the chunked form's shared memory (q, k of a chunk, a state tile) fits for this dk on
// the current device; when it does, the kernel is allowed that much.
bool delta_chunk_fits(int64_t dk);

}  // namespace dl::cuda
