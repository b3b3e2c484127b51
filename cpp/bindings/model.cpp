// Bindings for models, sessions, evaluation, sampling and generation. Compute
// runs with the GIL released; logits cross as numpy views of session memory.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>

#include "bindings/bind.h"
#include "core/errors.h"
#include "kv/pool.h"
#include "model/model.h"
#include "model/session.h"
#include "model/stepper.h"

namespace dl::py_bind {

namespace {

SamplingParams params_from(const py::object& o) {
  SamplingParams p;
  if (o.is_none()) return p;
  p.temp = o.attr("temp").cast<float>();
  p.top_k = o.attr("top_k").cast<int>();
  p.top_p = o.attr("top_p").cast<float>();
  p.min_p = o.attr("min_p").cast<float>();
  p.repeat_penalty = o.attr("repeat_penalty").cast<float>();
  p.penalty_last_n = o.attr("penalty_last_n").cast<int>();
  p.presence_penalty = o.attr("presence_penalty").cast<float>();
  p.frequency_penalty = o.attr("frequency_penalty").cast<float>();
  p.seed = o.attr("seed").cast<int64_t>();
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) throw py::value_error("top_p must be in (0, 1]");
  if (p.min_p < 0.f || p.min_p > 1.f) throw py::value_error("min_p must be in [0, 1]");
  if (p.top_k < 0) throw py::value_error("top_k must be >= 0");
  if (!(p.repeat_penalty > 0.f)) throw py::value_error("repeat_penalty must be > 0");
  return p;
}

std::vector<int32_t> ids_from(const Model& m, const std::vector<int64_t>& ids) {
  std::vector<int32_t> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= m.config().vocab_size)
      throw py::value_error("token id " + std::to_string(ids[i]) + " out of range [0, " +
                            std::to_string(m.config().vocab_size) + ")");
    out[i] = (int32_t)ids[i];
  }
  return out;
}

py::dict config_dict(const Model& m) {
  const ModelConfig& c = m.config();
  py::dict d;
  d["arch"] = c.arch;
  d["dim"] = c.dim;
  d["n_layers"] = c.n_layers;
  d["n_heads"] = c.n_heads;
  d["n_kv_heads"] = c.n_kv_heads;
  d["head_size"] = c.head_dim;
  d["ffn_dim"] = c.ffn_dim;
  d["vocab_size"] = c.vocab_size;
  d["seq_len"] = c.seq_len;
  d["norm_eps"] = c.norm_eps;
  d["n_deepstack"] = c.n_deepstack;
  d["rope_sections"] = c.mrope ? std::vector<int>(c.rope_sections, c.rope_sections + 4) : std::vector<int>{};
  d["n_rot"] = c.n_rot;
  d["rope_base"] = c.rope_base;
  d["rope_base_swa"] = c.rope_base_swa;
  d["rope_freq_scale"] = c.rope_freq_scale;
  d["rope_scaling"] = c.rope_scaling;
  d["sliding_window"] = c.sliding_window;
  d["attn_softcap"] = c.attn_softcap;
  d["final_softcap"] = c.final_softcap;
  return d;
}

}  // namespace

