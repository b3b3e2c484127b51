// Reads a weight range and drops it: its lines land in the GPU's L2, so the GEMV that reads them
// next (a barrier later) finds them there. Vulkan has no dependent launches, so a decode step's
// GEMV starts cold after each barrier; this runs beside the decode attention, which leaves the
// memory idle (vulkan_backend.cpp, prefetch). The loads feed a value stored only when `magic`
// is nonzero and matches, which the backend never asks for: the compiler cannot drop them.
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t a;    // 16-aligned
  uint64_t n16;  // 16-byte units
  uint64_t sink;
  uint magic;
} pc;

void main() {
  uvec4 acc = uvec4(0u);
  const uint64_t per = 256ul * 8ul, stride = uint64_t(gl_NumWorkGroups.x) * per;
  for (uint64_t i0 = uint64_t(gl_WorkGroupID.x) * per + gl_LocalInvocationID.x; i0 < pc.n16; i0 += stride) {
    uvec4 v[8];  // eight 16-byte loads in flight an invocation
    [[unroll]] for (uint u = 0u; u < 8u; ++u) {
      const uint64_t i = i0 + 256ul * u;
      v[u] = i < pc.n16 ? V4U(pc.a + i * 16ul).v[0] : uvec4(0u);
    }
    [[unroll]] for (uint u = 0u; u < 8u; ++u) acc ^= v[u];
  }
  if (pc.magic != 0u && acc.x == pc.magic) U32(pc.sink).v[0] = acc.y ^ acc.z ^ acc.w;
}
