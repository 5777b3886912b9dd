// prunekit's CPU sparse kernels for inference: y = x @ W^T + b, W stored as
//   * CSR: int32 row pointers, int16 (in_features <= 32768) or int32 column indices;
//   * BSR with 4x1 (4 outputs x 1 input) or 1x4 (1 output x 4 consecutive inputs) blocks,
//     the block patterns prunekit's training pruners produce.
//
// Why not torch.sparse.mm (MKL): it offers only W @ x.T, so x is read transposed and the result
// comes back transposed (the next op copies it), int64 indices are widened per call, and its
// threads are not ATen's pool, so called right after a dense op it waits for threads of its own
// (`benchmarks/bench_sparse.py --parts kernels` compares the two on a given machine). Here:
//   * one input row (batch 1): a gathered dot product per output row (AVX-512 gathers where
//     available), several accumulators to hide the FMA latency;
//   * several rows: x is transposed in chunks of CH rows (16x16 register tiles), so every stored
//     weight multiplies a contiguous CH-wide vector held in L1/L2; results go through a small tile
//     and are written back in contiguous rows;
//   * threads come from ATen's own OpenMP pool (at::parallel_for), the pool the dense ops just
//     used, split by equal numbers of stored weights; threads=1 runs without a parallel region.
// Built by `make kernels` (torch.utils.cpp_extension, -O3 -march=native); optional: prunekit
// falls back to torch's kernels when it is not built.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T, int CH>
struct Lanes {
  static constexpr int width = (64 / (int)sizeof(T)) < CH ? (64 / (int)sizeof(T)) : CH;  // at most one 512-bit register
  static constexpr int n = CH / width;
  typedef T vec __attribute__((vector_size(sizeof(T) * width)));
};

template <typename T>
struct Buffer {
  T* p = nullptr;
  explicit Buffer(size_t n) {
    size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
    p = static_cast<T*>(std::aligned_alloc(64, bytes ? bytes : 64));
    TORCH_CHECK(p != nullptr, "prunekit sparse kernel: out of memory");
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};


// dst[c * dst_stride + r] = src[r * src_stride + c] for r < rows, c < cols.
template <typename T>
inline void transpose_scalar(const T* src, int64_t ss, T* dst, int64_t ds, int rows, int cols) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * ds + r] = src[r * ss + c];
}

#if defined(__AVX512F__)
// A full 16 x 16 float tile, in registers.
inline void transpose16(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ds, r[i]);
}
#endif

// dst (cols x rows, stride ds) = transpose of src (rows x cols, stride ss); 16 x 16 tiles where possible.
template <typename T>
void transpose(const T* src, int64_t ss, T* dst, int64_t ds, int64_t rows, int64_t cols) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<T, float>::value) {
    int64_t r = 0;
    for (; r + 16 <= rows; r += 16) {
      int64_t c = 0;
      for (; c + 16 <= cols; c += 16) transpose16(src + r * ss + c, ss, dst + c * ds + r, ds);
      if (c < cols) transpose_scalar(src + r * ss + c, ss, dst + c * ds + r, ds, 16, (int)(cols - c));
    }
    if (r < rows)
      for (int64_t c = 0; c < cols; c += 64)
        transpose_scalar(src + r * ss + c, ss, dst + c * ds + r, ds, (int)(rows - r), (int)std::min<int64_t>(64, cols - c));
    return;
  }
#endif
  for (int64_t r = 0; r < rows; r += 16)
    for (int64_t c = 0; c < cols; c += 16)
      transpose_scalar(src + r * ss + c, ss, dst + c * ds + r, ds, (int)std::min<int64_t>(16, rows - r),
                       (int)std::min<int64_t>(16, cols - c));
}

// x rows [r0, r0 + nr) (row-major, I columns) -> dst laid out (I, CH), zero-padded to CH rows.
template <typename T, int CH>
void transpose_chunk(const T* x, int64_t r0, int nr, int64_t I, T* dst) {
  transpose(x + r0 * I, I, dst, CH, nr, I);
  if (nr < CH)
    for (int64_t j = 0; j < I; ++j)
      for (int r = nr; r < CH; ++r) dst[j * CH + r] = T(0);
}

