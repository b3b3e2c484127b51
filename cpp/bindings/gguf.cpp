// _core.GGUFFile: the mmapped GGUF reader for Python (metadata, tensor infos, zero-copy bytes, dequantize).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings/bind.h"
#include "core/errors.h"
#include "gguf/gguf.h"
#include "quant/quant.h"
#include "quant/types.h"

namespace dl::py_bind {

namespace {

using gguf::File;
using gguf::Value;
using gguf::ValueType;

// Strings decode as UTF-8 with errors='replace' (metadata is meant to be UTF-8;
// a bad byte must not make the whole file unreadable). Raw bytes stay in C++.
py::object to_str(std::string_view s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

const char* numpy_dtype(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "<u1";
    case ValueType::INT8: return "<i1";
    case ValueType::UINT16: return "<u2";
    case ValueType::INT16: return "<i2";
    case ValueType::UINT32: return "<u4";
    case ValueType::INT32: return "<i4";
    case ValueType::UINT64: return "<u8";
    case ValueType::INT64: return "<i8";
    case ValueType::FLOAT32: return "<f4";
    case ValueType::FLOAT64: return "<f8";
    case ValueType::BOOL: return "?";
    default: return nullptr;
  }
}

py::object to_py(const Value& v) {
  switch (v.type) {
    case ValueType::UINT8: case ValueType::UINT16: case ValueType::UINT32: case ValueType::UINT64:
      return py::int_(v.num.u);
    case ValueType::INT8: case ValueType::INT16: case ValueType::INT32: case ValueType::INT64:
      return py::int_(v.num.i);
    case ValueType::FLOAT32: case ValueType::FLOAT64: return py::float_(v.num.f);
    case ValueType::BOOL: return py::bool_(v.num.b);
    case ValueType::STRING: return to_str(v.str);
    case ValueType::ARRAY: break;
  }
  if (v.elem_type == ValueType::STRING) {
    // Filled in place: 150k tokens convert in a few ms.
    PyObject* lst = PyList_New(static_cast<Py_ssize_t>(v.strs.size()));
    if (!lst) throw py::error_already_set();
    py::object keep = py::reinterpret_steal<py::object>(lst);
    for (size_t i = 0; i < v.strs.size(); ++i) PyList_SET_ITEM(lst, i, to_str(v.strs[i]).release().ptr());
    return keep;
  }
  if (v.elem_type == ValueType::ARRAY) {
    py::list out(v.arr.size());
    for (size_t i = 0; i < v.arr.size(); ++i) out[i] = to_py(v.arr[i]);
    return out;
  }
  // Numbers and bools: a numpy array (a copy, so it owns aligned memory and outlives the file).
  py::dtype dt(numpy_dtype(v.elem_type));
  py::array out(dt, std::vector<py::ssize_t>{static_cast<py::ssize_t>(v.n)}, std::vector<py::ssize_t>{});
  if (v.n) std::memcpy(out.mutable_data(), v.data, v.n * gguf::value_type_size(v.elem_type));
  return std::move(out);
}

const gguf::TensorInfo& tensor_or_keyerror(const File& f, const std::string& name) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) throw py::key_error("no tensor named '" + name + "' in " + f.path());
  return *t;
}

std::vector<py::ssize_t> numpy_shape(const gguf::TensorInfo& t) {
  return std::vector<py::ssize_t>(t.ne.rbegin(), t.ne.rend());  // outermost first, like gguf-py
}

}  // namespace

