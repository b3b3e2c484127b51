// Model loading: config from metadata, every shape checked against the config before
// use, weights in the format the backend asks for (converted on the host where it
// differs from the file), then made resident on the backend once they all fit.
#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "core/errors.h"
#include "model/session.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl {

namespace {

std::string key(const ModelConfig& c, const char* suffix) { return c.arch + "." + suffix; }

int get_int_or(const gguf::File& f, const std::string& k, int def) {
  const gguf::Value* v = f.find(k);
  if (!v) return def;
  if (v->type == gguf::ValueType::ARRAY)
    throw UnsupportedModelError("metadata '" + k + "' varies per layer; not supported");
  int64_t x = v->as_int();
  if (x < 0 || x > (1 << 30)) throw GGUFError("metadata '" + k + "' out of range: " + std::to_string(x));
  return (int)x;
}

// A key that is one value for every layer or an array of one per layer (gemma4's head_count_kv,
// feed_forward_length); def where absent.
std::vector<int> get_ints_per_layer(const gguf::File& f, const std::string& k, int n_layers, int def) {
  std::vector<int> out((size_t)n_layers, def);
  const gguf::Value* v = f.find(k);
  if (!v) return out;
  if (v->type != gguf::ValueType::ARRAY) {
    std::fill(out.begin(), out.end(), get_int_or(f, k, def));
    return out;
  }
  if (v->size() != (size_t)n_layers)
    throw GGUFError("metadata '" + k + "' has " + std::to_string(v->size()) + " values for " +
                    std::to_string(n_layers) + " layers");
  for (int il = 0; il < n_layers; ++il) {
    const int64_t x = v->at((size_t)il).as_int();
    if (x < 0 || x > (1 << 30)) throw GGUFError("metadata '" + k + "' out of range: " + std::to_string(x));
    out[(size_t)il] = (int)x;
  }
  return out;
}

float get_float_or(const gguf::File& f, const std::string& k, float def) {
  auto v = f.get_float(k);
  return v ? (float)*v : def;
}

Weight convert(const Weight& w, uint32_t to) {
  Weight o = w;
  o.type = to;
  int64_t rb = type_nbytes(to, w.cols);
  o.row_bytes = (size_t)rb;
  o.owned = std::make_shared<std::vector<uint8_t>>((size_t)rb * w.rows);
  std::vector<float> row((size_t)w.cols);
  for (int64_t r = 0; r < w.rows; ++r) {
    dequantize_row(w.type, w.host + (size_t)r * w.row_bytes, row.data(), w.cols);
    if (to == (uint32_t)GGMLType::F32)
      std::memcpy(o.owned->data() + (size_t)r * rb, row.data(), (size_t)rb);
    else
      quantize_row(to, row.data(), o.owned->data() + (size_t)r * rb, w.cols);
  }
  o.host = o.owned->data();
  return o;
}

}  // namespace

std::shared_ptr<Tokenizer> load_tokenizer(const gguf::File& f) {
  const ArchTraits* t = find_arch(f.get_string("general.architecture").value_or(""));
  return Tokenizer::from_gguf(f, t && t->spm_gemma);
}

std::shared_ptr<Model> Model::load(const std::string& path, QuantMode mode, const std::string& device,
                                   int n_threads) {
  return open(path, mode, device, n_threads, false);
}

Model::MemoryEstimate Model::estimate(const std::string& path, QuantMode mode, const std::string& device,
                                      int64_t n_ctx, KVType kv_type) {
  if (n_ctx < 1) throw Error("estimate: n_ctx must be >= 1");
  std::shared_ptr<Model> m = open(path, mode, device, 1, true);
  const ModelConfig& c = m->cfg_;
  MemoryEstimate e;
  e.weights = m->weight_bytes_;
  e.embd_table = m->embd_bytes_;
  const KVGeometry g = m->kv_geometry(kv_type);
  e.kv = (size_t)g.n_layers * 2 * (size_t)n_ctx * g.row_bytes + (size_t)c.n_rec_layers * c.rec_state_floats * 4;
  // One chunk of rows through a layer (decoder.cpp's scratch), the logits of one row, the
  // quantized activations, and per worker the attention's score row over n_ctx keys.
  const int64_t rows = std::min<int64_t>(m->max_chunk_, n_ctx);
  const int64_t q_dim = (int64_t)c.n_heads * c.head_dim, kv_dim = (int64_t)c.n_kv_heads * c.head_dim;
  const int64_t per_row = 4 * (int64_t)c.dim + 2 * q_dim + 2 * kv_dim + std::max<int64_t>(c.dim, q_dim + 2 * kv_dim) +
                          3 * (int64_t)c.ffn_dim +
                          // a mixture of experts: per token k experts' gate, up and down rows, the shared expert
                          (int64_t)c.n_expert_used * (2 * (int64_t)c.expert_ffn_dim + c.dim) +
                          (c.n_expert > 0 ? 2 * (int64_t)c.shexp_ffn_dim + 2 * c.dim + c.n_expert : 0);
  const int threads = std::max(1, m->backend_->info().threads);
  e.scratch = (size_t)(rows * per_row + c.vocab_size) * 4 + (size_t)(rows * std::max(c.dim, c.ffn_dim)) * 2 +
              (size_t)threads * 16 * (size_t)n_ctx * 4;
  e.total = e.weights + e.kv + e.scratch;
  e.available = std::string(m->backend_->name()) == "cpu" ? host_memory_available() : 0;
  return e;
}

