// Bindings for the mel front end and audio towers: numpy float32 in and out, GIL
// released while computing.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <memory>
#include <mutex>

#include "audio/mel.h"
#include "audio/tower.h"
#include "bindings/bind.h"
#include "core/errors.h"

namespace dl::py_bind {

namespace {

using Samples = py::array_t<float, py::array::c_style | py::array::forcecast>;

Samples mono(const py::object& o) {
  Samples a = Samples::ensure(o);
  if (!a) throw py::value_error("samples must be a float array");
  if (a.ndim() != 1) throw py::value_error("samples must be 1-D (16 kHz mono), got " + std::to_string(a.ndim()) + "-D");
  return a;
}

// One CPU backend for the free log_mel (serialized: the backend's buffers are shared).
Backend& shared_backend(std::unique_lock<std::mutex>& lock) {
  static std::mutex mu;
  static std::shared_ptr<Backend> be;
  lock = std::unique_lock<std::mutex>(mu);
  if (!be) be = make_cpu_backend(0);
  return *be;
}

}  // namespace

void bind_audio(py::module_& m) {
  m.def(
      "log_mel",
      [](const py::object& samples, int n_mel) {
        Samples x = mono(samples);
        const int64_t n = x.shape(0);
        if (n == 0) throw py::value_error("audio clip is empty");
        audio::MelBank bank(n_mel);
        const int64_t frames = audio::mel_chunks(n) * audio::kChunkFrames;
        py::array_t<float> out({(int64_t)n_mel, frames});
        float* o = out.mutable_data();
        const float* xp = x.data();
        {
          py::gil_scoped_release rel;
          audio::MelScratch s;
          audio::log_mel(bank, xp, n, s, o);
        }
        return out;
      },
      py::arg("samples"), py::arg("n_mel") = 80);

  m.def(
      "nemo_fbank",
      [](const py::object& samples, int n_mel) {
        Samples x = mono(samples);
        const int64_t n = x.shape(0);
        if (n < 2 * audio::kHop) throw py::value_error("audio clip is shorter than two hops (320 samples)");
        audio::FbankBank bank(n_mel);
        const int64_t frames = audio::fbank_frames(n);
        py::array_t<float> out({(int64_t)n_mel, frames});
        float* o = out.mutable_data();
        const float* xp = x.data();
        {
          py::gil_scoped_release rel;
          std::unique_lock<std::mutex> lock;
          Backend& be = shared_backend(lock);
          audio::MelScratch s;
          audio::nemo_fbank(be, bank, xp, n, s, o);
        }
        return out;
      },
      py::arg("samples"), py::arg("n_mel") = 80);

  py::class_<audio::AudioScratch, std::shared_ptr<audio::AudioScratch>>(m, "AudioScratch").def(py::init<>());

  py::class_<audio::AudioEncoder, std::shared_ptr<audio::AudioEncoder>>(m, "AudioEncoder")
      .def(py::init([](const std::string& path, int n_threads, const std::string& device) {
             py::gil_scoped_release rel;
             return audio::AudioEncoder::load(path, device, n_threads);
           }),
           py::arg("path"), py::arg("n_threads") = 0, py::arg("device") = "cpu")
      .def_property_readonly("device", [](audio::AudioEncoder& e) { return device_dict(e.backend().info()); })
      .def_static("probe_family",
                  [](const std::string& path) {
                    py::gil_scoped_release rel;
                    auto f = gguf::File::open(path);
                    return audio::AudioEncoder::probe_family(*f);
                  })
      .def_static("families",
                  [] {
                    py::dict d;  // name -> whether it projects into a decoder (a tower) or is a bare encoder
                    for (const audio::TowerFamily& f : audio::tower_families())
                      d[py::str(f.name)] = f.proj != audio::Projector::none;
                    return d;
                  },
                  "The audio families the registry serves: name -> True for a tower (a projector into a "
                  "decoder), False for a bare encoder.")
      .def_property_readonly("path", &audio::AudioEncoder::path)
      .def_property_readonly("config",
                             [](const audio::AudioEncoder& e) {
                               const audio::TowerConfig& c = e.config();
                               py::dict d;
                               d["family"] = c.family;
                               d["n_mel"] = c.n_mel;
                               d["dim"] = c.dim;
                               d["n_layers"] = c.n_layers;
                               d["n_heads"] = c.n_heads;
                               d["ffn_dim"] = c.ffn_dim;
                               d["n_pos"] = c.n_pos;
                               d["proj_dim"] = c.proj_dim;
                               d["stack"] = c.stack;
                               d["eps"] = c.eps;
                               d["full_window_default"] = c.full_window_default;
                               return d;
                             })
      .def("n_rows", &audio::AudioEncoder::n_rows, py::arg("n_samples"), py::arg("full_window"))
      .def(
          "encode",
          [](audio::AudioEncoder& e, const py::object& samples, bool full, audio::AudioScratch& s,
             py::array out) {
            Samples x = mono(samples);
            // Written in place, so no converting copy: the caller's own float32 buffer.
            if (!out.dtype().is(py::dtype::of<float>()) || !(out.flags() & py::array::c_style) || !out.writeable())
              throw py::value_error("out must be a writable C-contiguous float32 array");
            float* o = static_cast<float*>(out.mutable_data());
            const int64_t cap = out.size();
            const float* xp = x.data();
            const int64_t n = x.shape(0);
            py::gil_scoped_release rel;
            return e.encode(xp, n, full, s, o, cap);
          },
          py::arg("samples"), py::arg("full_window"), py::arg("scratch"), py::arg("out"))
      .def(
          "encode_mel_window",
          [](audio::AudioEncoder& e, py::array_t<float, py::array::c_style | py::array::forcecast> mel) {
            const audio::TowerConfig& c = e.config();
            if (mel.ndim() != 2 || mel.shape(0) != c.n_mel || mel.shape(1) != audio::kChunkFrames)
              throw py::value_error("mel must be (" + std::to_string(c.n_mel) + ", " +
                                    std::to_string(audio::kChunkFrames) + ") float32");
            py::array_t<float> out({(int64_t)audio::kChunkFrames / 2, (int64_t)c.dim});
            float* o = out.mutable_data();
            const float* m = mel.data();
            const int64_t cap = out.size();
            {
              py::gil_scoped_release rel;
              e.encode_mel_window(m, o, cap);
            }
            return out;
          },
          py::arg("mel"),
          "The encoder rows (1500 x dim, post-LN) of one 30 s window of log-mel features (n_mel x 3000).");
}

}  // namespace dl::py_bind
