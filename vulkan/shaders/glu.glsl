// The GEMVs that compute their x as act(gate) * up on the way (gemv.comp -DGLU, gemv_q.comp): the
// activation (ops.comp's codes 5 silu, 6 gelu_tanh, else relu), and the GLU's output written by
// the last workgroup to finish, once every workgroup has read gate and up (out may be up itself).
// That workgroup's NL invocations (l its own) take 16-byte units, four of each input in flight an
// invocation: a row of 8192 one value at a time was 64 dependent round trips a lane, ~20 us of
// an H100's F16 decode layer in which nothing else ran.
float glu_act(uint act, float g) { return act == 5u ? silu(g) : act == 6u ? gelu_tanh(g) : max(g, 0.0f); }

void glu_write(uint64_t gate, uint64_t up, uint64_t dst, uint gs, uint us, uint n, uint cols, uint act, uint l,
               uint NL) {
  if (((gate | up | dst) & 15ul) == 0ul && cols % 4u == 0u && gs % 4u == 0u && us % 4u == 0u) {
    const uint q4 = n * cols / 4u;
    for (uint i0 = l; i0 < q4; i0 += 4u * NL) {
      vec4 g[4], u[4];
      [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        const uint i = i0 + k * NL, t = 4u * i / cols, c = 4u * i % cols;
        g[k] = vec4(0.0f), u[k] = vec4(0.0f);
        if (i < q4) g[k] = V4(gate + (uint64_t(t) * gs + c) * 4u).v[0], u[k] = V4(up + (uint64_t(t) * us + c) * 4u).v[0];
      }
      [[unroll]] for (uint k = 0u; k < 4u; ++k) {
        const uint i = i0 + k * NL;
        if (i < q4)
          V4(dst + uint64_t(i) * 16u).v[0] = vec4(glu_act(act, g[k].x) * u[k].x, glu_act(act, g[k].y) * u[k].y,
                                                  glu_act(act, g[k].z) * u[k].z, glu_act(act, g[k].w) * u[k].w);
      }
    }
    return;
  }
  F32 gr = F32(gate), ur = F32(up), o = F32(dst);
  for (uint i = l; i < n * cols; i += NL) {
    const uint t = i / cols, k = i % cols;
    o.v[i] = glu_act(act, gr.v[t * gs + k]) * ur.v[t * us + k];
  }
}
