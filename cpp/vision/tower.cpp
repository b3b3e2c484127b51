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

// The eps and the normalization the file states (clip.vision.*), over the defaults.
void read_norm_meta(const gguf::File& f, VisionConfig& c) {
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
}

}  // namespace

const std::vector<VisionFamily>& vision_families() {
  static const std::vector<VisionFamily> t = {
      // Gemma-3: SigLIP, then avg-pool (merge x merge) + RMSNorm + linear; the image's rows
      // attend each other in the decoder (transformers' token_type_ids blocks, mtmd's
      // non-causal image batch).
      {"gemma3v", "gemma3", Projector::gemma3, true, false},
      // Qwen2.5-VL: a ViT at the image's own size (RMSNorm blocks, 2-D rope, attention within
      // 112-pixel windows but in every n_wa_pattern-th block), then the merger (RMSNorm, 2x2
      // patches as one row, GELU MLP); its rows are causal in the decoder, at M-RoPE grid positions.
      {"qwen25v", "qwen2.5vl_merger", Projector::qwen25, false, true},
      // Qwen3-VL: a ViT at the image's own size (LayerNorm blocks, 2-D rope, learned positions
      // resampled to the image, full attention), the merger, and deepstack mergers after some
      // blocks whose rows feed the decoder's first layers; M-RoPE (interleaved) in the decoder.
      {"qwen3v", "qwen3vl_merger", Projector::qwen3, false, true},
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
  std::vector<Weight*> mats = {&e->patch_};
  if (!e->proj_.empty()) mats.push_back(&e->proj_);
  for (VitLayer& L : e->layers_)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_up, &L.w_down}) mats.push_back(w);
  for (QwenLayer& L : e->qlayers_)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      if (!w->empty()) mats.push_back(w);
  if (!e->mm0_.empty()) mats.push_back(&e->mm0_), mats.push_back(&e->mm2_);
  for (DeepstackMerger& m : e->deepstack_) mats.push_back(&m.fc1), mats.push_back(&m.fc2);
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
    if (c.family == fam.name) c.proj = fam.proj, c.non_causal = fam.non_causal, c.mrope = fam.mrope;
  if (c.proj == Projector::qwen25 || c.proj == Projector::qwen3) return load_qwen25();

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
  read_norm_meta(f, c);

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

