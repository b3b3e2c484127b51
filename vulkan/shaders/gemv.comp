// The decode GEMV (up to 32 tokens, subgroup devices) for weights read in 16-byte units: the
// split q8_0 / q4_0 layouts (16 and 32 elements a unit, f16 scales after the row's quants) and
// f16 / bf16 (8 elements). cuda/matmul.cu's gemv_direct_k in Vulkan terms:
//  - a subgroup owns R rows, so every x value it loads serves R rows, and the reduction is one
//    subgroupAdd per (row, token) over R rows' worth of loads;
//  - KS subgroups (pc.ks, picked by the host from the row length) split a long row's units and
//    meet in shared memory, so long rows still spread over many lanes;
//  - each lane loads two units of each of its R rows (2R 16-byte loads) before using any, so
//    that many loads are in flight per lane (a GPU does not overlap loop iterations itself).
// Same push constants and fusions as matmul.comp's SG path (up to three weights against one x,
// x RMS-normed on the way, the result added into y), plus ks and rpw.
// Compiled per TYPE and per NT (tokens a pass: 1 for decode, 8 otherwise).
// With -DGLU (one weight, no norm) x is act(gate) * up, computed on the way from the GLU's
// inputs (a step's glu followed by the matmul that reads its output: ffn down): one dispatch
// and one barrier less. The GLU's output is still written, by the last workgroup to finish
// (a counter at norm_w, left at 0 again): out may be up itself, which every workgroup reads.
// Its fields ride in unused slots: w[1] up, w[2] the GLU's out, y[1] the gate and up row
// strides (low, high 32 bits), y[2] the activation (ops.comp's op code), norm_w the counter.
// With -DGLUT (two weights, gate and up, of equal height; one token): the GLU's output
// act(gate) * up written by the second of the two workgroups that cover the same rows of gate and
// of up to finish (a counter a block at kvp; y[2] the output, w[2] the activation code), so the
// glu's dispatch is taken back and ffn down reads a plain x.
// With -DKVT (three weights Q, K and V; heads of head_dim rows, rpw a multiple or a divisor of
// it; one pass of tokens, grid y 1): the step's ropes and KV store folded in as gemv_i8x.comp's
// KV tail does them (kvtail.glsl): the last workgroup to finish a head's rows (a KV head's: of
// its K and V rows) does that head's; the parameters and counters at kvp (KvTailParams).
#version 450
#include "common.glsl"
#include "dequant.glsl"
#ifdef KVT
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#endif
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x = 128) in;
layout(push_constant, std430) uniform PC {
  uint64_t w[3], y[3];
  uint64_t x, row_bytes, norm_w;
  uint rows[3];
  uint cols, n, b0, b1, flags;
  float eps;
  uint ks, rpw;  // subgroups a row is split over; rows a workgroup covers
  uint64_t kvp;  // KVT: the KV tail's parameters
} pc;

const uint R = 4u, U = 2u;
#if TYPE == T_Q8_0S
const uint UE = 16u;
#elif TYPE == T_Q4_0S
const uint UE = 32u;
#else
const uint UE = 8u;
#endif
#if defined(GLU) || defined(GLUT)
shared bool glu_last;
#include "glu.glsl"
#endif
const uint MAXSG = 32u;  // 128 invocations over subgroups of 4 or more
shared float red[MAXSG][R + 1u][NT];
#ifdef KVT
shared float kv_h[256], kv_amax[32];
shared bool tail_last;
#define KV_H(e) kv_h[e]
#define KV_AMAX(i) kv_amax[i]
#include "kvtail.glsl"
#define YV F32C  // y read back by a tail in another workgroup
#elif defined(GLUT)
#define YV F32C
#else
#define YV F32
#endif

// The 8 values of half h of unit q (before the unit's scale), and their first element's offset.
uint unit_group(uvec4 q, uint h, out float v[8]) {
#if TYPE == T_Q8_0S
  const uint a = h == 1u ? q.z : q.x, b = h == 1u ? q.w : q.y;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) v[i] = float(sbyte(i < 4u ? a : b, i & 3u));
  return 8u * h;