std::shared_ptr<Model> Model::open(const std::string& path, QuantMode mode, const std::string& device,
                                   int n_threads, bool dry_run) {
  std::shared_ptr<Model> m(new Model());
  // The backend first: a device that is missing is refused before the file is read.
  m->backend_ = make_backend(device, n_threads);
  // A GPU's prefill matmuls fill its SMs only with more token tiles: 512 rows a chunk there
  // (the CPU's 256 keep a chunk's activations in its caches).
  if (std::string(m->backend_->name()) != "cpu") m->max_chunk_ = 512;
  m->file_ = gguf::File::open(path);
  m->mode_ = mode;
  const gguf::File& f = *m->file_;
  auto arch = f.get_string("general.architecture");
  if (!arch) throw UnsupportedModelError("GGUF has no general.architecture: not a language model file");
  m->traits_ = find_arch(*arch);
  if (!m->traits_) {
    std::string known;
    for (auto& a : registered_archs()) known += (known.empty() ? "" : ", ") + a;
    throw UnsupportedModelError("unsupported architecture '" + *arch + "' (supported: " + known + ")");
  }
  ModelConfig& c = m->cfg_;
  c.arch = *arch;
  c.dim = get_int_or(f, key(c, "embedding_length"), 0);
  c.n_layers = get_int_or(f, key(c, "block_count"), 0);
  c.n_heads = get_int_or(f, key(c, "attention.head_count"), 0);
  if (c.dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0)
    throw GGUFError("metadata: embedding_length, block_count and attention.head_count must be positive");
  const std::vector<int> kv_heads = get_ints_per_layer(f, key(c, "attention.head_count_kv"), c.n_layers, c.n_heads);
  c.head_dim = get_int_or(f, key(c, "attention.key_length"), c.dim / c.n_heads);
  c.head_dim_v = get_int_or(f, key(c, "attention.value_length"), c.head_dim);
  c.l_ffn_dim = get_ints_per_layer(f, key(c, "feed_forward_length"), c.n_layers, 0);
  c.ffn_dim = *std::max_element(c.l_ffn_dim.begin(), c.l_ffn_dim.end());
  c.seq_len = get_int_or(f, key(c, "context_length"), 2048);
  c.norm_eps = get_float_or(f, key(c, "attention.layer_norm_rms_epsilon"), 1e-5f);
  c.rope_base = get_float_or(f, key(c, "rope.freq_base"), 10000.f);
  c.n_rot = get_int_or(f, key(c, "rope.dimension_count"), c.head_dim);
  auto scaling = f.get_string(key(c, "rope.scaling.type"));
  c.rope_scaling = scaling ? *scaling : "none";
  if (c.rope_scaling == "linear") {
    float factor = get_float_or(f, key(c, "rope.scaling.factor"), 1.f);
    if (factor > 0) c.rope_freq_scale = 1.f / factor;
  } else if (c.rope_scaling == "yarn") {
    // YaRN as transformers computes it (truncated correction range): per pair,
    // interpolated and extrapolated frequencies blended by a linear ramp, and
    // cos/sin scaled by the attention factor 0.1 ln(factor) + 1.
    const double factor = get_float_or(f, key(c, "rope.scaling.factor"), 1.f);
    const int orig = get_int_or(f, key(c, "rope.scaling.original_context_length"), 0);
    if (!(factor > 0) || orig <= 0)
      throw GGUFError("metadata: yarn rope scaling needs rope.scaling.factor and original_context_length");
    const double beta_fast = get_float_or(f, key(c, "rope.scaling.yarn_beta_fast"), 32.f);
    const double beta_slow = get_float_or(f, key(c, "rope.scaling.yarn_beta_slow"), 1.f);
    const double dim = c.n_rot, base = c.rope_base;
    auto corr = [&](double rot) { return dim * std::log(orig / (rot * 2 * M_PI)) / (2 * std::log(base)); };
    const bool trunc = m->traits_->yarn_truncate;
    const double low = std::max(trunc ? std::floor(corr(beta_fast)) : corr(beta_fast), 0.0);
    double high = std::min(trunc ? std::ceil(corr(beta_slow)) : corr(beta_slow), dim - 1);
    if (low == high) high += 0.001;
    c.rope_inv_freq.resize((size_t)c.n_rot / 2);
    for (int i = 0; i < c.n_rot / 2; ++i) {
      const double extrap = 1.0 / std::pow(base, 2.0 * i / dim);
      const double ramp = std::min(1.0, std::max(0.0, (i - low) / (high - low)));
      const double keep = 1.0 - ramp;  // share of the extrapolated (unscaled) frequency
      c.rope_inv_freq[i] = extrap / factor * (1.0 - keep) + extrap * keep;
    }
    c.rope_mscale = (float)((factor > 1 ? 0.1 * std::log(factor) + 1.0 : 1.0) *
                            get_float_or(f, key(c, "rope.scaling.attn_factor"), 1.f));
  } else if (c.rope_scaling != "none" && c.rope_scaling != "") {
    throw UnsupportedModelError("rope scaling '" + c.rope_scaling + "' is not supported yet");
  }
  const ArchTraits& t = *m->traits_;
  if (const gguf::Value* sec = f.get_array(key(c, "rope.dimension_sections"))) {
    if (sec->size() < 3 || sec->size() > 4) throw GGUFError("metadata: rope.dimension_sections must hold 3 or 4 values");
    int64_t sum = 0;
    for (size_t i = 0; i < sec->size(); ++i) {
      const int64_t v = (*sec)[i].as_int();
      if (v < 0 || v > (int64_t)1 << 20) throw GGUFError("metadata: rope.dimension_sections out of range");
      c.rope_sections[i] = (int)v;
      sum += v;
    }
    // Sections that do not fit the rotary pairs (Qwen3.5's default [11, 11, 10] written into a
    // narrower model) cannot place image rows; text rows are unaffected (one position for every
    // section is plain rope, as llama.cpp runs them), so such a file loads without M-RoPE.
    c.mrope = sum > 0 && sum <= c.n_rot / 2;
  }
  c.n_deepstack = get_int_or(f, key(c, "n_deepstack_layers"), 0);
  if (c.n_deepstack < 0 || c.n_deepstack > c.n_layers) throw GGUFError("metadata: n_deepstack_layers out of range");
  c.rope_base_swa = get_float_or(f, key(c, "rope.freq_base_swa"), t.default_rope_base_swa);
  if (c.rope_base_swa <= 0) c.rope_base_swa = c.rope_base;
  c.rope_freq_scale_swa = t.swa_rope_scaled ? c.rope_freq_scale : 1.f;
  c.sliding_window = get_int_or(f, key(c, "attention.sliding_window"), t.default_sliding_window);
  c.layer_is_swa.assign(c.n_layers, 0);
  if (const gguf::Value* v = f.find(key(c, "attention.sliding_window_pattern")); v && v->type == gguf::ValueType::ARRAY) {
    // A flag per layer (gemma4).
    if (v->size() != (size_t)c.n_layers)
      throw GGUFError("metadata: attention.sliding_window_pattern must have a flag per layer");
    for (int il = 0; il < c.n_layers; ++il) {
      const gguf::Value e = v->at((size_t)il);
      c.layer_is_swa[il] = c.sliding_window > 0 && (e.type == gguf::ValueType::BOOL ? e.as_bool() : e.as_int() != 0);
    }
  } else {
    int pattern = get_int_or(f, key(c, "attention.sliding_window_pattern"), t.swa_pattern);
    if (c.sliding_window > 0 && pattern > 0)
      for (int il = 0; il < c.n_layers; ++il) c.layer_is_swa[il] = (il % pattern) < (pattern - 1);
  }
  // Per-layer head dims, kv heads and rope dims: the sliding layers' own where the file gives them
  // (key_length_swa, rope.dimension_count_swa), else the model's.
  {
    const int hd_swa = get_int_or(f, key(c, "attention.key_length_swa"), c.head_dim);
    const int hdv_swa = get_int_or(f, key(c, "attention.value_length_swa"), hd_swa);
    const int rot_swa = get_int_or(f, key(c, "rope.dimension_count_swa"), c.n_rot == c.head_dim ? hd_swa : c.n_rot);
    c.l_head_dim.resize(c.n_layers), c.l_kv_heads = kv_heads, c.l_n_rot.resize(c.n_layers);
    c.n_kv_heads = 0;
    int max_hd = 0;
    for (int il = 0; il < c.n_layers; ++il) {
      const bool swa = c.layer_is_swa[il];
      const int hd = swa ? hd_swa : c.head_dim, hdv = swa ? hdv_swa : c.head_dim_v;
      const int kvh = kv_heads[il], rot = swa ? rot_swa : c.n_rot;
      if (kvh <= 0 || c.n_heads % kvh != 0 || hd <= 0 || hdv != hd)
        throw UnsupportedModelError("unsupported head layout: heads " + std::to_string(c.n_heads) + ", kv heads " +
                                    std::to_string(kvh) + ", head dims " + std::to_string(hd) + "/" +
                                    std::to_string(hdv) + " (layer " + std::to_string(il) + ")");
      if (rot <= 0 || rot > hd || rot % 2) throw GGUFError("metadata: bad rope.dimension_count");
      c.l_head_dim[il] = hd, c.l_n_rot[il] = rot;
      c.n_kv_heads = std::max(c.n_kv_heads, kvh);
      max_hd = std::max(max_hd, hd);
    }
    c.head_dim = c.head_dim_v = max_hd;
  }
  c.attn_softcap = get_float_or(f, key(c, "attn_logit_softcapping"), t.default_attn_softcap);
  c.final_softcap = get_float_or(f, key(c, "final_logit_softcapping"), t.default_final_softcap);
  const auto& big = t.attn_scale_dim_over_heads_at_layers;
  // 0: 1/sqrt of each layer's head dim (decoder.cpp).
  c.attn_scale = t.attn_unscaled ? 1.f
                 : std::find(big.begin(), big.end(), c.n_layers) != big.end() ? 1.f / std::sqrt((float)(c.dim / c.n_heads))
                                                                                : 0.f;
  c.ple_dim = get_int_or(f, key(c, "embedding_length_per_layer_input"), 0);

  c.n_expert = get_int_or(f, key(c, "expert_count"), 0);
  c.n_expert_used = get_int_or(f, key(c, "expert_used_count"), 0);
  c.expert_ffn_dim = get_int_or(f, key(c, "expert_feed_forward_length"), c.ffn_dim);
  c.shexp_ffn_dim = get_int_or(f, key(c, "expert_shared_feed_forward_length"), c.ffn_dim);
  {
    const gguf::Value* v = f.find(key(c, "expert_weights_norm"));
    c.moe_norm_topk = v && v->type == gguf::ValueType::BOOL ? v->as_int() != 0 : t.moe_norm_topk;
  }
  if (c.n_expert > 0 && (c.n_expert_used < 1 || c.n_expert_used > c.n_expert || c.expert_ffn_dim <= 0))
    throw GGUFError("metadata: bad expert counts (" + std::to_string(c.n_expert_used) + " used of " +
                    std::to_string(c.n_expert) + ", expert ffn " + std::to_string(c.expert_ffn_dim) + ")");

  // Recurrent layers: named by the file (recurrent_layers), or every layer but each
  // full_attention_interval-th when only the interval is given; none without ssm keys.
  c.ssm_conv_k = get_int_or(f, key(c, "ssm.conv_kernel"), 0);
  c.rec_slot.assign(c.n_layers, -1);
  c.kv_slot.assign(c.n_layers, -1);
  if (c.ssm_conv_k > 0) {
    c.ssm_dk = get_int_or(f, key(c, "ssm.state_size"), 0);
    c.ssm_nk = get_int_or(f, key(c, "ssm.group_count"), 0);
    c.ssm_nv = get_int_or(f, key(c, "ssm.time_step_rank"), 0);
    const int inner = get_int_or(f, key(c, "ssm.inner_size"), 0);
    if (c.ssm_conv_k > 65 || c.ssm_dk <= 0 || c.ssm_nk <= 0 || c.ssm_nv <= 0 || c.ssm_nv % c.ssm_nk != 0 ||
        inner <= 0 || inner % c.ssm_nv != 0)
      throw GGUFError("metadata: bad ssm shapes (conv_kernel " + std::to_string(c.ssm_conv_k) + ", state_size " +
                      std::to_string(c.ssm_dk) + ", group_count " + std::to_string(c.ssm_nk) + ", time_step_rank " +
                      std::to_string(c.ssm_nv) + ", inner_size " + std::to_string(inner) + ")");
    c.ssm_dv = inner / c.ssm_nv;
    c.ssm_conv_dim = 2 * (int64_t)c.ssm_nk * c.ssm_dk + inner;
    c.rec_state_floats = (int64_t)(c.ssm_conv_k - 1) * c.ssm_conv_dim + (int64_t)c.ssm_nv * c.ssm_dk * c.ssm_dv;
    std::vector<uint8_t> rec((size_t)c.n_layers, 0);
    if (const gguf::Value* v = f.find(key(c, "attention.recurrent_layers"))) {
      if (v->type != gguf::ValueType::ARRAY || v->size() < (size_t)c.n_layers)
        throw GGUFError("metadata: attention.recurrent_layers must be an array of a flag per layer");
      for (int il = 0; il < c.n_layers; ++il) {
        const gguf::Value e = v->at((size_t)il);
        rec[(size_t)il] = e.type == gguf::ValueType::BOOL ? e.as_bool() : e.as_int() != 0;
      }
    } else {
      const int every = get_int_or(f, key(c, "full_attention_interval"), 4);
      if (every <= 0) throw GGUFError("metadata: full_attention_interval must be positive");
      for (int il = 0; il < c.n_layers; ++il) rec[(size_t)il] = (il + 1) % every != 0;
    }
    for (int il = 0; il < c.n_layers; ++il)
      if (rec[(size_t)il]) c.rec_slot[(size_t)il] = c.n_rec_layers++;
  }
  // The last shared_kv_layers layers keep no cache: each attends over the last earlier layer of its
  // kind (sliding or global) that keeps one.
  const int n_shared = get_int_or(f, key(c, "attention.shared_kv_layers"), 0);
  if (n_shared >= c.n_layers) throw GGUFError("metadata: attention.shared_kv_layers must leave a layer with a cache");
  c.kv_src.resize(c.n_layers);
  for (int il = 0; il < c.n_layers; ++il) {
    c.kv_src[il] = il;
    if (il < c.n_layers - n_shared) continue;
    int src = -1;
    for (int j = c.n_layers - n_shared - 1; j >= 0 && src < 0; --j)
      if (c.layer_is_swa[j] == c.layer_is_swa[il] && c.rec_slot[j] < 0) src = j;
    if (src < 0 || c.l_head_dim[src] != c.l_head_dim[il] || c.l_kv_heads[src] != c.l_kv_heads[il])
      throw UnsupportedModelError("layer " + std::to_string(il) + " shares KV but no earlier layer of its kind has it");
    c.kv_src[il] = src;
  }
  for (int il = 0; il < c.n_layers; ++il)
    if (c.rec_slot[(size_t)il] < 0) c.kv_slot[(size_t)il] = c.kv_src[il] == il ? c.n_kv_layers++ : -2;
  for (int il = 0; il < c.n_layers; ++il)
    if (c.kv_slot[(size_t)il] == -2) c.kv_slot[(size_t)il] = c.kv_slot[(size_t)c.kv_src[il]];

  m->load_weights();  // shapes and types checked, sizes known; nothing resident yet
  if (dry_run) return m;
  // The tokenizer before the weights: its build's temporaries then never sit on top of them.
  m->tokenizer_ = load_tokenizer(f);
  // The header and metadata (the vocabulary's strings) are parsed and copied: their pages go
  // back now, not after the weights are resident (they would add to the load's peak).
  f.release(f.base(), (size_t)f.data_offset());
  m->make_resident();
  // End of generation: the declared ids plus the control tokens chat formats close turns with.
  for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
    if (auto v = f.get_int(k); v && *v >= 0 && *v < m->cfg_.vocab_size) m->eog_.push_back((int32_t)*v);
  for (const TurnEnd& t : turn_end_tokens()) {
    int32_t id = m->tokenizer_->token_to_id(t.text);
    if (id >= 0 && id < m->cfg_.vocab_size && m->tokenizer_->token_type(id) == TokenType::CONTROL &&
        std::find(m->eog_.begin(), m->eog_.end(), id) == m->eog_.end())
      m->eog_.push_back(id);
  }
  m->release_unread_pages();
  return m;
}

