// The op interface every backend implements (CPU in cpp/cpu, devices in cuda/,
// vulkan/, metal/). Model code, the KV pool and the towers reach kernels and
// memory only through it. Knows no architecture: ops take plain shapes and flags.
//
// Memory. Every pointer an op takes is *backend memory*: host memory for the CPU,
// device memory for a GPU. Callers get it only from alloc() (and from load_weight),
// pass it to ops, and cross to the host with upload() / download(); they never
// dereference it. The KV pool's pages, the block tables attention reads and the
// weights all live there.
//
// Order. Ops run in the order they are issued, on the backend's one queue (a CUDA
// stream). upload() returns once the source may be reused; download() and sync()
// return once everything issued before them has finished. A forward step uploads
// all of its per-step host data (token ids, positions, block tables, embedding rows)
// first, then issues its ops between begin_step() and end_step() (only ops and
// buffer growth in between: no upload, download or sync), then downloads its logits.
// A backend may record the ops between the brackets and replay them (a CUDA graph)
// or run a fused kernel instead.
//
// Weights. The backend says which format it wants each matrix in (weight_type) and
// makes the chosen bytes resident (load_weight: the CPU packs them for its ISA, a
// GPU copies them to device memory). An op a backend cannot run is refused by
// supports() before any compute, never emulated silently.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dl {

class ThreadPool;

// How a model's weights and activations are computed (the CPU's policy; a device
// backend may keep more precision, never less).
enum class QuantMode { fp32 = 0, q8 = 1, q4_0 = 2 };

enum class KVType : uint32_t { f32 = 0, f16 = 1, q8_0 = 8 };

// What a backend is and where it runs.
struct DeviceInfo {
  std::string backend;        // "cpu", "cuda", ...
  int index = 0;              // cuda:N
  std::string name;           // GPU or CPU model name
  size_t total_bytes = 0, free_bytes = 0;  // device memory (0 on the CPU: host memory)
  int cc_major = 0, cc_minor = 0;          // CUDA compute capability
  std::string driver;         // driver / runtime versions
  std::string features;       // kernel paths in use (e.g. Vulkan's "subgroup matmul")
  int threads = 0;            // CPU worker threads
};

// A block of backend memory, freed when the last owner lets go.
class Buffer {
 public:
  virtual ~Buffer() = default;
  void* data() const { return ptr_; }
  size_t size() const { return size_; }

 protected:
  void* ptr_ = nullptr;
  size_t size_ = 0;
};
using BufferPtr = std::shared_ptr<Buffer>;

// A 2-D weight: rows of `cols` elements in ggml type `type`, row-major.
struct Weight {
  uint32_t type = 0;
  int64_t rows = 0, cols = 0;
  size_t row_bytes = 0;
  const uint8_t* host = nullptr;                 // the bytes on the host (mapped file or `owned`)
  std::shared_ptr<std::vector<uint8_t>> owned;   // set when converted at load
  const uint8_t* data = nullptr;                 // backend memory the kernels read (== host on the CPU)
  BufferPtr resident;                            // the backend's copy, when it keeps one
  // The backend's own layout of the same matrix, tagged with the kernel variant it
  // is for; a backend ignores a layout it did not make.
  std::shared_ptr<void> packed_owner;
  const uint8_t* packed = nullptr;
  int packed_for = -1;
  // Set by load_weight when the backend never reads w.host again (it reads its own copy):
  // the loader may then drop those bytes (free a converted copy, release mapped pages).
  bool host_done = false;
  // Set by an owner that keeps `owned` for the weight's whole life and never frees it on
  // host_done (the mel bank's tables): an owned f32 / f16 matrix may then pack as well.
  bool host_kept = false;
  // Set by the loader when host lies in a read-only file mapping: a backend copying it may
  // drop its pages as it goes (a later read only faults them in again), so a load never
  // holds a matrix twice.
  bool host_mapped = false;
  // Set by the loader in fp32 mode: this matrix's matmuls keep f32 activations (a backend
  // may otherwise quantize them to 8 bits, as the CPU does for every quantized weight).
  bool exact = false;
  // A stack of experts (a 3-D GGUF tensor [n_expert][expert_rows][cols]) seen as one matrix
  // of n_expert * expert_rows rows; 0 for a plain matrix. matmul_id reads one expert's slice.
  int64_t expert_rows = 0;
  bool empty() const { return host == nullptr && data == nullptr; }
};