void VisionEncoder::load_qwen25() {
  const gguf::File& f = *file_;
  VisionConfig& c = cfg_;
  const bool q3 = c.proj == Projector::qwen3;
  // The Conv3d over two frames of one image is two 2-D kernels (the converter splits it:
  // weight and weight.1) applied to the same pixels: one kernel, their sum.
  const gguf::TensorInfo* tp = f.find_tensor("v.patch_embd.weight");
  const gguf::TensorInfo* tp1 = f.find_tensor("v.patch_embd.weight.1");
  if (!tp || tp->ne.size() != 4 || tp->ne[0] != tp->ne[1] || tp->ne[2] != 3 || tp->ne[0] < 1 || tp->ne[0] > 64 ||
      tp->ne[3] < 1 || tp->ne[3] > 16384)
    throw UnsupportedModelError("vision tower: v.patch_embd.weight must be a square kernel over 3 channels" +
                                (tp ? ", got " + shape_str(*tp) : std::string(", missing")));
  c.patch = (int)tp->ne[0];
  c.dim = (int)tp->ne[3];
  const int64_t d = c.dim, K = 3 * (int64_t)c.patch * c.patch;
  {
    std::vector<float> w = encoder::vec(f, "v.patch_embd.weight", d * K, kWhat);
    if (tp1) {
      if (tp1->ne != tp->ne)
        throw UnsupportedModelError("vision tower: v.patch_embd.weight.1 has shape " + shape_str(*tp1) +
                                    ", not the first frame's " + shape_str(*tp));
      const std::vector<float> w1 = encoder::vec(f, "v.patch_embd.weight.1", d * K, kWhat);
      for (size_t i = 0; i < w.size(); ++i) w[i] += w1[i];
    }
    auto owned = std::make_shared<std::vector<uint8_t>>(w.size() * 4);
    std::memcpy(owned->data(), w.data(), w.size() * 4);
    patch_.type = (uint32_t)GGMLType::F32;
    patch_.rows = d;
    patch_.cols = K;
    patch_.row_bytes = (size_t)K * 4;
    patch_.owned = owned;
    patch_.host = owned->data();
  }
  patch_b_ = upload_vec(*backend_, vec(f, "v.patch_embd.bias", d, q3), kWhat);
  c.merge = meta_int(f, "clip.vision.spatial_merge_size", 2);
  if (c.merge != 2) throw UnsupportedModelError("vision tower: a spatial merge of " + std::to_string(c.merge) +
                                                " (the Qwen-VL mergers take 2 x 2 patches)");
  c.image_size = meta_int(f, "clip.vision.image_size", 0);  // informative: any size is taken
  c.n_wa_pattern = q3 ? 0 : meta_int(f, "clip.vision.n_wa_pattern", 0);
  c.window = meta_int(f, "clip.vision.window_size", 112);
  if (c.window < c.patch * c.merge)
    throw UnsupportedModelError("vision tower: a window of " + std::to_string(c.window) + " pixels is under one merged patch");
  c.n_heads = meta_int(f, "clip.vision.attention.head_count", 0);
  if (c.n_heads <= 0 || d % c.n_heads != 0 || (d / c.n_heads) % 4 != 0)
    throw UnsupportedModelError("vision tower: clip.vision.attention.head_count " + std::to_string(c.n_heads) +
                                " does not split the width " + std::to_string(d) + " into heads of a multiple of 4");
  if (!q3) {
    // Qwen2-VL's processor normalizes by CLIP's mean and std (when the file states none).
    const float clip_mean[3] = {0.48145466f, 0.4578275f, 0.40821073f}, clip_std[3] = {0.26862954f, 0.26130258f, 0.27577711f};
    std::memcpy(c.mean, clip_mean, sizeof c.mean);
    std::memcpy(c.std, clip_std, sizeof c.std);
  }
  read_norm_meta(f, c);
  if (q3) {
    const gguf::TensorInfo& tpos = encoder::need(f, "v.position_embd.weight", kWhat);
    const int64_t P = tpos.ne.size() == 2 ? tpos.ne[1] : 0;
    c.pos_side = (int)std::lround(std::sqrt((double)P));
    if (tpos.ne.size() != 2 || tpos.ne[0] != d || P < 1 || (int64_t)c.pos_side * c.pos_side != P)
      throw UnsupportedModelError("vision tower: v.position_embd.weight must be " + std::to_string(d) +
                                  " x a square number of positions, got " + shape_str(tpos));
    pos_table_ = vec(f, "v.position_embd.weight", d * P);
  }
  load_qwen_layers(q3);
  c.n_rows = 0;
  // 2-D rope over each head: pairs [0, hd/4) turn by the patch's row, [hd/4, hd/2) by its column,
  // each axis with frequencies theta^(-2j / (hd/2)) (transformers' axial rope for Qwen-VL ViTs).
  const int hd = (int)(d / c.n_heads), q4 = hd / 4;
  for (int a = 0; a < 2; ++a) {
    std::vector<double> tab((size_t)(hd / 2), 0.0);
    for (int j = 0; j < q4; ++j) tab[(size_t)(a * q4 + j)] = std::pow((double)c.rope_theta, -2.0 * j / (hd / 2));
    rope_tab_[a] = backend_->alloc(tab.size() * sizeof(double), "vision tower");
    backend_->upload(rope_tab_[a]->data(), tab.data(), tab.size() * sizeof(double));
  }
}