// ---------------------------------------------------------------- CSR, a chunk of CH input rows
template <typename T, typename Idx, int CH>
void csr_chunk(const int32_t* crow, const Idx* col, const T* val, const T* xt, int nr, T* out, int64_t O,
               int64_t i0, int64_t i1, const T* bias) {
  using L = Lanes<T, CH>;
  using V = typename L::vec;
  constexpr int NV = L::n;
  constexpr int U = NV >= 4 ? 2 : (NV == 2 ? 4 : 8);  // independent accumulators hide FMA latency
  constexpr int IB = 16;  // output rows per tile: results go to a (IB, CH) tile, then out in rows of IB
  alignas(64) T tile[IB * CH];
  for (int64_t i = i0; i < i1; ++i) {
    V acc[U][NV];
    for (int u = 0; u < U; ++u)
      for (int q = 0; q < NV; ++q) acc[u][q] = V{};
    int64_t k = crow[i];
    const int64_t kend = crow[i + 1];
    for (; k + U <= kend; k += U) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const V* xr = reinterpret_cast<const V*>(xt + (int64_t)col[k + u] * CH);
        const T v = val[k + u];
#pragma GCC unroll 4
        for (int q = 0; q < NV; ++q) acc[u][q] += v * xr[q];
      }
    }
    for (; k < kend; ++k) {
      const V* xr = reinterpret_cast<const V*>(xt + (int64_t)col[k] * CH);
      const T v = val[k];
      for (int q = 0; q < NV; ++q) acc[0][q] += v * xr[q];
    }
    for (int u = 1; u < U; ++u)
      for (int q = 0; q < NV; ++q) acc[0][q] += acc[u][q];
    const T b = bias ? bias[i] : T(0);
    const int64_t ti = (i - i0) % IB;
    for (int q = 0; q < NV; ++q) acc[0][q] += b;
    std::memcpy(tile + ti * CH, acc[0], sizeof(T) * CH);
    if (ti == IB - 1 || i == i1 - 1) {
      const int64_t ib0 = i - ti;
      transpose(tile, CH, out + ib0, O, ti + 1, nr);
    }
  }
}

// ---------------------------------------------------------------- CSR, one input row (gather)
template <typename T, typename Idx>
void csr_vector(const int32_t* crow, const Idx* col, const T* val, const T* x, T* out, int64_t i0, int64_t i1,
                const T* bias) {
  for (int64_t i = i0; i < i1; ++i) {
    int64_t k = crow[i];
    const int64_t kend = crow[i + 1];
    T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (; k + 4 <= kend; k += 4) {
      s0 += val[k] * x[col[k]];
      s1 += val[k + 1] * x[col[k + 1]];
      s2 += val[k + 2] * x[col[k + 2]];
      s3 += val[k + 3] * x[col[k + 3]];
    }
    for (; k < kend; ++k) s0 += val[k] * x[col[k]];
    out[i] = (bias ? bias[i] : T(0)) + ((s0 + s1) + (s2 + s3));
  }
}

#if defined(__AVX512F__)
template <typename Idx>
inline __m512i load_idx16(const Idx* p, __mmask16 m);
template <>
inline __m512i load_idx16<int32_t>(const int32_t* p, __mmask16 m) { return _mm512_maskz_loadu_epi32(m, p); }
template <>
inline __m512i load_idx16<uint16_t>(const uint16_t* p, __mmask16 m) {
  return _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
}

template <typename Idx>
void csr_vector_avx512(const int32_t* crow, const Idx* col, const float* val, const float* x, float* out,
                       int64_t i0, int64_t i1, const float* bias) {
  for (int64_t i = i0; i < i1; ++i) {
    int64_t k = crow[i];
    const int64_t kend = crow[i + 1];
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (; k + 32 <= kend; k += 32) {
      __m512i j0 = load_idx16<Idx>(col + k, 0xFFFF), j1 = load_idx16<Idx>(col + k + 16, 0xFFFF);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(val + k), _mm512_i32gather_ps(j0, x, 4), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(val + k + 16), _mm512_i32gather_ps(j1, x, 4), a1);
    }
    for (; k < kend; k += 16) {
      const int left = (int)std::min<int64_t>(16, kend - k);
      const __mmask16 m = (__mmask16)((1u << left) - 1u);
      __m512i j = load_idx16<Idx>(col + k, m);
      __m512 xv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, j, x, 4);
      a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, val + k), xv, a0);
    }
    out[i] = (bias ? bias[i] : 0.f) + _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
}
#endif

