/*
 * ropekit CPU rotary kernel: the row loops (C-style, compiled as C++ by rotary_cpu.cpp).
 *
 * For every "row" (one head vector of head_dim channels) and every rotary pair (x1, x2):
 *
 *     y1 = x1 * c - x2 * s
 *     y2 = x2 * c + x1 * s          (conjugate: s -> -s, i.e. rotation by -theta)
 *
 * computed in float (double for double input) and rounded once to the element type: exactly
 * the expression of the eager torch backend. Built without FMA contraction (-ffp-contract=off
 * -fno-tree-slp-vectorize, see ropekit/ops/cpu_build.py), so results are bit-identical to eager
 * for every dtype (bf16/fp16: same float32 value, same round-to-nearest-even). Layouts: "half"
 * pairs (i, i + h), "interleaved" pairs (2i, 2i + 1), h = rotary_dim / 2. Channels [2h, head_dim)
 * are copied when out of place (flag COPY_TAIL) and left alone in place.
 *
 * One function per element type, all with the same signature:
 *
 *   int ropekit_rotate_<t>(void *x, void *out, const void *cos, const void *sin,
 *                          const int64_t *params, int64_t row_begin, int64_t row_end);
 *
 *   t = f32, f64, bf16, f16. cos/sin are float (double for f64). out == x means in place.
 *   params (int64, element units):
 *     [0] L, the number of leading dims (0..8); rows are their C-order flattening
 *     [1] h, rotary half width           [2] head_dim
 *     [3] flags: 1 interleaved, 2 conjugate, 4 copy tail, 8 stream rows written far apart
 *     [4..7] last-dim strides of x, out, cos, sin: must be 1
 *     [8 .. 8+L)  sizes of the leading dims
 *     then L strides each for x, out, cos, sin (0 where cos/sin broadcast)
 *   Rows [row_begin, row_end) are processed, so threads can split one call's rows.
 *   Returns 0, or -1 when params are out of range (nothing is written then). The caller
 *   guarantees that every row it describes lies inside its tensors: there are no bounds checks.
 *
 * Loops are plain C written for gcc/clang -O3 auto-vectorisation (contiguous runs x[i], x[i+h]
 * for "half", stride-2 pairs for "interleaved"), except the bf16/fp16/f32 inner loops on x86,
 * which use AVX2/F16C intrinsics when the compiler targets them (rotary_avx2.h).
 */
#ifndef ROPEKIT_ROTARY_ROWS_H
#define ROPEKIT_ROTARY_ROWS_H

/* C99's restrict, spelled the way C++ compilers accept it */
#define restrict __restrict__

#include <stdint.h>
#include <string.h>

#define ROPEKIT_MAX_DIMS 8
#define FLAG_INTERLEAVED 1
#define FLAG_CONJUGATE 2
#define FLAG_COPY_TAIL 4
#define FLAG_STREAM 8 /* rows written far apart (a KV cache's slots): stream them (see rotary_avx2.h) */

