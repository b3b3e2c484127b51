// _core.Backend: one backend (cpu, cuda:N) with each op callable on numpy arrays, for the
// backend-ops harness (tests/test_backend_ops.py) that runs every op on every backend
// present against the CPU. Each call uploads its inputs, poisons its output with NaN,
// runs the op and downloads the result. Not a public API.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "bindings/bind.h"
#include "core/backend.h"
#include "core/errors.h"
#include "quant/types.h"

namespace dl::py_bind {

namespace {

using F32 = py::array_t<float, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

struct Dev {
  std::shared_ptr<Backend> be;
  std::vector<BufferPtr> keep;  // one call's buffers
  bool exact = true;            // weights load as in fp32 mode

  template <typename T>
  T* put(const T* src, size_t n) {
    BufferPtr b = be->alloc(std::max<size_t>(n, 1) * sizeof(T), "harness");
    if (n) be->upload(b->data(), src, n * sizeof(T));
    keep.push_back(b);
    return static_cast<T*>(b->data());
  }
  float* put(const F32& a) { return put(a.data(), (size_t)a.size()); }
  // An output of n floats, filled with NaN so an element the op never writes shows.
  float* poisoned(size_t n) {
    std::vector<float> nan(std::max<size_t>(n, 1), std::numeric_limits<float>::quiet_NaN());
    return put(nan.data(), nan.size());
  }
  py::array_t<float> get(const float* d, std::vector<int64_t> shape) {
    py::array_t<float> out(shape);
    be->download(out.mutable_data(), d, (size_t)out.size() * 4);
    keep.clear();
    return out;
  }
};

// Every input is checked here (rank, sizes, ranges) before an op sees it: a bad call is a
// ValueError, never a read or write out of bounds in a kernel.
F32 f32(const py::object& o, const char* what, int ndim = -1) {
  F32 a = F32::ensure(o);
  if (!a) throw py::value_error(std::string(what) + " must be a float32 array");
  if (ndim >= 0 && a.ndim() != ndim) throw py::value_error(std::string(what) + " must be " + std::to_string(ndim) + "-D");
  return a;
}
void need(bool ok, const char* what) {
  if (!ok) throw py::value_error(what);
}

Weight weight(Dev& d, const py::array& bytes, uint32_t type, int64_t rows, int64_t cols, WeightUse use,
              int64_t expert_rows = 0) {
  const TypeTraits* tt = type_traits(type);
  if (!tt) throw py::value_error("unknown ggml type " + std::to_string(type));
  const int64_t rb = type_nbytes(type, cols);
  if (rb < 0 || bytes.nbytes() != rows * rb) throw py::value_error("weight bytes do not match rows x cols");
  Weight w;
  w.type = type;
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = (size_t)rb;
  w.owned = std::make_shared<std::vector<uint8_t>>((const uint8_t*)bytes.data(), (const uint8_t*)bytes.data() + bytes.nbytes());
  w.host = w.owned->data();
  w.exact = d.exact;
  w.expert_rows = expert_rows;
  d.be->load_weight(w, use);
  return w;
}

}  // namespace

void bind_backend(py::module_& m) {
  py::class_<Dev, std::shared_ptr<Dev>>(m, "Backend")
      // exact: weights loaded as in fp32 mode (f32 activations on every backend that honours it).
      .def(py::init([](const std::string& device, int n_threads, bool exact) {
             need(n_threads >= 0 && n_threads <= 512, "n_threads must be in [0, 512] (0: the default)");
             auto d = std::make_shared<Dev>();
             d->be = make_backend(device, n_threads);
             d->exact = exact;
             return d;
           }),
           py::arg("device") = "cpu", py::arg("n_threads") = 0, py::arg("exact") = true)
      .def_property_readonly("name", [](const Dev& d) { return std::string(d.be->name()); })
      .def_property_readonly("device", [](const Dev& d) { return device_dict(d.be->info()); })
      // Ops the backend ran on a named optional path since it was made (Backend::path_count).
      .def("path_count", [](const Dev& d, const std::string& name) { return d.be->path_count(name); }, py::arg("name"))
      .def("supports", [](const Dev& d, const std::string& op, uint32_t type) {
        const Op o = op == "matmul" ? Op::matmul : op == "get_rows" ? Op::get_rows : op == "attention" ? Op::attention : Op::kv_store;
        return d.be->supports(o, type);
      })
      .def("matmul", [](Dev& d, const py::array& wb, uint32_t type, int64_t rows, int64_t cols, const py::object& xo,
                        bool packed, int repeat) {
        F32 x = f32(xo, "x");
        if (x.ndim() != 2 || x.shape(1) != cols) throw py::value_error("x must be [n, cols]");
        need(rows > 0 && cols > 0, "rows and cols must be positive");
        need(d.be->supports(Op::matmul, type), "this backend has no matmul for the weight type");
        need(repeat >= 1 && repeat <= 1000000, "repeat must be in [1, 1e6]");
        const int64_t n = x.shape(0);
        Weight w = weight(d, wb, type, rows, cols, WeightUse::matmul);
        if (!packed && w.packed) {
          // The file's layout: the CPU drops the ISA's packed copy made at load (a backend reads
          // only a layout it made; a device backend's own layout, when it keeps one, is w.data).
          w.packed = nullptr;
          w.packed_owner.reset();
          w.packed_for = -1;
        }
        if (n == 0) return py::array_t<float>(std::vector<int64_t>{0, rows});
        float* xd = d.put(x);
        float* y = d.poisoned((size_t)(n * rows));
        {
          py::gil_scoped_release nogil;
          for (int r = 0; r < repeat; ++r) d.be->matmul(w, xd, n, y);
        }
        return d.get(y, {n, rows});
      },
      py::arg("w"), py::arg("type"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("packed") = true,
      py::arg("repeat") = 1,
      "y[n, rows] = x @ W.T through the backend (weight loaded as the model loader loads it). packed=False: "
      "the CPU reads the file's layout instead of the ISA's packed one. repeat > 1 runs the product that "
      "many times after one upload and load (benchmarks time the op from the difference).")
      .def("matmul_multi", [](Dev& d, const std::vector<py::array>& wbs, uint32_t type, const std::vector<int64_t>& rows,
                              int64_t cols, const py::object& xo) {
        F32 x = f32(xo, "x", 2);
        need(x.shape(1) == cols, "x must be [n, cols]");
        const int64_t n = x.shape(0);
        if (wbs.size() != rows.size() || wbs.empty() || wbs.size() > 8) throw py::value_error("1..8 weights");
        std::vector<Weight> ws;
        for (size_t i = 0; i < wbs.size(); ++i) ws.push_back(weight(d, wbs[i], type, rows[i], cols, WeightUse::matmul));
        float* xd = d.put(x);
        std::vector<const Weight*> wp;
        std::vector<float*> yp;
        int64_t total = 0;
        for (auto& w : ws) total += w.rows;
        float* y = d.poisoned((size_t)(n * total));
        int64_t off = 0;
        for (auto& w : ws) {
          wp.push_back(&w);
          yp.push_back(y + off * n);
          off += w.rows;
        }
        d.be->matmul_multi(wp.data(), yp.data(), (int)ws.size(), xd, n);
        return d.get(y, {n * total});
      })
      // A matmul with its epilogue (matmul_multi_ex), and the same weight through the plain ops
      // (matmul, add_bias, gelu_erf) for comparison. packed: f32 / f16 weights take the CPU's packed
      // layout (as a model's mapped weights do; the harness's own copies otherwise stay unpacked).
      .def("matmul_ex", [](Dev& d, const py::array& wb, uint32_t type, int64_t rows, int64_t cols, const py::object& xo,
                           const py::object& bo, bool gelu, bool packed) {
        F32 x = f32(xo, "x", 2);
        need(x.shape(1) == cols && x.shape(0) > 0, "x must be [n, cols], n > 0");
        need(rows > 0 && cols > 0, "rows and cols must be positive");
        need(d.be->supports(Op::matmul, type), "this backend has no matmul for the weight type");
        F32 b;
        if (!bo.is_none()) {
          b = f32(bo, "bias", 1);
          need(b.shape(0) == rows, "bias must hold one float per row");
        }
        const int64_t n = x.shape(0);
        Weight w;
        {
          const TypeTraits* tt = type_traits(type);
          const int64_t rb = type_nbytes(type, cols);
          if (!tt || rb < 0 || wb.nbytes() != rows * rb) throw py::value_error("weight bytes do not match rows x cols");
          w.type = type, w.rows = rows, w.cols = cols, w.row_bytes = (size_t)rb;
          w.owned = std::make_shared<std::vector<uint8_t>>((const uint8_t*)wb.data(), (const uint8_t*)wb.data() + wb.nbytes());
          w.host = w.owned->data();
          w.host_kept = packed;  // the copy lives as long as w: an f32 / f16 matrix may pack
          w.exact = d.exact;
          d.be->load_weight(w, WeightUse::matmul);
        }
        float* xd = d.put(x);
        float* bd = bo.is_none() ? nullptr : d.put(b);
        float* y = d.poisoned((size_t)(n * rows));
        float* y2 = d.poisoned((size_t)(n * rows));
        MatmulEpilogue e;
        e.bias = bd;
        e.gelu_erf = gelu;
        const Weight* wp[1] = {&w};
        {
          py::gil_scoped_release nogil;
          d.be->matmul_multi_ex(wp, &y, 1, xd, n, &e);
          d.be->matmul(w, xd, n, y2);
          if (bd) d.be->add_bias(y2, bd, n, rows);
          if (gelu) d.be->gelu_erf(y2, n * rows);
        }
        py::array_t<float> plain({n, rows});
        d.be->download(plain.mutable_data(), y2, (size_t)(n * rows) * 4);
        return py::make_tuple(d.get(y, {n, rows}), plain);
      },
      py::arg("w"), py::arg("type"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("bias") = py::none(),
      py::arg("gelu") = false, py::arg("packed") = true)
      // A fused matmul stage: the (normed) x through 1-3 weights, or into a residual.
      // type: one for every weight, or a list of one a weight (a Q4_K_M file's Q / K with a q6_K V).
      .def("matmul_step", [](Dev& d, const std::vector<py::array>& wbs, const py::object& typeo,
                             const std::vector<int64_t>& rows, int64_t cols, const py::object& xo, bool norm,
                             const py::object& nwo, float eps, const py::object& reso) {
        F32 x = f32(xo, "x", 2);
        need(x.shape(1) == cols, "x must be [n, cols]");
        const int64_t n = x.shape(0);
        if (wbs.size() != rows.size() || wbs.empty() || wbs.size() > 3) throw py::value_error("1..3 weights");
        if (!reso.is_none() && wbs.size() != 1) throw py::value_error("a residual takes one weight");
        std::vector<uint32_t> types;
        try {
          if (py::isinstance<py::sequence>(typeo)) types = typeo.cast<std::vector<uint32_t>>();
          else types.assign(wbs.size(), typeo.cast<uint32_t>());
        } catch (const py::cast_error&) {
          throw py::type_error("type: a weight type id, or a list of one a weight");
        }
        if (types.size() != wbs.size()) throw py::value_error("one type, or one a weight");
        std::vector<Weight> ws;
        for (size_t i = 0; i < wbs.size(); ++i) ws.push_back(weight(d, wbs[i], types[i], rows[i], cols, WeightUse::matmul));
        MatmulStep st;
        st.x = d.put(x), st.n = n, st.count = (int)ws.size(), st.norm = norm, st.eps = eps;
        if (!nwo.is_none()) {
          F32 nw = f32(nwo, "norm_w", 1);
          need(nw.shape(0) == cols, "norm_w must have cols elements");
          st.norm_w = d.put(nw);
        }
        st.xn = d.poisoned((size_t)(n * cols));
        int64_t total = 0;
        for (auto& w : ws) total += w.rows;
        float* y = d.poisoned((size_t)(n * total));
        int64_t off = 0;
        for (size_t i = 0; i < ws.size(); ++i) {
          st.w[i] = &ws[i];
          st.y[i] = y + off * n;
          off += ws[i].rows;
        }
        if (!reso.is_none()) {
          F32 r = f32(reso, "residual", 2);
          need(r.shape(0) == n && r.shape(1) == rows[0], "residual must be [n, rows]");
          st.residual = d.put(r);
          d.be->matmul_step(st);
          return d.get(st.residual, {n, rows[0]});
        }
        d.be->matmul_step(st);
        return d.get(y, {n * total});
      })
      .def("get_rows", [](Dev& d, const py::array& wb, uint32_t type, int64_t rows, int64_t cols, const I32& ids) {
        for (int64_t i = 0; i < ids.size(); ++i)
          if (ids.data()[i] < 0 || ids.data()[i] >= rows) throw py::value_error("id out of range");
        Weight w = weight(d, wb, type, rows, cols, WeightUse::rows);
        const int64_t n = ids.size();
        int32_t* id = d.put(ids.data(), (size_t)n);
        float* y = d.poisoned((size_t)(n * cols));
        d.be->get_rows(w, id, n, y);
        return d.get(y, {n, cols});
      })
      .def("rms_norm", [](Dev& d, const py::object& xo, const py::object& wo, float eps) {
        F32 x = f32(xo, "x", 2);
        const int64_t r = x.shape(0), c = x.shape(1);
        float* xd = d.put(x);
        F32 w = wo.is_none() ? F32() : f32(wo, "w", 1);
        need(wo.is_none() || w.size() == c, "w must have a row's length");
        float* wd = wo.is_none() ? nullptr : d.put(w);
        float* y = d.poisoned((size_t)(r * c));
        d.be->rms_norm(xd, wd, y, r, c, eps);
        return d.get(y, {r, c});
      })
      .def("layer_norm", [](Dev& d, const py::object& xo, const py::object& wo, const py::object& bo, float eps) {
        F32 x = f32(xo, "x", 2);
        const int64_t r = x.shape(0), c = x.shape(1);
        float* xd = d.put(x);
        F32 w = wo.is_none() ? F32() : f32(wo, "w", 1), b = bo.is_none() ? F32() : f32(bo, "b", 1);
        need((wo.is_none() || w.size() == c) && (bo.is_none() || b.size() == c), "w and b must have a row's length");
        float* wd = wo.is_none() ? nullptr : d.put(w);
        float* bd = bo.is_none() ? nullptr : d.put(b);
        float* y = d.poisoned((size_t)(r * c));
        d.be->layer_norm(xd, wd, bd, y, r, c, eps);
        return d.get(y, {r, c});
      })
      .def("rope", [](Dev& d, const py::object& xo, int n_heads, int head_dim, const I32& pos, bool neox, int n_rot,
                      float base, float freq_scale, const py::object& ff, const py::object& inv, float mscale) {
        F32 x = f32(xo, "x", 2);
        const int64_t n = x.shape(0), stride = x.shape(1);
        need(pos.size() == n, "one position per row");
        need(head_dim > 0 && n_heads > 0 && (int64_t)n_heads * head_dim <= stride, "heads must fit in a row");
        need(n_rot > 0 && n_rot % 2 == 0 && n_rot <= head_dim, "n_rot must be even and at most head_dim");
        need(ff.is_none() || f32(ff, "freq_factors", 1).size() == n_rot / 2, "freq_factors: n_rot / 2 values");
        need(inv.is_none() || py::array_t<double>::ensure(inv).size() == n_rot / 2, "inv_freq: n_rot / 2 values");
        float* xd = d.put(x);
        RopeParams p;
        p.neox = neox;
        p.n_rot = n_rot;
        p.base = base;
        p.freq_scale = freq_scale;
        p.mscale = mscale;
        if (!ff.is_none()) p.freq_factors = d.put(f32(ff, "freq_factors"));
        if (!inv.is_none()) {
          auto a = py::array_t<double, py::array::c_style | py::array::forcecast>::ensure(inv);
          p.inv_freq = d.put(a.data(), (size_t)a.size());
        }
        d.be->rope(xd, n, stride, n_heads, head_dim, d.put(pos.data(), (size_t)pos.size()), p);
        return d.get(xd, {n, stride});
      })
      .def("glu", [](Dev& d, const py::object& go, const py::object& uo, int act) {
        F32 g = f32(go, "gate", 2), u = f32(uo, "up", 2);
        need(g.shape(0) == u.shape(0) && g.shape(1) == u.shape(1), "gate and up must have one shape");
        const int64_t r = g.shape(0), c = g.shape(1);
        float* gd = d.put(g);
        float* ud = d.put(u);
        float* y = d.poisoned((size_t)(r * c));
        need(act >= 0 && act <= 4, "act must be 0 (silu), 1 (gelu_tanh), 2 (swiglu_oai), 3 (sigmoid) or 4 (relu)");
        d.be->glu(gd, c, ud, c, y, r, c, (Act)act);
        return d.get(y, {r, c});
      })
      // A step's glu (in place into up, as the decoder's FFN does) and the matmul that reads it
      // (ffn down), recorded as one step: a backend may fold the glu into the matmul. Returns
      // (the glu's output, the matmul's).
      .def("glu_matmul_step", [](Dev& d, const py::object& go, const py::object& uo, int act, const py::array& wb,
                                 uint32_t type, int64_t rows) {
        F32 g = f32(go, "gate", 2), u = f32(uo, "up", 2);
        need(g.shape(0) == u.shape(0) && g.shape(1) == u.shape(1), "gate and up must have one shape");
        need(act >= 0 && act <= 4, "act must be 0 (silu), 1 (gelu_tanh), 2 (swiglu_oai), 3 (sigmoid) or 4 (relu)");
        const int64_t n = g.shape(0), c = g.shape(1);
        need(n > 0 && c > 0 && rows > 0, "gate, up and the weight must not be empty");
        need(d.be->supports(Op::matmul, type), "this backend has no matmul for the weight type");
        Weight w = weight(d, wb, type, rows, c, WeightUse::matmul);
        float* gd = d.put(g);
        float* ud = d.put(u);
        float* y = d.poisoned((size_t)(n * rows));
        MatmulStep st;
        st.x = ud, st.n = n, st.count = 1, st.w[0] = &w, st.y[0] = y;
        st.xn = d.poisoned((size_t)(n * c));
        d.be->begin_step();
        try {
          d.be->glu(gd, c, ud, c, ud, n, c, (Act)act);
          d.be->matmul_step(st);
        } catch (...) {  // the step ended either way: the backend is not left recording
          try {
            d.be->end_step();
          } catch (...) {
          }
          throw;
        }
        d.be->end_step();
        py::array_t<float> out({n, c});
        d.be->download(out.mutable_data(), ud, (size_t)out.size() * 4);
        return py::make_tuple(out, d.get(y, {n, rows}));
      }, py::arg("gate"), py::arg("up"), py::arg("act"), py::arg("w"), py::arg("type"), py::arg("rows"))
      .def("unary", [](Dev& d, const std::string& op, const py::object& xo, float a) {
        F32 x = f32(xo, "x");
        const int64_t n = x.size();
        float* xd = d.put(x);
        if (op == "scale") d.be->scale(xd, a, n);
        else if (op == "softcap") d.be->softcap(xd, a, n);
        else if (op == "gelu_erf") d.be->gelu_erf(xd, n);
        else throw py::value_error("unknown op " + op);
        return d.get(xd, {n});
      })
      .def("add", [](Dev& d, const py::object& yo, const py::object& xo) {
        F32 y = f32(yo, "y"), x = f32(xo, "x");
        need(x.size() == y.size(), "x and y must have one size");
        float* yd = d.put(y);
        d.be->add(yd, d.put(x), y.size());
        return d.get(yd, {(int64_t)y.size()});
      })
      .def("argmax", [](Dev& d, const py::object& xo) {
        F32 x = f32(xo, "x", 2);
        const int64_t n = x.shape(0), dim = x.shape(1);
        need(dim >= 1, "rows must not be empty");
        float* xd = d.put(x);
        std::vector<int32_t> minus((size_t)std::max<int64_t>(n, 1), -1);
        int32_t* out = d.put(minus.data(), minus.size());
        d.be->argmax(xd, n, dim, out);
        py::array_t<int32_t> got(n);
        d.be->download(got.mutable_data(), out, (size_t)n * 4);
        return got;
      })
      .def("moe_route", [](Dev& d, const py::object& lo, int k, int gate, bool norm) {
        F32 l = f32(lo, "logits", 2);
        const int64_t n = l.shape(0), E = l.shape(1);
        need(E >= 1 && k >= 1 && k <= E, "k must be in [1, n_expert]");
        need(gate >= 0 && gate <= 2, "gate must be 0 (softmax), 1 (sigmoid) or 2 (softmax over the top k)");
        float* ld = d.put(l);
        std::vector<int32_t> minus((size_t)std::max<int64_t>(n * k, 1), -1);
        int32_t* ids = d.put(minus.data(), minus.size());
        float* w = d.poisoned((size_t)(n * k));
        d.be->moe_route(ld, n, (int)E, k, (MoeGate)gate, norm, ids, w);
        py::array_t<int32_t> ids_out({n, (int64_t)k});
        d.be->download(ids_out.mutable_data(), ids, (size_t)(n * k) * 4);
        return py::make_tuple(ids_out, d.get(w, {n, (int64_t)k}));
      })
      .def("matmul_id", [](Dev& d, const py::array& wb, uint32_t type, int64_t n_expert, int64_t rows, int64_t cols,
                           const py::object& xo, int64_t x_div, const I32& ids, const py::object& bo) {
        F32 x = f32(xo, "x", 2);
        need(x.shape(1) == cols, "x must be [rows of x, cols]");
        need(n_expert >= 1 && rows >= 1, "n_expert and rows must be positive");
        need(x_div >= 1, "x_div must be >= 1");
        const int64_t P = ids.size();
        need(P == 0 || (P - 1) / x_div < x.shape(0), "x has fewer rows than the pairs read");
        for (int64_t i = 0; i < P; ++i) need(ids.data()[i] >= 0 && ids.data()[i] < n_expert, "expert id out of range");
        F32 b;
        if (!bo.is_none()) {
          b = f32(bo, "bias", 2);
          need(b.shape(0) == n_expert && b.shape(1) == rows, "bias must be [n_expert, rows]");
        }
        Weight w = weight(d, wb, type, n_expert * rows, cols, WeightUse::matmul, rows);
        float* xd = d.put(x);
        int32_t* id = d.put(ids.data(), (size_t)P);
        float* bd = bo.is_none() ? nullptr : d.put(b);
        float* y = d.poisoned((size_t)(P * rows));
        d.be->matmul_id(w, xd, x_div, id, P, bd, y);
        return d.get(y, {P, rows});
      })
      // Returns (y, the new state).
      .def("conv1d_causal", [](Dev& d, const py::object& so, const py::object& xo, const py::object& wo, bool silu) {
        F32 st = f32(so, "state", 2), x = f32(xo, "x", 2), w = f32(wo, "w", 2);
        const int64_t n = x.shape(0), C = x.shape(1), k = w.shape(1);
        need(w.shape(0) == C, "w must be [C, k]");
        need(k >= 1 && k <= 65, "k must be in [1, 65]");
        need(st.shape(0) == k - 1 && st.shape(1) == C, "state must be [k - 1, C]");
        float* sd = d.put(st);
        float* xd = d.put(x);
        float* wd = d.put(w);
        float* y = d.poisoned((size_t)(n * C));
        d.be->conv1d_causal(sd, xd, C, n, C, wd, (int)k, silu, y);
        py::array_t<float> st_out(std::vector<int64_t>{k - 1, C});
        d.be->download(st_out.mutable_data(), sd, (size_t)st_out.size() * 4);
        return py::make_tuple(d.get(y, {n, C}), st_out);
      })
      // qkv rows [n][2 nk dk + nv dv]; alpha, beta [n][nv]; A, dt_bias [nv]; state [nv][dk][dv].
      // Returns (out [n][nv dv], the new state). chunked: the prefill's chunked form.
      .def("delta_rule", [](Dev& d, const py::object& so, const py::object& qo, const py::object& ao,
                            const py::object& bo, const py::object& Ao, const py::object& dto, int nk, float eps,
                            bool grouped, bool chunked) {
        F32 st = f32(so, "state", 3), qkv = f32(qo, "qkv", 2), al = f32(ao, "alpha", 2), be = f32(bo, "beta", 2);
        F32 A = f32(Ao, "A", 1), dt = f32(dto, "dt_bias", 1);
        const int64_t nv = st.shape(0), dk = st.shape(1), dv = st.shape(2), n = qkv.shape(0);
        need(nk >= 1 && nv % nk == 0, "n_v_heads must be a multiple of n_k_heads");
        need(qkv.shape(1) == 2 * nk * dk + nv * dv, "qkv rows must be 2 nk dk + nv dv");
        need(al.shape(0) == n && al.shape(1) == nv && be.shape(0) == n && be.shape(1) == nv, "alpha, beta: [n, nv]");
        need(A.size() == nv && dt.size() == nv, "A and dt_bias: [nv]");
        DeltaRuleArgs a;
        a.state = d.put(st);
        a.q = d.put(qkv);
        a.k = a.q + nk * dk;
        a.v = a.q + 2 * nk * dk;
        a.qkv_stride = qkv.shape(1);
        a.alpha = d.put(al);
        a.beta = d.put(be);
        a.ab_stride = nv;
        a.A = d.put(A);
        a.dt_bias = d.put(dt);
        a.n = n;
        a.n_k_heads = nk, a.n_v_heads = (int)nv, a.dk = (int)dk, a.dv = (int)dv;
        a.l2_eps = eps;
        a.grouped = grouped;
        a.chunked = chunked;
        float* out = d.poisoned((size_t)(n * nv * dv));
        a.out = out;
        a.out_stride = nv * dv;
        d.be->delta_rule(a);
        py::array_t<float> st_out(std::vector<int64_t>{nv, dk, dv});
        d.be->download(st_out.mutable_data(), a.state, (size_t)st_out.size() * 4);
        return py::make_tuple(d.get(out, {n, nv * dv}), st_out);
      }, py::arg("state"), py::arg("qkv"), py::arg("alpha"), py::arg("beta"), py::arg("A"), py::arg("dt_bias"),
         py::arg("nk"), py::arg("eps"), py::arg("grouped") = false, py::arg("chunked") = false)
      .def("moe_sum", [](Dev& d, const py::object& yo, const py::object& wo) {
        F32 w = f32(wo, "w", 2);
        const int64_t n = w.shape(0), k = w.shape(1);
        F32 y = f32(yo, "y", 2);
        need(y.shape(0) == n * k, "y must have a row per (token, slot)");
        const int64_t dim = y.shape(1);
        float* yd = d.put(y);
        float* wd = d.put(w);
        float* out = d.poisoned((size_t)(n * dim));
        d.be->moe_sum(yd, wd, n, (int)k, dim, out);
        return d.get(out, {n, dim});
      })
      .def("add_bias", [](Dev& d, const py::object& yo, const py::object& bo) {
        F32 y = f32(yo, "y", 2), b = f32(bo, "b", 1);
        need(b.size() == y.shape(1), "b must have a row's length");
        float* yd = d.put(y);
        d.be->add_bias(yd, d.put(b), y.shape(0), y.shape(1));
        return d.get(yd, {y.shape(0), y.shape(1)});
      })
      .def("copy_rows", [](Dev& d, const py::object& xo, int64_t col0, int64_t width) {
        F32 x = f32(xo, "x", 2);
        const int64_t r = x.shape(0);
        need(col0 >= 0 && width >= 0 && col0 + width <= x.shape(1), "columns out of the row");
        float* xd = d.put(x);
        float* y = d.poisoned((size_t)(r * width));
        d.be->copy_rows(y, width, xd + col0, x.shape(1), r, width);
        return d.get(y, {r, width});
      })
      .def("im2col_1d", [](Dev& d, const py::object& xo, int64_t T, int k, int stride, int pad, int64_t T_out) {
        F32 x = f32(xo, "x", 2);  // [C][x_stride]
        const int64_t C = x.shape(0);
        need(T >= 0 && T <= x.shape(1) && k >= 1 && stride >= 1 && pad >= 0 && T_out >= 0, "bad conv geometry");
        float* xd = d.put(x);
        float* y = d.poisoned((size_t)(T_out * C * k));
        d.be->im2col_1d(xd, x.shape(1), C, T, k, stride, pad, y, T_out);
        return d.get(y, {T_out, C * k});
      })
      .def("im2col_rows", [](Dev& d, const py::object& xo, int k, int stride, int pad, int64_t T_out) {
        F32 x = f32(xo, "x", 2);  // [T][C]
        const int64_t T = x.shape(0), C = x.shape(1);
        need(k >= 1 && stride >= 1 && pad >= 0 && T_out >= 0, "bad conv geometry");
        float* xd = d.put(x);
        float* y = d.poisoned((size_t)(T_out * C * k));
        d.be->im2col_rows(xd, C, T, k, stride, pad, y, T_out);
        return d.get(y, {T_out, C * k});
      })
      .def("im2col_2d", [](Dev& d, const py::object& xo, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh,
                           int64_t sw, int kh, int kw, int stride, int pad, int64_t H_out, int64_t W_out) {
        F32 x = f32(xo, "x", 1);  // flat; element (c, h, w) at c * sc + h * sh + w * sw
        need(C >= 1 && H >= 1 && W >= 1 && sc >= 0 && sh >= 0 && sw >= 0 && kh >= 1 && kw >= 1 && stride >= 1 &&
                 pad >= 0 && H_out >= 0 && W_out >= 0,
             "bad conv geometry");
        need((C - 1) * sc + (H - 1) * sh + (W - 1) * sw < x.shape(0), "strides reach past x");
        float* xd = d.put(x);
        float* y = d.poisoned((size_t)(H_out * W_out * C * kh * kw));
        d.be->im2col_2d(xd, C, H, W, sc, sh, sw, kh, kw, stride, pad, y, H_out, W_out);
        return d.get(y, {H_out * W_out, C * kh * kw});
      })
      .def("avg_pool_rows", [](Dev& d, const py::object& xo, int k) {
        F32 x = f32(xo, "x", 2);
        need(k >= 1, "k must be >= 1");
        const int64_t r = x.shape(0), c = x.shape(1), ro = (r + k - 1) / k;
        float* xd = d.put(x);
        float* y = d.poisoned((size_t)(ro * c));
        d.be->avg_pool_rows(xd, r, c, k, y);
        return d.get(y, {ro, c});
      })
      // K/V rows stored through kv_store into a paged cache whose pages are shuffled
      // (page_ids[p] is the pool page of the p-th block), then attention over it. Returns
      // (attention output, the raw bytes of the pool) so both ops are checked.
      .def("paged_attention", [](Dev& d, const py::object& qo, const py::object& ko, const py::object& vo,
                                 const I32& q_pos, int n_heads, int n_kv_heads, int head_dim, int kv_type,
                                 int page_rows, const I32& page_ids, int n_pool_pages, int window, float scale,
                                 float softcap, int64_t store_chunk, const py::object& sinks_o, bool any_order,
                                 int repeat) {
        F32 q = f32(qo, "q", 2), k = f32(ko, "k", 2), v = f32(vo, "v", 2);
        need(repeat >= 1 && repeat <= 1000000, "repeat must be in [1, 1e6]");
        F32 sinks;
        if (!sinks_o.is_none()) {
          sinks = f32(sinks_o, "sinks", 1);
          need(sinks.shape(0) == n_heads, "sinks must hold one logit per query head");
        }
        need(kv_type == 0 || kv_type == 1 || kv_type == 8, "kv_type must be 0 (f32), 1 (f16) or 8 (q8_0)");
        need(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0, "bad head layout");
        need(kv_type != 8 || head_dim % 32 == 0, "a q8_0 cache needs head_dim a multiple of 32");
        need(q_pos.size() == q.shape(0) && store_chunk >= 1 && n_pool_pages >= 1, "bad positions, chunk or pool");
        for (int64_t i = 0; i < q_pos.size(); ++i) need(q_pos.data()[i] >= 0, "positions must be >= 0");
        for (int64_t i = 0; i < page_ids.size(); ++i)
          need(page_ids.data()[i] >= 0 && page_ids.data()[i] < n_pool_pages, "a page id outside the pool");
        const int64_t n_tok = q.shape(0), n_kv = k.shape(0), kv_dim = (int64_t)n_kv_heads * head_dim;
        if (k.shape(1) != kv_dim || v.shape(0) != n_kv || v.shape(1) != kv_dim || q.shape(1) != (int64_t)n_heads * head_dim)
          throw py::value_error("paged_attention: shapes");
        int shift = 0;
        while ((1 << shift) < page_rows) ++shift;
        if ((1 << shift) != page_rows) throw py::value_error("page_rows must be a power of two");
        if (page_ids.size() * page_rows < n_kv) throw py::value_error("not enough pages");
        KVView kv;
        kv.type = (KVType)kv_type;
        kv.row_bytes = kv_row_bytes(kv.type, kv_dim);
        kv.page_shift = shift;
        kv.k_off = 0;
        kv.v_off = (size_t)page_rows * kv.row_bytes;
        kv.page_bytes = 2 * kv.v_off;
        BufferPtr pool = d.be->alloc(kv.page_bytes * (size_t)n_pool_pages, "harness pool");
        d.be->zero(pool->data(), kv.page_bytes * (size_t)n_pool_pages);
        kv.base = static_cast<uint8_t*>(pool->data());
        kv.pages = d.put(page_ids.data(), (size_t)page_ids.size());
        kv.n_pages = page_ids.size();
        float* kd = d.put(k);
        float* vd = d.put(v);
        for (int64_t r = 0; r < n_kv; r += store_chunk) {  // in chunks, as prefill and decode store
          const int64_t c = std::min(store_chunk, n_kv - r);
          d.be->kv_store(kv, r, kd + r * kv_dim, vd + r * kv_dim, c, kv_dim, kv_dim);
        }
        AttnArgs a;
        a.q = d.put(q);
        a.q_stride = q.shape(1);
        a.kv = kv;
        a.n_tok = n_tok;
        a.n_kv = n_kv;
        a.n_heads = n_heads;
        a.n_kv_heads = n_kv_heads;
        a.head_dim = head_dim;
        a.q_pos = d.put(q_pos.data(), (size_t)q_pos.size());
        a.window = window;
        a.scale = scale;
        a.softcap = softcap;
        a.sinks = sinks_o.is_none() ? nullptr : d.put(sinks);
        a.out = d.poisoned((size_t)(n_tok * n_heads * head_dim));
        a.out_stride = (int64_t)n_heads * head_dim;
        a.any_order = any_order;
        a.exact = d.exact;
        for (int r = 0; r < repeat; ++r) d.be->attention(a);  // repeat: for timing (benchmarks/)
        py::array_t<uint8_t> raw((int64_t)(kv.page_bytes * (size_t)n_pool_pages));
        d.be->download(raw.mutable_data(), pool->data(), (size_t)raw.size());
        py::array_t<float> out = d.get(a.out, {n_tok, (int64_t)n_heads * head_dim});
        return py::make_tuple(out, raw);
      }, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_pos"), py::arg("n_heads"), py::arg("n_kv_heads"),
         py::arg("head_dim"), py::arg("kv_type"), py::arg("page_rows"), py::arg("page_ids"), py::arg("n_pool_pages"),
         py::arg("window"), py::arg("scale"), py::arg("softcap"), py::arg("store_chunk"), py::arg("sinks") = py::none(),
         py::arg("any_order") = false, py::arg("repeat") = 1)
      // Several sessions of one step, as eval_batch issues them: each session's rows before
      // n_past are in its pages already; inside one begin_step / end_step each stores its new
      // rows and attention_multi runs every session's queries together. A session is
      // (q [n_tok][H hd], k and v [n_past + n_tok][KVH hd], page_ids); its queries sit at
      // n_past..n_past + n_tok - 1. Returns each session's output.
      .def("paged_attention_multi", [](Dev& d, const py::list& sessions, int n_heads, int n_kv_heads, int head_dim,
                                       int kv_type, int page_rows, int n_pool_pages, float scale) {
        need(kv_type == 0 || kv_type == 1 || kv_type == 8, "kv_type must be 0 (f32), 1 (f16) or 8 (q8_0)");
        need(n_heads > 0 && n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0, "bad head layout");
        need(kv_type != 8 || head_dim % 32 == 0, "a q8_0 cache needs head_dim a multiple of 32");
        need(n_pool_pages >= 1 && !sessions.empty(), "bad pool or no sessions");
        int shift = 0;
        while ((1 << shift) < page_rows) ++shift;
        if (page_rows < 1 || (1 << shift) != page_rows) throw py::value_error("page_rows must be a power of two");
        const int64_t kv_dim = (int64_t)n_kv_heads * head_dim, q_dim = (int64_t)n_heads * head_dim;
        KVView kv;
        kv.type = (KVType)kv_type;
        kv.row_bytes = kv_row_bytes(kv.type, kv_dim);
        kv.page_shift = shift;
        kv.v_off = (size_t)page_rows * kv.row_bytes;
        kv.page_bytes = 2 * kv.v_off;
        BufferPtr pool = d.be->alloc(kv.page_bytes * (size_t)n_pool_pages, "harness pool");
        d.be->zero(pool->data(), kv.page_bytes * (size_t)n_pool_pages);
        kv.base = static_cast<uint8_t*>(pool->data());
        std::vector<bool> used((size_t)n_pool_pages, false);
        std::vector<AttnArgs> args;
        std::vector<const float*> ks, vs;
        std::vector<int64_t> past;
        for (const py::handle& h : sessions) {
          const py::tuple t = py::cast<py::tuple>(h);
          need(t.size() == 4, "a session is (q, k, v, page_ids)");
          F32 q = f32(t[0], "q", 2), k = f32(t[1], "k", 2), v = f32(t[2], "v", 2);
          const I32 ids = I32::ensure(t[3]);
          need((bool)ids, "page_ids must be int32");
          const int64_t n_tok = q.shape(0), n_kv = k.shape(0);
          need(q.shape(1) == q_dim && k.shape(1) == kv_dim && v.shape(0) == n_kv && v.shape(1) == kv_dim &&
                   n_tok >= 1 && n_tok <= n_kv, "a session's shapes");
          need(ids.size() * page_rows >= n_kv, "a session has too few pages");
          for (int64_t i = 0; i < ids.size(); ++i) {
            const int32_t id = ids.data()[i];
            need(id >= 0 && id < n_pool_pages && !used[(size_t)id], "page ids must be in the pool and not shared");
            used[(size_t)id] = true;
          }
          std::vector<int32_t> pos((size_t)n_tok);
          for (int64_t i = 0; i < n_tok; ++i) pos[(size_t)i] = (int32_t)(n_kv - n_tok + i);
          AttnArgs a;
          a.kv = kv;
          a.kv.pages = d.put(ids.data(), (size_t)ids.size());
          a.kv.n_pages = ids.size();
          a.q = d.put(q);
          a.q_stride = q_dim;
          a.n_tok = n_tok, a.n_kv = n_kv;
          a.n_heads = n_heads, a.n_kv_heads = n_kv_heads, a.head_dim = head_dim;
          a.q_pos = d.put(pos.data(), pos.size());
          a.scale = scale;
          a.out = d.poisoned((size_t)(n_tok * q_dim));
          a.out_stride = q_dim;
          a.exact = d.exact;
          args.push_back(a);
          ks.push_back(d.put(k)), vs.push_back(d.put(v)), past.push_back(n_kv - n_tok);
        }
        const size_t n = args.size();
        for (size_t i = 0; i < n; ++i)  // the cache as earlier steps left it
          if (past[i] > 0) d.be->kv_store(args[i].kv, 0, ks[i], vs[i], past[i], kv_dim, kv_dim);
        d.be->begin_step();
        for (size_t i = 0; i < n; ++i)
          d.be->kv_store(args[i].kv, past[i], ks[i] + past[i] * kv_dim, vs[i] + past[i] * kv_dim, args[i].n_tok, kv_dim,
                         kv_dim);
        d.be->attention_multi(args.data(), (int)n);
        d.be->end_step();
        py::list outs;
        for (size_t i = 0; i < n; ++i) {
          py::array_t<float> o({args[i].n_tok, q_dim});
          d.be->download(o.mutable_data(), args[i].out, (size_t)o.size() * 4);
          outs.append(o);
        }
        d.keep.clear();
        return outs;
      }, py::arg("sessions"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("kv_type"),
         py::arg("page_rows"), py::arg("n_pool_pages"), py::arg("scale"));
}

}  // namespace dl::py_bind
