// The ViT of vision towers on the Backend ops: patches as one matmul (the conv of stride =
// kernel is a reshape on the host), learned positions, pre-LN blocks with bidirectional
// attention, the post-LN, then the family's projector.
#include "vision/tower.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "core/errors.h"
#include "encoder/tensors.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl::vision {

namespace {

constexpr const char* kWhat = "vision tower";
using encoder::meta_int;
using encoder::shape_str;
std::vector<float> vec(const gguf::File& f, const std::string& name, int64_t n, bool required = true) {
  return encoder::vec(f, name, n, kWhat, required);
}
Weight mat(const gguf::File& f, const std::string& name, int64_t rows, int64_t cols) {
  return encoder::mat(f, name, rows, cols, kWhat);
}

std::string blk(int il, const char* s) { return "v.blk." + std::to_string(il) + "." + s; }

std::optional<std::string> projector_type(const gguf::File& f) {
  if (f.find("clip.vision.projector_type")) return f.get_string("clip.vision.projector_type");
  if (f.find("clip.projector_type")) return f.get_string("clip.projector_type");
  return std::nullopt;
}

}  // namespace

const std::vector<VisionFamily>& vision_families() {
  static const std::vector<VisionFamily> t = {
      // Gemma-3: SigLIP, then avg-pool (merge x merge) + RMSNorm + linear; the image's rows
      // attend each other in the decoder (transformers' token_type_ids blocks, mtmd's
      // non-causal image batch).
      {"gemma3v", "gemma3", Projector::gemma3, true},
  };
  return t;
}

std::string VisionEncoder::probe_family(const gguf::File& f) {
  if (auto has = f.find("clip.has_vision_encoder"); has && has->type == gguf::ValueType::BOOL && !has->as_bool())
    return "";
  const auto t = projector_type(f);
  if (!t) return "";
  bool any = false;
  for (const auto& ti : f.tensors()) any |= ti.name.rfind("v.", 0) == 0;
  if (!any) return "";
  for (const VisionFamily& fam : vision_families())
    if (*t == fam.projector_type) return fam.name;
  return "";
}

std::shared_ptr<VisionEncoder> VisionEncoder::load(const std::string& path, const std::string& device,
                                                   int n_threads) {
  std::shared_ptr<VisionEncoder> e(new VisionEncoder());
  e->backend_ = make_backend(device, n_threads);
  e->file_ = gguf::File::open(path);
  e->cfg_.family = probe_family(*e->file_);
  if (e->cfg_.family.empty()) {
    const auto t = projector_type(*e->file_);
    std::string names;
    for (const VisionFamily& fam : vision_families()) names += (names.empty() ? "" : ", ") + std::string(fam.name);
    throw UnsupportedModelError(path + ": no vision tower we serve (projector type '" + (t ? *t : "") +
                                "'; supported: " + names + ")");
  }
  e->load_weights();
  Backend& be = *e->backend_;
  std::vector<Weight*> mats = {&e->patch_, &e->proj_};
  for (VitLayer& L : e->layers_)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_up, &L.w_down}) mats.push_back(w);
  size_t total = 0;
  for (Weight* w : mats) {
    if (!be.supports(Op::matmul, w->type)) {
      const TypeTraits* tt = type_traits(w->type);
      throw UnsupportedModelError(std::string("vision tower: the ") + be.name() + " backend has no matmul for " +
                                  (tt ? tt->name : "?"));
    }
    total += (size_t)w->rows * w->row_bytes;
  }
  be.check_fits(total, "vision tower weights");
  for (Weight* w : mats) be.load_weight(*w, WeightUse::matmul);
  return e;
}

