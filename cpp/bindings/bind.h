// One bind_* function per area; module.cpp calls them all.
#pragma once
#include <pybind11/pybind11.h>

#include "core/backend.h"

namespace dl::py_bind {
namespace py = pybind11;
void bind_errors(py::module_& m);
void bind_system(py::module_& m);
void bind_quant(py::module_& m);
void bind_gguf(py::module_& m);
void bind_tokenizer(py::module_& m);
void bind_model(py::module_& m);
void bind_kernels(py::module_& m);
void bind_kv(py::module_& m);
void bind_audio(py::module_& m);
void bind_vision(py::module_& m);
void bind_asr(py::module_& m);
void bind_backend(py::module_& m);
// A DeviceInfo as a dict (system_info, Model.device).
py::dict device_dict(const DeviceInfo& d);
}  // namespace dl::py_bind