/* ---- element conversions (bit manipulation, branch-free so loops still vectorise) ---- */

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* All-ones when cond holds, else zero: selects by masking keep the loops free of branches. */
static inline uint32_t mask_if(int cond) { return (uint32_t)0 - (uint32_t)(cond != 0); }
static inline uint32_t select_u32(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

/* bfloat16 is the upper half of a float32. */
static inline float bf16_load(uint16_t v) { return f32_from_bits((uint32_t)v << 16); }

/* Round to nearest even; NaN -> 0x7FC0 (what torch's c10::BFloat16 produces). The NaN select
   happens on 32-bit lanes before the shift, which keeps the vectorised loop short. */
static inline uint16_t bf16_store(float f) {
    uint32_t u = f32_bits(f);
    uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(select_u32(mask_if(f != f), 0x7FC00000u, rounded) >> 16);
}

/* IEEE binary16 -> float, exact (normals, subnormals, zeros, inf, NaN keep their payload). */
static inline float f16_load(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = (uint32_t)(h & 0x7FFFu);
    uint32_t normal = (em << 13) + ((uint32_t)(127 - 15) << 23);        /* rebias exponent */
    uint32_t special = (em << 13) | 0x7F800000u;                        /* inf / NaN */
    uint32_t sub = f32_bits((float)(int32_t)em * 5.9604644775390625e-8f); /* em * 2^-24, exact */
    uint32_t mag = select_u32(mask_if(em >= 0x7C00u), special,
                              select_u32(mask_if(em >= 0x0400u), normal, sub));
    return f32_from_bits(sign | mag);
}

/* float -> IEEE binary16, round to nearest even; overflow -> inf; NaN -> quiet NaN 0x7E00. */
static inline uint16_t f16_store(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    /* normal results: drop 13 mantissa bits with round-to-nearest-even, rebias exponent */
    uint32_t normal = (a + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    /* subnormal results (|f| < 2^-14): adding 0.5 aligns the value to the 2^-24 grid with
       the FPU's own round-to-nearest-even; the low bits of the sum are the fp16 bits */
    uint32_t sub = f32_bits(f32_from_bits(a) + 0.5f) - 0x3F000000u;
    uint32_t mag = select_u32(mask_if(a > 0x7F800000u), 0x7E00u,
                   select_u32(mask_if(a >= 0x477FF000u), 0x7C00u,              /* rounds to >= 65520 */
                   select_u32(mask_if(a >= 0x38800000u), normal, sub)));
    return (uint16_t)(sign | mag);
}

static inline float f32_load(float v) { return v; }
static inline float f32_store(float v) { return v; }
static inline double f64_load(double v) { return v; }
static inline double f64_store(double v) { return v; }

/* ---- x86 AVX2 + F16C loops (rotary_avx2.h; -DROPEKIT_PORTABLE leaves them out) ---- */
#include "rotary_avx2.h"

/* Hooks the row kernels call first; no SIMD version -> 0 pairs done. */
#define ROPEKIT_NO_SIMD_HALF(NAME, T, CT)                                                     \
static inline int64_t NAME##_half_simd(const T *xlo, const T *xhi, T *olo, T *ohi,            \
                                       const CT *c, const CT *s, int64_t h, int conj,         \
                                       int nr, int64_t xs, int64_t os) {                      \
    (void)xlo; (void)xhi; (void)olo; (void)ohi; (void)c; (void)s; (void)h; (void)conj;        \
    (void)nr; (void)xs; (void)os;                                                             \
    return 0;                                                                                 \
}
#define ROPEKIT_NO_SIMD_INTER(NAME, T, CT)                                                    \
static inline int64_t NAME##_inter_simd(const T *x, T *o, const CT *c, const CT *s,           \
                                        int64_t h, int conj, int nr, int64_t xs, int64_t os) { \
    (void)x; (void)o; (void)c; (void)s; (void)h; (void)conj; (void)nr; (void)xs; (void)os;    \
    return 0;                                                                                 \
}
/* float64 runs the plain C loops (vectorised by the compiler). */
ROPEKIT_NO_SIMD_HALF(f64, double, double)
ROPEKIT_NO_SIMD_INTER(f64, double, double)
#if !ROPEKIT_SIMD
ROPEKIT_NO_SIMD_HALF(f32, float, float)
ROPEKIT_NO_SIMD_INTER(f32, float, float)
ROPEKIT_NO_SIMD_HALF(bf16, uint16_t, float)
ROPEKIT_NO_SIMD_INTER(bf16, uint16_t, float)
ROPEKIT_NO_SIMD_HALF(f16, uint16_t, float)
ROPEKIT_NO_SIMD_INTER(f16, uint16_t, float)
#endif

/* ---- row kernels: one head vector; sg is +1 or -1 (exact), folding the conjugate flag ----

   The in-place kernels take the row as two restrict pointers to disjoint parts (halves, or the
   even/odd channels' common base for "interleaved"), so the compiler needs no aliasing checks.
   The "4" kernels rotate four rows that share one table row (cos/sin broadcast over heads, as
   at decode): each table element is loaded once for the four, which leaves the loop bound by
   the rows' own loads and stores, like a plain pass over memory. */
#define ROPEKIT_ROT(NAME, CT, A, B, OA, OB)                                                   \
    do {                                                                                      \
        CT a_ = NAME##_load(A), b_ = NAME##_load(B);                                          \
        OA = NAME##_store(a_ * cc - b_ * ss);                                                 \
        OB = NAME##_store(b_ * cc + a_ * ss);                                                 \
    } while (0)