void VisionEncoder::load_weights() {
  const gguf::File& f = *file_;
  VisionConfig& c = cfg_;
  for (const VisionFamily& fam : vision_families())
    if (c.family == fam.name) c.proj = fam.proj, c.non_causal = fam.non_causal;

  const gguf::TensorInfo* tp = f.find_tensor("v.patch_embd.weight");
  if (!tp) throw UnsupportedModelError("vision tower: missing tensor 'v.patch_embd.weight'");
  if (tp->ne.size() != 4 || tp->ne[0] != tp->ne[1] || tp->ne[2] != 3 || tp->ne[0] < 1 || tp->ne[0] > 64 ||
      tp->ne[3] < 1 || tp->ne[3] > 16384)
    throw UnsupportedModelError("vision tower: v.patch_embd.weight has shape " + shape_str(*tp) +
                                ", expected a square kernel over 3 channels");
  c.patch = (int)tp->ne[0];
  c.dim = (int)tp->ne[3];
  const int64_t d = c.dim;
  patch_ = mat(f, "v.patch_embd.weight", d, 3 * (int64_t)c.patch * c.patch);
  patch_b_ = upload_vec(*backend_, vec(f, "v.patch_embd.bias", d), "vision tower");

  c.image_size = meta_int(f, "clip.vision.image_size", 0);
  if (c.image_size <= 0 || c.image_size % c.patch != 0 || c.image_size > 4096)
    throw UnsupportedModelError("vision tower: clip.vision.image_size " + std::to_string(c.image_size) +
                                " is not a whole number of " + std::to_string(c.patch) + "-pixel patches");
  c.grid = c.image_size / c.patch;
  const int64_t P = (int64_t)c.grid * c.grid;
  const gguf::TensorInfo* tpos = f.find_tensor("v.position_embd.weight");
  if (!tpos || tpos->ne.size() != 2 || tpos->ne[0] != d || tpos->ne[1] != P)
    throw UnsupportedModelError("vision tower: v.position_embd.weight must be " + std::to_string(d) + "x" +
                                std::to_string(P) + " (one row per patch)" +
                                (tpos ? ", got " + shape_str(*tpos) : ", missing"));
  pos_emb_ = upload_vec(*backend_, vec(f, "v.position_embd.weight", d * P), "vision tower");
  post_w_ = upload_vec(*backend_, vec(f, "v.post_ln.weight", d), "vision tower");
  post_b_ = upload_vec(*backend_, vec(f, "v.post_ln.bias", d), "vision tower");

  c.n_heads = meta_int(f, "clip.vision.attention.head_count", 0);
  if (c.n_heads <= 0 || d % c.n_heads != 0)
    throw UnsupportedModelError("vision tower: clip.vision.attention.head_count " + std::to_string(c.n_heads) +
                                " does not divide the width " + std::to_string(d));
  if (auto eps = f.get_float("clip.vision.attention.layer_norm_epsilon")) {
    if (!(*eps > 0 && *eps < 1)) throw GGUFError("metadata clip.vision.attention.layer_norm_epsilon out of range");
    c.eps = (float)*eps;
  }
  for (const char* key : {"clip.vision.image_mean", "clip.vision.image_std"}) {
    const gguf::Value* v = f.get_array(key);
    if (!v) continue;
    if (v->size() != 3) throw GGUFError(std::string("metadata ") + key + " must hold 3 values");
    float* dst = key[12] == 'm' ? c.mean : c.std;
    for (int i = 0; i < 3; ++i) {
      const double x = (*v)[i].as_float();
      if (!std::isfinite(x) || std::fabs(x) > 1e3 || (dst == c.std && !(x > 0)))
        throw GGUFError(std::string("metadata ") + key + " out of range");
      dst[i] = (float)x;
    }
  }

  int n_layers = 0;
  while (f.find_tensor(blk(n_layers, "attn_q.weight"))) ++n_layers;
  if (n_layers == 0) throw UnsupportedModelError("vision tower: no encoder blocks (v.blk.0.attn_q.weight)");
  c.n_layers = n_layers;
  layers_.resize(n_layers);
  auto up = [&](const std::string& name, int64_t n) { return upload_vec(*backend_, vec(f, name, n), kWhat); };
  int64_t ffn = -1;  // the first block's width, then every block's
  for (int il = 0; il < n_layers; ++il) layers_[il] = encoder::load_layer(*backend_, f, blk(il, ""), d, ffn, kWhat);
  c.ffn_dim = (int)ffn;
  if (f.find_tensor(blk(n_layers, "ln1.weight")) || f.find_tensor(blk(n_layers + 1, "attn_q.weight")))
    throw UnsupportedModelError("vision tower: block " + std::to_string(n_layers) + " is incomplete");

  switch (c.proj) {
    case Projector::gemma3: {
      c.merge = meta_int(f, "clip.vision.projector.scale_factor", 4);
      if (c.merge < 1 || c.grid % c.merge != 0)
        throw UnsupportedModelError("vision tower: the " + std::to_string(c.grid) + "-patch grid does not pool by " +
                                    std::to_string(c.merge));
      soft_norm_ = up("mm.soft_emb_norm.weight", d);
      // mm.input_projection is stored [vision width][text width] (the torch parameter as it is,
      // used as x @ W): transposed here once into rows of the text width.
      const gguf::TensorInfo* t = f.find_tensor("mm.input_projection.weight");
      if (!t || t->ne.size() != 2 || t->ne[1] != d || t->ne[0] < 1 || t->ne[0] > (1 << 18))
        throw UnsupportedModelError("vision tower: mm.input_projection.weight must be [" + std::to_string(d) +
                                    "][text width]" + (t ? ", got " + shape_str(*t) : ", missing"));
      const int64_t D = t->ne[0];
      encoder::check_float_type(*t, D, kWhat);
      std::vector<float> src((size_t)(D * d));
      dequantize_row(t->type, f.tensor_data(*t), src.data(), D * d);
      auto owned = std::make_shared<std::vector<uint8_t>>((size_t)(D * d) * 4);
      float* dst = reinterpret_cast<float*>(owned->data());
      for (int64_t i = 0; i < d; ++i)
        for (int64_t j = 0; j < D; ++j) dst[j * d + i] = src[i * D + j];
      proj_.type = (uint32_t)GGMLType::F32;
      proj_.rows = D;
      proj_.cols = d;
      proj_.row_bytes = (size_t)d * 4;
      proj_.owned = owned;
      proj_.host = owned->data();
      c.proj_dim = (int)D;
      c.n_rows = (c.grid / c.merge) * (c.grid / c.merge);
      break;
    }
  }
}

