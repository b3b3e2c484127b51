// Bindings for speech recognition: the whisper decoder (teacher-forced logits and greedy
// decoding), numpy in and out, GIL released while computing.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "audio/whisper_decoder.h"
#include "bindings/bind.h"

namespace dl::py_bind {

void bind_asr(py::module_& m) {
  using audio::WhisperDecoder;
  py::class_<WhisperDecoder, std::shared_ptr<WhisperDecoder>>(m, "WhisperDecoder")
      .def(py::init([](const std::string& path, int n_threads, const std::string& device) {
             py::gil_scoped_release rel;
             return WhisperDecoder::load(path, device, n_threads);
           }),
           py::arg("path"), py::arg("n_threads") = 0, py::arg("device") = "cpu")
      .def_static("probe",
                  [](const std::string& path) {
                    py::gil_scoped_release rel;
                    return WhisperDecoder::probe(*gguf::File::open(path));
                  })
      .def_property_readonly("device", [](WhisperDecoder& d) { return device_dict(d.backend().info()); })
      .def_property_readonly("config",
                             [](const WhisperDecoder& d) {
                               const audio::WhisperDecoderConfig& c = d.config();
                               py::dict r;
                               r["dim"] = c.dim;
                               r["n_layers"] = c.n_layers;
                               r["n_heads"] = c.n_heads;
                               r["ffn_dim"] = c.ffn_dim;
                               r["n_ctx"] = c.n_ctx;
                               r["vocab"] = c.vocab;
                               r["eps"] = c.eps;
                               return r;
                             })
      .def(
          "set_encoder",
          [](WhisperDecoder& d, py::array_t<float, py::array::c_style | py::array::forcecast> rows) {
            if (rows.ndim() != 2 || rows.shape(1) != d.config().dim)
              throw py::value_error("encoder rows must be (n, " + std::to_string(d.config().dim) + ") float32");
            const float* p = rows.data();
            const int64_t n = rows.shape(0);
            py::gil_scoped_release rel;
            d.set_encoder(p, n);
          },
          py::arg("rows"))
      .def(
          "forward",
          [](WhisperDecoder& d, py::array_t<int32_t, py::array::c_style | py::array::forcecast> ids, int64_t pos0,
             bool all_logits) {
            if (ids.ndim() != 1 || ids.shape(0) == 0) throw py::value_error("ids must be a non-empty 1-D array");
            const int64_t n = ids.shape(0), m = all_logits ? n : 1;
            py::array_t<float> out({m, (int64_t)d.config().vocab});
            float* o = out.mutable_data();
            const int32_t* p = ids.data();
            {
              py::gil_scoped_release rel;
              d.forward(p, n, pos0, all_logits, o);
            }
            return out;
          },
          py::arg("ids"), py::arg("pos0") = 0, py::arg("all_logits") = true,
          "Logits of the tokens fed at positions pos0..: (n, vocab) with all_logits, else (1, vocab).")
      .def(
          "greedy",
          [](WhisperDecoder& d, std::vector<int32_t> prompt, std::vector<int32_t> suppress,
             std::vector<int32_t> suppress_begin, int32_t eot, int max_new, int32_t no_timestamps,
             int32_t timestamp_begin, int max_initial_timestamp, int32_t no_speech_id, int sot_index,
             float temperature, uint64_t seed) {
            audio::GreedyOptions o;
            o.prompt = std::move(prompt);
            o.suppress = std::move(suppress);
            o.suppress_begin = std::move(suppress_begin);
            o.eot = eot;
            o.max_new = max_new;
            o.no_timestamps = no_timestamps;
            o.timestamp_begin = timestamp_begin;
            o.max_initial_timestamp = max_initial_timestamp;
            o.temperature = temperature;
            o.seed = seed;
            audio::GreedyResult r;
            {
              py::gil_scoped_release rel;
              r = d.greedy(o, no_speech_id, sot_index);
            }
            return py::make_tuple(r.tokens, r.sum_logprob, r.no_speech_prob);
          },
          py::arg("prompt"), py::arg("suppress"), py::arg("suppress_begin"), py::arg("eot"), py::arg("max_new"),
          py::arg("no_timestamps") = -1, py::arg("timestamp_begin") = 0, py::arg("max_initial_timestamp") = 50,
          py::arg("no_speech_id") = -1, py::arg("sot_index") = 0, py::arg("temperature") = 0.f,
          py::arg("seed") = 0,
          "Greedy tokens (sampled at temperature > 0, from a generator seeded by seed) after the prompt (without the end of text), their summed log-probability, and the "
          "no-speech probability.");
}

}  // namespace dl::py_bind
