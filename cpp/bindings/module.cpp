// The dasllama._core module: registers every area's bindings.
#include "bindings/bind.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "dasllama C++ core";
  dl::py_bind::bind_errors(m);
  dl::py_bind::bind_system(m);
  dl::py_bind::bind_quant(m);
  dl::py_bind::bind_gguf(m);
  dl::py_bind::bind_tokenizer(m);
  dl::py_bind::bind_model(m);
  dl::py_bind::bind_kv(m);
  dl::py_bind::bind_kernels(m);
  dl::py_bind::bind_audio(m);
  dl::py_bind::bind_vision(m);
  dl::py_bind::bind_asr(m);
  dl::py_bind::bind_backend(m);
}
