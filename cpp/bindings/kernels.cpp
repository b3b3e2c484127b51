// _matmul: a test and benchmark entry to the CPU matmul kernels (quantize_act + matmul_rows over a thread pool);
// _f32_to_f16 / _f16_to_f32: the active ISA's KV-cache row conversions, for tests against numpy.
#include <pybind11/numpy.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "bindings/bind.h"
#include "core/threadpool.h"
#include "cpu/kernels.h"
#include "quant/types.h"

namespace dl::py_bind {

namespace {
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// One pool for every call, grown when a call asks for more threads; the mutex
// serializes calls (the pool runs one job at a time) since the GIL is released.
std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;
}  // namespace

void bind_kernels(py::module_& m) {
  m.def(
      "_matmul",
      [](const py::array& w, uint32_t wtype, int64_t k, const py::array& x_in, int n_threads, bool packed,
         int repeat) {
        const TypeTraits* tt = type_traits(wtype);
        if (!tt) throw py::value_error("_matmul: unknown ggml type id " + std::to_string(wtype));
        const cpu::KernelTable& kt = cpu::kernels();
        const uint32_t at = kt.act_type(wtype);
        if (at == UINT32_MAX) throw py::value_error(std::string("_matmul: no matmul for type ") + tt->name);
        if (k <= 0 || k % tt->block_size != 0)
          throw py::value_error("_matmul: k=" + std::to_string(k) + " is not a positive multiple of the " +
                                tt->name + " block (" + std::to_string(tt->block_size) + ")");
        if (k > (int64_t(1) << 30)) throw py::value_error("_matmul: k too large");
        if (!py::isinstance<py::array_t<uint8_t>>(w) || w.ndim() != 2 || !(w.flags() & py::array::c_style))
          throw py::value_error("_matmul: w must be a C-contiguous 2-D uint8 array (rows x row_bytes)");
        const int64_t row_bytes = type_nbytes(wtype, k);
        if (w.shape(1) != row_bytes)
          throw py::value_error("_matmul: a row of " + std::to_string(k) + " " + tt->name + " elements takes " +
                                std::to_string(row_bytes) + " bytes, w rows have " + std::to_string(w.shape(1)));
        auto x = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(x_in);
        if (!x || x.ndim() != 2 || x.shape(1) != k)
          throw py::value_error("_matmul: x must be a 2-D float32 array [n_tok, k=" + std::to_string(k) + "]");
        if (n_threads < 1 || n_threads > 512) throw py::value_error("_matmul: n_threads must be in [1, 512]");
        if (repeat < 1) throw py::value_error("_matmul: repeat must be >= 1");
        const int64_t rows = w.shape(0), n_tok = x.shape(0);
        py::array_t<float> y({n_tok, rows});
        if (rows == 0 || n_tok == 0) return y;

        const size_t arb = cpu::act_row_bytes(at, k);
        std::unique_ptr<uint8_t, FreeDeleter> act(static_cast<uint8_t*>(std::aligned_alloc(64, arb * (size_t)n_tok)));
        if (!act) throw std::bad_alloc();
        cpu::MatmulArgs a;
        a.wtype = wtype;
        a.k = k;
        a.w = w.data();
        a.w_row_bytes = (size_t)row_bytes;
        a.act = act.get();
        a.act_row_bytes = arb;
        a.n_tok = n_tok;
        a.y = y.mutable_data();
        a.y_stride = rows;
        a.rows = rows;
        // packed: the matrix in the active ISA's load-time layout, as the backend prepares weights.
        std::unique_ptr<uint8_t, FreeDeleter> pack;
        const size_t pack_n = packed ? kt.pack_bytes(wtype, rows, k) : 0;
        if (pack_n) {
          pack.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (pack_n + 63) / 64 * 64)));
          if (!pack) throw std::bad_alloc();
          kt.pack_rows(wtype, a.w, a.w_row_bytes, rows, k, 0, (rows + cpu::kPackRowAlign - 1) / cpu::kPackRowAlign,
                       pack.get());
          a.wpack = pack.get();
        }
        const float* xs = x.data();
        {
          py::gil_scoped_release nogil;
          std::lock_guard<std::mutex> lk(g_pool_mu);
          if (!g_pool || g_pool->size() < n_threads) {
            g_pool.reset();
            g_pool = std::make_unique<ThreadPool>(n_threads);
          }
          g_pool->run(
              [&](int ith, int nth) {
                for (int64_t t = ith; t < n_tok; t += nth) kt.quantize_act(at, xs + t * k, act.get() + t * arb, k);
              },
              n_threads);
          // Row ranges in multiples of 16 (row tiles and packed groups), as even as possible.
          const int64_t A = cpu::kPackRowAlign, tiles = (rows + A - 1) / A;
          for (int rep = 0; rep < repeat; ++rep)
            g_pool->run(
                [&](int ith, int nth) {
                  const int64_t r0 = std::min(rows, tiles * ith / nth * A);
                  const int64_t r1 = std::min(rows, tiles * (ith + 1) / nth * A);
                  kt.matmul_rows(a, r0, r1);
                },
                n_threads);
        }
        return y;
      },
      py::arg("w"), py::arg("wtype"), py::arg("k"), py::arg("x"), py::arg("n_threads") = 1, py::arg("packed") = false,
      py::arg("repeat") = 1,
      "y[n_tok, rows] = x @ W.T with W the raw rows of a ggml type, through the active ISA's kernels "
      "(packed=True: through the layout the backend prepares at load, where the ISA has one). "
      "repeat > 1 runs the product that many times after one packing and activation quantization "
      "(benchmarks time the kernel alone from the difference).");
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
