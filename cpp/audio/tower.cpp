// The whisper encoder and the audio projectors on the Backend ops: convs as im2col +
// matmul, pre-LN blocks with bidirectional attention, then the family's projector.
#include "audio/tower.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "core/errors.h"
#include "encoder/tensors.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl::audio {

namespace {

constexpr const char* kWhat = "audio tower";
using encoder::meta_int;
using encoder::shape_str;
const gguf::TensorInfo& need(const gguf::File& f, const std::string& name) { return encoder::need(f, name, kWhat); }
std::vector<float> vec(const gguf::File& f, const std::string& name, int64_t n, bool required = true) {
  return encoder::vec(f, name, n, kWhat, required);
}
Weight mat(const gguf::File& f, const std::string& name, int64_t rows, int64_t cols, bool required = true) {
  return encoder::mat(f, name, rows, cols, kWhat, required);
}

std::string blk(int il, const char* s) { return "a.blk." + std::to_string(il) + "." + s; }

// Length after one k3 s2 p1 convolution (zero stays zero), and after three (the conv2d stem).
int64_t post1(int64_t l) { return l > 0 ? (l - 1) / 2 + 1 : 0; }
int64_t post3(int64_t l) { return post1(post1(post1(l))); }

}  // namespace

const std::vector<TowerFamily>& tower_families() {
  static const std::vector<TowerFamily> t = {
      // Qwen2-Audio: avg-pool + linear; its processor keeps only the clip's rows.
      {"qwen2a", Projector::qwen2a, false, 0},
      // Qwen2.5-Omni: Qwen2-Audio's projector; the tower encodes the clip's frames in chunks of
      // 2 * n_window = 200, each with its own conv padding, positions 0.. and attention
      // (transformers' cu_seqlens); n_window is not in mmproj files and is 100 in every release.
      {"qwen2.5o", Projector::qwen2a, false, 200},
      {"ultravox", Projector::ultravox, true, 0},  // stack 8 + RMSNorm + SwiGLU, whole windows
      {"voxtral", Projector::voxtral, true, 0},    // stack 4 + GELU MLP, whole windows
      {"whisper", Projector::none, true, 0},       // a bare encoder: its rows are the output
      // Qwen3-ASR: the conv2d stem over 100-frame chunks (2 * n_window), attention within windows
      // of 800 frames (n_window_infer), then Voxtral's GELU MLP with a stack of 1. Neither n_window
      // is in mmproj files (llama.cpp hard-codes the chunk); these are every release's. Its
      // processor zero-pads clips to 0.5 s and keeps only the clip's own frames.
      {"qwen3a", Projector::voxtral, false, 100, Stem::conv2d, 800, 8000},
  };
  return t;
}

const TowerFamily* find_tower_family(const std::string& name) {
  for (const TowerFamily& f : tower_families())
    if (name == f.name) return &f;
  return nullptr;
}

std::string AudioEncoder::probe_family(const gguf::File& f) {
  if (auto has = f.find("clip.has_audio_encoder"); has && has->type == gguf::ValueType::BOOL && !has->as_bool())
    return "";
  std::optional<std::string> t;
  if (f.find("clip.audio.projector_type")) t = f.get_string("clip.audio.projector_type");
  else if (f.find("clip.projector_type")) t = f.get_string("clip.projector_type");
  if (!t) return "";
  // A vision-only file of a family that also hears (Qwen2.5-Omni) holds no a.* tensors.
  bool any_audio = false;
  for (const auto& ti : f.tensors()) any_audio |= ti.name.rfind("a.", 0) == 0;
  if (!any_audio) return "";
  return find_tower_family(*t) ? *t : "";
}

