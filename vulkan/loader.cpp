// dlopen of the Vulkan loader, the process-wide instance, and device function tables.
#include "loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace dl::vk {

const Api* api(std::string* why) {
  static std::once_flag once;
  static Api a;
  static std::string err;
  std::call_once(once, [] {
    void* lib = dlopen("libvulkan.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libvulkan.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      err = "the Vulkan loader (libvulkan.so.1) is not installed (Debian: libvulkan1 and a driver such as "
            "mesa-vulkan-drivers)";
      return;
    }
    a.vkGetInstanceProcAddr = reinterpret_cast<PFN_vkGetInstanceProcAddr>(dlsym(lib, "vkGetInstanceProcAddr"));
    auto create = a.vkGetInstanceProcAddr
                      ? reinterpret_cast<PFN_vkCreateInstance>(a.vkGetInstanceProcAddr(nullptr, "vkCreateInstance"))
                      : nullptr;
    if (!create) {
      err = "libvulkan.so.1 has no vkGetInstanceProcAddr / vkCreateInstance";
      return;
    }
    VkApplicationInfo app{VK_STRUCTURE_TYPE_APPLICATION_INFO};
    app.pApplicationName = "dasllama";
    app.apiVersion = VK_API_VERSION_1_2;  // buffer device addresses are core from 1.2
    // Vulkan 1.3 where the loader has it, whose SPIR-V 1.6 NVIDIA's workgroup-scope cooperative
    // matrices need (gemm_f16m.comp); DASLLAMA_VULKAN_COOPMAT2=0 (read once, at the first device)
    // keeps 1.2 and the matrices off.
    if (const char* e = std::getenv("DASLLAMA_VULKAN_COOPMAT2"); !(e && std::strcmp(e, "0") == 0)) {
      auto ver = reinterpret_cast<PFN_vkEnumerateInstanceVersion>(
          a.vkGetInstanceProcAddr(nullptr, "vkEnumerateInstanceVersion"));
      uint32_t v = 0;
      if (ver && ver(&v) == VK_SUCCESS && v >= VK_API_VERSION_1_3) app.apiVersion = VK_API_VERSION_1_3;
    }
    VkInstanceCreateInfo ci{VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO};
    ci.pApplicationInfo = &app;
    const VkResult r = create(&ci, nullptr, &a.instance);
    a.api_version = app.apiVersion;
    if (r != VK_SUCCESS) {
      err = std::string("vkCreateInstance failed: ") + result_str(r) +
            (r == VK_ERROR_INCOMPATIBLE_DRIVER ? " (no Vulkan driver installed)" : "");
      a.instance = VK_NULL_HANDLE;
      return;
    }
#define DL_LOAD(f) a.f = reinterpret_cast<PFN_##f>(a.vkGetInstanceProcAddr(a.instance, #f));
    DL_VK_INSTANCE_FNS(DL_LOAD)
#undef DL_LOAD
  });
  if (!a.instance) {
    if (why) *why = err;
    return nullptr;
  }
  return &a;
}

void DeviceFns::load(const Api& a, VkDevice dev) {
#define DL_LOAD(f) f = reinterpret_cast<PFN_##f>(a.vkGetDeviceProcAddr(dev, #f));
  DL_VK_DEVICE_FNS(DL_LOAD)
#undef DL_LOAD
}

const char* result_str(VkResult r) {
  switch (r) {
#define DL_R(x) case x: return #x;
    DL_R(VK_SUCCESS) DL_R(VK_NOT_READY) DL_R(VK_TIMEOUT) DL_R(VK_INCOMPLETE) DL_R(VK_ERROR_OUT_OF_HOST_MEMORY)
    DL_R(VK_ERROR_OUT_OF_DEVICE_MEMORY) DL_R(VK_ERROR_INITIALIZATION_FAILED) DL_R(VK_ERROR_DEVICE_LOST)
    DL_R(VK_ERROR_MEMORY_MAP_FAILED) DL_R(VK_ERROR_LAYER_NOT_PRESENT) DL_R(VK_ERROR_EXTENSION_NOT_PRESENT)
    DL_R(VK_ERROR_FEATURE_NOT_PRESENT) DL_R(VK_ERROR_INCOMPATIBLE_DRIVER) DL_R(VK_ERROR_TOO_MANY_OBJECTS)
    DL_R(VK_ERROR_UNKNOWN)
#undef DL_R
    default: return "VkResult (other)";
  }
}

}  // namespace dl::vk