// After load only matrices read in place need the file's pages: the header, metadata,
// vectors (copied at load), packed matrices and the embedding table (get_rows pages in
// the rows it reads) go back to the page cache, so the process holds the file once.
void Model::release_unread_pages() {
  std::vector<const uint8_t*> in_place;
  auto keep = [&](const Weight& w) {
    if (!w.empty() && !w.host_done && !w.owned && w.host) in_place.push_back(w.host);
  };
  for (const Weight* w : matrices()) keep(*w);
  const gguf::File& f = *file_;
  f.release(f.base(), (size_t)f.data_offset());
  for (const gguf::TensorInfo& t : f.tensors()) {
    const uint8_t* p = f.tensor_data(t);
    if (std::find(in_place.begin(), in_place.end(), p) == in_place.end()) f.release(p, (size_t)t.nbytes);
  }
}

std::vector<float> Model::load_vector(const std::string& name, bool required, int64_t n) {
  const gguf::TensorInfo* ti = file_->find_tensor(name);
  if (!ti) {
    if (required) throw UnsupportedModelError("missing tensor '" + name + "'");
    return {};
  }
  int64_t ne = ti->n_elements();
  if (n >= 0 && ne != n)
    throw UnsupportedModelError("tensor '" + name + "' has " + std::to_string(ne) + " elements, expected " +
                                std::to_string(n));
  std::vector<float> v((size_t)ne);
  dequantize_row(ti->type, file_->tensor_data(*ti), v.data(), ne);
  return v;
}

