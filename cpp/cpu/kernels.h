// The CPU kernel table: one instance per compiled ISA, chosen at run time.
// Kernel bodies live in cpp/cpu/*_isa.cpp, compiled once per ISA (see CMakeLists).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/cpu_features.h"
#include "cpu/act_blocks.h"  // act_row_bytes(act_type, k): the size of one activation row

namespace dl {
struct DeltaRuleArgs;
}

namespace dl::cpu {

// Scratch of the chunked delta rule, one per thread, grown on first use.
struct DeltaScratch {
  std::vector<float> buf;
};

// One matmul y[t][r] = sum_k W[r][k] * x[t][k] over weight rows [r0, r1).
// W is row-major in its own block format (wtype), each row w_row_bytes long.
// act holds the n_tok activation rows already converted to act_type(wtype)
// (quantized blocks, or plain f32), each act_row_bytes long.
struct MatmulArgs {
  uint32_t wtype = 0;
  int64_t k = 0;  // inner dimension (elements per row)
  const void* w = nullptr;
  size_t w_row_bytes = 0;
  const void* act = nullptr;
  size_t act_row_bytes = 0;
  int64_t n_tok = 0;
  float* y = nullptr;
  int64_t y_stride = 0;  // floats between consecutive tokens' outputs
  int64_t rows = 0;      // rows of the whole matrix
  const void* wpack = nullptr;  // the same matrix in this ISA's packed layout (pack_rows), or null
  // The epilogue (Backend::matmul_multi_ex) as the output is stored: y += bias[r], then the exact
  // GELU. Only the packed f32 / f16 kernel reads these; the backend applies them after any other.
  const float* bias = nullptr;
  bool gelu = false;
};

// Attention of n_rows query rows (each with `group` heads of head_dim, laid out
// contiguously per row) against one KV head held in f32 rows. Row t sits at
// position pos[t] and sees keys j <= pos[t] (and pos[t] - j < window if window).
// Key row j is at k_pages[j >> page_shift] + k_off bytes + (j & mask) * kv_stride
// floats (V alike); contiguous rows are one page with a shift past any j.
struct AttnBlock {
  const float* q = nullptr;
  int64_t q_stride = 0;  // floats between rows
  const uint8_t* const* k_pages = nullptr;
  const uint8_t* const* v_pages = nullptr;
  size_t k_off = 0, v_off = 0;  // bytes into each page (this KV head's first element)
  int page_shift = 62;
  int64_t kv_stride = 0;  // elements between key rows
  bool kv_f16 = false;    // rows hold f16 (read as they are used), else f32
  const int32_t* pos = nullptr;
  int64_t n_rows = 0, n_kv = 0;
  int group = 1, head_dim = 0, window = 0;
  float scale = 1.f, softcap = 0.f;
  const float* sinks = nullptr;  // the block's first query head's sink logit (AttnArgs::sinks), or null
  float* out = nullptr;
  int64_t out_stride = 0;
  float* scratch = nullptr;  // attn_block_scratch(...) floats
  // Split over keys: with part set, only key chunks [c_lo, c_hi) (kAttnChunk keys each, from
  // key 0) are done and row r's partial for chunk c goes to part + r * part_stride + (c - c_lo)
  // * (head_dim + 2), for attn_combine; out and sinks are not used. part_stride 0 means
  // (c_hi - c_lo) * (head_dim + 2).
  float* part = nullptr;
  int64_t part_stride = 0;
  int64_t c_lo = 0, c_hi = 0;
  // An f16 cache's rows of this KV head converted once for the whole call (attn_kv_f32), keys
  // [kv32_lo, kv32_hi): kt32 in transposed tiles of 16 keys (tile of key j at kt32 + (j -
  // kv32_lo) / 16 * 16 * head_dim, element d of its key i at [d * 16 + i]), v32 as rows (key j at
  // v32 + (j - kv32_lo) * head_dim). Null: the block converts what it reads itself. The values
  // are the same (the conversion is exact), so are the bits.
  const float* kt32 = nullptr;
  const float* v32 = nullptr;
  int64_t kv32_lo = 0, kv32_hi = 0;
};

// Dense attention of one head for an encoder (AttnArgs::any_order; dense_attn_isa.cpp): rows
// [0, n_rows) of q (each row's head slice at q + r * q_stride) against all n_kv keys, K packed
// by dense_attn_pack_k into kt, V rows at v + j * v_stride; out rows at out + r * out_stride.
struct DenseAttn {
  const float* q = nullptr;
  int64_t q_stride = 0;
  const float* kt = nullptr;
  const float* v = nullptr;
  int64_t v_stride = 0;
  int64_t n_rows = 0, n_kv = 0;
  int head_dim = 0;
  float scale = 1.f;
  float* out = nullptr;
  int64_t out_stride = 0;
  float* scratch = nullptr;  // dense_attn_scratch(n_rows, n_kv) floats
};

// Keys per chunk of the softmax: every row's keys are summed in chunks at multiples of this
// many keys, then the chunks are combined in order, however the work was split.
constexpr int64_t kAttnChunk = 512;

// Packed matrices come in groups of this many rows; matmul row ranges start on a group.
constexpr int64_t kPackRowAlign = 16;

struct KernelTable {
  Isa isa = Isa::baseline;
  // Dequantize n elements (a whole number of blocks) of ggml type `type`.
  // Returns false if the type has no dequantizer.
  bool (*dequant_row)(uint32_t type, const void* src, float* dst, int64_t n) = nullptr;

