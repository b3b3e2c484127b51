// A FastConformer encoder with a CTC head (NVIDIA's Parakeet CTC models), from the GGUF
// `dasllama convert` writes out of a transformers ParakeetForCTC checkpoint (general.architecture
// "fastconformer_ctc", tensors sub.* / blk.* / ctc.*; docs/speech.md has the layout).
//
// The NeMo filterbank front end, a conv2d subsampling stem (a 3x3 stride-2 conv, then
// depthwise + pointwise pairs folded at conversion into dense 3x3 stride-2 convs, ReLU after
// each), a linear to the model width, then conformer blocks: FFN/2, relative-position MHSA,
// the conv module, FFN/2, LayerNorm. All on the Backend ops:
//  - relative-position attention (Transformer-XL's (q + u) k^T + rel_shift((q + v) p^T)) as one
//    attention whose heads are [pos | content]: keys [rope_j(1, 0, ...) | k], queries
//    [rope_i(W_pos^T (q + v)) | q + u] (the sinusoid of i - j splits into products of i and j
//    terms; the converter turns W_pos's (sin, cos) pairs into (cos, -sin)), values [0 | v];
//  - the conv module's 'same' depthwise conv as conv1d_causal over the rows followed by
//    (k - 1) / 2 zero rows, its batch norm folded into the weights at conversion.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "audio/mel.h"
#include "core/backend.h"
#include "gguf/gguf.h"

namespace dl::audio {

// The FFN's and the conv module's activation (the config's hidden_act).
enum class ConfAct { silu, relu, gelu_erf, gelu_tanh };

struct ConformerConfig {
  int n_mel = 0, dim = 0, n_layers = 0, n_heads = 0, ffn_dim = 0, conv_kernel = 0;
  int sub_channels = 0, sub_convs = 0, sub_bins = 0;  // stem: channels, stride-2 convs, mel bins left
  int vocab = 0, blank = 0;
  float eps = 1e-5f, input_scale = 1.f;
  ConfAct act = ConfAct::silu;
  std::string act_name;
};

struct ConformerLayer {
  Vec ff1_nw, ff1_nb, ff1_bu, ff1_bd, ff2_nw, ff2_nb, ff2_bu, ff2_bd;
  Weight ff1_up, ff1_down, ff2_up, ff2_down;
  Vec att_nw, att_nb, bq, bk, bv, bo, bias_u, bias_v;
  Weight wq, wk, wv, wo;
  std::vector<Weight> wpos;  // per head: dim rows (pe pairs as (cos, -sin)) of head_dim
  Vec conv_nw, conv_nb, pw1_b, dw_w, dw_b, pw2_b;
  Weight pw1, pw2;
  Vec out_nw, out_nb;
};

class ConformerCTC {
 public:
  // Whether the file is one of ours (general.architecture "fastconformer_ctc"); throws only
  // GGUFError for a malformed file.
  static bool probe(const gguf::File& f);
  static std::shared_ptr<ConformerCTC> load(const std::string& path, const std::string& device, int n_threads);

  const ConformerConfig& config() const { return cfg_; }
  const std::string& path() const { return file_->path(); }
  Backend& backend() { return *backend_; }
  // Feature frames the model reads of a clip of n samples (n / 160: the front end's valid
  // frames) and encoder rows of F frames (three k3 s2 p1 convs for the usual 8x).
  static int64_t clip_frames(int64_t n) { return n / kHop; }
  int64_t n_rows(int64_t frames) const;
  // Features (host, [n_mel][stride], the first `frames` columns read) -> n_rows(frames) rows:
  // the encoder's output (dim each) into hidden when not null, the CTC logits (vocab each)
  // into logits when not null.
  int64_t encode_features(const float* feat, int64_t stride, int64_t frames, float* hidden, float* logits);
  // 16 kHz mono -> NeMo features -> encode_features; 0 rows for a clip under two hops.
  int64_t encode(const float* x, int64_t n, float* hidden, float* logits);

 private:
  ConformerCTC() = default;
  void load_weights();
  float* buf(int i, int64_t floats);
  void act(float* y, int64_t rows, int64_t dim);
  void ffn(const ConformerLayer& Ly, bool second, float* h, int64_t L);
  void attention(const ConformerLayer& Ly, float* h, int64_t L);
  void conv_module(const ConformerLayer& Ly, float* h, int64_t L);
  void stem(const float* feat, int64_t frames, float* h);
  void conv_rows(const float* x, int64_t x_row0, int64_t C_in, int64_t H, int64_t W, int64_t sc, int64_t sh,
                 int64_t sw, const Weight& w, const Vec& b, int64_t r0, int64_t n, float* dst);

  std::shared_ptr<gguf::File> file_;
  ConformerConfig cfg_;
  std::shared_ptr<Backend> backend_, fbank_backend_;
  std::unique_ptr<FbankBank> fbank_;
  std::mutex mu_;
  std::vector<Weight> sub_w_;
  std::vector<Vec> sub_b_;
  Weight sub_out_, ctc_;
  Vec sub_out_b_, ctc_b_, ones_;
  std::vector<ConformerLayer> layers_;
  enum {
    B_FEAT, B_X, B_G0, B_G1, B_FLAT, B_H, B_XN, B_U, B_O, B_Q, B_QV, B_T, B_PB, B_QX, B_KV, B_ATT, B_Y2, B_GL, B_DW,
    B_ST, B_POS, B_QPOS, B_PAGE, B_LOG, B_COUNT
  };
  BufferPtr bufs_[B_COUNT];
};

}  // namespace dl::audio