void VisionEncoder::load_qwen_layers(bool q3) {
  const gguf::File& f = *file_;
  VisionConfig& c = cfg_;
  const int64_t d = c.dim;
  int n_layers = 0;
  const char* probe = q3 ? "attn_qkv.weight" : "attn_q.weight";
  while (f.find_tensor(blk(n_layers, probe))) ++n_layers;
  if (n_layers == 0) throw UnsupportedModelError(std::string("vision tower: no encoder blocks (v.blk.0.") + probe + ")");
  c.n_layers = n_layers;
  auto up = [&](const std::string& name, int64_t n) { return upload_vec(*backend_, vec(f, name, n), kWhat); };
  qlayers_.resize(n_layers);
  int64_t F = -1;
  for (int il = 0; il < n_layers; ++il) {
    QwenLayer& L = qlayers_[il];
    auto w = [&](const char* s) { return blk(il, s); };
    L.ln1 = up(w("ln1.weight"), d);
    L.ln2 = up(w("ln2.weight"), d);
    if (q3) {
      L.ln1_b = up(w("ln1.bias"), d);
      L.ln2_b = up(w("ln2.bias"), d);
      // The fused QKV: its three row blocks as three matrices over the same file rows.
      const Weight qkv = mat(f, w("attn_qkv.weight"), 3 * d, d);
      Weight* parts[3] = {&L.wq, &L.wk, &L.wv};
      for (int i = 0; i < 3; ++i) {
        *parts[i] = qkv;
        parts[i]->rows = d;
        parts[i]->host = static_cast<const uint8_t*>(qkv.host) + (size_t)i * d * qkv.row_bytes;
      }
      const std::vector<float> b = vec(f, w("attn_qkv.bias"), 3 * d);
      Vec* bs[3] = {&L.bq, &L.bk, &L.bv};
      for (int i = 0; i < 3; ++i)
        *bs[i] = upload_vec(*backend_, std::vector<float>(b.begin() + i * d, b.begin() + (i + 1) * d), kWhat);
    } else {
      L.wq = mat(f, w("attn_q.weight"), d, d);
      L.wk = mat(f, w("attn_k.weight"), d, d);
      L.wv = mat(f, w("attn_v.weight"), d, d);
      L.bq = up(w("attn_q.bias"), d);
      L.bk = up(w("attn_k.bias"), d);
      L.bv = up(w("attn_v.bias"), d);
    }
    L.wo = mat(f, w("attn_out.weight"), d, d);
    L.bo = up(w("attn_out.bias"), d);
    const gguf::TensorInfo& tu = encoder::need(f, w("ffn_up.weight"), kWhat);
    if (F < 0) F = tu.ne.size() == 2 ? tu.ne[1] : 0;
    if (F <= 0 || F > (1 << 18)) throw UnsupportedModelError("vision tower: " + w("ffn_up.weight") + " has shape " + shape_str(tu));
    if (!q3) {
      L.w_gate = mat(f, w("ffn_gate.weight"), F, d);
      L.b_gate = up(w("ffn_gate.bias"), F);
    }
    L.w_up = mat(f, w("ffn_up.weight"), F, d);
    L.w_down = mat(f, w("ffn_down.weight"), d, F);
    L.b_up = up(w("ffn_up.bias"), F);
    L.b_down = up(w("ffn_down.bias"), d);
  }
  c.ffn_dim = (int)F;
  post_w_ = up("v.post_ln.weight", d);  // the merger's norm (RMSNorm for Qwen2.5-VL, LayerNorm for Qwen3-VL)
  if (q3) post_b_ = up("v.post_ln.bias", d);
  const gguf::TensorInfo& t2 = encoder::need(f, "mm.2.weight", kWhat);
  if (t2.ne.size() != 2 || t2.ne[0] != 4 * d || t2.ne[1] < 1 || t2.ne[1] > (1 << 18))
    throw UnsupportedModelError("vision tower: mm.2.weight must be [" + std::to_string(4 * d) + "][text width], got " +
                                shape_str(t2));
  c.proj_dim = (int)t2.ne[1];
  mm0_ = mat(f, "mm.0.weight", 4 * d, 4 * d);
  mm0_b_ = up("mm.0.bias", 4 * d);
  mm2_ = mat(f, "mm.2.weight", c.proj_dim, 4 * d);
  mm2_b_ = up("mm.2.bias", c.proj_dim);
  if (q3) {
    for (int il = 0; il < n_layers; ++il) {
      const std::string pre = "v.deepstack." + std::to_string(il) + ".";
      if (!f.find_tensor(pre + "fc1.weight")) continue;
      DeepstackMerger m;
      m.layer = il;
      m.norm_w = up(pre + "norm.weight", 4 * d);
      m.norm_b = up(pre + "norm.bias", 4 * d);
      m.fc1 = mat(f, pre + "fc1.weight", 4 * d, 4 * d);
      m.b1 = up(pre + "fc1.bias", 4 * d);
      m.fc2 = mat(f, pre + "fc2.weight", c.proj_dim, 4 * d);
      m.b2 = up(pre + "fc2.bias", c.proj_dim);
      deepstack_.push_back(std::move(m));
    }
    c.n_deepstack = (int)deepstack_.size();
    std::vector<float> one((size_t)F, 1.f);
    ones_ = backend_->alloc((size_t)F * 4, kWhat);
    backend_->upload(ones_->data(), one.data(), (size_t)F * 4);
  }
}

