// Paged KV rows, read by attention.comp and flash.comp: the start of key j's row through the
// block table (before the K / V offsets), and element d of a head's slice of a cache row.
uint64_t kv_row_at(uint64_t base, uint64_t pages, uint page_bytes, uint row_bytes, int pshift, int j) {
  const int64_t jj = int64_t(j);
  const int64_t page = int64_t(I32(pages).v[uint(jj >> pshift)]);
  const int64_t mask = (int64_t(1) << pshift) - 1;
  return base + uint64_t(page) * page_bytes + uint64_t(jj & mask) * row_bytes;
}
// kvtype: 0 f32, 1 f16, 8 q8_0 (blocks of 34 bytes: an f16 scale, 32 quants).
float kv_value(uint64_t r, int d, int kvtype) {
  if (kvtype == 0) return F32(r).v[d];
  if (kvtype == 1) return h2f(rd16(r + uint64_t(d) * 2u));
  const uint64_t b = r + uint64_t(d >> 5) * 34u;
  return float(sbyte(rd8(b + 2u + uint(d & 31)), 0u)) * h2f(rd16(b));
}
