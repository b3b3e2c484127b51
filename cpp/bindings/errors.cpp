// Maps the dl:: exception types onto a Python hierarchy rooted at DasllamaError.
#include "bindings/bind.h"
#include "core/errors.h"

namespace dl::py_bind {

void bind_errors(py::module_& m) {
  static py::exception<dl::Error> base(m, "DasllamaError", PyExc_RuntimeError);
  static py::exception<dl::GGUFError> gguf(m, "GGUFError", base.ptr());
  static py::exception<dl::UnsupportedModelError> unsup(m, "UnsupportedModelError", base.ptr());
  static py::exception<dl::ContextOverflowError> ctx(m, "ContextOverflowError", base.ptr());
  static py::exception<dl::PoolExhaustedError> pool(m, "PoolExhaustedError", base.ptr());
  static py::exception<dl::DeviceError> device(m, "DeviceError", base.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dl::GGUFError& e) {
      PyErr_SetString(gguf.ptr(), e.what());
    } catch (const dl::UnsupportedModelError& e) {
      PyErr_SetString(unsup.ptr(), e.what());
    } catch (const dl::DeviceError& e) {
      PyErr_SetString(device.ptr(), e.what());
    } catch (const dl::ContextOverflowError& e) {
      PyErr_SetString(ctx.ptr(), e.what());
    } catch (const dl::PoolExhaustedError& e) {
      // The instance carries session_index: the asking session's place in a batch (else -1).
      py::object inst = py::reinterpret_borrow<py::object>(pool.ptr())(e.what());
      inst.attr("session_index") = e.index;
      PyErr_SetObject(pool.ptr(), inst.ptr());
    } catch (const dl::Error& e) {
      PyErr_SetString(base.ptr(), e.what());
    }
  });
}

}  // namespace dl::py_bind
