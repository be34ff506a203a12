/* ropekit: the x86 AVX2/F16C loops of the CPU rotary kernel (see rotary_rows.h). */
#ifndef ROPEKIT_ROTARY_AVX2_H
#define ROPEKIT_ROTARY_AVX2_H

/* ---- x86 AVX2 + F16C inner loops, included by rotary_rows.h ----
 *
 * Each is the rotation of the portable loops for some pairs of `nr` rows (row r of x at
 * x + r * xs, of out at out + r * os) that share one table row: the table vectors are loaded
 * once for all of them.
 *
 * 16-bit types: gcc's auto-vectorised bf16/fp16 loops spend most of their time packing and unpacking
 * (about 0.24 ns per element here, more than the memory floor); these hand-written ones convert
 * with unpack / shift / F16C instructions instead (about 0.18). Same arithmetic, same rounding
 * (round to nearest even, bf16 NaN -> 0x7FC0), so results equal the portable loops bit for bit.
 * A bfloat16 rotation is bound by the vector instructions it issues (AVX2 has no bf16 arithmetic:
 * widen, rotate in float32, round back): about 0.37 cycles an element against 0.22 for float16,
 * whose conversions F16C does in one instruction each, and 0.10 for memcpy (Zen 3).
 * Each returns how many pairs it did (a multiple of its width); the portable loop does the
 * rest. Build with -DROPEKIT_PORTABLE to leave them out. Pointers may alias (in place:
 * out == x): every iteration loads its elements before storing them.
 */
#if defined(__AVX2__) && defined(__F16C__) && !defined(ROPEKIT_PORTABLE)
#include <immintrin.h>
#define ROPEKIT_SIMD 1

/* float -> bf16 round to nearest even, left in the upper half of each 32-bit lane; NaN lanes must
   have been replaced by 0x7FC00000 first (bf16_nan_fix). */
static inline __m256i bf16_round_hi(__m256 y) {
    __m256i u = _mm256_castps_si256(y);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
}

/* NaN -> 0x7FC00000 (what torch's c10::BFloat16 rounds every NaN to); other lanes unchanged. */
static inline __m256 bf16_nan_fix(__m256 y) {
    return _mm256_blendv_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
}

/* Whether any lane of a or b is NaN: one unordered compare for both. The loops below test it once
   per step and replace NaNs only then (a rare branch): the blend on every vector cost about 8% of
   a 16-bit rotation, which is bound by how many vector instructions it issues. */
static inline int any_nan(__m256 a, __m256 b) {
    __m256 m = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return !_mm256_testz_ps(m, m);
}

static inline __m256 sign_mask(int conj) {
    return _mm256_castsi256_ps(_mm256_set1_epi32(conj ? INT32_MIN : 0));
}

/* "half": 16 pairs per step. unpack{lo,hi}_epi16 with zero turn 16 bf16 into floats in the
   order [0-3, 8-11] and [4-7, 12-15]; the tables are permuted alike, and packus_epi32 of the
   two results restores the natural order. */
static int64_t bf16_half_simd(const uint16_t *xlo, const uint16_t *xhi, uint16_t *olo, uint16_t *ohi,
                              const float *c, const float *s, int64_t h, int conj,
                              int nr, int64_t xs, int64_t os) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256 neg = sign_mask(conj);
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
        __m256 c0 = _mm256_loadu_ps(c + i), c1 = _mm256_loadu_ps(c + i + 8);
        __m256 s0 = _mm256_xor_ps(_mm256_loadu_ps(s + i), neg);
        __m256 s1 = _mm256_xor_ps(_mm256_loadu_ps(s + i + 8), neg);
        __m256 cA = _mm256_permute2f128_ps(c0, c1, 0x20), cB = _mm256_permute2f128_ps(c0, c1, 0x31);
        __m256 sA = _mm256_permute2f128_ps(s0, s1, 0x20), sB = _mm256_permute2f128_ps(s0, s1, 0x31);
        for (int r = 0; r < nr; r++) {
            __m256i l = _mm256_loadu_si256((const __m256i *)(xlo + r * xs + i));
            __m256i u = _mm256_loadu_si256((const __m256i *)(xhi + r * xs + i));
            __m256 a0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, l));
            __m256 a1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, l));
            __m256 b0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, u));
            __m256 b1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, u));
            __m256 y1A = _mm256_sub_ps(_mm256_mul_ps(a0, cA), _mm256_mul_ps(b0, sA));
            __m256 y1B = _mm256_sub_ps(_mm256_mul_ps(a1, cB), _mm256_mul_ps(b1, sB));
            __m256 y2A = _mm256_add_ps(_mm256_mul_ps(b0, cA), _mm256_mul_ps(a0, sA));
            __m256 y2B = _mm256_add_ps(_mm256_mul_ps(b1, cB), _mm256_mul_ps(a1, sB));
            if (__builtin_expect(any_nan(y1A, y1B) | any_nan(y2A, y2B), 0)) {
                y1A = bf16_nan_fix(y1A), y1B = bf16_nan_fix(y1B), y2A = bf16_nan_fix(y2A), y2B = bf16_nan_fix(y2B);
            }
            _mm256_storeu_si256((__m256i *)(olo + r * os + i),
                                _mm256_packus_epi32(_mm256_srli_epi32(bf16_round_hi(y1A), 16),
                                                    _mm256_srli_epi32(bf16_round_hi(y1B), 16)));
            _mm256_storeu_si256((__m256i *)(ohi + r * os + i),
                                _mm256_packus_epi32(_mm256_srli_epi32(bf16_round_hi(y2A), 16),
                                                    _mm256_srli_epi32(bf16_round_hi(y2B), 16)));
        }
    }
    return i;
}

