// dequantize / quantize / type_info over numpy arrays (flat; python/dasllama/quant.py shapes them).
#include <pybind11/numpy.h>

#include <string>

#include "bindings/bind.h"
#include "core/errors.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl::py_bind {

namespace {
const TypeTraits& traits_or_throw(uint32_t type_id) {
  const TypeTraits* t = type_traits(type_id);
  if (!t) throw py::value_error("unknown ggml type id " + std::to_string(type_id));
  return *t;
}
}  // namespace

void bind_quant(py::module_& m) {
  m.def(
      "dequantize",
      [](const py::array& data, uint32_t type_id, int64_t n) {
        const TypeTraits& t = traits_or_throw(type_id);
        if (!(data.flags() & py::array::c_style)) throw py::value_error("dequantize: data must be C-contiguous");
        if (n < 0) throw py::value_error("dequantize: n must be non-negative");
        if (n % t.block_size != 0)
          throw py::value_error("dequantize: " + std::to_string(n) + " elements is not a whole number of " + t.name +
                                " blocks (" + std::to_string(t.block_size) + ")");
        const int64_t need = n / t.block_size * t.type_size;
        if ((int64_t)data.nbytes() != need)
          throw py::value_error("dequantize: " + std::to_string(n) + " " + t.name + " elements take " +
                                std::to_string(need) + " bytes, got " + std::to_string(data.nbytes()));
        py::array_t<float> out(n);
        const void* src = data.data();
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          dl::dequantize_row(type_id, src, dst, n);
        }
        return out;
      },
      py::arg("data"), py::arg("type_id"), py::arg("n"),
      "Dequantize the raw bytes of n elements of a ggml type to a flat float32 array.");

  m.def(
      "quantize",
      [](const py::array_t<float, py::array::c_style | py::array::forcecast>& x, uint32_t type_id) {
        const TypeTraits& t = traits_or_throw(type_id);
        const int64_t n = (int64_t)x.size();
        if (n % t.block_size != 0)
          throw py::value_error("quantize: " + std::to_string(n) + " elements is not a whole number of " + t.name +
                                " blocks (" + std::to_string(t.block_size) + ")");
        py::array_t<uint8_t> out(n / t.block_size * t.type_size);
        const float* src = x.data();
        void* dst = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          dl::quantize_row(type_id, src, dst, n);
        }
        return out;
      },
      py::arg("x"), py::arg("type_id"), "Quantize a flat float32 array to the raw bytes of a ggml type.");

  m.def(
      "type_info",
      [](uint32_t type_id) {
        const TypeTraits& t = traits_or_throw(type_id);
        return py::make_tuple(std::string(t.name), t.block_size, t.type_size, t.dequantizable);
      },
      py::arg("type_id"), "(name, block_size, type_size, dequantizable) of a ggml type id.");
}

}  // namespace dl::py_bind