#define ROPEKIT_ROW_KERNELS(NAME, T, CT)                                                      \
static void NAME##_half_inplace(T *restrict lo, T *restrict hi, const CT *restrict c,         \
                                const CT *restrict s, int64_t h, CT sg) {                     \
    for (int64_t i = NAME##_half_simd(lo, hi, lo, hi, c, s, h, sg < 0, 1, 0, 0); i < h; i++) { \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, lo[i], hi[i], lo[i], hi[i]);                                    \
    }                                                                                         \
}                                                                                             \
static void NAME##_half_copy(const T *restrict x, T *restrict o, const CT *restrict c,        \
                             const CT *restrict s, int64_t h, CT sg) {                        \
    for (int64_t i = NAME##_half_simd(x, x + h, o, o + h, c, s, h, sg < 0, 1, 0, 0); i < h; i++) { \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, x[i], x[i + h], o[i], o[i + h]);                                \
    }                                                                                         \
}                                                                                             \
static void NAME##_inter_inplace(T *restrict p, const CT *restrict c, const CT *restrict s,   \
                                 int64_t h, CT sg) {                                          \
    for (int64_t i = NAME##_inter_simd(p, p, c, s, h, sg < 0, 1, 0, 0); i < h; i++) {         \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, p[2 * i], p[2 * i + 1], p[2 * i], p[2 * i + 1]);                \
    }                                                                                         \
}                                                                                             \
static void NAME##_inter_copy(const T *restrict x, T *restrict o, const CT *restrict c,       \
                              const CT *restrict s, int64_t h, CT sg) {                       \
    for (int64_t i = NAME##_inter_simd(x, o, c, s, h, sg < 0, 1, 0, 0); i < h; i++) {         \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, x[2 * i], x[2 * i + 1], o[2 * i], o[2 * i + 1]);                \
    }                                                                                         \
}                                                                                             \
static void NAME##_half_inplace4_(T *restrict l0, T *restrict h0, T *restrict l1,             \
                                  T *restrict h1, T *restrict l2, T *restrict h2,             \
                                  T *restrict l3, T *restrict h3, const CT *restrict c,       \
                                  const CT *restrict s, int64_t begin, int64_t h, CT sg) {    \
    for (int64_t i = begin; i < h; i++) {                                                     \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, l0[i], h0[i], l0[i], h0[i]);                                    \
        ROPEKIT_ROT(NAME, CT, l1[i], h1[i], l1[i], h1[i]);                                    \
        ROPEKIT_ROT(NAME, CT, l2[i], h2[i], l2[i], h2[i]);                                    \
        ROPEKIT_ROT(NAME, CT, l3[i], h3[i], l3[i], h3[i]);                                    \
    }                                                                                         \
}                                                                                             \
static void NAME##_half_copy4_(const T *restrict x0, const T *restrict x1,                   \
                               const T *restrict x2, const T *restrict x3, T *restrict o0,    \
                               T *restrict o1, T *restrict o2, T *restrict o3,                \
                               const CT *restrict c, const CT *restrict s, int64_t begin,     \
                               int64_t h, CT sg) {                                            \
    for (int64_t i = begin; i < h; i++) {                                                     \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, x0[i], x0[i + h], o0[i], o0[i + h]);                            \
        ROPEKIT_ROT(NAME, CT, x1[i], x1[i + h], o1[i], o1[i + h]);                            \
        ROPEKIT_ROT(NAME, CT, x2[i], x2[i + h], o2[i], o2[i + h]);                            \
        ROPEKIT_ROT(NAME, CT, x3[i], x3[i + h], o3[i], o3[i + h]);                            \
    }                                                                                         \
}                                                                                             \
static void NAME##_inter_inplace4_(T *restrict p0, T *restrict p1, T *restrict p2,            \
                                   T *restrict p3, const CT *restrict c, const CT *restrict s, \
                                   int64_t begin, int64_t h, CT sg) {                         \
    for (int64_t i = begin; i < h; i++) {                                                     \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, p0[2 * i], p0[2 * i + 1], p0[2 * i], p0[2 * i + 1]);            \
        ROPEKIT_ROT(NAME, CT, p1[2 * i], p1[2 * i + 1], p1[2 * i], p1[2 * i + 1]);            \
        ROPEKIT_ROT(NAME, CT, p2[2 * i], p2[2 * i + 1], p2[2 * i], p2[2 * i + 1]);            \
        ROPEKIT_ROT(NAME, CT, p3[2 * i], p3[2 * i + 1], p3[2 * i], p3[2 * i + 1]);            \
    }                                                                                         \
}                                                                                             \
static void NAME##_inter_copy4_(const T *restrict x0, const T *restrict x1,                  \
                                const T *restrict x2, const T *restrict x3, T *restrict o0,   \
                                T *restrict o1, T *restrict o2, T *restrict o3,               \
                                const CT *restrict c, const CT *restrict s, int64_t begin,    \
                                int64_t h, CT sg) {                                           \
    for (int64_t i = begin; i < h; i++) {                                                     \
        CT cc = c[i], ss = s[i] * sg;                                                         \
        ROPEKIT_ROT(NAME, CT, x0[2 * i], x0[2 * i + 1], o0[2 * i], o0[2 * i + 1]);            \
        ROPEKIT_ROT(NAME, CT, x1[2 * i], x1[2 * i + 1], o1[2 * i], o1[2 * i + 1]);            \
        ROPEKIT_ROT(NAME, CT, x2[2 * i], x2[2 * i + 1], o2[2 * i], o2[2 * i + 1]);            \
        ROPEKIT_ROT(NAME, CT, x3[2 * i], x3[2 * i + 1], o3[2 * i], o3[2 * i + 1]);            \
    }                                                                                         \
}                                                                                             \
/* Four rows x, x + xs, x + 2 xs, x + 3 xs (out: o, o + os, ...) sharing the table row c, s. */ \
static void NAME##_rows4(T *x, T *o, int64_t xs, int64_t os, const CT *c, const CT *s,        \
                         int64_t h, CT sg, int interleaved, int inplace) {                    \
    const int conj = sg < 0;                                                                  \
    if (interleaved && inplace) {                                                             \
        int64_t i = NAME##_inter_simd(x, x, c, s, h, conj, 4, xs, xs);                        \
        NAME##_inter_inplace4_(x, x + xs, x + 2 * xs, x + 3 * xs, c, s, i, h, sg);            \
    } else if (interleaved) {                                                                 \
        int64_t i = NAME##_inter_simd(x, o, c, s, h, conj, 4, xs, os);                        \
        NAME##_inter_copy4_(x, x + xs, x + 2 * xs, x + 3 * xs, o, o + os, o + 2 * os,         \
                            o + 3 * os, c, s, i, h, sg);                                      \
    } else if (inplace) {                                                                     \
        int64_t i = NAME##_half_simd(x, x + h, x, x + h, c, s, h, conj, 4, xs, xs);           \
        NAME##_half_inplace4_(x, x + h, x + xs, x + xs + h, x + 2 * xs, x + 2 * xs + h,       \
                              x + 3 * xs, x + 3 * xs + h, c, s, i, h, sg);                    \
    } else {                                                                                  \
        int64_t i = NAME##_half_simd(x, x + h, o, o + h, c, s, h, conj, 4, xs, os);           \
        NAME##_half_copy4_(x, x + xs, x + 2 * xs, x + 3 * xs, o, o + os, o + 2 * os,          \
                           o + 3 * os, c, s, i, h, sg);                                       \
    }                                                                                         \
}

