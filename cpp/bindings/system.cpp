// system_info(): CPU features, compiled and active ISA, backends built; ISA control.
#include <pybind11/stl.h>

#include "bindings/bind.h"
#include "core/cpu_features.h"
#include "cpu/kernels.h"

namespace dl::py_bind {

py::dict device_dict(const DeviceInfo& i) {
  py::dict d;
  d["backend"] = i.backend;
  d["index"] = i.index;
  d["name"] = i.name;
  if (i.backend == "cpu") {
    d["threads"] = i.threads;
  } else {
    d["total_bytes"] = i.total_bytes;
    d["free_bytes"] = i.free_bytes;
    if (i.backend == "cuda") d["compute_capability"] = std::to_string(i.cc_major) + "." + std::to_string(i.cc_minor);
    d["driver"] = i.driver;
    d["features"] = i.features;
  }
  return d;
}

void bind_system(py::module_& m) {
  m.def("system_info", [] {
    const CpuFeatures& f = cpu_features();
    py::dict cpu;
    cpu["arch"] = f.arch;
    py::dict flags;
#define F(x) flags[#x] = f.x;
    F(sse42) F(avx) F(avx2) F(fma) F(f16c) F(bmi2) F(avx512f) F(avx512bw) F(avx512vl) F(avx512dq)
    F(avx512vnni) F(avx512bf16) F(avxvnni) F(amx_int8) F(neon) F(dotprod) F(i8mm) F(fp16)
#undef F
    cpu["features"] = flags;
    cpu["logical_cores"] = f.logical_cores;
    cpu["physical_cores"] = f.physical_cores;
    py::list compiled, supported;
    for (Isa i : isas_compiled()) {
      compiled.append(isa_name(i));
      if (isa_supported(i)) supported.append(isa_name(i));
    }
    py::dict d;
    d["cpu"] = cpu;
    d["isa_compiled"] = compiled;
    d["isa_supported"] = supported;
    d["isa_active"] = isa_name(active_isa());
    d["backends_built"] = std::string(DL_BACKENDS_BUILT);
    // Each backend: built or not, the devices it reaches now, or why none.
    py::dict devs;
    for (const BackendProbe& p : probe_backends()) {
      py::dict e;
      e["built"] = p.built;
      py::list l;
      for (const DeviceInfo& i : p.devices) l.append(device_dict(i));
      e["devices"] = l;
      e["error"] = p.error;
      devs[py::str(p.backend)] = e;
    }
    d["devices"] = devs;
    return d;
  }, "CPU features, kernel ISAs and backends of this build.");
  m.def("set_isa", [](const std::string& name) { set_active_isa(parse_isa(name)); },
        "Force the kernel ISA (baseline, avx2, avx512, neon, i8mm); raises if it cannot run here.");
  m.def("get_isa", [] { return std::string(isa_name(active_isa())); });
}

}  // namespace dl::py_bind