#elif TYPE == T_Q4_0S
  // Halves 0, 1: the low nibbles of bytes 0-7, 8-15 (elements 0-15); 2, 3: the high ones.
  const uint a = (h & 1u) == 1u ? q.z : q.x, b = (h & 1u) == 1u ? q.w : q.y;
  const uint sh = (h >> 1) * 4u;
  [[unroll]] for (uint i = 0u; i < 8u; ++i) v[i] = float(int(((i < 4u ? a : b) >> ((i & 3u) * 8u + sh)) & 0xFu) - 8);
  return 8u * h;
#else
  [[unroll]] for (uint i = 0u; i < 4u; ++i) {
    const uint w = i == 0u ? q.x : i == 1u ? q.y : i == 2u ? q.z : q.w;
#if TYPE == T_F16
    const vec2 f = unpackHalf2x16(w);
#else
    const vec2 f = vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xffff0000u));
#endif
    v[2u * i] = f.x, v[2u * i + 1u] = f.y;
  }
  return 0u;
#endif
}

float unit_scale(uint64_t row, uint u) {
#if TYPE == T_Q8_0S
  return h2f(rd16(row + uint64_t(pc.cols) + uint64_t(u >> 1) * 2u));
#elif TYPE == T_Q4_0S
  return h2f(rd16(row + uint64_t(pc.cols / 2u) + uint64_t(u) * 2u));
#else
  return 1.0f;
#endif
}

