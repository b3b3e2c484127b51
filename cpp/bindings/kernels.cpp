// _f32_to_f16 / _f16_to_f32: the active ISA's KV-cache row conversions, for tests against numpy.
// (Matmul kernels are tested and timed through the backend: _core.Backend in bindings/backend.cpp.)
#include <pybind11/numpy.h>

#include "bindings/bind.h"
#include "cpu/kernels.h"

namespace dl::py_bind {

void bind_kernels(py::module_& m) {
  m.def(
      "_f32_to_f16",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> x) {
        py::array_t<uint16_t> out(x.size());
        cpu::kernels().f32_to_f16(x.data(), out.mutable_data(), (int64_t)x.size());
        return out;
      },
      py::arg("x"), "float32 values to f16 bits (round to nearest even) with the active ISA's cache-row kernel.");
  m.def(
      "_f16_to_f32",
      [](py::array_t<uint16_t, py::array::c_style | py::array::forcecast> h) {
        py::array_t<float> out(h.size());
        cpu::kernels().f16_to_f32(h.data(), out.mutable_data(), (int64_t)h.size());
        return out;
      },
      py::arg("h"), "f16 bits to float32 with the active ISA's cache-row kernel.");
}

}  // namespace dl::py_bind
