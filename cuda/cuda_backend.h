// The CUDA backend's entry points: make a backend on device N, and probe the devices.
#pragma once
#include <memory>

#include "core/backend.h"

namespace dl {

// The backend on CUDA device `device_index`; throws dl::DeviceError saying why not
// (no driver, no device, bad index).
std::shared_ptr<Backend> make_cuda_backend(int device_index);
// The devices the CUDA runtime sees now, or why none; never throws.
BackendProbe probe_cuda();

}  // namespace dl