void main() {
  uint wg = gl_WorkGroupID.x, mi = 0u;
  if (wg >= pc.b0) {
    wg -= pc.b0, mi = 1u;
    if (wg >= pc.b1) wg -= pc.b1, mi = 2u;
  }
  const uint rows = pc.rows[mi];
  const uint64_t wbase = pc.w[mi], rb = pc.row_bytes;
  const uint t0 = gl_WorkGroupID.y * NT, nt = min(NT, pc.n - t0);
  const uint nsg = gl_NumSubgroups, sg = gl_SubgroupID, lane = gl_SubgroupInvocationID, S = gl_SubgroupSize;
  const uint ks = min(pc.ks, nsg);  // a device with wider subgroups than the host planned for
  const uint groups = nsg / ks, group = sg / ks, part = sg % ks;
  const bool in_use = group < groups;  // subgroups past groups * ks idle (nsg not a multiple of ks)
  const uint nu = pc.cols / UE, per = (nu + ks - 1u) / ks;
  const uint ub = part * per, ue = min(nu, ub + per);
  const bool norm = (pc.flags & 1u) != 0u;
  // The same number of passes in every subgroup (the barriers below are in uniform flow).
  const uint passes = (pc.rpw + groups * R - 1u) / (groups * R);
  for (uint pass = 0u; pass < passes; ++pass) {
    const uint r0 = wg * pc.rpw + (pass * groups + group) * R;
    const bool live = in_use && (pass * groups + group) * R < pc.rpw && r0 < rows;
    float acc[R][NT], ss[NT];
    [[unroll]] for (uint t = 0u; t < NT; ++t) {
      ss[t] = 0.0f;
      [[unroll]] for (uint r = 0u; r < R; ++r) acc[r][t] = 0.0f;
    }
#ifdef GLU
    const uint gs = uint(pc.y[1]), us = uint(pc.y[1] >> 32), act = uint(pc.y[2]);
#endif
    if (live) {
      uint64_t row[R];
      [[unroll]] for (uint r = 0u; r < R; ++r) row[r] = wbase + uint64_t(min(r0 + r, rows - 1u)) * rb;
      for (uint u0 = ub + lane; u0 < ue; u0 += U * S) {
        uvec4 q[U][R];
        float d[U][R];
        [[unroll]] for (uint k = 0u; k < U; ++k) {
          const uint u = min(u0 + k * S, ue - 1u);  // past ue: a repeat, loaded but not used
          [[unroll]] for (uint r = 0u; r < R; ++r) {
            q[k][r] = V4U(row[r] + uint64_t(u) * 16u).v[0];
            d[k][r] = unit_scale(row[r], u);
          }
        }
        [[unroll]] for (uint k = 0u; k < U; ++k) {
          const uint u = u0 + k * S;
          if (u >= ue) break;
          [[unroll]] for (uint h = 0u; h < UE / 8u; ++h) {
            float wv[R][8];
            uint off = 0u;
            [[unroll]] for (uint r = 0u; r < R; ++r) off = unit_group(q[k][r], h, wv[r]);
            const uint e = u * UE + off;
            vec4 nw0 = vec4(1.0f), nw1 = vec4(1.0f);
            if (norm && pc.norm_w != 0ul) {
              V4 nr = V4(pc.norm_w + uint64_t(e) * 4u);
              nw0 = nr.v[0], nw1 = nr.v[1];
            }
            [[unroll]] for (uint t = 0u; t < NT; ++t) {
              if (t >= nt) break;
#ifdef GLU
              V4 gr = V4(pc.x + (uint64_t(t0 + t) * gs + e) * 4u), ur = V4(pc.w[1] + (uint64_t(t0 + t) * us + e) * 4u);
              vec4 xa, xb;
              {
                const vec4 g0 = gr.v[0], g1 = gr.v[1], u0 = ur.v[0], u1 = ur.v[1];
                [[unroll]] for (uint i = 0u; i < 4u; ++i) {
                  xa[i] = glu_act(act, g0[i]) * u0[i];
                  xb[i] = glu_act(act, g1[i]) * u1[i];
                }
              }
#else
              V4 xr = V4(pc.x + (uint64_t(t0 + t) * pc.cols + e) * 4u);
              vec4 xa = xr.v[0], xb = xr.v[1];
#endif
              if (norm) {
                ss[t] += dot(xa, xa) + dot(xb, xb);
                xa *= nw0, xb *= nw1;
              }
              [[unroll]] for (uint r = 0u; r < R; ++r) {
                const float p = dot(vec4(wv[r][0], wv[r][1], wv[r][2], wv[r][3]), xa) +
                                dot(vec4(wv[r][4], wv[r][5], wv[r][6], wv[r][7]), xb);
                acc[r][t] += d[k][r] * p;
              }
            }
          }
        }
      }
    }
    // Subgroup sums; with ks > 1 the row's parts meet in shared memory.
    [[unroll]] for (uint t = 0u; t < NT; ++t) {
      if (t >= nt) break;
      [[unroll]] for (uint r = 0u; r < R; ++r) acc[r][t] = subgroupAdd(acc[r][t]);
      if (norm) ss[t] = subgroupAdd(ss[t]);
    }
    if (ks > 1u) {
      if (subgroupElect()) {
        [[unroll]] for (uint t = 0u; t < NT; ++t) {
          [[unroll]] for (uint r = 0u; r < R; ++r) red[sg][r][t] = acc[r][t];
          red[sg][R][t] = ss[t];
        }
      }
      barrier();
      if (part == 0u && in_use) {
        [[unroll]] for (uint t = 0u; t < NT; ++t) {
          [[unroll]] for (uint r = 0u; r < R; ++r) {
            float s = 0.0f;
            for (uint p = 0u; p < ks; ++p) s += red[sg + p][r][t];
            acc[r][t] = s;
          }
          float q = 0.0f;
          for (uint p = 0u; p < ks; ++p) q += red[sg + p][R][t];
          ss[t] = q;
        }
      }
      barrier();  // red is rewritten by the next pass
    }
    if (live && part == 0u) {
      // Lane i < R * nt writes (row i % R, token i / R).
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= nt) break;
        float s[R];
        [[unroll]] for (uint r = 0u; r < R; ++r) s[r] = acc[r][t];
        const float sc = norm ? 1.0f / sqrt(ss[t] / float(pc.cols) + pc.eps) : 1.0f;
        if (lane < R && r0 + lane < rows) {
          const float v = (lane == 0u ? s[0] : lane == 1u ? s[1] : lane == 2u ? s[2] : s[3]) * sc;
          YV yo = YV(pc.y[mi] + (uint64_t(t0 + t) * rows + r0 + lane) * 4u);
          yo.v[0] = (pc.flags & 2u) != 0u ? yo.v[0] + v : v;
        }
      }
    }
  }
