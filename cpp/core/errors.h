// Exception types the core throws; bindings map each to a Python class of the same name.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>

namespace dl {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A malformed or truncated GGUF file; the message names the field and byte offset.
struct GGUFError : Error {
  using Error::Error;
};
// An architecture, tensor type or feature we do not serve; the message names it.
struct UnsupportedModelError : Error {
  using Error::Error;
};
// Evaluating past the session's context.
struct ContextOverflowError : Error {
  using Error::Error;
};
// A KV pool with no free page left for the session asking. In a batched step,
// index is the asking session's place in the batch (else -1).
struct PoolExhaustedError : Error {
  using Error::Error;
  PoolExhaustedError(const std::string& what, int64_t i) : Error(what), index(i) {}
  int64_t index = -1;
};

// A device that is missing, not built, or out of memory; the message says which and why.
// Raised before anything is half-allocated.
struct DeviceError : Error {
  using Error::Error;
};

}  // namespace dl
