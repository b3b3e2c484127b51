// Bindings for the paged KV pool, the prefix cache and releasing a session's pages.
// Pool and cache calls are short bookkeeping under the pool's lock (no GIL release needed).
#include <pybind11/stl.h>

#include "bindings/bind.h"
#include "core/errors.h"
#include "kv/pool.h"
#include "kv/prefix_cache.h"
#include "model/model.h"
#include "model/session.h"

namespace dl::py_bind {

namespace {

// Token ids (>= 0, < vocab) or media ids (< 0, int32), as the history holds them.
std::vector<int32_t> history_ids(const Model& m, const std::vector<int64_t>& ids) {
  std::vector<int32_t> out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= m.config().vocab_size || ids[i] < INT32_MIN)
      throw py::value_error("id " + std::to_string(ids[i]) + " is neither a token id below " +
                            std::to_string(m.config().vocab_size) + " nor an int32 media id");
    out[i] = (int32_t)ids[i];
  }
  return out;
}

PrefixCache& bound(PrefixCache& c, const std::shared_ptr<KVPool>& pool) {
  if (!pool) throw py::value_error("no pool");
  c.bind(pool);
  return c;
}

}  // namespace

void bind_kv(py::module_& m) {
  py::class_<KVPool, std::shared_ptr<KVPool>>(m, "KVPool")
      .def(py::init([](std::shared_ptr<Model> model, int64_t page_rows, int kv, int64_t max_pages) {
             if (!model) throw py::value_error("KVPool needs a model");
             if (kv != 0 && kv != 1 && kv != 8) throw py::value_error("kv_dtype must be KVDtype.f32, f16 or q8_0");
             if (page_rows < 1 || page_rows > 65536 || (page_rows & (page_rows - 1)) != 0)
               throw py::value_error("page_rows must be a power of two in [1, 65536], got " +
                                     std::to_string(page_rows));
             if (max_pages < 0) throw py::value_error("max_pages must be >= 0 (0: four default contexts)");
             if (max_pages == 0) {
               // Four contexts of the default session size; memory is taken page by page.
               const int64_t ctx = std::min(model->config().seq_len, 4096);
               max_pages = std::max<int64_t>(1, 4 * ((ctx + page_rows - 1) / page_rows));
             }
             return std::make_shared<KVPool>(model->kv_geometry((KVType)kv), page_rows, max_pages,
                                             model->backend_ptr());
           }),
           py::arg("model"), py::arg("page_rows") = 64, py::arg("kv_dtype") = 1, py::arg("max_pages") = 0)
      .def_property_readonly("page_rows", &KVPool::page_rows)
      .def_property_readonly("max_pages", &KVPool::max_pages)
      .def_property_readonly("page_bytes", &KVPool::page_bytes)
      .def_property_readonly("kv_dtype", [](const KVPool& p) { return (int)p.geometry().type; })
      .def("refcount",
           [](const KVPool& p, int64_t id) {
             if (id < 0 || id >= p.max_pages()) throw py::value_error("page id out of range");
             std::lock_guard<std::mutex> lk(p.mu());
             const PoolStats s = p.stats_locked();
             return id < s.allocated ? p.refcount((int32_t)id) : 0;
           })
      .def("stats", [](const KVPool& p) {
        const PoolStats s = p.stats();
        py::dict d;
        d["page_rows"] = s.page_rows;
        d["page_bytes"] = s.page_bytes;
        d["total"] = s.total;
        d["free"] = s.free;
        d["used"] = s.used;
        d["by_sessions"] = s.by_sessions;
        d["by_cache"] = s.by_cache;
        d["shared"] = s.shared;
        d["allocated"] = s.allocated;
        return d;
      });

  py::class_<PrefixCache, std::shared_ptr<PrefixCache>>(m, "PrefixCache")
      .def(py::init([](int64_t max_groups) {
             if (max_groups < 0) throw py::value_error("max_groups must be >= 0 (0: unbounded)");
             return std::make_shared<PrefixCache>(max_groups);
           }),
           py::arg("max_groups") = 0)
      .def_property_readonly("max_groups", &PrefixCache::max_groups)
      .def("held", &PrefixCache::held)
      // Recurrent-state snapshots held with cached pages (hybrid models), and their budget.
      .def("states_held", &PrefixCache::states_held)
      .def_property("max_states", &PrefixCache::max_states, [](PrefixCache& c, int64_t n) {
        if (n < 0) throw py::value_error("max_states must be >= 0");
        c.set_max_states(n);
      })
      .def("chains",
           [](const PrefixCache& c) {
             py::list out;
             for (const PrefixChainInfo& i : c.chains()) {
               py::dict d;
               d["tokens"] = i.tokens;
               d["live_pages"] = i.live_pages;
               d["hits"] = i.hits;
               d["born"] = i.born;
               d["last_hit"] = i.last_hit;
               d["preview"] = i.preview;
               out.append(d);
             }
             return out;
           })
      .def("release",
           [](PrefixCache& c, const std::shared_ptr<KVPool>& pool) {
             if (c.pool() && pool && c.pool() != pool) throw py::value_error("this prefix cache serves another pool");
             c.release();
           })
      .def("evict_one", [](PrefixCache& c) {
        if (!c.pool()) return false;
        std::lock_guard<std::mutex> lk(c.pool()->mu());
        return c.evict_one_locked();
      });

  m.def("prefix_attach", [](PrefixCache& c, const std::shared_ptr<KVPool>& pool, Session& s,
                            const std::vector<int64_t>& prompt) {
    if (s.kv().pool_ptr() != pool) throw py::value_error("prefix_attach: the session is not of this pool");
    auto ids = history_ids(s.model(), prompt);
    return prefix_attach(bound(c, pool), s, ids);
  });
  m.def("prefix_insert", [](PrefixCache& c, const std::shared_ptr<KVPool>& pool, Session& s,
                            const std::vector<int64_t>& tokens, const std::string& preview) {
    if (s.kv().pool_ptr() != pool) throw py::value_error("prefix_insert: the session is not of this pool");
    auto ids = history_ids(s.model(), tokens);
    prefix_insert(bound(c, pool), s, ids, preview);
  });
  m.def("release_kv_pages", [](Session& s) { s.release_pages(); });
  m.def("session_pages", [](const Session& s) { return s.kv().page_ids(); });
}

}  // namespace dl::py_bind