/* "interleaved": 8 pairs per step; a pair is one 32-bit lane, x1 its low half, x2 its high. */
static int64_t bf16_inter_simd(const uint16_t *x, uint16_t *o, const float *c, const float *s,
                               int64_t h, int conj, int nr, int64_t xs, int64_t os) {
    const __m256i high = _mm256_set1_epi32((int32_t)0xFFFF0000u);
    const __m256 neg = sign_mask(conj);
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_xor_ps(_mm256_loadu_ps(s + i), neg);
        for (int r = 0; r < nr; r++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x + r * xs + 2 * i));
            __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            __m256 b = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            __m256 y1 = _mm256_sub_ps(_mm256_mul_ps(a, cc), _mm256_mul_ps(b, ss));
            __m256 y2 = _mm256_add_ps(_mm256_mul_ps(b, cc), _mm256_mul_ps(a, ss));
            if (__builtin_expect(any_nan(y1, y2), 0)) y1 = bf16_nan_fix(y1), y2 = bf16_nan_fix(y2);
            __m256i packed = _mm256_or_si256(_mm256_srli_epi32(bf16_round_hi(y1), 16),
                                        _mm256_and_si256(bf16_round_hi(y2), high));
            _mm256_storeu_si256((__m256i *)(o + r * os + 2 * i), packed);
        }
    }
    return i;
}

#define F16_ROUND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static int64_t f16_half_simd(const uint16_t *xlo, const uint16_t *xhi, uint16_t *olo, uint16_t *ohi,
                             const float *c, const float *s, int64_t h, int conj,
                             int nr, int64_t xs, int64_t os) {
    const __m256 neg = sign_mask(conj);
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_xor_ps(_mm256_loadu_ps(s + i), neg);
        for (int r = 0; r < nr; r++) {
            __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(xlo + r * xs + i)));
            __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(xhi + r * xs + i)));
            __m256 y1 = _mm256_sub_ps(_mm256_mul_ps(a, cc), _mm256_mul_ps(b, ss));
            __m256 y2 = _mm256_add_ps(_mm256_mul_ps(b, cc), _mm256_mul_ps(a, ss));
            _mm_storeu_si128((__m128i *)(olo + r * os + i), _mm256_cvtps_ph(y1, F16_ROUND));
            _mm_storeu_si128((__m128i *)(ohi + r * os + i), _mm256_cvtps_ph(y2, F16_ROUND));
        }
    }
    return i;
}

/* shuffle_ps splits 16 floats into pair members in the order [0,1,4,5, 2,3,6,7];
   permute4x64 puts the tables in that order and unpack{lo,hi}_ps undoes it. */
static int64_t f16_inter_simd(const uint16_t *x, uint16_t *o, const float *c, const float *s,
                              int64_t h, int conj, int nr, int64_t xs, int64_t os) {
    const __m256 neg = sign_mask(conj);
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        __m256 cc = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_loadu_ps(c + i)), 0xD8));
        __m256 ss = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_loadu_ps(s + i)), 0xD8));
        ss = _mm256_xor_ps(ss, neg);
        for (int r = 0; r < nr; r++) {
            const uint16_t *xr = x + r * xs;
            uint16_t *orow = o + r * os;
            __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(xr + 2 * i)));
            __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(xr + 2 * i + 8)));
            __m256 a = _mm256_shuffle_ps(v0, v1, 0x88), b = _mm256_shuffle_ps(v0, v1, 0xDD);
            __m256 y1 = _mm256_sub_ps(_mm256_mul_ps(a, cc), _mm256_mul_ps(b, ss));
            __m256 y2 = _mm256_add_ps(_mm256_mul_ps(b, cc), _mm256_mul_ps(a, ss));
            _mm_storeu_si128((__m128i *)(orow + 2 * i), _mm256_cvtps_ph(_mm256_unpacklo_ps(y1, y2), F16_ROUND));
            _mm_storeu_si128((__m128i *)(orow + 2 * i + 8), _mm256_cvtps_ph(_mm256_unpackhi_ps(y1, y2), F16_ROUND));
        }
    }
    return i;
}
/* float32 "half": 8 pairs per step, the plain loop's arithmetic written out so that each
   element is loaded once (gcc's own vectorisation of the loop reloads x after storing out). */
