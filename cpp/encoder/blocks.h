// Pre-LN transformer encoder blocks with bidirectional attention, shared by the audio towers
// (whisper encoders) and the vision towers (ViTs): LayerNorm, Q/K/V with biases, every
// position attending every position, output projection, LayerNorm, GELU MLP, residuals.
// Knows no family: the caller loads the weights and says which GELU.
#pragma once
#include <cstdint>
#include <vector>

#include "core/backend.h"

namespace dl::encoder {

struct Layer {
  Vec ln1_w, ln1_b, ln2_w, ln2_b, bq, bk, bv, bo, b_up, b_down;  // bk may be empty (whisper)
  Weight wq, wk, wv, wo, w_up, w_down;
};

enum class Gelu { erf, tanh };

// A one-page f32 cache over `rows` K rows of `width` floats followed by as many V rows, at
// base (page0: a backend block table {0}): how a tower's or decoder's own K|V buffer is
// handed to the paged attention op.
inline KVView flat_kv(void* base, int64_t rows, int64_t width, const int32_t* page0) {
  KVView kv;
  kv.base = static_cast<uint8_t*>(base);
  kv.pages = page0;
  kv.n_pages = 1;
  kv.page_shift = 62;
  kv.page_bytes = (size_t)(2 * rows * width) * 4;
  kv.k_off = 0;
  kv.v_off = (size_t)(rows * width) * 4;
  kv.row_bytes = (size_t)width * 4;
  kv.type = KVType::f32;
  return kv;
}

// Backend scratch (grown on demand) of one run of blocks, and the constant inputs of its
// attention: a one-page block table {0} and the all-see-all positions.
class Blocks {
 public:
  // h: L x dim rows in backend memory, updated in place through every layer.
  void run(Backend& be, const std::vector<Layer>& layers, float* h, int64_t L, int64_t dim, int n_heads,
           int64_t ffn_dim, float eps, Gelu gelu);

 private:
  float* buf(Backend& be, int i, int64_t floats);
  enum { B_XN, B_KV, B_Q, B_A, B_O, B_U, B_COUNT };
  BufferPtr bufs_[B_COUNT];
  BufferPtr pos_, page0_, ones_;
  int64_t pos_rows_ = 0;
};

}  // namespace dl::encoder