std::shared_ptr<AudioEncoder> AudioEncoder::load(const std::string& path, const std::string& device,
                                                 int n_threads) {
  std::shared_ptr<AudioEncoder> e(new AudioEncoder());
  e->backend_ = make_backend(device, n_threads);
  e->file_ = gguf::File::open(path);
  e->cfg_.family = probe_family(*e->file_);
  if (e->cfg_.family.empty()) {
    auto t = e->file_->find("clip.projector_type") ? e->file_->get_string("clip.projector_type") : std::nullopt;
    std::string names;
    for (const TowerFamily& fam : tower_families()) names += (names.empty() ? "" : ", ") + std::string(fam.name);
    throw UnsupportedModelError(path + ": no audio tower we serve (projector type '" + (t ? *t : "") +
                                "'; supported: " + names + ")");
  }
  e->load_weights();
  // The file's formats as they are (f16 convs stay f16), resident in the backend's layout,
  // once they are known to fit.
  Backend& be = *e->backend_;
  std::vector<Weight*> mats;
  for (Weight* w : {&e->conv1_, &e->conv2_, &e->conv3_, &e->conv_out_, &e->fc_, &e->mm1_, &e->mm2_})
    if (!w->empty()) mats.push_back(w);
  for (EncoderLayer& L : e->layers_)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_up, &L.w_down}) mats.push_back(w);
  size_t total = 0;
  for (Weight* w : mats) {
    if (!be.supports(Op::matmul, w->type)) {
      const TypeTraits* tt = type_traits(w->type);
      throw UnsupportedModelError(std::string("audio tower: the ") + be.name() + " backend has no matmul for " +
                                  (tt ? tt->name : "?"));
    }
    total += (size_t)w->rows * w->row_bytes;
  }
  be.check_fits(total, "audio tower weights");
  for (Weight* w : mats) be.load_weight(*w, WeightUse::matmul);
  e->mel_ = std::make_unique<MelBank>(e->cfg_.n_mel);
  return e;
}

