// Bindings for speech recognition: the whisper decoder (teacher-forced logits and greedy
// decoding), numpy in and out, GIL released while computing.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "audio/conformer.h"
#include "audio/whisper_decoder.h"
#include "bindings/bind.h"

namespace dl::py_bind {

void bind_asr(py::module_& m) {
  using audio::ConformerCTC;
  using F32In = py::array_t<float, py::array::c_style | py::array::forcecast>;
  // (hidden rows, CTC logits) as numpy arrays of the rows the encoder wrote.
  auto outputs = [](ConformerCTC& e, int64_t rows, bool want_hidden, auto&& run) {
    const auto& c = e.config();
    py::array_t<float> hid(std::vector<int64_t>{want_hidden ? rows : 0, (int64_t)c.dim});
    py::array_t<float> lg(std::vector<int64_t>{rows, (int64_t)c.vocab});
    float* hp = want_hidden ? hid.mutable_data() : nullptr;
    float* lp = lg.mutable_data();
    {
      py::gil_scoped_release rel;
      run(hp, lp);
    }
    return py::make_tuple(hid, lg);
  };
  py::class_<ConformerCTC, std::shared_ptr<ConformerCTC>>(m, "ConformerCTC")
      .def(py::init([](const std::string& path, int n_threads, const std::string& device) {
             py::gil_scoped_release rel;
             return ConformerCTC::load(path, device, n_threads);
           }),
           py::arg("path"), py::arg("n_threads") = 0, py::arg("device") = "cpu")
      .def_static("probe",
                  [](const std::string& path) {
                    py::gil_scoped_release rel;
                    return ConformerCTC::probe(*gguf::File::open(path));
                  })
      .def_property_readonly("device", [](ConformerCTC& e) { return device_dict(e.backend().info()); })
      .def_property_readonly("path", &ConformerCTC::path)
      .def_property_readonly("config",
                             [](const ConformerCTC& e) {
                               const audio::ConformerConfig& c = e.config();
                               py::dict r;
                               r["n_mel"] = c.n_mel;
                               r["dim"] = c.dim;
                               r["n_layers"] = c.n_layers;
                               r["n_heads"] = c.n_heads;
                               r["ffn_dim"] = c.ffn_dim;
                               r["conv_kernel"] = c.conv_kernel;
                               r["subsampling_channels"] = c.sub_channels;
                               r["subsampling_convs"] = c.sub_convs;
                               r["vocab"] = c.vocab;
                               r["blank"] = c.blank;
                               r["eps"] = c.eps;
                               r["input_scale"] = c.input_scale;
                               r["activation"] = c.act_name;
                               return r;
                             })
      .def(
          "encode_features",
          [outputs](ConformerCTC& e, F32In feat, bool hidden) {
            if (feat.ndim() != 2 || feat.shape(0) != e.config().n_mel)
              throw py::value_error("features must be (" + std::to_string(e.config().n_mel) + ", frames) float32");
            const int64_t frames = feat.shape(1), rows = e.n_rows(frames);
            const float* p = feat.data();
            return outputs(e, rows, hidden, [&](float* hp, float* lp) { e.encode_features(p, frames, frames, hp, lp); });
          },
          py::arg("features"), py::arg("hidden") = false,
          "(hidden rows or an empty array, CTC logits) of features (n_mel, frames): every frame is read.")
      .def(
          "encode",
          [outputs](ConformerCTC& e, F32In x, bool hidden) {
            if (x.ndim() != 1) throw py::value_error("samples must be 1-D (16 kHz mono)");
            const int64_t n = x.shape(0);
            const int64_t rows = n < 2 * audio::kHop ? 0 : e.n_rows(ConformerCTC::clip_frames(n));
            const float* p = x.data();
            return outputs(e, rows, hidden, [&](float* hp, float* lp) { e.encode(p, n, hp, lp); });
          },
          py::arg("samples"), py::arg("hidden") = false,
          "(hidden rows or an empty array, CTC logits) of a 16 kHz mono clip through the NeMo front end.");

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
