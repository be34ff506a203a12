// ropekit CPU kernels: RMSNorm and rotation of a row in one pass, and its backward (C++ templates
// over the element type T and the compute type CT: float, or double for double input).
//
// For a row x of n channels (one head vector; per token, the token's heads one after another):
//
//     ms = sum_j x_j^2 / n              the squares summed in 8 lanes (lane = j mod 8, in order), in
//                                       float64 (squares of float32 values are exact there; the mean
//                                       is then right to ~1e-15 whatever the order), in float32 for
//                                       16-bit inputs (their squares are exact in float32); the lanes
//                                       combined in float64 as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
//     r  = 1 / sqrt(ms + eps)           float64, rounded once to float32 (float64 for double x)
//     y_j = (x_j * r) * g_j             g = weight, weight_offset + weight, or 1 (float32)
//     pairs (y1, y2) of each head:  o1 = y1 c - y2 s,  o2 = y2 c + y1 s;  tail channels o_j = y_j
//
// rounded once to T. No FMA contraction (-ffp-contract=off): the AVX2 loops and the portable
// ones give the same bits (the same products, sums and lane order). The norm is F.rms_norm's
// without its rounding to T and with a mean square that does not depend on a summation order
// (F.rms_norm sums in float32 in an order that depends on the machine), and the rotation is the
// one of rotary_rows.h.
//
// Backward (go = dL/do for a row; r recomputed from x as above):
//
//     gy = R(-theta) go on the pairs, go on the tail;   gyg_j = gy_j g_j;   dot = sum_j gyg_j x_j
//     dL/dx_j = r gyg_j - x_j (r^3 dot / n)             dL/dw_j += (gy_j x_j) r   (over all rows)
#ifndef ROPEKIT_NORM_ROWS_H
#define ROPEKIT_NORM_ROWS_H

// A normalising job's arguments (see NormSpec in cpu_jobs.h). Per head: heads = 1. Per token:
// each row holds `heads` head vectors, head_stride[k] apart in x, out, cos and sin, and the
// gains of head h start at gains + h * gain_head_stride.
struct NormArgs {
    const void *gains = nullptr;  // float (double for double x), n of them
    double eps = 0.0;
    int64_t n = 0;                // channels one norm spans (head_dim, or heads * head_dim)
    int64_t heads = 1;
    int64_t head_stride[4] = {0, 0, 0, 0};
    int64_t gain_head_stride = 0;
};

// 16-bit element types as distinct C++ types (both are uint16_t bits).
struct bf16_t { uint16_t bits; };
struct f16_t { uint16_t bits; };

// The lanes of the sum of squares: float64, except for 16-bit inputs, whose squares (at most 22
// significant bits) are exact in float32 and whose float32 sums err far below their own precision.
template <class T> struct Lanes { using type = double; };
template <> struct Lanes<bf16_t> { using type = float; };
template <> struct Lanes<f16_t> { using type = float; };

inline float load_elem(const float *p) { return *p; }
inline double load_elem(const double *p) { return *p; }
inline float load_elem(const bf16_t *p) { return bf16_load(p->bits); }
inline float load_elem(const f16_t *p) { return f16_load(p->bits); }
inline void store_elem(float *p, float v) { *p = v; }
inline void store_elem(double *p, double v) { *p = v; }
inline void store_elem(bf16_t *p, float v) { p->bits = bf16_store(v); }
inline void store_elem(f16_t *p, float v) { p->bits = f16_store(v); }

// ---- SIMD pieces (AVX2/F16C); each returns how many elements or pairs it did, 0 without SIMD ----
#if ROPEKIT_SIMD
inline __m256 load8(const float *p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const f16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
inline void store8(float *p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16_t *p, __m256 v) {
    __m256i t = _mm256_srli_epi32(bf16_round_hi(bf16_nan_fix(v)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}
inline void store8(f16_t *p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i *>(p), _mm256_cvtps_ph(v, F16_ROUND));
}

template <class T>
int64_t simd_sum_squares(const T *x, int64_t n, int64_t base, double *acc) {
    if (base & 7) return 0;
    __m256d low = _mm256_loadu_pd(acc), high = _mm256_loadu_pd(acc + 4);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = load8(x + i);
        __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
        low = _mm256_add_pd(low, _mm256_mul_pd(a, a));
        high = _mm256_add_pd(high, _mm256_mul_pd(b, b));
    }
    _mm256_storeu_pd(acc, low);
    _mm256_storeu_pd(acc + 4, high);
    return i;
}

template <class T>
int64_t simd_sum_squares(const T *x, int64_t n, int64_t base, float *acc) {
    if (base & 7) return 0;
    __m256 lanes = _mm256_loadu_ps(acc);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = load8(x + i);
        lanes = _mm256_add_ps(lanes, _mm256_mul_ps(v, v));
    }
    _mm256_storeu_ps(acc, lanes);
    return i;
}