void AudioEncoder::load_weights() {
  const gguf::File& f = *file_;
  TowerConfig& c = cfg_;
  const TowerFamily& fam = *find_tower_family(c.family);  // probe_family found it
  c.proj = fam.proj;
  c.full_window_default = fam.full_window_default;
  c.window_frames = fam.window_frames;
  c.stem = fam.stem;
  c.attn_frames = fam.attn_frames;
  c.min_samples = fam.min_samples;

  if (c.stem == Stem::conv2d) {
    load_conv2d_stem();
  } else {
  const gguf::TensorInfo& t1 = need(f, "a.conv1d.1.weight");
  if (t1.ne.size() != 3 || t1.ne[0] != 3)
    throw UnsupportedModelError("audio tower: a.conv1d.1.weight has shape " + shape_str(t1) +
                                ", expected a kernel of 3 over [n_mel, dim]");
  if (t1.ne[1] <= 0 || t1.ne[1] > 512 || t1.ne[2] <= 0 || t1.ne[2] > 16384)
    throw UnsupportedModelError("audio tower: a.conv1d.1.weight has shape " + shape_str(t1));
  c.n_mel = (int)t1.ne[1];
  c.dim = (int)t1.ne[2];
  const int64_t d = c.dim;
  conv1_ = mat(f, "a.conv1d.1.weight", d, 3 * (int64_t)c.n_mel);
  const gguf::TensorInfo& t2 = need(f, "a.conv1d.2.weight");
  if (t2.ne.size() != 3 || t2.ne[0] != 3 || t2.ne[1] != d || t2.ne[2] != d)
    throw UnsupportedModelError("audio tower: a.conv1d.2.weight has shape " + shape_str(t2) + ", expected 3x" +
                                std::to_string(d) + "x" + std::to_string(d));
  conv2_ = mat(f, "a.conv1d.2.weight", d, 3 * d);
  conv1_b_ = upload_vec(*backend_, vec(f, "a.conv1d.1.bias", d), "audio tower");
  conv2_b_ = upload_vec(*backend_, vec(f, "a.conv1d.2.bias", d), "audio tower");
  const gguf::TensorInfo& tp = need(f, "a.position_embd.weight");
  if (tp.ne.size() != 2 || tp.ne[0] != d || tp.ne[1] < 1500 || tp.ne[1] > 1 << 20)
    throw UnsupportedModelError("audio tower: a.position_embd.weight has shape " + shape_str(tp) + ", expected " +
                                std::to_string(d) + "x(>= 1500): a 30 s window needs 1500 positions");
  c.n_pos = (int)tp.ne[1];
  {  // the first 1500 rows: one 30 s window
    const TypeTraits* tt = type_traits(tp.type);
    if (!tt || !tt->dequantizable || d % tt->block_size != 0)
      throw UnsupportedModelError("audio tower: a.position_embd.weight has an unsupported type");
    std::vector<float> pe((size_t)d * 1500);
    const size_t rb = (size_t)type_nbytes(tp.type, d);
    for (int64_t r = 0; r < 1500; ++r) dequantize_row(tp.type, f.tensor_data(tp) + r * rb, pe.data() + r * d, d);
    pos_emb_ = upload_vec(*backend_, pe, "audio tower");
  }
  }  // conv1d stem
  const int64_t d = c.dim;
  post_w_ = upload_vec(*backend_, vec(f, "a.post_ln.weight", d), "audio tower");
  post_b_ = upload_vec(*backend_, vec(f, "a.post_ln.bias", d), "audio tower");

  c.n_heads = meta_int(f, "clip.audio.attention.head_count", 0);
  if (c.n_heads <= 0 || d % c.n_heads != 0)
    throw UnsupportedModelError("audio tower: clip.audio.attention.head_count " + std::to_string(c.n_heads) +
                                " does not divide the width " + std::to_string(d));
  if (auto eps = f.get_float("clip.audio.attention.layer_norm_epsilon")) {
    if (!(*eps > 0 && *eps < 1)) throw GGUFError("metadata clip.audio.attention.layer_norm_epsilon out of range");
    c.eps = (float)*eps;
  }
  int n_layers = 0;
  while (f.find_tensor(blk(n_layers, "attn_q.weight"))) ++n_layers;
  if (n_layers == 0) throw UnsupportedModelError("audio tower: no encoder blocks (a.blk.0.attn_q.weight)");
  c.n_layers = n_layers;
  layers_.resize(n_layers);
  int64_t ffn = -1;  // the first block's width, then every block's
  for (int il = 0; il < n_layers; ++il) layers_[il] = encoder::load_layer(*backend_, f, blk(il, ""), d, ffn, kWhat);
  c.ffn_dim = (int)ffn;
  if (f.find_tensor(blk(n_layers, "ln1.weight")) || f.find_tensor(blk(n_layers + 1, "attn_q.weight")))
    throw UnsupportedModelError("audio tower: block " + std::to_string(n_layers) + " is incomplete");

  switch (c.proj) {
    case Projector::none: c.proj_dim = c.dim; break;
    case Projector::qwen2a:
      fc_ = mat(f, "mm.a.fc.weight", -1, d);
      fc_b_ = upload_vec(*backend_, vec(f, "mm.a.fc.bias", fc_.rows), "audio tower");
      c.proj_dim = (int)fc_.rows;
      break;
    case Projector::ultravox:
    case Projector::voxtral: {
      mm1_ = mat(f, "mm.a.mlp.1.weight", -1, -1);
      if (mm1_.cols % d != 0 || mm1_.cols / d > 64)
        throw UnsupportedModelError("audio tower: mm.a.mlp.1.weight takes rows of " + std::to_string(mm1_.cols) +
                                    ", not a stack of " + std::to_string(d) + "-wide frames");
      c.stack = (int)(mm1_.cols / d);
      if (c.proj == Projector::ultravox) {
        if (mm1_.rows % 2 != 0) throw UnsupportedModelError("audio tower: ultravox mm.a.mlp.1 rows must be even (SwiGLU)");
        c.proj_hidden = (int)(mm1_.rows / 2);
        norm_pre_ = upload_vec(*backend_, vec(f, "mm.a.norm_pre.weight", mm1_.cols), "audio tower");
        norm_mid_ = upload_vec(*backend_, vec(f, "mm.a.norm_mid.weight", c.proj_hidden), "audio tower");
      } else {
        c.proj_hidden = (int)mm1_.rows;
        mm1_b_ = upload_vec(*backend_, vec(f, "mm.a.mlp.1.bias", mm1_.rows, false), "audio tower");
      }
      mm2_ = mat(f, "mm.a.mlp.2.weight", -1, c.proj_hidden);
      if (c.proj == Projector::voxtral) mm2_b_ = upload_vec(*backend_, vec(f, "mm.a.mlp.2.bias", mm2_.rows, false), "audio tower");
      c.proj_dim = (int)mm2_.rows;
      break;
    }
  }
  if (c.proj_dim <= 0 || c.proj_dim > 1 << 18) throw UnsupportedModelError("audio tower: projection width out of range");
}