float* VisionEncoder::buf(int i, int64_t floats) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!bufs_[i] || bufs_[i]->size() < bytes) bufs_[i] = backend_->alloc(bytes, "vision tower scratch");
  return static_cast<float*>(bufs_[i]->data());
}

int64_t VisionEncoder::encode(const float* pixels, int64_t n_pixels, float* out, int64_t out_cap) {
  const VisionConfig& c = cfg_;
  const int64_t S = c.image_size, p = c.patch, G = c.grid, L = G * G, d = c.dim;
  if (n_pixels != 3 * S * S)
    throw std::invalid_argument("pixels hold " + std::to_string(n_pixels) + " floats; the tower takes 3 x " +
                                std::to_string(S) + " x " + std::to_string(S));
  if ((int64_t)c.n_rows * c.proj_dim > out_cap)
    throw std::invalid_argument("output holds " + std::to_string(out_cap) + " floats; an image makes " +
                                std::to_string(c.n_rows) + " rows of " + std::to_string(c.proj_dim));
  std::lock_guard<std::mutex> lock(mu_);
  Backend& be = *backend_;
  // Patches as rows of (channel, y, x) -- the conv kernel's own order -- on the host.
  const int64_t K = 3 * p * p;
  patches_host_.resize((size_t)(L * K));
  for (int64_t gy = 0; gy < G; ++gy)
    for (int64_t gx = 0; gx < G; ++gx) {
      float* row = patches_host_.data() + (gy * G + gx) * K;
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t ky = 0; ky < p; ++ky)
          std::memcpy(row + (ch * p + ky) * p, pixels + (ch * S + gy * p + ky) * S + gx * p, (size_t)p * 4);
    }
  float* x = buf(B_X, L * K);
  be.upload(x, patches_host_.data(), patches_host_.size() * 4);
  float* h = buf(B_H, L * d);
  be.matmul(patch_, x, L, h);
  be.add_bias(h, patch_b_.data(), L, d);
  be.add(h, pos_emb_.data(), L * d);

  blocks_.run(be, layers_, h, L, d, c.n_heads, c.ffn_dim, c.eps, encoder::Gelu::tanh);  // SigLIP: GELU(tanh)
  be.layer_norm(h, post_w_.data(), post_b_.data(), h, L, d, c.eps);

  float* dev_out = buf(B_OUT, (int64_t)c.n_rows * c.proj_dim);
  switch (c.proj) {
    case Projector::gemma3: {
      // AvgPool2d(merge) over the G x G grid as two row pools: along x (merge consecutive
      // patches of a grid row), then along y (a pooled grid row is one wide row of G/merge
      // patches, and merge consecutive wide rows average). Rows come out row-major, as
      // transformers flattens them.
      const int64_t m = c.merge, Q = G / m;
      float* p1 = buf(B_P, L / m * d);
      be.avg_pool_rows(h, L, d, (int)m, p1);
      float* p2 = buf(B_P2, Q * Q * d);
      be.avg_pool_rows(p1, G, Q * d, (int)m, p2);
      be.rms_norm(p2, soft_norm_.data(), p2, Q * Q, d, c.eps);
      be.matmul(proj_, p2, Q * Q, dev_out);
      break;
    }
  }
  be.download(out, dev_out, (size_t)c.n_rows * c.proj_dim * 4);
  return c.n_rows;
}

}  // namespace dl::vision