// Whether a GPU's prefill of f16 weights on f16 tensor cores keeps f32 activations (each token's
// x split into two f16 halves, two products) or rounds them to f16 once (one product, as
// llama.cpp's f16 matmuls do): split in fp32 mode (w.exact), or everywhere with
// DASLLAMA_F16_SPLIT=1. Read at each matmul (A/B runs switch it between loads).
inline bool f16_act_split(const Weight& w) {
  if (w.exact) return true;
  const char* e = std::getenv("DASLLAMA_F16_SPLIT");
  return e && e[0] == '1';
}

// A vector of floats in backend memory (norm weights, biases, rope factors).
struct Vec {
  BufferPtr buf;
  int64_t n = 0;
  const float* data() const { return buf ? static_cast<const float*>(buf->data()) : nullptr; }
  bool empty() const { return n == 0; }
};

struct RopeParams {
  bool neox = true;          // split-halves pairs (else adjacent pairs)
  int n_rot = 0;             // rotated dims per head (<= head_dim)
  float base = 10000.f;
  float freq_scale = 1.f;    // linear scaling: positions times this
  const float* freq_factors = nullptr;  // backend memory: llama3-style per-pair divisors (n_rot/2), or null
  const double* inv_freq = nullptr;     // backend memory: explicit per-pair frequencies (YaRN), replacing base
  float mscale = 1.f;                   // cos/sin scale (YaRN attention factor)
};

// One layer's view of a session's KV cache through its block table. Row j of K
// lives at base + pages[j >> page_shift] * page_bytes + k_off + (j & (2^page_shift - 1)) * row_bytes
// (V: v_off). A flat cache is one page (page_shift 62, pages = {0}).
struct KVView {
  uint8_t* base = nullptr;        // backend memory: the pool's pages
  const int32_t* pages = nullptr; // backend memory: the block table (page ids, in row order)
  int64_t n_pages = 0;
  int page_shift = 0;
  size_t page_bytes = 0;
  size_t k_off = 0, v_off = 0;    // this layer's K and V rows inside a page
  size_t row_bytes = 0;
  KVType type = KVType::f32;
};

// Self-attention of n_tok queries against the cache rows [0, n_kv) of one layer.
// Query t sits at position q_pos[t] and sees cache rows j with
// j <= q_pos[t] and (window == 0 or q_pos[t] - j < window); an encoder gives every
// query the position n_kv - 1.
struct AttnArgs {
  const float* q = nullptr;  // [n_tok][n_heads * head_dim]
  int64_t q_stride = 0;
  KVView kv;
  int64_t n_tok = 0, n_kv = 0;
  int n_heads = 0, n_kv_heads = 0, head_dim = 0;
  const int32_t* q_pos = nullptr;  // backend memory
  int window = 0;
  float scale = 1.f;
  float softcap = 0.f;
  // backend memory: a learned logit per query head that joins each softmax's denominator
  // (gpt-oss's attention sinks; it takes a share of the weight but adds no value), or null
  const float* sinks = nullptr;
  float* out = nullptr;  // [n_tok][n_heads * head_dim]
  int64_t out_stride = 0;
  // An encoder's bidirectional rows (every q_pos >= n_kv - 1) that no decode step will read:
  // the backend may sum in another order than its decode path (the CPU's blocked dense kernel),
  // so these rows need not be the bits a step of one row would give. Decoders leave it false.
  bool any_order = false;
  // False in q8 mode: a backend may round queries and probabilities to f16 for its tensor
  // cores (as llama.cpp's flash attention does); true keeps f32 accuracy.
  bool exact = true;
};

// swiglu_oai: gpt-oss's clamped SwiGLU, g = min(gate, 7), u = clamp(up, -7, 7),
// out = g * sigmoid(1.702 g) * (u + 1). sigmoid: out = sigmoid(gate) * up (an output gate).
// relu: max(gate, 0) * up (a plain ReLU against a row of ones: conformer stems and FFNs).
enum class Act { silu, gelu_tanh, swiglu_oai, sigmoid, relu };