// ---------------------------------------------------------------- BSR (BH x BW blocks), a chunk of CH rows
template <typename T, typename Idx, int CH, int BH, int BW>
void bsr_chunk(const int32_t* brow, const Idx* bcol, const T* bval, const T* xt, int nr, T* out, int64_t O,
               int64_t b0, int64_t b1, const T* bias) {
  using L = Lanes<T, CH>;
  using V = typename L::vec;
  constexpr int NV = L::n;
  constexpr int U = (BH * NV >= 8) ? 1 : (8 / (BH * NV));
  for (int64_t ib = b0; ib < b1; ++ib) {
    V acc[U][BH][NV];
    for (int u = 0; u < U; ++u)
      for (int a = 0; a < BH; ++a)
        for (int q = 0; q < NV; ++q) acc[u][a][q] = V{};
    int64_t k = brow[ib];
    const int64_t kend = brow[ib + 1];
    auto step = [&](int u, int64_t kk) {
      const T* xr0 = xt + (int64_t)bcol[kk] * BW * CH;
      const T* vb = bval + kk * (BH * BW);
#pragma GCC unroll 4
      for (int c = 0; c < BW; ++c) {
        const V* xr = reinterpret_cast<const V*>(xr0 + c * CH);
#pragma GCC unroll 4
        for (int a = 0; a < BH; ++a) {
          const T v = vb[a * BW + c];
#pragma GCC unroll 4
          for (int q = 0; q < NV; ++q) acc[u][a][q] += v * xr[q];
        }
      }
    };
    for (; k + U <= kend; k += U) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) step(u, k + u);
    }
    for (; k < kend; ++k) step(0, k);
    for (int u = 1; u < U; ++u)
      for (int a = 0; a < BH; ++a)
        for (int q = 0; q < NV; ++q) acc[0][a][q] += acc[u][a][q];
    for (int a = 0; a < BH; ++a) {
      const int64_t i = ib * BH + a;
      if (i >= O) break;
      alignas(64) T res[CH];
      std::memcpy(res, acc[0][a], sizeof(res));
      const T b = bias ? bias[i] : T(0);
      for (int r = 0; r < nr; ++r) out[r * O + i] = res[r] + b;
    }
  }
}

// Split [0, nrows) into `parts` ranges holding about equal numbers of stored entries.
std::vector<int64_t> split_rows(const int32_t* ptr, int64_t nrows, int parts) {
  std::vector<int64_t> b(parts + 1, 0);
  const int64_t total = ptr[nrows];
  for (int p = 1; p < parts; ++p) {
    const int32_t target = (int32_t)(total * p / parts);
    int64_t at = std::lower_bound(ptr, ptr + nrows + 1, target) - ptr;
    b[p] = std::min<int64_t>(std::max<int64_t>(at, b[p - 1]), nrows);
  }
  b[parts] = nrows;
  return b;
}

template <typename F>
void run_tasks(int64_t n, int64_t threads, const F& f) {
  if (threads <= 1 || n <= 1) {
    for (int64_t t = 0; t < n; ++t) f(t);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t);
  });
}

// Shared driver: transpose x into chunks of CH rows, then a (chunk x row-range) task grid.
template <typename T, int CH, typename Body>
void chunked(const T* x, int64_t R, int64_t I, int64_t threads, const int32_t* ptr, int64_t nrows, const Body& body) {
  const int64_t nchunks = (R + CH - 1) / CH;
  Buffer<T> xt((size_t)(nchunks * I * CH));
  run_tasks(nchunks, threads, [&](int64_t c) {
    transpose_chunk<T, CH>(x, c * CH, (int)std::min<int64_t>(CH, R - c * CH), I, xt.p + c * I * CH);
  });
  const int parts = (int)std::max<int64_t>(1, threads);
  const auto bounds = split_rows(ptr, nrows, parts);
  run_tasks(nchunks * parts, threads, [&](int64_t t) {
    const int64_t c = t / parts, p = t % parts;
    body(xt.p + c * I * CH, c * CH, (int)std::min<int64_t>(CH, R - c * CH), bounds[p], bounds[p + 1]);
  });
}

// Rows of x handled together. Wider chunks share each index/value load among more rows, but the
// transposed chunk (in_features x CH) must stay in L1/L2: at most 32 rows, fewer for small batches.
int pick_chunk(int64_t R) { return R <= 4 ? 4 : R <= 8 ? 8 : R <= 16 ? 16 : 32; }