bool Model::is_eog(int32_t id) const { return std::find(eog_.begin(), eog_.end(), id) != eog_.end(); }

Weight Model::load_matrix(const std::string& name, bool required, int64_t rows, int64_t cols) {
  const gguf::TensorInfo* ti = file_->find_tensor(name);
  if (!ti) {
    if (required) throw UnsupportedModelError("missing tensor '" + name + "'");
    return {};
  }
  // A 1-D tensor is a matrix of one row where one is asked for (qwen2moe's shared-expert gate).
  const int64_t ne1 = ti->ne.size() == 1 && rows == 1 ? 1 : ti->ne.size() == 2 ? ti->ne[1] : -1;
  if ((ti->ne.size() != 2 && ne1 != 1) || (cols >= 0 && ti->ne[0] != cols) || (rows >= 0 && ne1 != rows)) {
    std::string got;
    for (auto d : ti->ne) got += (got.empty() ? "" : "x") + std::to_string(d);
    throw UnsupportedModelError("tensor '" + name + "' has shape " + got + ", expected " + std::to_string(cols) +
                                "x" + std::to_string(rows));
  }
  const TypeTraits* tt = type_traits(ti->type);
  if (!tt || !tt->dequantizable)
    throw UnsupportedModelError("tensor '" + name + "' has unsupported type " + (tt ? tt->name : "?"));
  Weight w;
  w.type = ti->type;
  w.cols = ti->ne[0];
  w.rows = ne1;
  w.host = file_->tensor_data(*ti);
  w.row_bytes = (size_t)type_nbytes(ti->type, w.cols);
  const uint32_t want = backend_->weight_type(w.type, w.cols, mode_);
  if (want != w.type) {
    // A quantized format the backend has no kernel for is converted here, said once per load and type
    // (float matrices requantized by QuantMode are the documented default, not worth a line).
    const bool is_float = w.type == (uint32_t)GGMLType::F32 || w.type == (uint32_t)GGMLType::F16 ||
                          w.type == (uint32_t)GGMLType::BF16;
    if (!is_float && mode_ != QuantMode::fp32 && noticed_.insert(w.type).second) {
      const TypeTraits* from = type_traits(w.type);
      const TypeTraits* to = type_traits(want);
      std::fprintf(stderr, "dasllama: the %s backend has no %s kernel: those weights are converted to %s at load\n",
                   backend_->name(), from ? from->name : "?", to ? to->name : "?");
    }
  }
  // Converted later, one matrix at a time just before it is made resident, so a load
  // never holds every converted copy at once.
  if (!backend_->supports(Op::matmul, want)) {
    const TypeTraits* wt = type_traits(want);
    throw UnsupportedModelError("tensor '" + name + "': the " + backend_->name() + " backend has no matmul for " +
                                (wt ? wt->name : "?"));
  }
  return w;
}