static int64_t f32_half_simd(const float *xlo, const float *xhi, float *olo, float *ohi,
                             const float *c, const float *s, int64_t h, int conj,
                             int nr, int64_t xs, int64_t os) {
    const __m256 neg = sign_mask(conj);
    int64_t i = 0;
    if (nr == 1) { /* one row: its own loop, without the row loop's bookkeeping */
        for (; i + 8 <= h; i += 8) {
            __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_xor_ps(_mm256_loadu_ps(s + i), neg);
            __m256 a = _mm256_loadu_ps(xlo + i), b = _mm256_loadu_ps(xhi + i);
            _mm256_storeu_ps(olo + i, _mm256_sub_ps(_mm256_mul_ps(a, cc), _mm256_mul_ps(b, ss)));
            _mm256_storeu_ps(ohi + i, _mm256_add_ps(_mm256_mul_ps(b, cc), _mm256_mul_ps(a, ss)));
        }
        return i;
    }
    for (; i + 8 <= h; i += 8) {
        __m256 cc = _mm256_loadu_ps(c + i), ss = _mm256_xor_ps(_mm256_loadu_ps(s + i), neg);
        for (int r = 0; r < nr; r++) {
            __m256 a = _mm256_loadu_ps(xlo + r * xs + i), b = _mm256_loadu_ps(xhi + r * xs + i);
            _mm256_storeu_ps(olo + r * os + i, _mm256_sub_ps(_mm256_mul_ps(a, cc), _mm256_mul_ps(b, ss)));
            _mm256_storeu_ps(ohi + r * os + i, _mm256_add_ps(_mm256_mul_ps(b, cc), _mm256_mul_ps(a, ss)));
        }
    }
    return i;
}

/* float32 "interleaved": 8 pairs (16 floats) per step. y = x * c' + swap(x) * s' where swap
   exchanges each pair's members, c' repeats every cos twice and s' is (-s, s) per pair: the
   same products and the same rounding as y1 = x1 c - x2 s, y2 = x2 c + x1 s (x + (-y) == x - y). */
static int64_t f32_inter_simd(const float *x, float *o, const float *c, const float *s,
                              int64_t h, int conj, int nr, int64_t xs, int64_t os) {
    const __m256i lo_idx = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i hi_idx = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    const __m256 alt = _mm256_castsi256_ps(_mm256_setr_epi32(INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0));
    const __m256 neg = _mm256_xor_ps(alt, sign_mask(conj));
    int64_t i = 0;
    for (; i + 8 <= h; i += 8) {
        __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
        __m256 c0 = _mm256_permutevar8x32_ps(cv, lo_idx), c1 = _mm256_permutevar8x32_ps(cv, hi_idx);
        __m256 s0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(sv, lo_idx), neg);
        __m256 s1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(sv, hi_idx), neg);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + r * xs + 2 * i;
            float *orow = o + r * os + 2 * i;
            __m256 v0 = _mm256_loadu_ps(xr), v1 = _mm256_loadu_ps(xr + 8);
            __m256 w0 = _mm256_permute_ps(v0, 0xB1), w1 = _mm256_permute_ps(v1, 0xB1);
            _mm256_storeu_ps(orow, _mm256_add_ps(_mm256_mul_ps(v0, c0), _mm256_mul_ps(w0, s0)));
            _mm256_storeu_ps(orow + 8, _mm256_add_ps(_mm256_mul_ps(v1, c1), _mm256_mul_ps(w1, s1)));
        }
    }
    return i;
}
#else
#define ROPEKIT_SIMD 0
#endif

/* Rows written far apart (a KV cache's slots) go out with non-temporal stores where the row is
   32-byte aligned: no read of the destination lines first, which cuts the memory traffic of a
   scattered write (the lines are not wanted in the cache: attention reads them much later). */
#define ROPEKIT_STREAM_MAX_BYTES 1024 /* rows up to this size are staged (4 at a time) and streamed */
#if ROPEKIT_SIMD
static inline void ropekit_stream_row(void *dst, const void *src, int64_t bytes) {
    if (((uintptr_t)dst & 31) == 0 && (bytes & 31) == 0) {
        for (int64_t b = 0; b < bytes; b += 32)
            _mm256_stream_si256((__m256i *)((char *)dst + b), _mm256_loadu_si256((const __m256i *)((const char *)src + b)));
        return;
    }
    memcpy(dst, src, (size_t)bytes);
}
static inline void ropekit_stream_fence(void) { _mm_sfence(); /* streamed rows visible before returning */ }
#else
static inline void ropekit_stream_row(void *dst, const void *src, int64_t bytes) { memcpy(dst, src, (size_t)bytes); }
static inline void ropekit_stream_fence(void) {}
#endif

#endif /* ROPEKIT_ROTARY_AVX2_H */