template <typename T, typename Idx, int CH>
void csr_rows(const int32_t* crow, const Idx* col, const T* val, const T* x, int64_t R, int64_t I, int64_t O,
              T* out, const T* bias, int64_t threads) {
  chunked<T, CH>(x, R, I, threads, crow, O, [&](const T* xt, int64_t r0, int nr, int64_t i0, int64_t i1) {
    csr_chunk<T, Idx, CH>(crow, col, val, xt, nr, out + r0 * O, O, i0, i1, bias);
  });
}

template <typename T, typename Idx>
void csr_dispatch(const int32_t* crow, const Idx* col, const T* val, const T* x, int64_t R, int64_t I, int64_t O,
                  T* out, const T* bias, int64_t threads) {
  if (R == 1) {
    const int parts = (int)std::max<int64_t>(1, threads);
    const auto bounds = split_rows(crow, O, parts);
    run_tasks(parts, threads, [&](int64_t p) {
#if defined(__AVX512F__)
      if constexpr (std::is_same<T, float>::value) {
        csr_vector_avx512<Idx>(crow, col, val, x, out, bounds[p], bounds[p + 1], bias);
        return;
      }
#endif
      csr_vector<T, Idx>(crow, col, val, x, out, bounds[p], bounds[p + 1], bias);
    });
    return;
  }
  switch (pick_chunk(R)) {
    case 4: csr_rows<T, Idx, 4>(crow, col, val, x, R, I, O, out, bias, threads); break;
    case 8: csr_rows<T, Idx, 8>(crow, col, val, x, R, I, O, out, bias, threads); break;
    case 16: csr_rows<T, Idx, 16>(crow, col, val, x, R, I, O, out, bias, threads); break;
    default: csr_rows<T, Idx, 32>(crow, col, val, x, R, I, O, out, bias, threads); break;
  }
}

template <typename T, typename Idx, int CH, int BH, int BW>
void bsr_rows(const int32_t* brow, const Idx* bcol, const T* bval, const T* x, int64_t R, int64_t I, int64_t O,
              T* out, const T* bias, int64_t threads) {
  const int64_t nbrows = (O + BH - 1) / BH;
  if (CH == 1) {  // one input row: no transposition needed
    const int parts = (int)std::max<int64_t>(1, threads);
    const auto bounds = split_rows(brow, nbrows, parts);
    run_tasks(parts, threads, [&](int64_t p) {
      bsr_chunk<T, Idx, 1, BH, BW>(brow, bcol, bval, x, 1, out, O, bounds[p], bounds[p + 1], bias);
    });
    return;
  }
  chunked<T, CH>(x, R, I, threads, brow, nbrows, [&](const T* xt, int64_t r0, int nr, int64_t b0, int64_t b1) {
    bsr_chunk<T, Idx, CH, BH, BW>(brow, bcol, bval, xt, nr, out + r0 * O, O, b0, b1, bias);
  });
}

template <typename T, typename Idx, int BH, int BW>
void bsr_dispatch(const int32_t* brow, const Idx* bcol, const T* bval, const T* x, int64_t R, int64_t I, int64_t O,
                  T* out, const T* bias, int64_t threads) {
  switch (R == 1 ? 1 : pick_chunk(R)) {
    case 1: bsr_rows<T, Idx, 1, BH, BW>(brow, bcol, bval, x, R, I, O, out, bias, threads); break;
    case 4: bsr_rows<T, Idx, 4, BH, BW>(brow, bcol, bval, x, R, I, O, out, bias, threads); break;
    case 8: bsr_rows<T, Idx, 8, BH, BW>(brow, bcol, bval, x, R, I, O, out, bias, threads); break;
    case 16: bsr_rows<T, Idx, 16, BH, BW>(brow, bcol, bval, x, R, I, O, out, bias, threads); break;
    default: bsr_rows<T, Idx, 32, BH, BW>(brow, bcol, bval, x, R, I, O, out, bias, threads); break;
  }
}

void check_common(const at::Tensor& x, const at::Tensor& ptr, const at::Tensor& idx, const at::Tensor& val,
                  const c10::optional<at::Tensor>& bias, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "x must be a contiguous 2-D CPU tensor");
  TORCH_CHECK(ptr.scalar_type() == at::kInt && ptr.is_contiguous(), "row pointers must be contiguous int32");
  TORCH_CHECK((idx.scalar_type() == at::kInt || idx.scalar_type() == at::kShort) && idx.is_contiguous(),
              "column indices must be contiguous int32 or int16 (read as uint16)");
  TORCH_CHECK(val.scalar_type() == x.scalar_type() && val.is_contiguous(), "values must match x's dtype");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == O,
                "bias must be contiguous, of x's dtype, with out_features entries");
}

