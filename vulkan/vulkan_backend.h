// The Vulkan backend's entry points for the registry (cpp/core/backend.cpp).
#pragma once
#include <memory>

#include "core/backend.h"

namespace dl {

// vulkan:N (N counts the usable devices in the loader's order); DeviceError says why not.
std::shared_ptr<Backend> make_vulkan_backend(int device_index);
// Devices reachable now, or why none (no loader, no driver, a device too old).
BackendProbe probe_vulkan();

}  // namespace dl