void AudioEncoder::load_conv2d_stem() {
  const gguf::File& f = *file_;
  TowerConfig& c = cfg_;
  const gguf::TensorInfo& t1 = need(f, "a.conv2d.1.weight");
  if (t1.ne.size() != 4 || t1.ne[0] != 3 || t1.ne[1] != 3 || t1.ne[2] != 1 || t1.ne[3] <= 0 || t1.ne[3] > 4096)
    throw UnsupportedModelError("audio tower: a.conv2d.1.weight has shape " + shape_str(t1) +
                                ", expected a 3x3 kernel from 1 channel");
  const int64_t C = t1.ne[3];
  c.conv_channels = (int)C;
  for (const char* name : {"a.conv2d.2.weight", "a.conv2d.3.weight"}) {
    const gguf::TensorInfo& t = need(f, name);
    if (t.ne.size() != 4 || t.ne[0] != 3 || t.ne[1] != 3 || t.ne[2] != C || t.ne[3] != C)
      throw UnsupportedModelError(std::string("audio tower: ") + name + " has shape " + shape_str(t) + ", expected 3x3x" +
                                  std::to_string(C) + "x" + std::to_string(C));
  }
  conv1_ = mat(f, "a.conv2d.1.weight", C, 9);
  conv2_ = mat(f, "a.conv2d.2.weight", C, 9 * C);
  conv3_ = mat(f, "a.conv2d.3.weight", C, 9 * C);
  conv1_b_ = upload_vec(*backend_, vec(f, "a.conv2d.1.bias", C), kWhat);
  conv2_b_ = upload_vec(*backend_, vec(f, "a.conv2d.2.bias", C), kWhat);
  conv3_b_ = upload_vec(*backend_, vec(f, "a.conv2d.3.bias", C), kWhat);
  c.n_mel = meta_int(f, "clip.audio.num_mel_bins", 0);
  if (c.n_mel <= 0 || c.n_mel > 512)
    throw UnsupportedModelError("audio tower: clip.audio.num_mel_bins " + std::to_string(c.n_mel) + " out of range");
  // The linear reads each time step's channels x remaining mel bins.
  conv_out_ = mat(f, "a.conv_out.weight", -1, C * post3(c.n_mel));
  if (conv_out_.rows > 16384) throw UnsupportedModelError("audio tower: a.conv_out.weight is too wide");
  c.dim = (int)conv_out_.rows;
  const int64_t d = c.dim, R = post3(c.window_frames);  // positions of one chunk
  const gguf::TensorInfo& tp = need(f, "a.position_embd.weight");
  if (tp.ne.size() != 2 || tp.ne[0] != d || tp.ne[1] < R || tp.ne[1] > 1 << 20)
    throw UnsupportedModelError("audio tower: a.position_embd.weight has shape " + shape_str(tp) + ", expected " +
                                std::to_string(d) + "x(>= " + std::to_string(R) + ")");
  c.n_pos = (int)tp.ne[1];
  const TypeTraits* tt = type_traits(tp.type);
  if (!tt || !tt->dequantizable || d % tt->block_size != 0)
    throw UnsupportedModelError("audio tower: a.position_embd.weight has an unsupported type");
  std::vector<float> pe((size_t)(d * R));
  const size_t rb = (size_t)type_nbytes(tp.type, d);
  for (int64_t r = 0; r < R; ++r) dequantize_row(tp.type, f.tensor_data(tp) + r * rb, pe.data() + r * d, d);
  pos_emb_ = upload_vec(*backend_, pe, kWhat);
}