#ifdef GLU
  // Every workgroup has read its gate and up (its sums are out): the last one writes the GLU.
  barrier();
  if (gl_LocalInvocationIndex == 0u) {
    U32 cnt = U32(pc.norm_w);
    glu_last = atomicAdd(cnt.v[0], 1u) == gl_NumWorkGroups.x * gl_NumWorkGroups.y - 1u;
    if (glu_last) cnt.v[0] = 0u;
  }
  barrier();
  if (glu_last)
    glu_write(pc.x, pc.w[1], pc.w[2], uint(pc.y[1]), uint(pc.y[1] >> 32), pc.n, pc.cols, uint(pc.y[2]),
              gl_LocalInvocationIndex, gl_WorkGroupSize.x);
#endif
#ifdef GLUT
  // This workgroup's rows of gate (or up) are out: the second of the pair to count writes the GLU.
  memoryBarrierBuffer();
  barrier();
  if (gl_LocalInvocationIndex == 0u) {
    U32 c = U32(pc.kvp + uint64_t(wg) * 4u);
    glu_last = atomicAdd(c.v[0], 1u) == 1u;
    if (glu_last) c.v[0] = 0u;  // both have counted: ready for the next dispatch
  }
  barrier();
  if (glu_last) {
    memoryBarrierBuffer();
    F32C gr = F32C(pc.y[0]), ur = F32C(pc.y[1]);
    F32 o = F32(pc.y[2]);
    const uint act = uint(pc.w[2]);
    for (uint i = gl_LocalInvocationIndex; i < pc.rpw; i += gl_WorkGroupSize.x) {
      const uint r = wg * pc.rpw + i;
      if (r < rows) o.v[r] = glu_act(act, gr.v[r]) * ur.v[r];
    }
  }
#endif
#ifdef KVT
  // The heads this workgroup's rows cover (one, or rpw / head_dim of them): each counted, and
  // done by the workgroup that counts it last.
  memoryBarrierBuffer();  // this workgroup's y writes, before its counts
  KvP P = KvP(pc.kvp);
  const uint hd = P.head_dim, nq = pc.rows[0] / hd, wgs = pc.rpw >= hd ? 1u : hd / pc.rpw;
  const uint lid = gl_LocalInvocationIndex;
  const uint h0 = wg * pc.rpw / hd, h1 = (min(rows, wg * pc.rpw + pc.rpw) + hd - 1u) / hd;
  for (uint head = h0; head < h1; ++head) {
    barrier();  // every invocation's writes made available (and tail_last read) before the count
    if (lid == 0u) {
      U32 c = U32(P.cnt + uint64_t(mi == 0u ? head : nq + head) * 4u);
      const uint done = atomicAdd(c.v[0], 1u);
      tail_last = done == (mi == 0u ? 1u : 2u) * wgs - 1u;
      if (tail_last) c.v[0] = 0u;  // every workgroup of the head has counted: ready for the next dispatch
    }
    barrier();
    if (tail_last) {
      memoryBarrierBuffer();
      kv_tail(P, mi, head, pc.n, pc.y[0], pc.y[1], pc.y[2], pc.rows[0], pc.rows[1], pc.rows[2], lid, gl_WorkGroupSize.x);
    }
  }
#endif
}