at::Tensor csr_linear(const at::Tensor& x, const at::Tensor& crow, const at::Tensor& col, const at::Tensor& val,
                      const c10::optional<at::Tensor>& bias, int64_t O, int64_t threads) {
  check_common(x, crow, col, val, bias, O);
  TORCH_CHECK(crow.numel() == O + 1, "crow must hold out_features + 1 entries");
  const int64_t R = x.size(0), I = x.size(1);
  at::Tensor out = at::empty({R, O}, x.options());
  if (R == 0) return out;
  const int64_t nt = threads > 0 ? threads : at::get_num_threads();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "prunekit_csr_linear", [&] {
    const scalar_t* b = bias.has_value() && bias->defined() ? bias->data_ptr<scalar_t>() : nullptr;
    if (col.scalar_type() == at::kShort)
      csr_dispatch<scalar_t, uint16_t>(crow.data_ptr<int32_t>(), reinterpret_cast<const uint16_t*>(col.data_ptr<int16_t>()),
                                       val.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), R, I, O,
                                       out.data_ptr<scalar_t>(), b, nt);
    else
      csr_dispatch<scalar_t, int32_t>(crow.data_ptr<int32_t>(), col.data_ptr<int32_t>(), val.data_ptr<scalar_t>(),
                                      x.data_ptr<scalar_t>(), R, I, O, out.data_ptr<scalar_t>(), b, nt);
  });
  return out;
}

at::Tensor bsr_linear(const at::Tensor& x, const at::Tensor& brow, const at::Tensor& bcol, const at::Tensor& bval,
                      const c10::optional<at::Tensor>& bias, int64_t O, int64_t bh, int64_t bw, int64_t threads) {
  check_common(x, brow, bcol, bval, bias, O);
  TORCH_CHECK((bh == 4 && bw == 1) || (bh == 1 && bw == 4), "blocks must be 4x1 or 1x4");
  TORCH_CHECK(brow.numel() == (O + bh - 1) / bh + 1, "block row pointers do not match out_features");
  TORCH_CHECK(x.size(1) % bw == 0, "in_features must be a multiple of the block width");
  const int64_t R = x.size(0), I = x.size(1);
  at::Tensor out = at::empty({R, O}, x.options());
  if (R == 0) return out;
  const int64_t nt = threads > 0 ? threads : at::get_num_threads();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "prunekit_bsr_linear", [&] {
    const scalar_t* b = bias.has_value() && bias->defined() ? bias->data_ptr<scalar_t>() : nullptr;
    const int32_t* bp = brow.data_ptr<int32_t>();
    const scalar_t* bv = bval.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    if (bcol.scalar_type() == at::kShort) {
      const uint16_t* bc = reinterpret_cast<const uint16_t*>(bcol.data_ptr<int16_t>());
      if (bh == 4) bsr_dispatch<scalar_t, uint16_t, 4, 1>(bp, bc, bv, xp, R, I, O, op, b, nt);
      else bsr_dispatch<scalar_t, uint16_t, 1, 4>(bp, bc, bv, xp, R, I, O, op, b, nt);
    } else {
      const int32_t* bc = bcol.data_ptr<int32_t>();
      if (bh == 4) bsr_dispatch<scalar_t, int32_t, 4, 1>(bp, bc, bv, xp, R, I, O, op, b, nt);
      else bsr_dispatch<scalar_t, int32_t, 1, 4>(bp, bc, bv, xp, R, I, O, op, b, nt);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(prunekit_sparse, m) {
  m.def("csr_linear(Tensor x, Tensor crow, Tensor col, Tensor values, Tensor? bias, int out_features, int threads) -> Tensor");
  m.def("bsr_linear(Tensor x, Tensor brow, Tensor bcol, Tensor values, Tensor? bias, int out_features, int bh, int bw, int threads) -> Tensor");
}
TORCH_LIBRARY_IMPL(prunekit_sparse, CPU, m) {
  m.impl("csr_linear", &csr_linear);
  m.impl("bsr_linear", &bsr_linear);
}