int64_t AudioEncoder::conv2d_rows(int64_t n) const {
  const int64_t F = std::max<int64_t>(n, cfg_.min_samples) / kHop, W = cfg_.window_frames;
  return F / W * post3(W) + post3(F % W);
}

int64_t AudioEncoder::encode_conv2d(const float* x, int64_t n, AudioScratch& s, float* out) {
  Backend& be = *backend_;
  const TowerConfig& c = cfg_;
  const int64_t W = c.window_frames, C = c.conv_channels, d = c.dim, nm = c.n_mel;
  const int64_t total = conv2d_rows(n);
  std::vector<float> padded;  // the processor's zero padding of a short clip
  if (n < c.min_samples) {
    padded.assign((size_t)c.min_samples, 0.f);
    std::copy(x, x + n, padded.begin());
    x = padded.data();
    n = c.min_samples;
  }
  const int64_t F = n / kHop, chunks = (F + W - 1) / W, stride = chunks * W;
  if (total == 0) return 0;
  s.mel.resize((size_t)(nm * stride));
  log_mel_clip(*mel_, x, n, s.mel_s, s.mel.data(), stride, be.host_threads());
  float* mel = buf(B_MEL, nm * stride);
  be.upload(mel, s.mel.data(), s.mel.size() * 4);
  // Each chunk's convs see only its own frames (zeros past its edges and past the clip); the
  // positions are [mel bin][frame] rows of channels, and the last im2col turns the third conv's
  // rows into one row per time step of [channel][bin], the order the linear reads.
  const int64_t h1 = post1(nm), w1 = post1(W), h2 = post1(h1), w2 = post1(w1), h3 = post1(h2), w3 = post1(w2);
  float* xc = buf(B_X1, std::max(h1 * w1 * 9, h2 * w2 * C * 9));
  float* g1 = buf(B_G1, h1 * w1 * C);
  float* g2 = buf(B_G2, h2 * w2 * C);
  float* g3 = buf(B_Y2, h3 * w3 * C);
  // The linear's input rows of a group of chunks at a time: a ten-minute clip's would be 600 x 13
  // rows of channels x bins (240 MB at Qwen3-ASR's sizes).
  constexpr int64_t kGroup = 16;
  float* feat = buf(B_P, std::min(chunks, kGroup) * w3 * C * h3);
  auto conv = [&](const Weight& w, const Vec& b, float* y, int64_t rows) {
    be.matmul(w, xc, rows, y);
    be.add_bias(y, b.data(), rows, C);
    be.gelu_erf(y, rows * C);
  };
  float* h = buf(B_HALL, chunks * w3 * d);
  for (int64_t g0 = 0; g0 < chunks; g0 += kGroup) {
    const int64_t gn = std::min(kGroup, chunks - g0);
    for (int64_t ci = g0; ci < g0 + gn; ++ci) {
      be.im2col_2d(mel + ci * W, 1, nm, W, 0, stride, 1, 3, 3, 2, 1, xc, h1, w1);
      conv(conv1_, conv1_b_, g1, h1 * w1);
      be.im2col_2d(g1, C, h1, w1, 1, w1 * C, C, 3, 3, 2, 1, xc, h2, w2);
      conv(conv2_, conv2_b_, g2, h2 * w2);
      be.im2col_2d(g2, C, h2, w2, 1, w2 * C, C, 3, 3, 2, 1, xc, h3, w3);
      conv(conv3_, conv3_b_, g3, h3 * w3);
      be.im2col_2d(g3, C, h3, w3, 1, w3 * C, C, (int)h3, 1, 1, 0, feat + (ci - g0) * w3 * C * h3, 1, w3);
    }
    be.matmul(conv_out_, feat, gn * w3, h + g0 * w3 * d);
  }
  for (int64_t ci = 0; ci < chunks; ++ci) be.add(h + ci * w3 * d, pos_emb_.data(), w3 * d);
  // Only the last chunk can be partial, so the clip's positions are the first `total` rows.
  // Attention windows: attn_frames worth of the longest chunk's positions (transformers' cu_seqlens).
  const int64_t longest = F >= W ? w3 : post3(F);
  const int64_t win = c.attn_frames > 0 ? std::max<int64_t>(1, longest * (c.attn_frames / W)) : total;
  for (int64_t r0 = 0; r0 < total; r0 += win)
    blocks_.run(be, layers_, h + r0 * d, std::min(win, total - r0), d, c.n_heads, c.ffn_dim, c.eps, encoder::Gelu::erf);
  be.layer_norm(h, post_w_.data(), post_b_.data(), h, total, d, c.eps);
  float* y = buf(B_Y, total * c.proj_hidden);
  be.matmul(mm1_, h, total, y);
  if (!mm1_b_.empty()) be.add_bias(y, mm1_b_.data(), total, c.proj_hidden);
  be.gelu_erf(y, total * c.proj_hidden);
  float* dev_out = buf(B_OUT, total * c.proj_dim);
  be.matmul(mm2_, y, total, dev_out);
  if (!mm2_b_.empty()) be.add_bias(dev_out, mm2_b_.data(), total, c.proj_dim);
  be.download(out, dev_out, (size_t)(total * c.proj_dim) * 4);
  return total;
}