Weight Model::load_experts(const std::string& name, bool required, int64_t n_expert, int64_t rows, int64_t cols) {
  const gguf::TensorInfo* ti = file_->find_tensor(name);
  if (!ti) {
    if (required) throw UnsupportedModelError("missing tensor '" + name + "'");
    return {};
  }
  if (ti->ne.size() != 3 || ti->ne[0] != cols || ti->ne[1] != rows || ti->ne[2] != n_expert) {
    std::string got;
    for (auto d : ti->ne) got += (got.empty() ? "" : "x") + std::to_string(d);
    throw UnsupportedModelError("tensor '" + name + "' has shape " + got + ", expected " + std::to_string(cols) + "x" +
                                std::to_string(rows) + "x" + std::to_string(n_expert));
  }
  // Each expert's rows are contiguous in the file: the stack is one matrix of n_expert * rows.
  Weight w;
  const TypeTraits* tt = type_traits(ti->type);
  if (!tt || !tt->dequantizable)
    throw UnsupportedModelError("tensor '" + name + "' has unsupported type " + (tt ? tt->name : "?"));
  w.type = ti->type;
  w.cols = cols;
  w.rows = n_expert * rows;
  w.expert_rows = rows;
  w.host = file_->tensor_data(*ti);
  w.row_bytes = (size_t)type_nbytes(ti->type, cols);
  const uint32_t want = backend_->weight_type(w.type, w.cols, mode_);
  if (!backend_->supports(Op::matmul, want)) {
    const TypeTraits* wt = type_traits(want);
    throw UnsupportedModelError("tensor '" + name + "': the " + backend_->name() + " backend has no matmul for " +
                                (wt ? wt->name : "?"));
  }
  return w;
}

