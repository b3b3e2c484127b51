// Vision towers from llama.cpp-layout mmproj GGUFs (clip.vision.* keys, v.* and mm.* tensors):
// a ViT over a normalized square image, then the family's projector. Served: gemma3v (SigLIP
// with Gemma-3's pooled projector) and qwen25v (Qwen2.5-VL's window-attention ViT with 2-D rope
// and the patch merger, at the image's own size). Image decoding and resizing live in Python
// (vision.py); this file takes normalized pixels, channel-major.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.h"
#include "encoder/blocks.h"
#include "gguf/gguf.h"

namespace dl::vision {

enum class Projector { gemma3, qwen25, qwen3 };

// One vision family as data (vision/tower.cpp's vision_families is the only place a family
// name is written): the projector, and whether its rows attend each other in the decoder.
struct VisionFamily {
  const char* name;            // ours (load_vision_embedder's family)
  const char* projector_type;  // clip.vision.projector_type / clip.projector_type in the file
  Projector proj;
  bool non_causal;  // the image's rows are one span every row of which sees the whole span
  bool mrope;       // the image's rows take M-RoPE grid positions in the decoder; any size (a multiple of patch x merge)
};
const std::vector<VisionFamily>& vision_families();

struct VisionConfig {
  std::string family;
  Projector proj = Projector::gemma3;
  bool non_causal = false;
  bool mrope = false;
  int image_size = 0, patch = 0, grid = 0;  // grid = image_size / patch patches per side (a fixed-size tower)
  int dim = 0, n_layers = 0, n_heads = 0, ffn_dim = 0;
  int merge = 1;       // gemma3: the projector's average-pool kernel (patches per row side)
  int proj_dim = 0;    // width of the rows encode() writes
  int n_rows = 0;      // rows per image (a fixed-size tower; 0: the image's size decides)
  int n_wa_pattern = 0;  // qwen25: block il attends its whole image when (il + 1) % n == 0, else its window
  int n_deepstack = 0;   // qwen3: deepstack mergers (each adds proj_dim to a row: rows are proj_dim x (1 + n) wide)
  int pos_side = 0;      // qwen3: the learned position grid's side (resampled to each image's)
  int window = 112;      // qwen25: the attention window's side in pixels
  float rope_theta = 10000.f;
  float eps = 1e-6f;
  float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.5f, 0.5f, 0.5f};
};

using VitLayer = encoder::Layer;

// A Qwen-VL ViT block: Qwen2.5-VL's RMSNorms and SiLU-gated MLP, or Qwen3-VL's LayerNorms (with
// biases) and GELU(tanh) MLP (no gate); biased Q/K/V/out both (Qwen3-VL's QKV fused in the file).
struct QwenLayer {
  Vec ln1, ln2, ln1_b, ln2_b, bq, bk, bv, bo, b_gate, b_up, b_down;
  Weight wq, wk, wv, wo, w_gate, w_up, w_down;
};

// Qwen3-VL's deepstack merger after a block: LayerNorm over a merged row (4 patches), GELU MLP.
struct DeepstackMerger {
  int layer = 0;
  Vec norm_w, norm_b, b1, b2;
  Weight fc1, fc2;
};

class VisionEncoder {
 public:
  // Our family name for the file's vision projector, or "" when it holds no vision tower we
  // serve. Throws GGUFError only for a malformed file.
  static std::string probe_family(const gguf::File& f);
  static std::shared_ptr<VisionEncoder> load(const std::string& path, const std::string& device, int n_threads);

  const VisionConfig& config() const { return cfg_; }
  const std::string& path() const { return file_->path(); }
  Backend& backend() { return *backend_; }
  // pixels: 3 x image_size x image_size floats (normalized, channel-major) -> n_rows x
  // proj_dim floats into out (room for out_cap floats). Returns n_rows.
  int64_t encode(const float* pixels, int64_t n_pixels, float* out, int64_t out_cap);
  // A variable-size tower (qwen25v): pixels 3 x height x width, both multiples of patch x merge;
  // rows come out row-major over the merged (height / (patch merge)) x (width / (patch merge)) grid.
  int64_t encode_hw(const float* pixels, int height, int width, float* out, int64_t out_cap);

 private:
  VisionEncoder() = default;
  void load_weights();
  void load_qwen25();
  void load_qwen_layers(bool qwen3);
  float* buf(int i, int64_t floats);
  int64_t encode_qwen25(const float* pixels, int H, int W, float* out);

  std::shared_ptr<gguf::File> file_;
  VisionConfig cfg_;
  std::shared_ptr<Backend> backend_;
  std::mutex mu_;  // one encode at a time (the device buffers below are shared)
  Weight patch_, proj_;
  Vec patch_b_, pos_emb_, post_w_, post_b_, soft_norm_;
  std::vector<VitLayer> layers_;
  std::vector<QwenLayer> qlayers_;
  std::vector<DeepstackMerger> deepstack_;
  std::vector<float> pos_table_;  // qwen3: the learned positions (pos_side^2 x dim), resampled on the host
  BufferPtr ones_;
  Weight mm0_, mm2_;
  Vec mm0_b_, mm2_b_;
  BufferPtr rope_tab_[2], page0_;  // qwen25: the h and w axes' pair frequencies (0 on the other axis' pairs)
  std::vector<float> patches_host_;
  enum { B_X, B_H, B_P, B_P2, B_OUT, B_XN, B_Q, B_KV, B_A, B_G, B_U, B_POS, B_DS, B_PE, B_COUNT };
  BufferPtr bufs_[B_COUNT];
  encoder::Blocks blocks_;
};

}  // namespace dl::vision
