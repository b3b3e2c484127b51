// Backend::argmax: each row split over S workgroups (x; the row is y). Each invocation keeps the
// first largest of a strided walk over its workgroup's range, 8 loads in flight a round; the
// workgroup joins them in shared memory, the smaller index winning ties (so the first index
// overall, in any join order). v > b never holds for a NaN; a row of -inf keeps its first
// through i < bi. With S > 1 each workgroup leaves (value, index) in the row's partials and the
// last to finish (a counter a row, left at 0 again) joins the S of them: one workgroup a row
// walked 500 loads an invocation for a 128K vocabulary, the greedy step's longest dispatch.
#version 450
#include "common.glsl"

layout(constant_id = 0) const uint WG = 64;
layout(local_size_x_id = 0) in;
layout(push_constant, std430) uniform PC {
  uint64_t x, out_, part, cnt;  // part: (value bits, index) pairs [row][S]; cnt: a counter a row
  uint dim, row_base, S;
} pc;

// The partials as other workgroups see them: coherent (not from a stale cache).
layout(buffer_reference, std430, buffer_reference_align = 8) coherent buffer PartU { uvec2 v[]; };

shared float sb[WG];
shared uint si[WG];
shared bool last;

const uint NONE = 0xffffffffu, U = 8u;

void join(inout float b, inout uint bi, float v, uint i) {
  if (v > b || (v == b && i < bi)) {
    b = v;
    bi = i;
  }
}

// The workgroup's join of (b, bi) into sb[0], si[0].
void reduce(float b, uint bi, uint tid) {
  sb[tid] = b;
  si[tid] = bi;
  barrier();
  for (uint h = WG / 2u; h > 0u; h >>= 1) {
    if (tid < h) {
      float v = sb[tid];
      uint vi = si[tid];
      join(v, vi, sb[tid + h], si[tid + h]);
      sb[tid] = v;
      si[tid] = vi;
    }
    barrier();
  }
}

void main() {
  const uint s = gl_WorkGroupID.x, S = pc.S, r = pc.row_base + gl_WorkGroupID.y, tid = gl_LocalInvocationID.x;
  F32 x = F32(pc.x + uint64_t(r) * pc.dim * 4u);
  const uint chunk = (pc.dim + S - 1u) / S, lo = s * chunk, hi = min(pc.dim, lo + chunk);
  float b = uintBitsToFloat(0xff800000u);  // -inf
  uint bi = NONE;
  for (uint i0 = lo + tid; i0 < hi; i0 += WG * U) {
    float v[U];
    for (uint u = 0u; u < U; ++u) {
      const uint i = i0 + u * WG;
      v[u] = i < hi ? x.v[i] : uintBitsToFloat(0xff800000u);
    }
    for (uint u = 0u; u < U; ++u) {
      const uint i = i0 + u * WG;
      if (i < hi) join(b, bi, v[u], i);
    }
  }
  reduce(b, bi, tid);
  if (S == 1u) {
    if (tid == 0u) I32(pc.out_).v[r] = si[0] == NONE ? 0 : int(si[0]);
    return;
  }
  PartU p = PartU(pc.part + uint64_t(r) * S * 8u);
  if (tid == 0u) p.v[s] = uvec2(floatBitsToUint(sb[0]), si[0]);
  // The partial out before the count; the row's last workgroup reads all of them.
  memoryBarrierBuffer();
  barrier();
  if (tid == 0u) {
    U32 cnt = U32(pc.cnt);
    last = atomicAdd(cnt.v[r], 1u) == S - 1u;
    if (last) cnt.v[r] = 0u;  // every workgroup has counted: ready for the next call
  }
  barrier();
  if (!last) return;
  memoryBarrierBuffer();
  b = uintBitsToFloat(0xff800000u);
  bi = NONE;
  for (uint k = tid; k < S; k += WG) {
    const uvec2 e = p.v[k];
    join(b, bi, uintBitsToFloat(e.x), e.y);
  }
  reduce(b, bi, tid);
  if (tid == 0u) I32(pc.out_).v[r] = si[0] == NONE ? 0 : int(si[0]);
}