// The gated delta rule of one sequence (a gated-DeltaNet layer: Qwen3.5, Qwen3-Next), run
// token by token from a carried state. For token t and value head h (its key head h % n_k_heads
// in the tiled order llama.cpp's converter writes for Qwen3.5, h / (n_v_heads / n_k_heads) when
// `grouped`, as Qwen3-Next files keep them):
//   q, k = l2norm(q, k) (x / sqrt(sum x^2 + l2_eps)), q /= sqrt(dk);
//   g = A[h] * softplus(alpha[t][h] + dt_bias[h]), beta = sigmoid(beta_logit[t][h]);
//   S = S * exp(g);  S += k (x) ((v - S^T k) * beta);  out = S^T q,
// with S [n_v_heads][dk][dv] the state (read and updated in place).
// `chunked` asks for the same result in the chunked form for a prefill (as transformers'
// torch_chunk_gated_delta_rule and FLA's chunked kernels): the tokens in chunks of
// kDeltaChunk, each chunk's rows solved together (the WY form: a unit lower-triangular
// solve within the chunk, then matmuls against the state), the state passed from chunk to
// chunk. Equal to the token-by-token rule up to f32 rounding, not bitwise; a backend may
// run it token by token where the chunked form does not fit (it says so where it does).
constexpr int kDeltaChunk = 64;
struct DeltaRuleArgs {
  float* state = nullptr;
  const float* q = nullptr;  // rows of qkv_stride floats: q at q, k at k, v at v (one row per token)
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t qkv_stride = 0;
  const float* alpha = nullptr;  // [n][n_v_heads] (ab_stride apart)
  const float* beta = nullptr;   // [n][n_v_heads] logits
  int64_t ab_stride = 0;
  const float* A = nullptr;        // [n_v_heads], negative
  const float* dt_bias = nullptr;  // [n_v_heads]
  int64_t n = 0;
  int n_k_heads = 0, n_v_heads = 0, dk = 0, dv = 0;
  bool grouped = false;
  bool chunked = false;
  float l2_eps = 1e-6f;
  float* out = nullptr;  // [n][n_v_heads * dv], out_stride apart
  int64_t out_stride = 0;
};

// How a mixture-of-experts router turns its logits into the weights of the k experts it picks
// (always the k largest logits, ties to the lower id, largest first):
//   softmax:      softmax over all experts, the picked experts' probabilities;
//   sigmoid:      sigmoid of each picked logit;
//   softmax_topk: softmax over the k picked logits only.
enum class MoeGate { softmax = 0, sigmoid = 1, softmax_topk = 2 };

// A layer's matmul stage described whole, so a backend can run it as one pass: the RMS
// norm of the n rows of x (when `norm`; scaled by norm_w unless null), `count` matmuls
// of the result (weights of equal cols), then, when `residual` is set, residual += y[0].
// The default composes the plain ops: the normed rows go to xn (n * cols floats the
// caller provides), and with a residual y[0] is scratch. A fusing backend may leave xn
// and that scratch unwritten.
// What a matmul does to each of its outputs before storing it (Backend::matmul_multi_ex).
struct MatmulEpilogue {
  const float* bias = nullptr;  // backend memory, one float per weight row: y[t][r] += bias[r]; null: none
  bool gelu_erf = false;        // then y = gelu_erf(y), as the gelu_erf op computes it
};

struct MatmulStep {
  const float* x = nullptr;
  int64_t n = 0;
  bool norm = false;
  const float* norm_w = nullptr;
  float eps = 0.f;
  float* xn = nullptr;
  int count = 0;
  const Weight* w[3] = {nullptr, nullptr, nullptr};
  float* y[3] = {nullptr, nullptr, nullptr};
  float* residual = nullptr;  // count 1 only
};