float* VisionEncoder::buf(int i, int64_t floats) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!bufs_[i] || bufs_[i]->size() < bytes) bufs_[i] = backend_->alloc(bytes, "vision tower scratch");
  return static_cast<float*>(bufs_[i]->data());
}

int64_t VisionEncoder::encode_hw(const float* pixels, int height, int width, float* out, int64_t out_cap) {
  const VisionConfig& c = cfg_;
  if (!c.mrope) {
    if (height != c.image_size || width != c.image_size)
      throw std::invalid_argument("the " + c.family + " tower takes " + std::to_string(c.image_size) + " x " +
                                  std::to_string(c.image_size) + " pixels, not " + std::to_string(height) + " x " +
                                  std::to_string(width));
    return encode(pixels, 3 * (int64_t)height * width, out, out_cap);
  }
  const int unit = c.patch * c.merge;
  if (height < unit || width < unit || height % unit || width % unit || (int64_t)height * width > (int64_t)1 << 26)
    throw std::invalid_argument("the " + c.family + " tower takes sides that are multiples of " + std::to_string(unit) +
                                " pixels, not " + std::to_string(height) + " x " + std::to_string(width));
  const int64_t rows = (int64_t)(height / unit) * (width / unit), width_out = (int64_t)c.proj_dim * (1 + c.n_deepstack);
  if (rows * width_out > out_cap)
    throw std::invalid_argument("output holds " + std::to_string(out_cap) + " floats; the image makes " +
                                std::to_string(rows) + " rows of " + std::to_string(width_out));
  std::lock_guard<std::mutex> lock(mu_);
  return encode_qwen25(pixels, height, width, out);
}