int64_t AudioEncoder::chunk_rows(int64_t L, bool full) const {
  switch (cfg_.proj) {
    case Projector::none: return L;
    case Projector::qwen2a: return L < 2 ? 0 : (L - 2) / 2 + 1;  // AvgPool1d(2, 2)
    default:
      // Stacked frames: the processor's clip pads the last group with zeros; the full
      // window keeps whole groups only (1500 / 8 -> 187, as llama.cpp counts).
      return full ? L / cfg_.stack : (L + cfg_.stack - 1) / cfg_.stack;
  }
}

int64_t AudioEncoder::clip_frames(int64_t n, bool full) const {
  return full ? mel_chunks(n) * kChunkFrames : (n + kHop - 1) / kHop;
}

int64_t AudioEncoder::n_rows(int64_t n, bool full) const {
  if (n <= 0) return 0;
  if (cfg_.stem == Stem::conv2d) return conv2d_rows(n);
  if (cfg_.window_frames) return chunk_rows((clip_frames(n, full) - 1) / 2 + 1, full);
  const int64_t chunks = mel_chunks(n);
  int64_t rows = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t nc = std::min(kChunkSamples, n - c * kChunkSamples);
    const int64_t frames = full ? kChunkFrames : (nc + kHop - 1) / kHop;
    rows += chunk_rows((frames - 1) / 2 + 1, full);
  }
  return rows;
}

float* AudioEncoder::buf(int i, int64_t floats) {
  const size_t bytes = (size_t)std::max<int64_t>(floats, 1) * sizeof(float);
  if (!bufs_[i] || bufs_[i]->size() < bytes) bufs_[i] = backend_->alloc(bytes, "audio tower scratch");
  return static_cast<float*>(bufs_[i]->data());
}