template <class T>
int64_t simd_sum_squares4(const T *const *x, int64_t n, float (*acc)[8]) {
    __m256 lanes[4];
    for (int q = 0; q < 4; q++) lanes[q] = _mm256_loadu_ps(acc[q]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int q = 0; q < 4; q++) {
            __m256 v = load8(x[q] + i);
            lanes[q] = _mm256_add_ps(lanes[q], _mm256_mul_ps(v, v));
        }
    for (int q = 0; q < 4; q++) _mm256_storeu_ps(acc[q], lanes[q]);
    return i;
}

// Four rows at once (eight independent accumulator chains): pass 1 of a group of rows.
template <class T>
int64_t simd_sum_squares4(const T *const *x, int64_t n, double (*acc)[8]) {
    __m256d low[4], high[4];
    for (int q = 0; q < 4; q++) {
        low[q] = _mm256_loadu_pd(acc[q]);
        high[q] = _mm256_loadu_pd(acc[q] + 4);
    }
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int q = 0; q < 4; q++) {
            __m256 v = load8(x[q] + i);
            __m256d a = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), b = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
            low[q] = _mm256_add_pd(low[q], _mm256_mul_pd(a, a));
            high[q] = _mm256_add_pd(high[q], _mm256_mul_pd(b, b));
        }
    }
    for (int q = 0; q < 4; q++) {
        _mm256_storeu_pd(acc[q], low[q]);
        _mm256_storeu_pd(acc[q] + 4, high[q]);
    }
    return i;
}

template <class T>
int64_t simd_norm_half(const T *x, T *o, const float *c, const float *s, const float *g, float r, int64_t h) {
    const __m256 rv = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        __m256 a = _mm256_mul_ps(_mm256_mul_ps(load8(x + i), rv), _mm256_loadu_ps(g + i));
        __m256 b = _mm256_mul_ps(_mm256_mul_ps(load8(x + h + i), rv), _mm256_loadu_ps(g + h + i));
        __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_loadu_ps(s + i);
        store8(o + i, _mm256_sub_ps(_mm256_mul_ps(a, cc), _mm256_mul_ps(b, ss)));
        store8(o + h + i, _mm256_add_ps(_mm256_mul_ps(b, cc), _mm256_mul_ps(a, ss)));
    }
    return i;
}

// "interleaved": 4 pairs (8 channels) per step. o = y c' + swap(y) s', c' = (c0, c0, c1, c1, ...),
// s' = (-s0, s0, -s1, s1, ...): the products and sums of o1 = y1 c - y2 s, o2 = y2 c + y1 s.
template <class T>
int64_t simd_norm_inter(const T *x, T *o, const float *c, const float *s, const float *g, float r, int64_t h) {
    const __m256 rv = _mm256_set1_ps(r);
    const __m256 odd_sign = _mm256_castsi256_ps(_mm256_setr_epi32(INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0));
    int64_t i = 0;
    for (; i + 4 <= h; i += 4) {
        __m256 y = _mm256_mul_ps(_mm256_mul_ps(load8(x + 2 * i), rv), _mm256_loadu_ps(g + 2 * i));
        __m128 c4 = _mm_loadu_ps(c + i), s4 = _mm_loadu_ps(s + i);
        __m256 cc = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
        __m256 ss = _mm256_xor_ps(_mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4)), odd_sign);
        __m256 swapped = _mm256_permute_ps(y, 0xB1);
        store8(o + 2 * i, _mm256_add_ps(_mm256_mul_ps(y, cc), _mm256_mul_ps(swapped, ss)));
    }
    return i;
}

template <class T>
int64_t simd_norm_tail(const T *x, T *o, const float *g, float r, int64_t n) {
    const __m256 rv = _mm256_set1_ps(r);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) store8(o + j, _mm256_mul_ps(_mm256_mul_ps(load8(x + j), rv), _mm256_loadu_ps(g + j)));
    return j;
}
#endif

// Generic versions: no SIMD for double (and for everything in the portable build).
#if !ROPEKIT_SIMD
template <class T, class A>
int64_t simd_sum_squares(const T *, int64_t, int64_t, A *) { return 0; }
template <class T, class A>
int64_t simd_sum_squares4(const T *const *, int64_t, A (*)[8]) { return 0; }
#endif
inline int64_t simd_sum_squares(const double *, int64_t, int64_t, double *) { return 0; }
inline int64_t simd_sum_squares4(const double *const *, int64_t, double (*)[8]) { return 0; }
template <class T, class CT>
int64_t simd_norm_half(const T *, T *, const CT *, const CT *, const CT *, CT, int64_t) { return 0; }
template <class T, class CT>
int64_t simd_norm_inter(const T *, T *, const CT *, const CT *, const CT *, CT, int64_t) { return 0; }
template <class T, class CT>
int64_t simd_norm_tail(const T *, T *, const CT *, CT, int64_t) { return 0; }