void bind_model(py::module_& m) {
  m.def("registered_archs", &registered_archs,
        "The general.architecture names the family registry serves (model/arch.cpp and the family files).");
  m.def("estimate_memory",
        [](const std::string& path, int mode, const std::string& device, int64_t n_ctx, int kv) {
          if (mode < 0 || mode > 2) throw py::value_error("mode must be QuantMode.fp32, q8 or q4_0");
          if (kv != 0 && kv != 1 && kv != 8) throw py::value_error("kv_dtype must be f32, f16 or q8_0");
          Model::MemoryEstimate e;
          {
            py::gil_scoped_release rel;
            e = Model::estimate(path, (QuantMode)mode, device, n_ctx, (KVType)kv);
          }
          py::dict d;
          d["weights"] = e.weights;
          d["embd_table"] = e.embd_table;
          d["kv"] = e.kv;
          d["scratch"] = e.scratch;
          d["total"] = e.total;
          d["available"] = e.available;
          return d;
        },
        py::arg("path"), py::arg("mode") = 1, py::arg("device") = "cpu", py::arg("n_ctx") = 4096,
        py::arg("kv_dtype") = 1);
  py::class_<Model, std::shared_ptr<Model>>(m, "Model")
      .def(py::init([](const std::string& path, int mode, const std::string& device, int n_threads) {
             if (mode < 0 || mode > 2) throw py::value_error("mode must be QuantMode.fp32, q8 or q4_0");
             py::gil_scoped_release rel;
             return Model::load(path, (QuantMode)mode, device, n_threads);
           }),
           py::arg("path"), py::arg("mode") = 1, py::arg("device") = "cpu", py::arg("n_threads") = 0)
      .def_property_readonly("device", [](const Model& x) { return device_dict(x.backend().info()); })
      .def_property_readonly("weight_bytes", &Model::weight_bytes)
      .def_property_readonly("fused_layers", &Model::fused_layers)
      .def_property_readonly("fused_ops", &Model::fused_ops)
      .def("path_count", &Model::path_count, py::arg("name"))
      .def_property_readonly("parted_logits", &Model::parted_logits)
      .def_property_readonly("speculated_steps", &Model::speculated_steps)
      .def_property_readonly("speculation_pending", &Model::speculation_pending)
      .def_property_readonly("config", &config_dict)
      .def_property_readonly("arch", [](const Model& x) { return x.config().arch; })
      .def_property_readonly("n_threads", [](Model& x) { return x.backend().info().threads; })
      .def_property_readonly("eog_ids", [](const Model& x) { return x.eog_ids(); })
      .def_property_readonly("bos", [](const Model& x) { return x.tokenizer().bos(); })
      // What the chat layer renders with, read from the mapped file (not a re-read of it):
      // tokenizer.chat_template (None when absent) and the bos / eos token texts ("" when unset).
      .def_property_readonly("chat_meta", [](const Model& x) {
        const gguf::File& f = x.file();
        auto text = [](std::string_view s) {
          PyObject* o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "replace");
          if (!o) throw py::error_already_set();
          return py::reinterpret_steal<py::object>(o);
        };
        const gguf::Value* toks = f.get_array("tokenizer.ggml.tokens");
        auto tok = [&](const char* key) -> py::object {
          const gguf::Value* v = f.find(key);
          if (!v || !v->is_int() || !toks) return py::str("");
          const int64_t i = v->as_int();
          if (i < 0 || i >= (int64_t)toks->strs.size()) return py::str("");
          return text(toks->strs[(size_t)i]);
        };
        const gguf::Value* t = f.find("tokenizer.chat_template");
        py::dict d;
        d["template"] = t && t->type == gguf::ValueType::STRING ? text(t->str) : py::none();
        d["bos"] = tok("tokenizer.ggml.bos_token_id");
        d["eos"] = tok("tokenizer.ggml.eos_token_id");
        return d;
      })
      .def("encode",
           [](const Model& x, const std::string& text, bool add_special, bool parse_special) {
             py::gil_scoped_release rel;
             return x.tokenizer().encode(text, add_special, parse_special);
           },
           py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = false)
      .def("decode",
           [](const Model& x, const std::vector<int64_t>& ids, bool special) {
             auto v = ids_from(x, ids);
             // Lenient, as the tokenizer's binding: ids that split a character (a random model's
             // output, a truncated reply) give U+FFFD, not UnicodeDecodeError.
             const std::string s = x.tokenizer().decode(v, special);
             PyObject* o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "replace");
             if (!o) throw py::error_already_set();
             return py::reinterpret_steal<py::str>(o);
           },
           py::arg("ids"), py::arg("special") = false)
      .def("piece",
           [](const Model& x, int64_t id) {
             auto v = ids_from(x, {id});
             return py::bytes(std::string(x.tokenizer().piece(v[0])));
           })
      .def("render",  // what the token adds to decode(): "" for a skipped special unless special
           [](const Model& x, int64_t id, bool special) {
             auto v = ids_from(x, {id});
             return py::bytes(std::string(x.tokenizer().render(v[0], special)));
           },
           py::arg("id"), py::arg("special") = false)
      .def("token_text", [](const Model& x, int64_t id) { return x.tokenizer().token_text(ids_from(x, {id})[0]); })
      .def("embed",
           [](Model& x, const std::string& text) {
             std::vector<float> v;
             {
               py::gil_scoped_release rel;
               auto ids = x.tokenizer().encode(text, true, false);
               v = x.embed_mean(ids);
             }
             return py::array_t<float>((py::ssize_t)v.size(), v.data());
           })
      .def("embed_tokens", [](Model& x, const std::vector<int64_t>& ids) {
        auto v = ids_from(x, ids);
        py::array_t<float> out({(py::ssize_t)v.size(), (py::ssize_t)x.config().dim});
        float* dst = out.mutable_data();
        {
          py::gil_scoped_release rel;
          x.embed_tokens(v.data(), (int64_t)v.size(), dst);
        }
        return out;
      });

  py::class_<Session, std::shared_ptr<Session>>(m, "Session")
      .def(py::init([](std::shared_ptr<Model> model, int kv, int n_ctx) {
             if (!model) throw py::value_error("Session needs a model");
             if (kv != 0 && kv != 1 && kv != 8) throw py::value_error("kv_dtype must be KVDtype.f32, f16 or q8_0");
             return std::make_shared<Session>(model, (KVType)kv, n_ctx);
           }),
           py::arg("model"), py::arg("kv_dtype") = 1, py::arg("n_ctx") = 0)
      .def(py::init([](std::shared_ptr<Model> model, std::shared_ptr<KVPool> pool, int n_ctx) {
             if (!model) throw py::value_error("Session needs a model");
             if (!pool) throw py::value_error("Session needs a pool");
             return std::make_shared<Session>(model, pool, n_ctx);
           }),
           py::arg("model"), py::arg("pool"), py::arg("n_ctx") = 0)
      .def_property_readonly("paged", [](const Session& s) { return s.kv().paged(); })
      .def_property_readonly("n_pages", [](const Session& s) { return s.kv().paged() ? s.kv().n_pages() : 0; })
      .def_property_readonly("n_past", &Session::n_past)
      .def_property_readonly("n_ctx", &Session::n_ctx)
      .def_property_readonly("kv_dtype", [](const Session& s) { return (int)s.kv_type(); })
      .def_property_readonly("history", [](const Session& s) { return s.history; })
      // M-RoPE marks [(position, delta)]: settable to restore them after a prefix attach.
      .def_property(
          "rope_marks", [](const Session& s) { return s.rope_marks; },
          [](Session& s, const std::vector<std::pair<int64_t, int64_t>>& v) {
            for (size_t i = 0; i < v.size(); ++i)
              if (v[i].first < 0 || v[i].first > s.n_past() || (i > 0 && v[i].first <= v[i - 1].first) ||
                  v[i].first + v[i].second < 0)
                throw py::value_error("rope_marks: ascending positions within the session, rope positions >= 0");
            s.rope_marks = v;
          })
      .def_property_readonly("logits",
                             [](py::object self) {
                               Session& s = self.cast<Session&>();
                               // A view of the session's buffer: valid until the next eval.
                               std::vector<float>& lg = s.logits_ready();
                               return py::array_t<float>({(py::ssize_t)lg.size()}, {sizeof(float)}, lg.data(),
                                                         self);
                             })
      .def("truncate", &Session::truncate)
      .def("rewind_point", &Session::rewind_point)
      .def("stats",
           [](const Session& s) {
             py::dict d;
             d["n_prompt"] = s.stats.n_prompt;
             d["n_gen"] = s.stats.n_gen;
             d["ttft_s"] = s.stats.ttft_s;
             d["prefill_tps"] = s.stats.prefill_tps;
             d["gen_tps"] = s.stats.gen_tps;
             return d;
           })
      .def("set_seed", [](Session& s, int64_t seed) { s.rng.reseed((uint64_t)seed); });

  m.def("eval",
        [](Session& s, const std::vector<int64_t>& tokens, bool all_logits) {
          auto v = ids_from(s.model(), tokens);
          py::gil_scoped_release rel;
          s.model().forward(s, v.data(), nullptr, (int64_t)v.size(), all_logits);
        },
        py::arg("session"), py::arg("tokens"), py::arg("all_logits") = false);
  // Ragged step: session b takes counts[b] tokens (in order) from tokens; counts
  // omitted means one token each (a plain decode step).
  m.def("eval_batch",
        [](std::vector<std::shared_ptr<Session>> sessions, const std::vector<int64_t>& tokens,
           std::vector<int64_t> counts, bool greedy) -> py::object {
          if (counts.empty()) counts.assign(sessions.size(), 1);
          if (counts.size() != sessions.size())
            throw py::value_error("eval_batch: " + std::to_string(sessions.size()) + " sessions but " +
                                  std::to_string(counts.size()) + " token groups");
          int64_t total = 0;
          for (int64_t c : counts) {
            if (c < 1) throw py::value_error("eval_batch: every session needs at least one token");
            total += c;
          }
          if (total != (int64_t)tokens.size())
            throw py::value_error("eval_batch: " + std::to_string(tokens.size()) + " tokens but the groups hold " +
                                  std::to_string(total));
          if (sessions.empty()) return greedy ? py::object(py::list()) : py::object(py::none());
          std::vector<Session*> ptrs;
          for (auto& s : sessions) {
            if (!s) throw py::value_error("eval_batch: None in sessions");
            ptrs.push_back(s.get());
          }
          Model& model = ptrs[0]->model();
          auto ids = ids_from(model, tokens);
          std::vector<int32_t> next(greedy ? ptrs.size() : 0);
          {
            py::gil_scoped_release rel;
            model.forward_ragged(ptrs.data(), ids.data(), counts.data(), (int64_t)ptrs.size(),
                                 greedy ? next.data() : nullptr);
          }
          if (!greedy) return py::none();
          return py::cast(next);
        },
        py::arg("sessions"), py::arg("tokens"), py::arg("counts") = std::vector<int64_t>{},
        py::arg("greedy") = false);
  m.def("eval_embd",
        [](Session& s, py::array_t<float, py::array::c_style | py::array::forcecast> embd, int64_t npos,
           const std::vector<int64_t>& ids, int64_t span_lo, int64_t span_hi) {
          const int64_t D = s.model().config().dim;
          const int64_t D_vocab = s.model().config().vocab_size;
          if (npos < 0 || embd.size() < npos * D)
            throw py::value_error("embd holds " + std::to_string(embd.size()) + " floats; npos x dim = " +
                                  std::to_string(npos * D));
          std::vector<int32_t> mid;
          if (!ids.empty()) {
            if ((int64_t)ids.size() != npos)
              throw py::value_error("eval_embd: " + std::to_string(ids.size()) + " media ids for " +
                                    std::to_string(npos) + " rows");
            for (int64_t v : ids) {
              if (v >= D_vocab || v < INT32_MIN)
                throw py::value_error("eval_embd: row ids are negative media ids or token ids below the vocab size");
              mid.push_back((int32_t)v);
            }
          }
          const float* p = embd.data();
          if (span_lo < 0 || span_hi < span_lo || span_hi > npos)
            throw py::value_error("eval_embd: span [" + std::to_string(span_lo) + ", " + std::to_string(span_hi) +
                                  ") is not within the " + std::to_string(npos) + " rows");
          py::gil_scoped_release rel;
          s.model().forward(s, nullptr, p, npos, false, mid.empty() ? nullptr : mid.data(), span_lo, span_hi);
        },
        py::arg("session"), py::arg("embd"), py::arg("npos"), py::arg("ids") = std::vector<int64_t>{},
        py::arg("span_lo") = 0, py::arg("span_hi") = 0);
  m.def("eval_embd_mrope",
        [](Session& s, py::array_t<float, py::array::c_style | py::array::forcecast> embd, int64_t npos,
           const std::vector<int64_t>& ids, int64_t lo, int64_t hi, int grid_h, int grid_w, bool non_causal,
           int64_t first_row, std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> deep) {
          const int64_t D = s.model().config().dim;
          const int K = s.model().config().n_deepstack;
          const float* dp = nullptr;
          if (deep) {
            if (K == 0) throw py::value_error("eval_embd_span_mrope: the model takes no deepstack rows");
            if (deep->size() != npos * K * D)
              throw py::value_error("deepstack holds " + std::to_string(deep->size()) + " floats; npos x " +
                                    std::to_string(K) + " x dim = " + std::to_string(npos * K * D));
            dp = deep->data();
          }
          if (npos < 0 || embd.size() < npos * D)
            throw py::value_error("embd holds " + std::to_string(embd.size()) + " floats; npos x dim = " +
                                  std::to_string(npos * D));
          std::vector<int32_t> mid;
          if (!ids.empty()) {
            if ((int64_t)ids.size() != npos)
              throw py::value_error("eval_embd_span_mrope: " + std::to_string(ids.size()) + " ids for " +
                                    std::to_string(npos) + " rows");
            for (int64_t v : ids) {
              if (v >= s.model().config().vocab_size || v < INT32_MIN)
                throw py::value_error("eval_embd_span_mrope: row ids are negative media ids or token ids below the vocab size");
              mid.push_back((int32_t)v);
            }
          }
          const float* p = embd.data();
          py::gil_scoped_release rel;
          s.model().forward_mrope(s, p, npos, mid.empty() ? nullptr : mid.data(), lo, hi, grid_h, grid_w, non_causal,
                                  first_row, dp);
        },
        py::arg("session"), py::arg("embd"), py::arg("npos"), py::arg("ids"), py::arg("span_lo"), py::arg("span_hi"),
        py::arg("grid_h"), py::arg("grid_w"), py::arg("non_causal") = false, py::arg("first_row") = 0,
        py::arg("deep") = py::none());
  // Draws from given logits, `n` times in one call with one generator (tests check the sampler's
  // distribution against a reference; not part of the public API).
  m.def(
      "sample_logits",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits, py::object params, uint64_t seed,
         int64_t n, std::vector<int32_t> history) {
        if (logits.ndim() != 1 || logits.size() < 1) throw py::value_error("sample_logits: logits must be 1-D, non-empty");
        if (n < 1) throw py::value_error("sample_logits: n must be >= 1");
        SamplingParams p = params_from(params);
        Rng rng(seed);
        std::vector<float> scratch;
        std::vector<int32_t> out((size_t)n);
        const float* l = logits.data();
        const int32_t V = (int32_t)logits.size();
        {
          py::gil_scoped_release rel;
          for (auto& t : out) t = sample_token(l, V, p, history, rng, scratch);
        }
        return out;
      },
      py::arg("logits"), py::arg("params"), py::arg("seed") = 0x5eed, py::arg("n") = 1,
      py::arg("history") = std::vector<int32_t>());
  m.def("sample", [](Session& s, py::object params) {
    if (!s.has_logits()) throw py::value_error("sample: no logits yet (eval first)");
    SamplingParams p = params_from(params);
    if (p.seed >= 0) s.rng.reseed((uint64_t)p.seed);
    const int V = s.model().config().vocab_size;
    return sample_token(s.last_logits(V), V, p, s.history, s.rng, s.sample_scratch);
  });
  m.def("generate",
        [](Session& s, const std::vector<int64_t>& prompt, py::object params, int64_t max_tokens,
           std::function<bool(int32_t, py::bytes)> cb, std::optional<std::vector<int64_t>> stop_ids, bool special) {
          auto v = ids_from(s.model(), prompt);
          std::vector<int32_t> stops;
          if (stop_ids) stops = ids_from(s.model(), *stop_ids);
          SamplingParams p = params_from(params);
          TokenCallback tc;
          if (cb) {
            tc = [&cb](int32_t id, const std::string& piece) {
              py::gil_scoped_acquire acq;
              return cb(id, py::bytes(piece));
            };
          }
          py::gil_scoped_release rel;
          return generate(s.model(), s, v, nullptr, 0, p, max_tokens, tc, stop_ids ? &stops : nullptr, special);
        },
        py::arg("session"), py::arg("prompt"), py::arg("params"), py::arg("max_tokens"), py::arg("callback"),
        py::arg("stop_ids") = py::none(), py::arg("special") = false);

  // The server's step loop: one call per step, the GIL released for the forward, samples and stops.
  py::class_<Stepper>(m, "Stepper")
      .def(py::init([](std::vector<std::shared_ptr<Session>> slots, int64_t chunk) {
             return std::make_unique<Stepper>(std::move(slots), chunk);
           }),
           py::arg("sessions"), py::arg("chunk"))
      .def("start",
           [](Stepper& st, int slot, const std::vector<int64_t>& prompt, py::object params, int64_t max_tokens,
              const std::vector<int64_t>& stop_ids, double priority) {
             std::vector<int32_t> p(prompt.begin(), prompt.end()), stops;
             for (int64_t v : prompt)
               if (v < INT32_MIN || v > INT32_MAX) throw py::value_error("Stepper.start: an id out of range");
             for (int64_t v : stop_ids)
               if (v >= INT32_MIN && v <= INT32_MAX) stops.push_back((int32_t)v);  // others can never be sampled
             st.start(slot, std::move(p), params_from(params), max_tokens, std::move(stops), priority);
           },
           py::arg("slot"), py::arg("prompt"), py::arg("params"), py::arg("max_tokens"), py::arg("stop_ids"),
           py::arg("priority"))
      .def("end", &Stepper::end)
      .def("active", &Stepper::active)
      .def("next_prefill", &Stepper::next_prefill)
      // -> ([(slot, kind, token, bytes)], n_decoded); kind 0 token, 1 stop (ended), 2 length (ended).
      .def("step", [](Stepper& st, bool prefill) {
        std::vector<StepEvent> ev;
        int64_t n_dec = 0;
        {
          py::gil_scoped_release rel;
          ev = st.step(prefill, &n_dec);
        }
        py::list out;
        for (auto& e : ev) out.append(py::make_tuple(e.slot, (int)e.kind, e.token, py::bytes(e.bytes)));
        return py::make_tuple(out, n_dec);
      }, py::arg("prefill") = true);
}

}  // namespace dl::py_bind