void AudioEncoder::encode_chunk(const float* mel, int64_t stride, int64_t avail, int64_t S, int64_t L) {
  Backend& be = *backend_;
  const TowerConfig& c = cfg_;
  const int64_t d = c.dim, nm = c.n_mel;
  // conv1 (k3 s1 p1) over frames [0, S): im2col rows [ch * 3 + k] = mel[ch][t + k - 1].
  float* x1 = buf(B_X1, std::max(S * 3 * nm, L * 3 * d));
  be.im2col_1d(mel, stride, nm, avail, 3, 1, 1, x1, S);
  // Each conv's bias and GELU are applied as its matmul stores.
  MatmulEpilogue e;
  e.gelu_erf = true;
  float* g1 = buf(B_G1, S * d);
  const Weight* w1[1] = {&conv1_};
  e.bias = conv1_b_.data();
  be.matmul_multi_ex(w1, &g1, 1, x1, S, &e);
  // conv2 (k3 s2 p1): output t reads conv1 rows 2t - 1 .. 2t + 1 (zero outside the window).
  float* x2 = x1;
  be.im2col_rows(g1, d, S, 3, 2, 1, x2, L);
  float* h = buf(B_H, L * d);
  const Weight* w2[1] = {&conv2_};
  e.bias = conv2_b_.data();
  be.matmul_multi_ex(w2, &h, 1, x2, L, &e);
  be.add(h, pos_emb_.data(), L * d);

  blocks_.run(be, layers_, h, L, d, c.n_heads, c.ffn_dim, c.eps, encoder::Gelu::erf);
}

// Qwen2-Audio's projector (Qwen2.5-Omni's too): AvgPool1d(2, 2) over the encoder's positions,
// the post-LN, then the linear; rows output rows from 2 * rows positions of h.
void AudioEncoder::pool_project(const float* h, int64_t rows, float* out) {
  const TowerConfig& c = cfg_;
  const int64_t d = c.dim;
  Backend& be = *backend_;
  float* p = buf(B_P, rows * d);
  be.avg_pool_rows(h, 2 * rows, d, 2, p);
  be.layer_norm(p, post_w_.data(), post_b_.data(), p, rows, d, c.eps);
  be.matmul(fc_, p, rows, out);
  be.add_bias(out, fc_b_.data(), rows, c.proj_dim);
}

int64_t AudioEncoder::encode_mel_window(const float* mel_host, float* out, int64_t out_cap) {
  const TowerConfig& c = cfg_;
  if (c.proj != Projector::none || c.window_frames)
    throw std::invalid_argument("audio tower: mel windows are for bare whisper encoders, not the " + c.family +
                                " tower");
  const int64_t L = kChunkFrames / 2, d = c.dim;
  if (L * d > out_cap)
    throw std::invalid_argument("output holds " + std::to_string(out_cap) + " floats; a window makes " +
                                std::to_string(L) + " rows of " + std::to_string(d));
  std::lock_guard<std::mutex> lock(mu_);
  Backend& be = *backend_;
  float* mel = buf(B_MEL, c.n_mel * kChunkFrames);
  be.upload(mel, mel_host, (size_t)(c.n_mel * kChunkFrames) * 4);
  encode_chunk(mel, kChunkFrames, kChunkFrames, kChunkFrames, L);
  float* dev_out = buf(B_OUT, L * d);
  be.layer_norm(static_cast<float*>(bufs_[B_H]->data()), post_w_.data(), post_b_.data(), dev_out, L, d, c.eps);
  be.download(out, dev_out, (size_t)(L * d) * 4);
  return L;
}

