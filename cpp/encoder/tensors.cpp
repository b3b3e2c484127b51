#include "encoder/tensors.h"

#include "core/errors.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl::encoder {

std::string shape_str(const gguf::TensorInfo& t) {
  std::string s;
  for (auto d : t.ne) s += (s.empty() ? "" : "x") + std::to_string(d);
  return s;
}

const gguf::TensorInfo& need(const gguf::File& f, const std::string& name, const char* what) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) throw UnsupportedModelError(std::string(what) + ": missing tensor '" + name + "'");
  return *t;
}

void check_float_type(const gguf::TensorInfo& t, int64_t cols, const char* what) {
  const TypeTraits* tt = type_traits(t.type);
  if (!tt || !tt->dequantizable || cols % tt->block_size != 0)
    throw UnsupportedModelError(std::string(what) + ": tensor '" + t.name + "' has unsupported type " +
                                (tt ? tt->name : "?") + " for rows of " + std::to_string(cols));
}

std::vector<float> vec(const gguf::File& f, const std::string& name, int64_t n, const char* what, bool required) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) {
    if (required) throw UnsupportedModelError(std::string(what) + ": missing tensor '" + name + "'");
    return {};
  }
  if (t->n_elements() != n)
    throw UnsupportedModelError(std::string(what) + ": tensor '" + name + "' has shape " + shape_str(*t) +
                                ", expected " + std::to_string(n) + " elements");
  check_float_type(*t, n, what);
  std::vector<float> v((size_t)n);
  dequantize_row(t->type, f.tensor_data(*t), v.data(), n);
  return v;
}

Weight mat(const gguf::File& f, const std::string& name, int64_t rows, int64_t cols, const char* what,
           bool required) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) {
    if (required) throw UnsupportedModelError(std::string(what) + ": missing tensor '" + name + "'");
    return {};
  }
  int64_t c = 1;
  for (size_t i = 0; i + 1 < t->ne.size(); ++i) c *= t->ne[i];
  const int64_t r = t->ne.empty() ? 0 : t->ne.back();
  if (t->ne.size() < 2 || t->ne.size() > 4 || r <= 0 || c <= 0 || r > (1 << 20) || c > (1 << 20) ||
      (rows >= 0 && r != rows) || (cols >= 0 && c != cols))
    throw UnsupportedModelError(std::string(what) + ": tensor '" + name + "' has shape " + shape_str(*t) +
                                ", expected " + (cols >= 0 ? std::to_string(cols) : "*") + "x" +
                                (rows >= 0 ? std::to_string(rows) : "*"));
  check_float_type(*t, c, what);
  Weight w;
  w.type = t->type;
  w.rows = r;
  w.cols = c;
  w.row_bytes = (size_t)type_nbytes(t->type, c);
  w.host = f.tensor_data(*t);
  // A tower's float matrices keep f32 activations on every backend (a GPU's f16 matmuls then
  // split x in two halves rather than rounding it to f16 once, as a q8-mode decoder's do), so
  // its rows match the CPU's within float sums, as the tower tests hold them (1e-9); quantized
  // ones round x to 8-bit blocks alike everywhere.
  const auto ty = static_cast<GGMLType>(t->type);
  w.exact = ty == GGMLType::F32 || ty == GGMLType::F16 || ty == GGMLType::BF16;
  return w;
}

Layer load_layer(Backend& be, const gguf::File& f, const std::string& prefix, int64_t d, int64_t& ffn_dim,
                 const char* what) {
  auto up = [&](const char* name, int64_t n, bool required = true) {
    return upload_vec(be, vec(f, prefix + name, n, what, required), what);
  };
  auto m = [&](const char* name, int64_t rows, int64_t cols) { return mat(f, prefix + name, rows, cols, what); };
  Layer L;
  L.ln1_w = up("ln1.weight", d), L.ln1_b = up("ln1.bias", d);
  L.ln2_w = up("ln2.weight", d), L.ln2_b = up("ln2.bias", d);
  L.wq = m("attn_q.weight", d, d), L.wk = m("attn_k.weight", d, d);
  L.wv = m("attn_v.weight", d, d), L.wo = m("attn_out.weight", d, d);
  L.bq = up("attn_q.bias", d), L.bk = up("attn_k.bias", d, false);
  L.bv = up("attn_v.bias", d), L.bo = up("attn_out.bias", d);
  L.w_up = m("ffn_up.weight", ffn_dim, d);
  if (L.w_up.rows > 1 << 18) throw UnsupportedModelError(std::string(what) + ": ffn width out of range");
  ffn_dim = L.w_up.rows;
  L.w_down = m("ffn_down.weight", d, ffn_dim);
  L.b_up = up("ffn_up.bias", ffn_dim), L.b_down = up("ffn_down.bias", d);
  return L;
}

int meta_int(const gguf::File& f, const std::string& key, int def) {
  const gguf::Value* v = f.find(key);
  if (!v) return def;
  const int64_t x = v->as_int();
  if (x < 0 || x > (1 << 20)) throw GGUFError("metadata '" + key + "' out of range: " + std::to_string(x));
  return (int)x;
}

}  // namespace dl::encoder