/* ---- walking the rows: an odometer over the leading dims, four offsets kept in step ---- */

typedef struct {
    int64_t ndim, h, head_dim, flags;
    int64_t size[ROPEKIT_MAX_DIMS], stride[4][ROPEKIT_MAX_DIMS]; /* stride[k]: x, out, cos, sin */
    int64_t index[ROPEKIT_MAX_DIMS];
    int64_t offset[4];
} rows_t;

/* Read params into r, dropping dims of size 1 and merging dims that are one run in all four
   arrays: the C-order enumeration of rows is unchanged, but the innermost loop gets long. */
static int rows_init(rows_t *r, const int64_t *params, int64_t row_begin, int64_t row_end) {
    const int64_t ndim = params[0];
    r->h = params[1];
    r->head_dim = params[2];
    r->flags = params[3];
    if (ndim < 0 || ndim > ROPEKIT_MAX_DIMS || r->h < 0 || r->head_dim < 2 * r->h) return -1;
    for (int k = 0; k < 4; k++)
        if (params[4 + k] != 1) return -1;
    int64_t rows = 1;
    r->ndim = 0;
    for (int64_t d = 0; d < ndim; d++) {
        const int64_t n = params[8 + d];
        if (n < 0) return -1;
        rows *= n;
        if (n == 1) continue;
        const int64_t m = r->ndim;
        int merge = m > 0;
        for (int k = 0; k < 4 && merge; k++)
            merge = r->stride[k][m - 1] == params[8 + (k + 1) * ndim + d] * n;
        for (int k = 0; k < 4; k++) r->stride[k][merge ? m - 1 : m] = params[8 + (k + 1) * ndim + d];
        if (merge) {
            r->size[m - 1] *= n;
        } else {
            r->size[m] = n;
            r->ndim++;
        }
    }
    if (row_begin < 0 || row_end > rows || row_begin > row_end) return -1;
    for (int k = 0; k < 4; k++) r->offset[k] = 0;
    int64_t rest = row_begin;
    for (int64_t d = r->ndim - 1; d >= 0; d--) {
        r->index[d] = rest % r->size[d];
        rest /= r->size[d];
        for (int k = 0; k < 4; k++) r->offset[k] += r->index[d] * r->stride[k][d];
    }
    return 0;
}

