// The op interface every backend implements (CPU in cpp/cpu, devices in cuda/,
// vulkan/, metal/). Model code reaches kernels only through it. Knows no
// architecture: ops take plain shapes and flags.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace dl {

// A 2-D weight: rows of `cols` elements in ggml type `type`, row-major.
struct Weight {
  uint32_t type = 0;
  int64_t rows = 0, cols = 0;
  const uint8_t* data = nullptr;
  size_t row_bytes = 0;
  std::shared_ptr<std::vector<uint8_t>> owned;  // set when converted at load
  // The backend's own layout of the same matrix (Backend::prepare), tagged with the kernel
  // variant it is for; a backend ignores a layout it did not make.
  std::shared_ptr<void> packed_owner;
  const uint8_t* packed = nullptr;
  int packed_for = -1;
  bool empty() const { return data == nullptr; }
};

struct RopeParams {
  bool neox = true;          // split-halves pairs (else adjacent pairs)
  int n_rot = 0;             // rotated dims per head (<= head_dim)
  float base = 10000.f;
  float freq_scale = 1.f;    // linear scaling: positions times this
  const float* freq_factors = nullptr;  // llama3-style per-pair divisors (n_rot/2), or null
  const double* inv_freq = nullptr;     // explicit per-pair frequencies (YaRN), replacing base
  float mscale = 1.f;                   // cos/sin scale (YaRN attention factor)
};

enum class KVType : uint32_t { f32 = 0, f16 = 1, q8_0 = 8 };

// Self-attention of n_tok queries against the cache rows [0, n_kv) of one layer.
// Query t sits at position q_pos[t] and sees cache rows j with
// j <= q_pos[t] and (window == 0 or q_pos[t] - j < window).
// The rows are either contiguous (k, v) or paged: row j of K is at
// pages[j >> page_shift] + k_off + (j & (2^page_shift - 1)) * kv_row_bytes (V: v_off).
struct AttnArgs {
  const float* q = nullptr;  // [n_tok][n_heads * head_dim]
  int64_t q_stride = 0;
  const void* k = nullptr;   // contiguous cache rows: [pos][n_kv_heads * head_dim] in kv_type
  const void* v = nullptr;
  const uint8_t* const* pages = nullptr;  // when set, k and v are unused
  int page_shift = 0;
  size_t k_off = 0, v_off = 0;
  size_t kv_row_bytes = 0;
  KVType kv_type = KVType::f32;
  int64_t n_tok = 0, n_kv = 0;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const int32_t* q_pos = nullptr;
  int window = 0;
  float scale = 1.f;
  float softcap = 0.f;
  float* out = nullptr;  // [n_tok][n_heads * head_dim]
  int64_t out_stride = 0;
};

enum class Act { silu, gelu_tanh };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  // y[t][r] = sum_k W[r][k] x[t][k] for t < n; x rows are w.cols long, y rows w.rows.
  virtual void matmul(const Weight& w, const float* x, int64_t n, float* y) = 0;
  // count weights with the same cols over the same x: ys[i] = x * ws[i]^T (count <= 8).
  virtual void matmul_multi(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n) = 0;
  // Lays out a matmul weight the way this backend reads it fastest (once, at load). Optional.
  virtual void prepare(Weight& w) { (void)w; }
  // Rows of embedding table w for ids, dequantized to f32.
  virtual void get_rows(const Weight& w, const int32_t* ids, int64_t n, float* out) = 0;
  // y = x / rms(x) * w over rows of dim elements; w may be null; y may alias x.
  virtual void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) = 0;
  // In-place RoPE on n_tok rows of n_heads heads (row stride in floats).
  virtual void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos,
                    const RopeParams& p) = 0;
  // Writes n rows of `dim` floats into cache rows starting at row `first`.
  virtual void kv_store(void* cache, KVType t, size_t row_bytes, int64_t first, const float* src, int64_t n,
                        int64_t src_stride, int64_t dim) = 0;
  virtual void attention(const AttnArgs& a) = 0;
  // Several independent attentions (one per session of a batched step); a backend
  // may run them as one dispatch.
  virtual void attention_multi(const AttnArgs* a, int count) {
    for (int i = 0; i < count; ++i) attention(a[i]);
  }
  // out[i] = act(gate[i]) * up[i] over rows.
  virtual void glu(const float* gate, int64_t gate_stride, const float* up, int64_t up_stride, float* out,
                   int64_t n_rows, int64_t dim, Act act) = 0;
  virtual void add(float* y, const float* x, int64_t n) = 0;        // y += x
  virtual void add_bias(float* y, const float* b, int64_t n_rows, int64_t dim) = 0;  // each row += b
  virtual void scale(float* y, float s, int64_t n) = 0;
  virtual void softcap(float* y, float cap, int64_t n) = 0;           // y = cap * tanh(y / cap)
  // y = (x - mean) / sqrt(var + eps) * w + b over rows of dim (w, b may be null); y may alias x.
  virtual void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t n_rows, int64_t dim,
                          float eps) = 0;
  // y = 0.5 y (1 + erf(y / sqrt 2)) in place: the exact GELU of whisper-class towers.
  virtual void gelu_erf(float* y, int64_t n) = 0;
  virtual int n_threads() const = 0;
};

size_t kv_row_bytes(KVType t, int64_t dim);

// The CPU backend with n_threads workers (0: physical cores).
std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace dl