void Model::load_weights() {
  const ModelConfig& c = cfg_;
  // The embedding table stays in its file format: rows are decoded on lookup.
  const gguf::TensorInfo* te = file_->find_tensor("token_embd.weight");
  if (!te) throw UnsupportedModelError("missing tensor 'token_embd.weight'");
  if (te->ne.size() != 2 || te->ne[0] != c.dim) throw UnsupportedModelError("token_embd.weight: bad shape");
  tok_embd_.type = te->type;
  tok_embd_.cols = te->ne[0];
  tok_embd_.rows = te->ne[1];
  tok_embd_.host = file_->tensor_data(*te);
  tok_embd_.row_bytes = (size_t)type_nbytes(te->type, te->ne[0]);
  const TypeTraits* tt = type_traits(te->type);
  if (!tt || !tt->dequantizable) throw UnsupportedModelError("token_embd.weight: unsupported type");
  cfg_.vocab_size = (int)tok_embd_.rows;

  if (!backend_->supports(Op::get_rows, te->type)) throw UnsupportedModelError("token_embd.weight: unsupported type");
  output_norm_ = upload(load_vector("output_norm.weight", true, c.dim));
  output_ = load_matrix("output.weight", false, c.vocab_size, c.dim);
  if (output_.empty()) output_ = load_matrix("token_embd.weight", true, c.vocab_size, c.dim);  // tied
  if (c.ple_dim > 0) {
    // Per-layer embeddings: a table read by rows as the token table is, and the projection of the
    // input embedding to n_layers x ple_dim.
    const int64_t W = (int64_t)c.n_layers * c.ple_dim;
    const gguf::TensorInfo* tp = file_->find_tensor("per_layer_token_embd.weight");
    if (!tp) throw UnsupportedModelError("missing tensor 'per_layer_token_embd.weight'");
    if (tp->ne.size() != 2 || tp->ne[0] != W || tp->ne[1] != c.vocab_size)
      throw UnsupportedModelError("per_layer_token_embd.weight: bad shape");
    const TypeTraits* pt = type_traits(tp->type);
    if (!pt || !pt->dequantizable || !backend_->supports(Op::get_rows, tp->type))
      throw UnsupportedModelError("per_layer_token_embd.weight: unsupported type");
    ple_embd_.type = tp->type;
    ple_embd_.cols = W;
    ple_embd_.rows = c.vocab_size;
    ple_embd_.host = file_->tensor_data(*tp);
    ple_embd_.row_bytes = (size_t)type_nbytes(tp->type, W);
    ple_model_proj_ = load_matrix("per_layer_model_proj.weight", true, W, c.dim);
    ple_proj_norm_ = upload(load_vector("per_layer_proj_norm.weight", true, c.ple_dim));
  }
  std::vector<float> rf = load_vector("rope_freqs.weight", false, c.n_rot / 2);
  if (rf.empty()) rf = load_vector("rope_factors_short.weight", false, c.n_rot / 2);
  rope_freqs_ = upload(rf);
  if (!c.rope_inv_freq.empty()) {
    rope_inv_freq_ = backend_->alloc(c.rope_inv_freq.size() * sizeof(double), "model weights");
    backend_->upload(rope_inv_freq_->data(), c.rope_inv_freq.data(), c.rope_inv_freq.size() * sizeof(double));
  }
  if (c.mrope) {
    // Pair i's axis, as ggml's rope_multi assigns it (sector = i mod the sections' sum): by runs
    // (t, then h, then w, then a 4th that ropes as t here: images are 2-D) or interleaved.
    const int half = c.n_rot / 2, *S = c.rope_sections, sum = S[0] + S[1] + S[2] + S[3];
    std::vector<double> tab[3];
    for (auto& v : tab) v.assign((size_t)half, 0.0);
    for (int i = 0; i < half; ++i) {
      const int sec = i % sum;
      int axis = 0;
      if (traits_->mrope_interleaved)
        axis = sec % 3 == 1 && sec < 3 * S[1] ? 1 : sec % 3 == 2 && sec < 3 * S[2] ? 2 : 0;
      else
        axis = sec < S[0] ? 0 : sec < S[0] + S[1] ? 1 : sec < S[0] + S[1] + S[2] ? 2 : 0;
      double fr = std::pow((double)c.rope_base, -2.0 * i / c.n_rot);
      if (!rf.empty()) fr /= rf[(size_t)i];
      tab[axis][(size_t)i] = c.rope_inv_freq.empty() ? fr : c.rope_inv_freq[(size_t)i];
    }
    for (int a = 0; a < 3; ++a) {
      mrope_inv_freq_[a] = backend_->alloc((size_t)half * sizeof(double), "model weights");
      backend_->upload(mrope_inv_freq_[a]->data(), tab[a].data(), (size_t)half * sizeof(double));
    }
  }

  layers_.resize(c.n_layers);
  for (int il = 0; il < c.n_layers; ++il) {
    LayerWeights& L = layers_[il];
    const int64_t hd = c.l_head_dim[il], q_dim = (int64_t)c.n_heads * hd, kv_dim = (int64_t)c.l_kv_heads[il] * hd;
    const int64_t F = c.l_ffn_dim[il];
    const bool own_kv = c.kv_src[il] == il;
    auto n = [&](const char* s) { return "blk." + std::to_string(il) + "." + s + ".weight"; };
    auto b = [&](const char* s) { return "blk." + std::to_string(il) + "." + s + ".bias"; };
    L.attn_norm = upload(load_vector(n("attn_norm"), true, c.dim));
    if (c.rec_slot[il] >= 0) {
      // A gated-DeltaNet layer in place of attention.
      const int64_t C = c.ssm_conv_dim, nv = c.ssm_nv, inner = (int64_t)nv * c.ssm_dv;
      L.ssm_qkv = load_matrix(n("attn_qkv"), true, C, c.dim);
      L.ssm_z = load_matrix(n("attn_gate"), true, inner, c.dim);
      L.ssm_alpha = load_matrix(n("ssm_alpha"), false, nv, c.dim);
      if (L.ssm_alpha.empty()) {
        // Qwen3-Next: one projection, per key head [beta of its nv/nk value heads | their alpha].
        L.ssm_ba = load_matrix(n("ssm_ba"), true, 2 * nv, c.dim);
      } else {
        L.ssm_beta = load_matrix(n("ssm_beta"), true, nv, c.dim);
      }
      L.ssm_out = load_matrix(n("ssm_out"), true, c.dim, inner);
      L.ssm_conv = upload(load_vector(n("ssm_conv1d"), true, C * c.ssm_conv_k));
      L.ssm_a = upload(load_vector("blk." + std::to_string(il) + ".ssm_a", true, nv));
      L.ssm_dt = upload(load_vector(b("ssm_dt"), true, nv));
      L.ssm_norm = upload(load_vector(n("ssm_norm"), true, c.ssm_dv));
    } else {
    const int64_t q_rows = traits_->attn_output_gate ? 2 * q_dim : q_dim;
    L.wqkv = own_kv ? load_matrix(n("attn_qkv"), false, q_rows + 2 * kv_dim, c.dim) : Weight{};
    if (L.wqkv.empty()) {
      // A layer that shares an earlier layer's KV has no K or V projection; a gemma4 global layer
      // may have no attn_v (its values are its keys' projection).
      L.wq = load_matrix(n("attn_q"), true, q_rows, c.dim);
      if (own_kv) {
        L.wk = load_matrix(n("attn_k"), true, kv_dim, c.dim);
        L.wv = load_matrix(n("attn_v"), !traits_->v_norm, kv_dim, c.dim);
      }
      L.bq = upload(load_vector(b("attn_q"), false, q_rows));
      L.bk = upload(load_vector(b("attn_k"), false, kv_dim));
      L.bv = upload(load_vector(b("attn_v"), false, kv_dim));
    }
    L.q_norm = upload(load_vector(n("attn_q_norm"), false, hd));
    if (own_kv) L.k_norm = upload(load_vector(n("attn_k_norm"), false, hd));
    L.wo = load_matrix(n("attn_output"), true, c.dim, q_dim);
    L.bo = upload(load_vector(b("attn_output"), false, c.dim));
    L.attn_sinks = upload(load_vector(n("attn_sinks"), false, c.n_heads));
    }
    const std::string& ffn_norm = traits_->ffn_norm_tensor;
    if (ffn_norm != "post_attention_norm")
      L.attn_post_norm = upload(load_vector(n("post_attention_norm"), false, c.dim));
    L.ffn_norm = upload(load_vector(n(ffn_norm.c_str()), true, c.dim));
    L.ffn_post_norm = upload(load_vector(n("post_ffw_norm"), false, c.dim));
    {
      const std::vector<float> sc = load_vector(n("layer_output_scale"), false, 1);
      if (!sc.empty()) L.out_scale = sc[0];
    }
    if (c.ple_dim > 0) {
      L.ple_gate = load_matrix(n("inp_gate"), true, c.ple_dim, c.dim);
      L.ple_proj = load_matrix(n("proj"), true, c.dim, c.ple_dim);
      L.ple_post_norm = upload(load_vector(n("post_norm"), true, c.dim));
    }
    if (c.n_expert > 0) L.router = load_matrix(n("ffn_gate_inp"), false, c.n_expert, c.dim);
    if (!L.router.empty()) {
      // A mixture-of-experts layer; the shared expert and the biases are found from the tensors.
      const int64_t E = c.n_expert, F = c.expert_ffn_dim;
      L.router_b = upload(load_vector(b("ffn_gate_inp"), false, E));
      L.gate_up_exps = load_experts(n("ffn_gate_up_exps"), false, E, 2 * F, c.dim);
      if (L.gate_up_exps.empty()) {
        L.gate_exps = load_experts(n("ffn_gate_exps"), true, E, F, c.dim);
        L.up_exps = load_experts(n("ffn_up_exps"), true, E, F, c.dim);
      }
      L.down_exps = load_experts(n("ffn_down_exps"), true, E, c.dim, F);
      L.gate_exps_b = upload(load_vector(b("ffn_gate_exps"), false, E * F));
      L.up_exps_b = upload(load_vector(b("ffn_up_exps"), false, E * F));
      L.down_exps_b = upload(load_vector(b("ffn_down_exps"), false, E * c.dim));
      L.router_shexp = load_matrix(n("ffn_gate_inp_shexp"), false, 1, c.dim);
      L.gate_shexp = load_matrix(n("ffn_gate_shexp"), !L.router_shexp.empty(), c.shexp_ffn_dim, c.dim);
      if (!L.gate_shexp.empty()) {
        L.up_shexp = load_matrix(n("ffn_up_shexp"), true, c.shexp_ffn_dim, c.dim);
        L.down_shexp = load_matrix(n("ffn_down_shexp"), true, c.dim, c.shexp_ffn_dim);
      }
      // gemma4: the router reads its own norm of the residual (a weight of scale / sqrt(dim)), the
      // routing weights take a per-expert scale, and a dense MLP runs beside the experts.
      const std::string pre = "blk." + std::to_string(il) + ".";
      std::vector<float> rs = load_vector(pre + "ffn_gate_inp.scale", false, c.dim);
      if (!rs.empty()) {
        for (float& v : rs) v /= std::sqrt((float)c.dim);
        L.router_in_norm = upload(rs);
      }
      std::vector<float> es = load_vector(pre + "ffn_down_exps.scale", false, E);
      if (!es.empty()) {
        L.exp_scale.type = (uint32_t)GGMLType::F32;
        L.exp_scale.rows = E, L.exp_scale.cols = 1, L.exp_scale.row_bytes = 4;
        L.exp_scale.owned = std::make_shared<std::vector<uint8_t>>((size_t)E * 4);
        std::memcpy(L.exp_scale.owned->data(), es.data(), (size_t)E * 4);
        L.exp_scale.host = L.exp_scale.owned->data();
      }
      L.ffn_pre_norm_2 = upload(load_vector(n("pre_ffw_norm_2"), false, c.dim));
      if (L.ffn_pre_norm_2.empty()) continue;
      L.ffn_post_norm_1 = upload(load_vector(n("post_ffw_norm_1"), true, c.dim));
      L.ffn_post_norm_2 = upload(load_vector(n("post_ffw_norm_2"), true, c.dim));
    }
    L.w_gate = load_matrix(n("ffn_gate"), false, F, c.dim);
    if (L.w_gate.empty()) {
      L.w_gate_up = load_matrix(n("ffn_up"), true, 2 * F, c.dim);  // phi3: gate | up
    } else {
      L.w_up = load_matrix(n("ffn_up"), true, F, c.dim);
    }
    L.w_down = load_matrix(n("ffn_down"), true, c.dim, F);
  }

  // Everything fits, or nothing is made resident: the sizes are known before any copy.
  // A tied output shares the embedding table's bytes when the backend kept the file's format.
  const bool tied_same = output_.host == tok_embd_.host &&
                         backend_->weight_type(output_.type, output_.cols, mode_) == tok_embd_.type;
  const std::vector<Weight*> mats = matrices();
  size_t total = tied_same ? 0 : (size_t)tok_embd_.rows * tok_embd_.row_bytes;
  for (const Weight* w : mats)
    total += (size_t)w->rows * (size_t)type_nbytes(backend_->weight_type(w->type, w->cols, mode_), w->cols);
  if (!ple_embd_.empty()) total += (size_t)ple_embd_.rows * ple_embd_.row_bytes;
  weight_bytes_ = total;
  embd_bytes_ = tied_same ? 0 : (size_t)tok_embd_.rows * tok_embd_.row_bytes;
}