void bind_gguf(py::module_& m) {
  py::class_<File, std::shared_ptr<File>>(m, "GGUFFile", "A GGUF file mapped read-only and validated.")
      .def(py::init([](const std::string& path, bool join_splits) {
             py::gil_scoped_release nogil;
             return File::open(path, join_splits);
           }),
           py::arg("path"), py::arg("join_splits") = true,
           "A first split part (NAME-00001-of-0000N.gguf) joins its other parts; join_splits=False opens one "
           "file as it is.")
      .def_property_readonly("part_paths", [](const File& f) {
             std::vector<std::string> out;
             for (size_t i = 0; i < f.n_parts(); ++i) out.push_back(f.part_path(i));
             return out;
           },
           "The files this one is made of: [path] for a plain file, every part of a split in order.")
      .def_property_readonly("path", &File::path)
      .def_property_readonly("version", &File::version)
      .def_property_readonly("alignment", &File::alignment)
      .def_property_readonly("data_offset", &File::data_offset)
      .def_property_readonly("file_size", &File::file_size)
      .def("metadata", [](const File& f) {
             py::dict d;
             for (const gguf::KV& kv : f.metadata()) d[to_str(kv.key)] = to_py(kv.value);
             return d;
           },
           "Metadata as a dict: ints, floats, bools, str (UTF-8, errors='replace'); arrays of numbers or "
           "bools as 1-D numpy arrays (copies), arrays of strings or arrays as lists.")
      .def("get", [](const File& f, const std::string& key) -> py::object {
             const Value* v = f.find(key);
             return v ? to_py(*v) : py::none();
           },
           py::arg("key"), "One metadata value (converted like metadata()), or None.")
      .def("metadata_types", [](const File& f) {
             py::dict d;
             for (const gguf::KV& kv : f.metadata()) {
               const Value& v = kv.value;
               d[to_str(kv.key)] = py::make_tuple(static_cast<uint32_t>(v.type), static_cast<uint32_t>(v.elem_type));
             }
             return d;
           },
           "key -> (value type id, array element type id).")
      .def("tensors", [](const File& f) {
             py::list out;
             for (const gguf::TensorInfo& t : f.tensors())
               out.append(py::make_tuple(t.name, numpy_shape(t), t.type, f.part_data_offset(t.part) + t.offset,
                                         t.nbytes, t.part));
             return out;
           },
           "[(name, numpy shape (outermost first), ggml type id, absolute offset in its part's file, nbytes, "
           "split part index)] in file order.")
      .def("tensor_bytes", [](std::shared_ptr<File> f, const std::string& name) {
             const gguf::TensorInfo& t = tensor_or_keyerror(*f, name);
             // A view over the mapping; the array's base holds the File, so the map outlives it.
             py::array_t<uint8_t> a({static_cast<py::ssize_t>(t.nbytes)}, {1}, f->tensor_data(t), py::cast(f));
             a.attr("setflags")(py::arg("write") = false);  // mapped PROT_READ: a write would fault
             return a;
           },
           py::arg("name"), "The tensor's raw bytes as a read-only uint8 numpy view (no copy).")
      .def("dequantize", [](std::shared_ptr<File> f, const std::string& name) {
             const gguf::TensorInfo& t = tensor_or_keyerror(*f, name);
             const TypeTraits* tr = type_traits(t.type);
             if (!tr || !tr->dequantizable)
               throw UnsupportedModelError(std::string("no dequantizer for tensor type ") +
                                           (tr ? tr->name : std::to_string(t.type)) + " (tensor '" + name + "')");
             py::array_t<float> out(numpy_shape(t));
             float* dst = out.mutable_data();
             const uint8_t* src = f->tensor_data(t);
             const int64_t row = t.ne[0];
             const int64_t rows = t.n_elements() / row;
             const int64_t row_bytes = type_nbytes(t.type, row);
             {
               py::gil_scoped_release nogil;
               for (int64_t r = 0; r < rows; ++r) dequantize_row(t.type, src + r * row_bytes, dst + r * row, row);
             }
             return out;
           },
           py::arg("name"), "The tensor as float32, numpy shape (outermost first).");
  m.def("ggml_type_name", [](uint32_t id) -> py::object {
    const TypeTraits* t = type_traits(id);
    if (!t) return py::none();
    return py::str(t->name);
  });
}

}  // namespace dl::py_bind
