// Fuzz harness for the GGUF reader: opens every path on argv, walks all metadata and
// tensors (touching each tensor's first and last byte). GGUFError is expected and
// counted; any other exception exits 2. Built under -fsanitize by tests/test_gguf_asan.py.
#include <cstdio>
#include <exception>

#include "core/errors.h"
#include "gguf/gguf.h"

namespace {

// Sums every element so the reads cannot be optimized away.
double walk(const dl::gguf::Value& v) {
  using dl::gguf::ValueType;
  double acc = 0;
  switch (v.type) {
    case ValueType::STRING:
      for (char c : v.str) acc += static_cast<unsigned char>(c);
      return acc;
    case ValueType::ARRAY:
      for (const dl::gguf::Value& e : v) acc += walk(e);
      return acc;
    case ValueType::BOOL: return v.num.b;
    default: return v.as_float();
  }
}

}  // namespace

int main(int argc, char** argv) {
  int ok = 0, rejected = 0;
  double sink = 0;
  for (int i = 1; i < argc; ++i) {
    try {
      auto f = dl::gguf::File::open(argv[i]);
      for (const auto& kv : f->metadata()) sink += walk(kv.value) + kv.key.size();
      for (const auto& t : f->tensors()) {
        const uint8_t* p = f->tensor_data(t);
        sink += p[0] + p[t.nbytes - 1] + static_cast<double>(t.n_elements());
        if (f->find_tensor(t.name) != &t) return 3;
      }
      f->get_int("general.alignment");
      ++ok;
    } catch (const dl::GGUFError&) {
      ++rejected;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unexpected exception: %s\n", argv[i], e.what());
      return 2;
    }
  }
  std::printf("ok %d rejected %d (%g)\n", ok, rejected, sink > 0 ? 1.0 : 0.0);
  return 0;
}