std::vector<Weight*> Model::matrices() {
  std::vector<Weight*> mats = {&output_};
  for (LayerWeights& L : layers_)
    for (Weight* w : {&L.wq, &L.wk, &L.wv, &L.wqkv, &L.wo, &L.w_gate, &L.w_up, &L.w_gate_up, &L.w_down, &L.router,
                      &L.gate_exps, &L.up_exps, &L.down_exps, &L.gate_shexp, &L.up_shexp, &L.down_shexp,
                      &L.router_shexp, &L.ssm_qkv, &L.ssm_z, &L.ssm_alpha, &L.ssm_beta, &L.ssm_ba, &L.ssm_out,
                      &L.ple_gate, &L.ple_proj, &L.gate_up_exps})
      if (!w->empty()) mats.push_back(w);
  if (!ple_model_proj_.empty()) mats.push_back(&ple_model_proj_);
  return mats;
}

// Converts (one matrix at a time), packs or uploads every matrix; all or nothing fits.
void Model::make_resident() {
  const bool tied_same = output_.host == tok_embd_.host &&
                         backend_->weight_type(output_.type, output_.cols, mode_) == tok_embd_.type;
  const std::vector<Weight*> mats = matrices();
  backend_->check_fits(weight_bytes_, "model weights");
  for (Weight* w : mats) {
    const uint8_t* file_bytes = w->host;
    const size_t file_n = (size_t)w->rows * w->row_bytes;
    const uint32_t want = backend_->weight_type(w->type, w->cols, mode_);
    if (want != w->type)
      *w = convert(*w, want);
    else
      w->host_mapped = true;  // from the file mapping
    w->exact = mode_ == QuantMode::fp32;
    backend_->load_weight(*w, WeightUse::matmul);
    // What the backend copied (packed, uploaded) is not kept twice: a converted copy is
    // freed, and the file's pages go back to the page cache (a read faults them in again,
    // so the tied embedding table's get_rows stays correct: it pages in only its rows).
    if (w->host_done) {
      if (w->owned) {
        if (w->data == w->host) w->data = w->packed;  // never read: the backend reads its copy
        w->owned.reset();
        w->host = nullptr;
      }
      file_->release(file_bytes, file_n);
    } else if (w->owned) {
      file_->release(file_bytes, file_n);  // read once by the conversion
    }
  }
  if (tied_same && output_.data != output_.host) {
    tok_embd_.data = output_.data;  // the device copy the output matmul reads, in its layout
    tok_embd_.resident = output_.resident;
    tok_embd_.packed = output_.packed, tok_embd_.packed_owner = output_.packed_owner;
    tok_embd_.packed_for = output_.packed_for;
  } else {
    backend_->load_weight(tok_embd_, WeightUse::rows);
  }
  if (!ple_embd_.empty()) backend_->load_weight(ple_embd_, WeightUse::rows);
  for (LayerWeights& L : layers_)
    if (!L.exp_scale.empty()) backend_->load_weight(L.exp_scale, WeightUse::rows);
}

}  // namespace dl