// ---- the row pieces ----

// Add the squares of x[0, n) to the float64 lanes: element j goes to lane (base + j) mod 8.
template <class T, class A>
inline void sum_squares(const T *x, int64_t n, int64_t base, A *acc) {
    for (int64_t i = simd_sum_squares(x, n, base, acc); i < n; i++) {
        const A v = load_elem(x + i);
        acc[(base + i) & 7] += v * v;
    }
}

// The squares of four rows of n channels each, lane by lane as sum_squares adds them.
template <class T, class A>
inline void sum_squares4(const T *const *x, int64_t n, A (*acc)[8]) {
    const int64_t done = simd_sum_squares4(x, n, acc);
    for (int q = 0; q < 4; q++)
        for (int64_t i = done; i < n; i++) {
            const A v = load_elem(x[q] + i);
            acc[q][i & 7] += v * v;
        }
}

// 1 / sqrt(mean + eps) from the lanes, in float64, rounded once to CT.
template <class CT, class A>
inline CT inv_rms(const A *acc, int64_t n, double eps) {
    const double a[8] = {acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7]};
    const double s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
    return static_cast<CT>(1.0 / std::sqrt(s / static_cast<double>(n) + eps));
}

// One head: normalise by r, scale by g, rotate the first 2h channels, write all D (o may be x).
template <class T, class CT>
void norm_rotate_head(const T *x, T *o, const CT *c, const CT *s, const CT *g, CT r, int64_t h, int64_t d,
                      bool interleaved) {
    if (interleaved) {
        for (int64_t i = simd_norm_inter(x, o, c, s, g, r, h); i < h; i++) {
            CT a = (load_elem(x + 2 * i) * r) * g[2 * i], b = (load_elem(x + 2 * i + 1) * r) * g[2 * i + 1];
            store_elem(o + 2 * i, a * c[i] - b * s[i]);
            store_elem(o + 2 * i + 1, b * c[i] + a * s[i]);
        }
    } else {
        for (int64_t i = simd_norm_half(x, o, c, s, g, r, h); i < h; i++) {
            CT a = (load_elem(x + i) * r) * g[i], b = (load_elem(x + i + h) * r) * g[i + h];
            store_elem(o + i, a * c[i] - b * s[i]);
            store_elem(o + i + h, b * c[i] + a * s[i]);
        }
    }
    const int64_t t = 2 * h;
    for (int64_t j = t + simd_norm_tail(x + t, o + t, g + t, r, d - t); j < d; j++)
        store_elem(o + j, (load_elem(x + j) * r) * g[j]);
}

// Step the odometer of rotary_rows.h one row on.
inline void rows_next(rows_t *r) {
    if (r->ndim == 0) return;
    const int64_t last = r->ndim - 1;
    r->index[last]++;
    for (int k = 0; k < 4; k++) r->offset[k] += r->stride[k][last];
    rows_carry(r);
}

// Four consecutive rows of the odometer: their pointers (taking them steps the odometer).
template <class T, class CT>
struct RowGroup {
    const T *x[4];
    T *out[4];
    const CT *cos[4], *sin[4];

    static RowGroup take(rows_t *r, const void *x0, void *out0, const void *cos0, const void *sin0) {
        RowGroup g;
        for (int q = 0; q < 4; q++, rows_next(r)) {
            g.x[q] = static_cast<const T *>(x0) + r->offset[0];
            g.out[q] = static_cast<T *>(out0) + r->offset[1];
            g.cos[q] = static_cast<const CT *>(cos0) + r->offset[2];
            g.sin[q] = static_cast<const CT *>(sin0) + r->offset[3];
        }
        return g;
    }
};