int64_t AudioEncoder::encode(const float* x, int64_t n, bool full, AudioScratch& s, float* out, int64_t out_cap) {
  const int64_t total_rows = n_rows(n, full);
  const TowerConfig& c = cfg_;
  if (n <= 0) throw std::invalid_argument("audio clip is empty");
  if (total_rows * c.proj_dim > out_cap)
    throw std::invalid_argument("output holds " + std::to_string(out_cap) + " floats; the clip makes " +
                                std::to_string(total_rows) + " rows of " + std::to_string(c.proj_dim));
  std::lock_guard<std::mutex> lock(mu_);
  if (c.stem == Stem::conv2d) return encode_conv2d(x, n, s, out);
  Backend& be = *backend_;
  const int64_t chunks = mel_chunks(n), frames = chunks * kChunkFrames, d = c.dim;
  s.mel.resize((size_t)(c.n_mel * frames));
  log_mel(*mel_, x, n, s.mel_s, s.mel.data(), be.host_threads());
  float* mel = buf(B_MEL, c.n_mel * frames);
  be.upload(mel, s.mel.data(), s.mel.size() * 4);
  float* dev_out = buf(B_OUT, total_rows * c.proj_dim);
  if (c.window_frames) {
    if (total_rows == 0) return 0;
    // Qwen2.5-Omni: chunks of the clip's frames, each encoded alone, then the pairs of the
    // concatenated positions averaged, the post-LN and the linear.
    const int64_t F = clip_frames(n, full), W = c.window_frames;
    int64_t P = 0;
    float* hall = buf(B_HALL, ((F - 1) / 2 + 1) * d);
    for (int64_t f0 = 0; f0 < F; f0 += W) {
      const int64_t len = std::min(W, F - f0), L = (len - 1) / 2 + 1;
      encode_chunk(mel + f0, frames, len, len, L);
      be.copy(hall + P * d, bufs_[B_H]->data(), (size_t)(L * d) * 4);
      P += L;
    }
    pool_project(hall, total_rows, dev_out);
    be.download(out, dev_out, (size_t)(total_rows * c.proj_dim) * 4);
    return total_rows;
  }
  int64_t row = 0;
  for (int64_t ci = 0; ci < chunks; ++ci) {
    const int64_t nc = std::min(kChunkSamples, n - ci * kChunkSamples);
    const int64_t L = ((full ? kChunkFrames : (nc + kHop - 1) / kHop) - 1) / 2 + 1;
    const int64_t rows = chunk_rows(L, full);
    if (rows == 0) continue;
    encode_chunk(mel + ci * kChunkFrames, frames, kChunkFrames, std::min<int64_t>(kChunkFrames, 2 * L), L);
    float* h = static_cast<float*>(bufs_[B_H]->data());
    float* dst = dev_out + row * c.proj_dim;
    switch (c.proj) {
      case Projector::none:
        be.layer_norm(h, post_w_.data(), post_b_.data(), dst, L, d, c.eps);
        break;
      case Projector::qwen2a: {
        pool_project(h, rows, dst);
        break;
      }
      case Projector::ultravox:
      case Projector::voxtral: {
        // Post-LN, then `stack` consecutive rows side by side (zeros past the last row).
        const int64_t sw = (int64_t)c.stack * d;
        float* p = buf(B_P, rows * sw);
        be.zero(p, (size_t)(rows * sw) * 4);
        be.layer_norm(h, post_w_.data(), post_b_.data(), h, L, d, c.eps);
        be.copy(p, h, (size_t)std::min(L * d, rows * sw) * 4);
        const int64_t hid = c.proj_hidden;
        if (c.proj == Projector::ultravox) {
          be.rms_norm(p, norm_pre_.data(), p, rows, sw, 1e-6f);
          float* y = buf(B_Y, rows * 2 * hid);
          be.matmul(mm1_, p, rows, y);
          // SwiGLU with the halves swapped: silu(second half) * first half.
          float* y2 = buf(B_Y2, rows * hid);
          be.glu(y + hid, 2 * hid, y, 2 * hid, y2, rows, hid, Act::silu);
          be.rms_norm(y2, norm_mid_.data(), y2, rows, hid, 1e-6f);
          be.matmul(mm2_, y2, rows, dst);
        } else {
          float* y = buf(B_Y, rows * hid);
          be.matmul(mm1_, p, rows, y);
          if (!mm1_b_.empty()) be.add_bias(y, mm1_b_.data(), rows, hid);
          be.gelu_erf(y, rows * hid);
          be.matmul(mm2_, y, rows, dst);
          if (!mm2_b_.empty()) be.add_bias(dst, mm2_b_.data(), rows, c.proj_dim);
        }
        break;
      }
    }
    row += rows;
  }
  be.download(out, dev_out, (size_t)(row * c.proj_dim) * 4);
  return row;
}

}  // namespace dl::audio