/* Advance past the innermost leading dim's end (the caller stepped it); carry outwards. */
static void rows_carry(rows_t *r) {
    for (int64_t d = r->ndim - 1; d > 0 && r->index[d] == r->size[d]; d--) {
        for (int k = 0; k < 4; k++) r->offset[k] -= r->size[d] * r->stride[k][d];
        r->index[d] = 0;
        r->index[d - 1]++;
        for (int k = 0; k < 4; k++) r->offset[k] += r->stride[k][d - 1];
    }
}

/* ---- the exported entry points ---- */

/* Run STMT for the n rows of the current innermost run, stepping the four row pointers. */
#define ROPEKIT_RUN(STMT)                                                                     \
    for (int64_t j = 0; j < n; j++, xr += sx, orow += so, cr += sc, sr += ss) { STMT; }

#define ROPEKIT_ENTRY(NAME, T, CT)                                                            \
ROPEKIT_ROW_KERNELS(NAME, T, CT)                                                              \
static int ropekit_rotate_##NAME(void *x, void *out, const void *cos, const void *sin,        \
                          const int64_t *params, int64_t row_begin, int64_t row_end) {        \
    rows_t r;                                                                                 \
    if (rows_init(&r, params, row_begin, row_end)) return -1;                                 \
    const int interleaved = (r.flags & FLAG_INTERLEAVED) != 0, inplace = x == out;            \
    const CT sg = (r.flags & FLAG_CONJUGATE) ? (CT)-1 : (CT)1;                                \
    const int64_t h = r.h;                                                                    \
    const int64_t tail = (r.flags & FLAG_COPY_TAIL) && !inplace ? r.head_dim - 2 * h : 0;     \
    const int64_t last = r.ndim > 0 ? r.ndim - 1 : 0, inner = r.ndim > 0 ? r.size[last] : 1; \
    const int64_t sx = r.ndim > 0 ? r.stride[0][last] : 0, so = r.ndim > 0 ? r.stride[1][last] : 0; \
    const int64_t sc = r.ndim > 0 ? r.stride[2][last] : 0, ss = r.ndim > 0 ? r.stride[3][last] : 0; \
    /* rows written far apart (a KV cache's slots), copied tail included: staged and streamed */ \
    T stage[4 * ROPEKIT_STREAM_MAX_BYTES / sizeof(T)];                                        \
    const int far = ROPEKIT_SIMD && !inplace && (r.flags & FLAG_STREAM) && (r.flags & FLAG_COPY_TAIL) && \
                    r.head_dim * (int64_t)sizeof(T) <= ROPEKIT_STREAM_MAX_BYTES &&            \
                    (so > 2 * r.head_dim || so < -2 * r.head_dim);                            \
    for (int64_t row = row_begin; row < row_end;) {                                           \
        const int64_t start = r.ndim > 0 ? r.index[last] : 0;                                 \
        const int64_t n = inner - start < row_end - row ? inner - start : row_end - row;      \
        T *xr = (T *)x + r.offset[0], *orow = (T *)out + r.offset[1];                         \
        const CT *cr = (const CT *)cos + r.offset[2], *sr = (const CT *)sin + r.offset[3];    \
        if (sc == 0 && ss == 0 && n >= 4) {                                                   \
            int64_t j = 0;                                                                    \
            for (; j + 4 <= n && far && h == 0; j += 4, xr += 4 * sx, orow += 4 * so)     \
                for (int q = 0; q < 4; q++) /* nothing to rotate (values): streamed as they are */ \
                    ropekit_stream_row(orow + q * so, xr + q * sx, r.head_dim * (int64_t)sizeof(T)); \
            for (; j + 4 <= n && far; j += 4, xr += 4 * sx, orow += 4 * so) {                 \
                /* staged in L1, four rows at a time, then streamed to their slots */         \
                NAME##_rows4(xr, stage, sx, r.head_dim, cr, sr, h, sg, interleaved, 0);       \
                for (int q = 0; q < 4; q++) {                                                 \
                    if (tail > 0)                                                             \
                        memcpy(stage + q * r.head_dim + 2 * h, xr + q * sx + 2 * h, (size_t)tail * sizeof(T)); \
                    ropekit_stream_row(orow + q * so, stage + q * r.head_dim, r.head_dim * (int64_t)sizeof(T)); \
                }                                                                             \
            }                                                                                 \
            for (; j + 4 <= n; j += 4, xr += 4 * sx, orow += 4 * so) {                        \
                NAME##_rows4(xr, orow, sx, so, cr, sr, h, sg, interleaved, inplace);          \
                if (tail > 0)                                                                 \
                    for (int q = 0; q < 4; q++)                                               \
                        memcpy(orow + q * so + 2 * h, xr + q * sx + 2 * h, (size_t)tail * sizeof(T)); \
            }                                                                                 \
            for (; j < n; j++, xr += sx, orow += so) {                                        \
                if (interleaved && inplace) NAME##_inter_inplace(xr, cr, sr, h, sg);          \
                else if (interleaved) NAME##_inter_copy(xr, orow, cr, sr, h, sg);             \
                else if (inplace) NAME##_half_inplace(xr, xr + h, cr, sr, h, sg);             \
                else NAME##_half_copy(xr, orow, cr, sr, h, sg);                               \
                if (tail > 0) memcpy(orow + 2 * h, xr + 2 * h, (size_t)tail * sizeof(T));    \
            }                                                                                 \
        } else if (inplace && interleaved) {                                                  \
            ROPEKIT_RUN(NAME##_inter_inplace(xr, cr, sr, h, sg))                              \
        } else if (inplace) {                                                                 \
            ROPEKIT_RUN(NAME##_half_inplace(xr, xr + h, cr, sr, h, sg))                       \
        } else {                                                                              \
            ROPEKIT_RUN(                                                                      \
                if (interleaved) NAME##_inter_copy(xr, orow, cr, sr, h, sg);                  \
                else NAME##_half_copy(xr, orow, cr, sr, h, sg);                               \
                if (tail > 0) memcpy(orow + 2 * h, xr + 2 * h, (size_t)tail * sizeof(T)))     \
        }                                                                                     \
        if (far) ropekit_stream_fence();                                                      \
        row += n;                                                                             \
        if (r.ndim > 0) {                                                                     \
            r.index[last] += n;                                                               \
            r.offset[0] += n * sx; r.offset[1] += n * so;                                     \
            r.offset[2] += n * sc; r.offset[3] += n * ss;                                     \
            rows_carry(&r);                                                                   \
        }                                                                                     \
    }                                                                                         \
    return 0;                                                                                 \
}

ROPEKIT_ENTRY(f32, float, float)
ROPEKIT_ENTRY(f64, double, double)
ROPEKIT_ENTRY(bf16, uint16_t, float)
ROPEKIT_ENTRY(f16, uint16_t, float)

#undef restrict

#endif /* ROPEKIT_ROTARY_ROWS_H */