// One token of one session through a whole dense pre-norm decoder layer, for a backend that
// runs it as one fused pass:
//   x += wo * attention(rope(wq * norm(x)), rope(wk * norm(x)) and wv * norm(x) stored at the
//   cache row attn.n_kv - 1);  x += down * act_glu(gate * norm2(x), up * norm2(x)),
// with the same results as those ops one by one (the model runs them so wherever
// decode_layer returns false). attn.q / attn.out and k, v, gate_out, up_out are the layer's
// scratch rows; rope positions are pos[0] (backend memory).
struct DecodeLayer {
  float* x = nullptr;
  int64_t dim = 0;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  float eps = 0.f;
  const Weight *wq = nullptr, *wk = nullptr, *wv = nullptr, *wo = nullptr;
  const Weight *gate = nullptr, *up = nullptr, *down = nullptr;
  Act act = Act::silu;
  RopeParams rope;
  const int32_t* pos = nullptr;
  AttnArgs attn;
  float *k = nullptr, *v = nullptr, *gate_out = nullptr, *up_out = nullptr;
};

// What a weight is read by: matmul kernels, or get_rows (an embedding table).
enum class WeightUse { matmul, rows };

// Ops a backend may or may not run, for supports().
enum class Op { matmul, get_rows, attention, kv_store };

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual DeviceInfo info() const = 0;

  // ---- memory --------------------------------------------------------------
  // Throws DeviceError (naming `what` and the sizes) when it does not fit.
  virtual BufferPtr alloc(size_t bytes, const char* what) = 0;
  virtual void upload(void* dst, const void* src, size_t bytes) = 0;    // host -> backend
  virtual void download(void* dst, const void* src, size_t bytes) = 0;  // backend -> host (waits)
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;      // backend -> backend
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void sync() {}
  // Steps run on a queue of the device's own (a GPU's), so the host may record the next step
  // while the last one runs; greedy generation then keeps the device busy (generate.cpp).
  virtual bool async_steps() const { return false; }
  // A small download (a few sampled ids) that does not wait: dst holds the bytes once
  // download_wait(ticket) returns. Issued after everything before it, like download(). The
  // default copies at once.
  virtual int64_t download_async(void* dst, const void* src, size_t bytes) {
    download(dst, src, bytes);
    return 0;
  }
  virtual void download_wait(int64_t ticket) { (void)ticket; }
  // Host memory for at least `floats` floats that download() fills fastest (CUDA: pinned, so
  // the copy is one DMA instead of a staged pageable one), owned by the backend and reused:
  // its contents last until the next call. For a step's downloads of many rows.
  virtual float* host_staging(size_t floats) {
    if (staging_.size() < floats) staging_.resize(floats);
    return staging_.data();
  }
  // Host memory of `floats` floats, owned by whoever holds it, that download() fills as fast as
  // host_staging (CUDA: pinned): for data that outlives a step (a batch step's logits).
  virtual std::shared_ptr<float> host_block(size_t floats) {
    return std::shared_ptr<float>(new float[floats], std::default_delete<float[]>());
  }
  // Refuses, before anything is allocated, `bytes` more that would not fit (weights, a pool).
  virtual void check_fits(size_t bytes, const char* what) { (void)bytes, (void)what; }

  // ---- weights -------------------------------------------------------------
  // The format a matrix of `type` (cols wide) is kept in under `mode`; the loader converts.
  virtual uint32_t weight_type(uint32_t type, int64_t cols, QuantMode mode) const;
  // Makes w (w.host) resident in the layout this backend reads fastest for `use`, once, at load:
  // sets w.data (and w.resident / w.packed where it keeps a copy).
  virtual void load_weight(Weight& w, WeightUse use) = 0;
  virtual bool supports(Op op, uint32_t type) const = 0;

  // The host threads the backend runs its own work on (the CPU's pool), for host-side work between
  // ops (the mel front end; a batched step's logits and samples) to share rather than start more
  // threads. A GPU backend runs none of its own: it gets a small pool on first use.
  virtual ThreadPool* host_threads();

  // ---- steps ---------------------------------------------------------------
  virtual void begin_step() {}
  virtual void end_step() {}
  // Deferred steps (where defer_steps()): end_step_deferred() ends a recording without issuing
  // it (true: kept; false: issued as end_step() does); launch_deferred() issues it later, as
  // end_step() would have; drop_deferred() forgets it.
  // One is kept at a time; begin_step() drops it. The model records a batch's next decode step
  // so while the device runs this one (Model::speculate).
  virtual bool defer_steps() const { return false; }
  virtual bool end_step_deferred() {
    end_step();
    return false;
  }
  virtual void launch_deferred() {}
  virtual void drop_deferred() {}
  virtual bool deferred_pending() const { return false; }
  // download() in two halves, so the host can record between them: the copy is issued behind
  // everything before it, and dst holds the bytes once download_finish() returns. The default
  // copies at once.
  virtual void download_start(void* dst, const void* src, size_t bytes) { download(dst, src, bytes); }
  virtual void download_finish() {}
  // The logits of n rows (w: the head, V = w.rows) made in parts of the vocabulary, so that a
  // GPU's download of one part overlaps the product of the next (a batched step's n x V floats
  // cross PCIe at ~55 GB/s: 0.6 ms at n = 64 for a 128K vocabulary). y[t * V + v] as matmul
  // writes it, then softcap (cap > 0) applied, as far as a later download(y, n * V * 4) or
  // download_start of it can tell: the backend may keep y in its own order until then, so y is
  // for downloading only. False (nothing recorded) where the backend does not split; the caller
  // then runs matmul and softcap.
  virtual bool matmul_logits(const Weight& w, const float* x, int64_t n, float* y, float cap) {
    (void)w, (void)x, (void)n, (void)y, (void)cap;
    return false;
  }

  // ---- ops -----------------------------------------------------------------
  // y[t][r] = sum_k W[r][k] x[t][k] for t < n; x rows are w.cols long, y rows w.rows.
  virtual void matmul(const Weight& w, const float* x, int64_t n, float* y) = 0;
  // count weights with the same cols over the same x: ys[i] = x * ws[i]^T (count <= 8).
  virtual void matmul_multi(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n) = 0;
  // matmul_multi, then for each i the epilogue eps[i] (a bias, the exact GELU) on ys[i]; eps null:
  // none. The default runs add_bias and gelu_erf after the matmuls; a backend may apply them as it
  // stores the outputs (the values must be those of the ops one after another).
  virtual void matmul_multi_ex(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n,
                               const MatmulEpilogue* eps);
  // See MatmulStep; the default runs rms_norm, matmul_multi and add.
  virtual void matmul_step(const MatmulStep& s);
  // See DecodeLayer: true when the backend ran (or recorded) the layer, false to have the
  // model run it op by op.
  virtual bool decode_layer(const DecodeLayer& l) { (void)l; return false; }
  // Ops a backend ran as part of the op before them since it was made (CUDA's GEMV tails):
  // tests check a fused path is taken.
  virtual int64_t fused_ops() const { return 0; }
  // Ops a backend issued (or recorded) on a named optional path since it was made (CUDA:
  // "attn_gqa", the grouped-query decode attention of DASLLAMA_CUDA_ATTN_GQA=1; "gemv_rope", Q / K / V
  // GEMVs that also rope and store K / V): tests check a switch's path is taken. 0 for a name the backend does not know.
  virtual int64_t path_count(const std::string& name) const {
    (void)name;
    return 0;
  }
  // Rows of table w for ids (backend memory; checked in range by the caller), dequantized to f32.
  virtual void get_rows(const Weight& w, const int32_t* ids, int64_t n, float* out) = 0;
  // y = x / rms(x) * w over rows of dim elements; w may be null; y may alias x.
  virtual void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) = 0;
  // In-place RoPE on n_tok rows of n_heads heads (row stride in floats); pos in backend memory.
  virtual void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos,
                    const RopeParams& p) = 0;
  // Writes n rows of K and V (dim floats each, src_stride apart) into cache rows
  // first.. of a layer, through the block table (rows may cross pages).
  virtual void kv_store(const KVView& kv, int64_t first, const float* k, const float* v, int64_t n,
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
  // rows x width floats from src (src_stride apart) to dst (dst_stride apart): the QKV split.
  virtual void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                         int64_t width) = 0;
  // 1-D convolution input as rows: x is [C][x_stride] (channel-major, as mel frames are);
  // out[t][c * k + j] = x[c][t * stride + j - pad], 0 outside [0, T), for t < T_out.
  virtual void im2col_1d(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad,
                         float* out, int64_t T_out) = 0;
  // 1-D convolution input from rows: x is [T][C] (row per frame); same out layout.
  virtual void im2col_rows(const float* x, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                           int64_t T_out) = 0;
  // 2-D convolution input as rows, any layout: element (c, h, w) of x is x[c * sc + h * sh + w * sw];
  // out[ho * W_out + wo][(c * kh + i) * kw + j] = x(c, ho * stride + i - pad, wo * stride + j - pad),
  // 0 outside [0, H) x [0, W) (torch's unfold order, so a conv2d weight [Cout][C][kh][kw] is the
  // matmul's matrix). kh = H, kw = 1, stride 1, pad 0 makes it a transpose ([w][c * H + h]).
  virtual void im2col_2d(const float* x, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh, int64_t sw, int kh,
                         int kw, int stride, int pad, float* out, int64_t H_out, int64_t W_out) = 0;
  // out[r] = mean of rows x[r * k .. r * k + k) (a trailing partial group averages what it has).
  virtual void avg_pool_rows(const float* x, int64_t n_rows, int64_t dim, int k, float* out) = 0;

  // ---- recurrent layers (gated DeltaNet) ---------------------------------------
  // A causal depthwise convolution of n rows of C channels continuing a carried state: with
  // u the k-1 state rows (oldest first) followed by the rows of x (x_stride apart),
  // y[t][c] = sum_j w[c * k + j] * u[t + j][c] (silu of it when `silu`), y rows C apart;
  // then the state becomes the last k-1 rows of u.
  virtual void conv1d_causal(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C, const float* w,
                             int k, bool silu, float* y) = 0;
  virtual void delta_rule(const DeltaRuleArgs& a) = 0;

  // ---- mixture of experts ----------------------------------------------------
  // Routing of n tokens, each a row of n_expert logits: ids[t * k + j] and w[t * k + j] for
  // the k experts token t goes to (see MoeGate); norm divides the k weights by their sum.
  virtual void moe_route(const float* logits, int64_t n, int n_expert, int k, MoeGate gate, bool norm, int32_t* ids,
                         float* w) = 0;
  // For pairs p < n_pairs (token p / k_x's slot): y[p][r] = sum_c W_e[r][c] x[p / x_div][c] (+ bias[e][r]),
  // with e = ids[p] and W_e rows [e * w.expert_rows, (e + 1) * w.expert_rows) of the stack w.
  // x_div is k (every slot of a token reads the token's row) or 1 (a row per pair); bias is
  // [n_expert][expert_rows] or null. ids are in backend memory, checked by the caller.
  // Only the experts named in ids are read, each once per call however many tokens use it.
  virtual void matmul_id(const Weight& w, const float* x, int64_t x_div, const int32_t* ids, int64_t n_pairs,
                         const float* bias, float* y) = 0;
  // out[t][d] = sum_j w[t * k + j] * y[t * k + j][d] over j in order, for t < n.
  virtual void moe_sum(const float* y, const float* w, int64_t n, int k, int64_t dim, float* out) = 0;

  // ---- sampling ----------------------------------------------------------------
  // out[r] = the index of row r's largest value (n_rows rows of dim floats; out in backend
  // memory): the first on ties, NaN never the largest, 0 for a row without a number. The
  // sampler's greedy pick (argmax_first), so a greedy stream's next id never leaves the device.
  virtual void argmax(const float* x, int64_t n_rows, int64_t dim, int32_t* out) = 0;

 private:
  std::vector<float> staging_;
  std::once_flag host_pool_once_;
  std::shared_ptr<ThreadPool> host_pool_;
};

size_t kv_row_bytes(KVType t, int64_t dim);

// Host memory this process may still take: MemAvailable, capped by the cgroup's limit
// less its usage (0 when neither can be read).
size_t host_memory_available();

// The CPU backend with n_threads workers (0: physical cores).
std::shared_ptr<Backend> make_cpu_backend(int n_threads);

// "cpu", "cuda", "cuda:N", ...: the backend for a device string, or a dl::Error that says
// why not (not built, no device, bad index).
std::shared_ptr<Backend> make_backend(const std::string& device, int n_threads);
// Backends built into this module, and the devices each can reach now (with the
// reason when none).
struct BackendProbe {
  std::string backend;
  bool built = false;
  std::vector<DeviceInfo> devices;
  std::string error;  // why no device was found
};
std::vector<BackendProbe> probe_backends();

// Host <-> backend helpers for callers holding host data.
Vec upload_vec(Backend& be, const std::vector<float>& v, const char* what);

}  // namespace dl