int64_t VisionEncoder::encode_qwen25(const float* pixels, int H, int W, float* out) {
  const VisionConfig& c = cfg_;
  Backend& be = *backend_;
  const int64_t p = c.patch, d = c.dim, K = 3 * p * p, F = c.ffn_dim;
  const int64_t gh = H / p, gw = W / p, mh = gh / 2, mw = gw / 2, U = mh * mw, L = 4 * U;
  const int hd = (int)(d / c.n_heads);
  const bool q3 = c.proj == Projector::qwen3;
  // Merged units (2x2 patches) in window order: windows of ws x ws units, row-major over the
  // image, units row-major inside each (edge windows smaller); `order` lists the raster unit of
  // each slot, `wins` each window's first slot.
  const int64_t ws = q3 ? std::max(mh, mw) : c.window / (p * c.merge);  // Qwen3-VL: no windows, raster order
  std::vector<int64_t> order, wins;
  for (int64_t wy = 0; wy < mh; wy += ws)
    for (int64_t wx = 0; wx < mw; wx += ws) {
      wins.push_back((int64_t)order.size());
      for (int64_t y = wy; y < std::min(wy + ws, mh); ++y)
        for (int64_t x = wx; x < std::min(wx + ws, mw); ++x) order.push_back(y * mw + x);
    }
  wins.push_back(U);
  // Patches in that order, each unit's four row-major; rows of (channel, y, x) as the kernel's.
  patches_host_.resize((size_t)(L * K));
  std::vector<int32_t> pos((size_t)(3 * L));  // h positions, w positions, then attention's (all see all)
  for (int64_t slot = 0; slot < U; ++slot) {
    const int64_t by = order[slot] / mw, bx = order[slot] % mw;
    for (int64_t q = 0; q < 4; ++q) {
      const int64_t py = 2 * by + q / 2, px = 2 * bx + q % 2, r = 4 * slot + q;
      pos[(size_t)r] = (int32_t)py;
      pos[(size_t)(L + r)] = (int32_t)px;
      pos[(size_t)(2 * L + r)] = (int32_t)(L - 1);
      float* row = patches_host_.data() + r * K;
      for (int64_t ch = 0; ch < 3; ++ch)
        for (int64_t ky = 0; ky < p; ++ky)
          std::memcpy(row + (ch * p + ky) * p, pixels + (ch * H + py * p + ky) * W + px * p, (size_t)p * 4);
    }
  }
  float* x = buf(B_X, L * K);
  be.upload(x, patches_host_.data(), patches_host_.size() * 4);
  int32_t* dpos = reinterpret_cast<int32_t*>(buf(B_POS, 3 * L));
  be.upload(dpos, pos.data(), pos.size() * 4);
  float* h = buf(B_H, L * d);
  be.matmul(patch_, x, L, h);
  if (!patch_b_.empty()) be.add_bias(h, patch_b_.data(), L, d);
  if (q3) {
    // The learned position grid resampled to the image's patch grid: bilinear with aligned corners
    // (source = index (side - 1) / (size - 1)), as transformers' Qwen3-VL interpolates it.
    const int64_t S = c.pos_side;
    std::vector<float>& pe = patches_host_;
    pe.assign((size_t)(L * d), 0.f);
    auto taps = [&](int64_t i, int64_t size, int64_t t[2], double w[2]) {
      const double src = (double)i * (double)(S - 1) / (double)std::max<int64_t>(size - 1, 1);
      const double fl = std::floor(src);
      for (int k = 0; k < 2; ++k) {
        t[k] = std::min<int64_t>(std::max<int64_t>((int64_t)fl + k, 0), S - 1);
        w[k] = std::max(0.0, 1.0 - std::fabs(src - fl - k));
      }
    };
    for (int64_t r = 0; r < L; ++r) {
      int64_t ty[2], tx[2];
      double wy[2], wx[2];
      taps(pos[(size_t)r], gh, ty, wy);
      taps(pos[(size_t)(L + r)], gw, tx, wx);
      float* dst = pe.data() + r * d;
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          const float wgt = (float)(wy[a] * wx[b]);
          if (wgt == 0.f) continue;
          const float* src = pos_table_.data() + (ty[a] * S + tx[b]) * d;
          for (int64_t j = 0; j < d; ++j) dst[j] += wgt * src[j];
        }
    }
    float* dpe = buf(B_PE, L * d);
    be.upload(dpe, pe.data(), pe.size() * 4);
    be.add(h, dpe, L * d);
  }
  float* ds_out = q3 && c.n_deepstack > 0 ? buf(B_DS, (int64_t)c.n_deepstack * U * c.proj_dim) : nullptr;
  size_t next_ds = 0;

  float* xn = buf(B_XN, L * d);
  float* q = buf(B_Q, L * d);
  float* kv = buf(B_KV, 2 * L * d);
  float* att = buf(B_A, L * d);
  float* g = buf(B_G, L * std::max(F, d));
  float* u = buf(B_U, L * F);
  if (!page0_) {
    page0_ = be.alloc(sizeof(int32_t), "vision tower");
    be.zero(page0_->data(), sizeof(int32_t));
  }
  RopeParams rp;
  rp.neox = true;
  rp.n_rot = hd;
  std::vector<AttnArgs> args;
  for (int il = 0; il < c.n_layers; ++il) {
    const QwenLayer& Ly = qlayers_[il];
    const bool full = c.n_wa_pattern <= 0 || (il + 1) % c.n_wa_pattern == 0;
    if (q3)
      be.layer_norm(h, Ly.ln1.data(), Ly.ln1_b.data(), xn, L, d, c.eps);
    else
      be.rms_norm(h, Ly.ln1.data(), xn, L, d, c.eps);
    const Weight* wsx[3] = {&Ly.wq, &Ly.wk, &Ly.wv};
    float* ys[3] = {q, kv, kv + L * d};
    be.matmul_multi(wsx, ys, 3, xn, L);
    be.add_bias(q, Ly.bq.data(), L, d);
    be.add_bias(kv, Ly.bk.data(), L, d);
    be.add_bias(kv + L * d, Ly.bv.data(), L, d);
    for (int a = 0; a < 2; ++a) {
      rp.inv_freq = static_cast<const double*>(rope_tab_[a]->data());
      be.rope(q, L, d, c.n_heads, hd, dpos + a * L, rp);
      be.rope(kv, L, d, c.n_heads, hd, dpos + a * L, rp);
    }
    // Each window (or the whole image) attends itself: its K rows then V rows are a one-page
    // cache starting at its first row.
    args.clear();
    const size_t nwin = full ? 1 : wins.size() - 1;
    for (size_t w = 0; w < nwin; ++w) {
      const int64_t r0 = full ? 0 : 4 * wins[w], r1 = full ? L : 4 * wins[w + 1];
      AttnArgs a;
      a.q = q + r0 * d;
      a.q_stride = d;
      a.kv = encoder::flat_kv(kv + r0 * d, L, d, static_cast<const int32_t*>(page0_->data()));
      a.n_tok = r1 - r0;
      a.n_kv = r1 - r0;
      a.n_heads = a.n_kv_heads = c.n_heads;
      a.head_dim = hd;
      a.q_pos = dpos + 2 * L;  // L - 1: every key of the window
      a.scale = 1.f / std::sqrt((float)hd);
      a.out = att + r0 * d;
      a.out_stride = d;
      args.push_back(a);
    }
    be.attention_multi(args.data(), (int)args.size());
    be.matmul(Ly.wo, att, L, g);
    be.add_bias(g, Ly.bo.data(), L, d);
    be.add(h, g, L * d);
    if (q3) {  // GELU(tanh) MLP: the GLU op against a row of ones
      be.layer_norm(h, Ly.ln2.data(), Ly.ln2_b.data(), xn, L, d, c.eps);
      be.matmul(Ly.w_up, xn, L, u);
      be.add_bias(u, Ly.b_up.data(), L, F);
      be.glu(u, F, static_cast<const float*>(ones_->data()), 0, u, L, F, Act::gelu_tanh);
    } else {  // SiLU-gated MLP
      be.rms_norm(h, Ly.ln2.data(), xn, L, d, c.eps);
      const Weight* wgu[2] = {&Ly.w_gate, &Ly.w_up};
      float* ygu[2] = {g, u};
      be.matmul_multi(wgu, ygu, 2, xn, L);
      be.add_bias(g, Ly.b_gate.data(), L, F);
      be.add_bias(u, Ly.b_up.data(), L, F);
      be.glu(g, F, u, F, u, L, F, Act::silu);
    }
    be.matmul(Ly.w_down, u, L, xn);
    be.add_bias(xn, Ly.b_down.data(), L, d);
    be.add(h, xn, L * d);
    if (next_ds < deepstack_.size() && deepstack_[next_ds].layer == il) {
      // A deepstack merger: a unit's four patches as one row of 4d, LayerNorm over it, GELU MLP.
      const DeepstackMerger& m = deepstack_[next_ds];
      float* m0 = buf(B_P, U * 4 * d);
      be.layer_norm(h, m.norm_w.data(), m.norm_b.data(), m0, U, 4 * d, c.eps);
      be.matmul(m.fc1, m0, U, xn);
      be.add_bias(xn, m.b1.data(), U, 4 * d);
      be.gelu_erf(xn, U * 4 * d);
      float* dst = ds_out + (int64_t)next_ds * U * c.proj_dim;
      be.matmul(m.fc2, xn, U, dst);
      be.add_bias(dst, m.b2.data(), U, c.proj_dim);
      ++next_ds;
    }
  }
  // The merger: RMSNorm per patch, a unit's four patches as one row of 4d, Linear, GELU, Linear.
  if (q3)
    be.layer_norm(h, post_w_.data(), post_b_.data(), h, L, d, c.eps);
  else
    be.rms_norm(h, post_w_.data(), h, L, d, c.eps);
  float* m0 = buf(B_P, U * 4 * d);
  be.matmul(mm0_, h, U, m0);
  be.add_bias(m0, mm0_b_.data(), U, 4 * d);
  be.gelu_erf(m0, U * 4 * d);
  float* dev_out = buf(B_OUT, U * c.proj_dim);
  be.matmul(mm2_, m0, U, dev_out);
  be.add_bias(dev_out, mm2_b_.data(), U, c.proj_dim);
  // Rows back in raster order, each [merger | deepstack 0 | deepstack 1 ...] (llama.cpp's concat).
  const int64_t P = c.proj_dim, n_ds = (int64_t)deepstack_.size(), Wd = P * (1 + n_ds);
  patches_host_.resize((size_t)(U * P * (1 + n_ds)));
  be.download(patches_host_.data(), dev_out, (size_t)(U * P) * 4);
  if (n_ds) be.download(patches_host_.data() + U * P, ds_out, (size_t)(n_ds * U * P) * 4);
  for (int64_t slot = 0; slot < U; ++slot)
    for (int64_t k = 0; k <= n_ds; ++k)
      std::memcpy(out + order[slot] * Wd + k * P, patches_host_.data() + (k * U + slot) * P, (size_t)P * 4);
  return U;
}

int64_t VisionEncoder::encode(const float* pixels, int64_t n_pixels, float* out, int64_t out_cap) {
  const VisionConfig& c = cfg_;
  if (c.mrope) throw std::invalid_argument("the " + c.family + " tower takes images of any size: use encode_hw");
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
