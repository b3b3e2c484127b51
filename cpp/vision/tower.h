// Vision towers from llama.cpp-layout mmproj GGUFs (clip.vision.* keys, v.* and mm.* tensors):
// a ViT over a normalized square image, then the family's projector. Served: gemma3v (SigLIP
// with Gemma-3's pooled projector). Image decoding and resizing live in Python (vision.py);
// this file takes normalized pixels, channel-major, at the tower's own size.
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

enum class Projector { gemma3 };

// One vision family as data (vision/tower.cpp's vision_families is the only place a family
// name is written): the projector, and whether its rows attend each other in the decoder.
struct VisionFamily {
  const char* name;            // ours (load_vision_embedder's family)
  const char* projector_type;  // clip.vision.projector_type / clip.projector_type in the file
  Projector proj;
  bool non_causal;  // the image's rows are one span every row of which sees the whole span
};
const std::vector<VisionFamily>& vision_families();

struct VisionConfig {
  std::string family;
  Projector proj = Projector::gemma3;
  bool non_causal = false;
  int image_size = 0, patch = 0, grid = 0;  // grid = image_size / patch patches per side
  int dim = 0, n_layers = 0, n_heads = 0, ffn_dim = 0;
  int merge = 1;       // gemma3: the projector's average-pool kernel (patches per row side)
  int proj_dim = 0;    // width of the rows encode() writes
  int n_rows = 0;      // rows per image
  float eps = 1e-6f;
  float mean[3] = {0.5f, 0.5f, 0.5f}, std[3] = {0.5f, 0.5f, 0.5f};
};

using VitLayer = encoder::Layer;

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

 private:
  VisionEncoder() = default;
  void load_weights();
  float* buf(int i, int64_t floats);

  std::shared_ptr<gguf::File> file_;
  VisionConfig cfg_;
  std::shared_ptr<Backend> backend_;
  std::mutex mu_;  // one encode at a time (the device buffers below are shared)
  Weight patch_, proj_;
  Vec patch_b_, pos_emb_, post_w_, post_b_, soft_norm_;
  std::vector<VitLayer> layers_;
  std::vector<float> patches_host_;
  enum { B_X, B_H, B_P, B_P2, B_OUT, B_COUNT };
  BufferPtr bufs_[B_COUNT];
  encoder::Blocks blocks_;
};

}  // namespace dl::vision