// The normalising row function (NormFn of cpu_jobs.h): rows [row_begin, row_end) of params.
template <class T, class CT>
int norm_rotate_rows(void *x, void *out, const void *cos, const void *sin, const NormArgs *na,
                     const int64_t *params, int64_t row_begin, int64_t row_end) {
    rows_t r;
    if (rows_init(&r, params, row_begin, row_end)) return -1;
    const bool interleaved = (r.flags & FLAG_INTERLEAVED) != 0;
    const CT *gains = static_cast<const CT *>(na->gains);
    int64_t row = row_begin;
    if (na->heads == 1) {  // one norm per row: four rows at a time (their sums and square roots overlap)
        for (; row + 4 <= row_end; row += 4) {
            const RowGroup<T, CT> group = RowGroup<T, CT>::take(&r, x, out, cos, sin);
            typename Lanes<T>::type acc[4][8] = {};
            sum_squares4(group.x, r.head_dim, acc);
            CT inv[4];
            for (int q = 0; q < 4; q++) inv[q] = inv_rms<CT>(acc[q], na->n, na->eps);
            for (int q = 0; q < 4; q++)
                norm_rotate_head(group.x[q], group.out[q], group.cos[q], group.sin[q], gains, inv[q], r.h, r.head_dim,
                                 interleaved);
        }
    }
    for (; row < row_end; row++, rows_next(&r)) {
        const T *xr = static_cast<const T *>(x) + r.offset[0];
        T *orow = static_cast<T *>(out) + r.offset[1];
        const CT *cr = static_cast<const CT *>(cos) + r.offset[2], *sr = static_cast<const CT *>(sin) + r.offset[3];
        typename Lanes<T>::type acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t hd = 0; hd < na->heads; hd++)
            sum_squares(xr + hd * na->head_stride[0], r.head_dim, hd * r.head_dim, acc);
        const CT inv = inv_rms<CT>(acc, na->n, na->eps);
        for (int64_t hd = 0; hd < na->heads; hd++)
            norm_rotate_head(xr + hd * na->head_stride[0], orow + hd * na->head_stride[1], cr + hd * na->head_stride[2],
                             sr + hd * na->head_stride[3], gains + hd * na->gain_head_stride, inv, r.h, r.head_dim,
                             interleaved);
    }
    return 0;
}

// The backward row function: grad has x's strides (grad + offset[0]), dL/dx goes to out. With
// gain_grad (n values, zeroed by the caller) the rows' dL/dw are added to it.
template <class T, class CT>
int norm_rotate_backward_rows(const void *grad, const void *x, void *out, const void *cos, const void *sin,
                              const NormArgs *na, const int64_t *params, int64_t row_begin, int64_t row_end,
                              CT *gain_grad, CT *work) {
    rows_t r;
    if (rows_init(&r, params, row_begin, row_end)) return -1;
    const bool interleaved = (r.flags & FLAG_INTERLEAVED) != 0;
    const CT *gains = static_cast<const CT *>(na->gains);
    const int64_t h = r.h, d = r.head_dim;
    for (int64_t row = row_begin; row < row_end; row++, rows_next(&r)) {
        typename Lanes<T>::type acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int64_t hd = 0; hd < na->heads; hd++)
            sum_squares(static_cast<const T *>(x) + r.offset[0] + hd * na->head_stride[0], d, hd * d, acc);
        const CT inv = inv_rms<CT>(acc, na->n, na->eps);
        CT dot = 0;
        for (int64_t hd = 0; hd < na->heads; hd++) {  // work[hd * d + j] = gy_j
            const T *go = static_cast<const T *>(grad) + r.offset[0] + hd * na->head_stride[0];
            const T *xr = static_cast<const T *>(x) + r.offset[0] + hd * na->head_stride[0];
            const CT *c = static_cast<const CT *>(cos) + r.offset[2] + hd * na->head_stride[2];
            const CT *s = static_cast<const CT *>(sin) + r.offset[3] + hd * na->head_stride[3];
            const CT *g = gains + hd * na->gain_head_stride;
            CT *gy = work + hd * d;
            for (int64_t i = 0; i < h; i++) {
                const int64_t p = interleaved ? 2 * i : i, q = interleaved ? 2 * i + 1 : i + h;
                CT a = load_elem(go + p), b = load_elem(go + q);
                gy[p] = a * c[i] + b * s[i];
                gy[q] = b * c[i] - a * s[i];
            }
            for (int64_t j = 2 * h; j < d; j++) gy[j] = load_elem(go + j);
            for (int64_t j = 0; j < d; j++) dot += (gy[j] * g[j]) * load_elem(xr + j);
        }
        const CT coef = ((inv * inv) * inv) * dot / static_cast<CT>(na->n);
        for (int64_t hd = 0; hd < na->heads; hd++) {
            const T *xr = static_cast<const T *>(x) + r.offset[0] + hd * na->head_stride[0];
            T *orow = static_cast<T *>(out) + r.offset[1] + hd * na->head_stride[1];
            const CT *g = gains + hd * na->gain_head_stride;
            const CT *gy = work + hd * d;
            for (int64_t j = 0; j < d; j++) {
                const CT xv = load_elem(xr + j);
                store_elem(orow + j, inv * (gy[j] * g[j]) - xv * coef);
            }
            if (gain_grad != nullptr) {
                CT *gg = gain_grad + hd * d;
                for (int64_t j = 0; j < d; j++) gg[j] += (gy[j] * load_elem(xr + j)) * inv;
            }
        }
    }
    return 0;
}

#endif  // ROPEKIT_NORM_ROWS_H
