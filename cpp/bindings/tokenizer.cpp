// Python bindings of dl::Tokenizer, the streaming Detokenizer and the pre-tokenizer (for tests).
#include <pybind11/stl.h>

#include "bindings/bind.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

namespace dl::py_bind {

namespace {
// Text from a Python str as UTF-8 (surrogates cannot be encoded: ValueError via pybind).
py::str to_py(const std::string& s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), (Py_ssize_t)s.size(), "replace");
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// Streams decoded text token by token, giving only whole UTF-8 characters.
struct Detokenizer {
  std::shared_ptr<const Tokenizer> tok;
  bool special;
  Utf8Holder holder;
};
}  // namespace

void bind_tokenizer(py::module_& m) {
  py::class_<Tokenizer, std::shared_ptr<Tokenizer>>(m, "Tokenizer",
      "Tokenizer of a GGUF vocabulary: byte-level BPE (model 'gpt2') or SentencePiece-style BPE ('llama').")
      .def(py::init([](std::vector<std::string> tokens, std::vector<float> scores, std::vector<int32_t> types,
                       std::vector<std::string> merges, std::string model, std::string pre, int32_t bos,
                       int32_t eos, bool add_bos, bool add_eos, bool add_space_prefix, int32_t unk, int32_t pad,
                       bool gemma_style) {
             TokenizerConfig c;
             c.tokens = std::move(tokens);
             c.scores = std::move(scores);
             c.types = std::move(types);
             c.merges = std::move(merges);
             c.model = std::move(model);
             c.pre = std::move(pre);
             c.bos = bos, c.eos = eos, c.unk = unk, c.pad = pad;
             c.add_bos = add_bos, c.add_eos = add_eos, c.add_space_prefix = add_space_prefix;
             c.gemma_style = gemma_style;
             py::gil_scoped_release nogil;
             return std::make_shared<Tokenizer>(std::move(c));
           }),
           py::arg("tokens"), py::arg("scores") = std::vector<float>{}, py::arg("types") = std::vector<int32_t>{},
           py::arg("merges") = std::vector<std::string>{}, py::arg("model") = "gpt2", py::arg("pre") = "",
           py::arg("bos") = -1, py::arg("eos") = -1, py::arg("add_bos") = false, py::arg("add_eos") = false,
           py::arg("add_space_prefix") = false, py::arg("unk") = -1, py::arg("pad") = -1,
           py::arg("gemma_style") = false)
      .def_static("from_gguf",
                  [](const std::string& path) {
                    py::gil_scoped_release nogil;
                    return load_tokenizer(*gguf::File::open(path));
                  },
                  py::arg("path"),
                  "The tokenizer of a GGUF file (a model, or only its tokenizer.ggml.* keys), built as "
                  "load_model builds it: the same C++ reader and the family's quirks from the registry.")
      .def("encode",
           [](const Tokenizer& t, const std::string& text, bool add_special, bool parse_special) {
             py::gil_scoped_release nogil;
             return t.encode(text, add_special, parse_special);
           },
           py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = false,
           "Token ids of text. add_special: BOS/EOS per the file; parse_special: control tokens spelled in the text.")
      .def("decode",
           [](const Tokenizer& t, const std::vector<int32_t>& ids, bool special) {
             std::string s;
             {
               py::gil_scoped_release nogil;
               s = t.decode(ids, special);
             }
             return to_py(s);
           },
           py::arg("ids"), py::arg("special") = false,
           "Text of ids; special=True renders control tokens, otherwise they give nothing.")
      .def("piece", [](const Tokenizer& t, int32_t id) { return py::bytes(std::string(t.piece(id))); }, py::arg("id"),
           "Raw bytes of one token.")
      .def("token_text", &Tokenizer::token_text, py::arg("id"))
      .def("token_type", [](const Tokenizer& t, int32_t id) { return (int)t.token_type(id); }, py::arg("id"))
      .def_property_readonly("n_vocab", &Tokenizer::n_vocab)
      .def_property_readonly("bos", &Tokenizer::bos)
      .def_property_readonly("eos", &Tokenizer::eos)
      .def_property_readonly("add_bos", &Tokenizer::add_bos)
      .def_property_readonly("add_eos", &Tokenizer::add_eos)
      .def_property_readonly("model", &Tokenizer::model)
      .def_property_readonly("pre", &Tokenizer::pre)
      .def("__repr__", [](const Tokenizer& t) {
        return "<Tokenizer " + t.model() + (t.pre().empty() ? "" : "/" + t.pre()) + " n_vocab=" +
               std::to_string(t.n_vocab()) + ">";
      });

  py::class_<Detokenizer>(m, "Detokenizer", "Streams the text of ids one at a time, only whole UTF-8 characters.")
      .def(py::init([](std::shared_ptr<Tokenizer> t, bool special) { return Detokenizer{t, special, {}}; }),
           py::arg("tokenizer"), py::arg("special") = false)
      .def("push", [](Detokenizer& d, int32_t id) { return to_py(d.holder.push(d.tok->render(id, d.special))); },
           py::arg("id"), "Text completed by this token (may be empty).")
      .def("push_bytes", [](Detokenizer& d, py::bytes b) { return to_py(d.holder.push(std::string(b))); },
           py::arg("data"))
      .def("flush", [](Detokenizer& d) { return to_py(d.holder.flush()); }, "Held bytes, invalid tail as U+FFFD.");

  m.def("pre_tokenize",
        [](const std::string& text, const std::string& pre) {
          std::vector<std::string> out;
          for (auto [a, b] : pre_tokenize(text, pre_split_from_name(pre))) out.push_back(text.substr(a, b - a));
          return out;
        },
        py::arg("text"), py::arg("pre"), "The byte-level pre-token split of text for tokenizer.ggml.pre (tests).");
}

}  // namespace dl::py_bind