  // Matmul. act_type(wtype) names the activation format the weight's dot
  // product wants (a GGMLType id naming one of the internal formats of
  // cpu/act_blocks.h: Q8_1, Q8_K or F32), or UINT32_MAX for a type with no matmul;
  // act_row_bytes(act_type, k) sizes a row. quantize_act converts one f32 row of n
  // elements into dst (act_row_bytes long; 64-byte alignment is best).
  uint32_t (*act_type)(uint32_t wtype) = nullptr;
  void (*quantize_act)(uint32_t act_type, const float* x, void* dst, int64_t n) = nullptr;
  // Rows [r0, r1) of the product; safe to call from several threads on disjoint rows.
  // With wpack set, r0 is a multiple of kPackRowAlign.
  void (*matmul_rows)(const MatmulArgs& a, int64_t r0, int64_t r1) = nullptr;
  // Repacked layouts (packed_isa.cpp): bytes of a rows x k matrix of wtype in this ISA's
  // packed layout (0: none, keep the file layout), and the packing of row groups [g0, g1)
  // (kPackRowAlign rows each) into out.
  size_t (*pack_bytes)(uint32_t wtype, int64_t rows, int64_t k) = nullptr;
  void (*pack_rows)(uint32_t wtype, const void* w, size_t row_bytes, int64_t rows, int64_t k, int64_t g0,
                    int64_t g1, void* out) = nullptr;

  // Float helpers for attention and norms.
  float (*dot_f32)(const float* a, const float* b, int64_t n) = nullptr;
  void (*attn_block)(const AttnBlock& b) = nullptr;
  // Keys [j0, j1) (j0 a multiple of 16 past b.kv32_lo) of b's f16 cache rows into kt and v in
  // AttnBlock::kt32 / v32's layouts for a prefill's blocks to share;
  // null where the ISA has none (head_dim a multiple of 16 only).
  void (*attn_kv_f32)(const AttnBlock& b, int64_t j0, int64_t j1, float* kt, float* v) = nullptr;
  // One row's output from its n_chunks partials [m, l, o[hd]] (AttnBlock::part), in chunk
  // order; sink: the head's sink logit or null.
  void (*attn_combine)(const float* part, int64_t n_chunks, int hd, const float* sink, float* out) = nullptr;
  // out = act(gate) * up; act 0: SiLU, 1: GELU (tanh form). out may alias up.
  void (*glu_f32)(const float* gate, const float* up, float* out, int64_t n, int act) = nullptr;
  // y = 0.5 y (1 + erf(y / sqrt 2)) in place (the exact GELU), with a branch-free erf.
  void (*gelu_erf_f32)(float* y, int64_t n) = nullptr;
  // One row of layer_norm: y = (x - mean) / sqrt(var + eps) * w + b (w, b may be null), the mean and
  // variance summed in double over eight lanes (lane l takes elements l, l + 8, ...), the same bits
  // on every ISA. y may alias x.
  void (*layer_norm_row)(const float* x, const float* w, const float* b, float* y, int64_t dim, float eps) = nullptr;
  size_t (*attn_block_scratch)(int64_t n_rows, int group, int head_dim, int64_t n_kv) = nullptr;
  // Dense (encoder) attention, or null where the ISA has none (the paged kernel serves then):
  // one head's K rows (k + j * k_stride, head_dim a multiple of 16) packed as transposed blocks
  // [b0, b1) of 64 keys (head_dim x 64 floats each), and one block of rows against them.
  void (*dense_attn_pack_k)(const float* k, int64_t k_stride, int64_t n_kv, int head_dim, int64_t b0, int64_t b1,
                            float* kt) = nullptr;
  void (*dense_attn_rows)(const DenseAttn& a) = nullptr;
  size_t (*dense_attn_scratch)(int64_t n_rows, int64_t n_kv, int head_dim) = nullptr;
  // f16 KV cache rows to f32 (exact for finite values).
  void (*f16_to_f32)(const uint16_t* src, float* dst, int64_t n) = nullptr;
  // f32 to f16 cache rows, rounding to nearest even.
  void (*f32_to_f16)(const float* src, uint16_t* dst, int64_t n) = nullptr;
  // The gated delta rule's chunked form (DeltaRuleArgs::chunked) for value head h over all a.n
  // tokens, updating its state (delta_isa.cpp).
  void (*delta_chunked_head)(const DeltaRuleArgs& a, int64_t h, DeltaScratch& scratch) = nullptr;
};

// The table for the active ISA (dl::active_isa()).
const KernelTable& kernels();
const KernelTable& kernels_for(Isa isa);

}  // namespace dl::cpu
