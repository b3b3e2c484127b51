// Bindings for vision towers: normalized pixels (numpy float32) in, rows out, GIL released
// while encoding.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>

#include "bindings/bind.h"
#include "core/errors.h"
#include "vision/tower.h"

namespace dl::py_bind {

void bind_vision(py::module_& m) {
  using Pixels = py::array_t<float, py::array::c_style | py::array::forcecast>;
  py::class_<vision::VisionEncoder, std::shared_ptr<vision::VisionEncoder>>(m, "VisionEncoder")
      .def(py::init([](const std::string& path, int n_threads, const std::string& device) {
             py::gil_scoped_release rel;
             return vision::VisionEncoder::load(path, device, n_threads);
           }),
           py::arg("path"), py::arg("n_threads") = 0, py::arg("device") = "cpu")
      .def_property_readonly("device", [](vision::VisionEncoder& e) { return device_dict(e.backend().info()); })
      .def_static("probe_family",
                  [](const std::string& path) {
                    py::gil_scoped_release rel;
                    auto f = gguf::File::open(path);
                    return vision::VisionEncoder::probe_family(*f);
                  })
      .def_static("families",
                  [] {
                    py::dict d;  // name -> whether its rows are one non-causal span in the decoder
                    for (const vision::VisionFamily& f : vision::vision_families()) d[py::str(f.name)] = f.non_causal;
                    return d;
                  })
      .def_property_readonly("path", &vision::VisionEncoder::path)
      .def_property_readonly("config",
                             [](const vision::VisionEncoder& e) {
                               const vision::VisionConfig& c = e.config();
                               py::dict d;
                               d["family"] = c.family;
                               d["non_causal"] = c.non_causal;
                               d["mrope"] = c.mrope;
                               d["n_wa_pattern"] = c.n_wa_pattern;
                               d["n_deepstack"] = c.n_deepstack;
                               d["window"] = c.window;
                               d["image_size"] = c.image_size;
                               d["patch_size"] = c.patch;
                               d["dim"] = c.dim;
                               d["n_layers"] = c.n_layers;
                               d["n_heads"] = c.n_heads;
                               d["ffn_dim"] = c.ffn_dim;
                               d["merge"] = c.merge;
                               d["proj_dim"] = c.proj_dim;
                               d["n_rows"] = c.n_rows;
                               d["eps"] = c.eps;
                               d["image_mean"] = std::vector<float>(c.mean, c.mean + 3);
                               d["image_std"] = std::vector<float>(c.std, c.std + 3);
                               return d;
                             })
      .def(
          "encode",
          [](vision::VisionEncoder& e, const py::object& pixels, py::array out) {
            Pixels x = Pixels::ensure(pixels);
            if (!x) throw py::value_error("pixels must be a float array");
            if (!out.dtype().is(py::dtype::of<float>()) || !(out.flags() & py::array::c_style) || !out.writeable())
              throw py::value_error("out must be a writable C-contiguous float32 array");
            float* o = static_cast<float*>(out.mutable_data());
            const int64_t cap = out.size();
            const float* xp = x.data();
            const int64_t n = x.size();
            py::gil_scoped_release rel;
            return e.encode(xp, n, o, cap);
          },
          py::arg("pixels"), py::arg("out"))
      .def(
          "encode_hw",
          [](vision::VisionEncoder& e, const py::object& pixels, py::array out) {
            Pixels x = Pixels::ensure(pixels);
            if (!x || x.ndim() != 3 || x.shape(0) != 3) throw py::value_error("pixels must be a float array 3 x H x W");
            if (!out.dtype().is(py::dtype::of<float>()) || !(out.flags() & py::array::c_style) || !out.writeable())
              throw py::value_error("out must be a writable C-contiguous float32 array");
            float* o = static_cast<float*>(out.mutable_data());
            const int64_t cap = out.size();
            const float* xp = x.data();
            const int H = (int)x.shape(1), W = (int)x.shape(2);
            py::gil_scoped_release rel;
            return e.encode_hw(xp, H, W, o, cap);
          },
          py::arg("pixels"), py::arg("out"));
}

}  // namespace dl::py_bind
