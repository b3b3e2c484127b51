// The Vulkan loader opened at run time (dlopen of libvulkan.so.1) and the entry points we use,
// so a module built here imports and runs on the CPU where no loader or driver is installed.
#pragma once
#define VK_NO_PROTOTYPES
#include <vulkan/vulkan.h>

#include <string>

namespace dl::vk {

#define DL_VK_INSTANCE_FNS(X)                                                                          \
  X(vkDestroyInstance) X(vkEnumeratePhysicalDevices) X(vkGetPhysicalDeviceProperties)                  \
  X(vkGetPhysicalDeviceProperties2) X(vkGetPhysicalDeviceFeatures2)                                    \
  X(vkGetPhysicalDeviceMemoryProperties) X(vkGetPhysicalDeviceQueueFamilyProperties) X(vkCreateDevice) \
  X(vkGetDeviceProcAddr) X(vkEnumerateDeviceExtensionProperties)

#define DL_VK_DEVICE_FNS(X)                                                                           \
  X(vkDestroyDevice) X(vkGetDeviceQueue) X(vkCreateBuffer) X(vkDestroyBuffer)                          \
  X(vkGetBufferMemoryRequirements) X(vkAllocateMemory) X(vkFreeMemory) X(vkBindBufferMemory)           \
  X(vkMapMemory) X(vkUnmapMemory) X(vkGetBufferDeviceAddress) X(vkCreateShaderModule)                  \
  X(vkDestroyShaderModule) X(vkCreatePipelineLayout) X(vkDestroyPipelineLayout)                        \
  X(vkCreateComputePipelines) X(vkDestroyPipeline) X(vkCreateCommandPool) X(vkDestroyCommandPool)      \
  X(vkAllocateCommandBuffers) X(vkBeginCommandBuffer) X(vkEndCommandBuffer) X(vkResetCommandBuffer)    \
  X(vkCmdBindPipeline) X(vkCmdPushConstants) X(vkCmdDispatch) X(vkCmdPipelineBarrier)                  \
  X(vkCmdCopyBuffer) X(vkCmdFillBuffer) X(vkQueueSubmit) X(vkCreateFence) X(vkDestroyFence)            \
  X(vkWaitForFences) X(vkResetFences) X(vkCreateQueryPool) X(vkDestroyQueryPool) X(vkCmdResetQueryPool)  \
  X(vkCmdWriteTimestamp) X(vkGetQueryPoolResults) X(vkCmdExecuteCommands) X(vkFreeCommandBuffers)

// The loader, one instance per process (made on first use, kept to exit).
struct Api {
  PFN_vkGetInstanceProcAddr vkGetInstanceProcAddr = nullptr;
  VkInstance instance = VK_NULL_HANDLE;
  uint32_t api_version = VK_API_VERSION_1_2;  // the instance's (1.3 with DASLLAMA_VULKAN_COOPMAT2=1)
#define DL_DECL(f) PFN_##f f = nullptr;
  DL_VK_INSTANCE_FNS(DL_DECL)
#undef DL_DECL
};

// The process's loader and instance, or null with `why` set (no libvulkan, no instance).
const Api* api(std::string* why);

// Device-level entry points of one VkDevice.
struct DeviceFns {
#define DL_DECL(f) PFN_##f f = nullptr;
  DL_VK_DEVICE_FNS(DL_DECL)
#undef DL_DECL
  void load(const Api& a, VkDevice dev);
};

const char* result_str(VkResult r);

}  // namespace dl::vk
