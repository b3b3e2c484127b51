// Tokenizer::from_gguf: reads tokenizer.ggml.* into a TokenizerConfig with llama.cpp's defaults for
// absent keys; the one builder load_model (through model.cpp's load_tokenizer, which adds the
// family's quirk from the registry) and the tests (_core.Tokenizer.from_gguf) use.
#include <algorithm>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "core/errors.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

namespace dl {

namespace {
std::vector<std::string> string_array(const gguf::File& f, const char* key, bool required) {
  std::vector<std::string> out;
  const gguf::Value* a = f.get_array(key);
  if (!a) {
    if (required) throw GGUFError(std::string("missing ") + key);
    return out;
  }
  out.reserve(a->size());
  for (const gguf::Value& v : *a) out.push_back(v.as_string());
  return out;
}
}  // namespace

std::shared_ptr<Tokenizer> Tokenizer::from_gguf(const gguf::File& f, bool spm_gemma) {
  TokenizerConfig c;
  auto model = f.get_string("tokenizer.ggml.model");
  if (!model) throw UnsupportedModelError("GGUF has no tokenizer (tokenizer.ggml.model missing)");
  c.model = *model;
  c.pre = f.get_string("tokenizer.ggml.pre").value_or("default");
  c.tokens = string_array(f, "tokenizer.ggml.tokens", true);
  c.merges = string_array(f, "tokenizer.ggml.merges", false);
  if (const auto* a = f.get_array("tokenizer.ggml.scores")) {
    c.scores.reserve(a->size());
    for (const gguf::Value& v : *a) c.scores.push_back((float)v.as_float());
  }
  if (const auto* a = f.get_array("tokenizer.ggml.token_type")) {
    c.types.reserve(a->size());
    for (const gguf::Value& v : *a) c.types.push_back((int32_t)v.as_int());
  }
  auto id = [&](const char* key) {
    auto v = f.get_int(key);
    // Out of range stays out of range (the constructor names it); absent is -1.
    return v ? (int32_t)std::min<int64_t>(std::max<int64_t>(*v, -2), INT32_MAX) : -1;
  };
  c.bos = id("tokenizer.ggml.bos_token_id");
  c.eos = id("tokenizer.ggml.eos_token_id");
  c.unk = id("tokenizer.ggml.unknown_token_id");
  c.pad = id("tokenizer.ggml.padding_token_id");
  // A SentencePiece vocabulary adds BOS and a space prefix unless the file says otherwise
  // (llama.cpp's defaults, which transformers follows).
  const bool spm = c.model == "llama" || c.model == "gemma4";
  c.add_bos = f.get_bool("tokenizer.ggml.add_bos_token").value_or(spm);
  c.add_eos = f.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
  c.add_space_prefix = f.get_bool("tokenizer.ggml.add_space_prefix").value_or(spm);
  c.gemma_style = spm && spm_gemma;
  auto tok = std::make_shared<Tokenizer>(std::move(c));
#if defined(__GLIBC__)
  // The config's many small strings are freed now; give their pages back to the system
  // rather than leave them resident in the heap for the model's lifetime.
  malloc_trim(0);
#endif
  return tok;
}

}  // namespace dl
