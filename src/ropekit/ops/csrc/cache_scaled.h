// Rotation into KV caches of any dtype, FP8 through a scale: the store templated on the cache's type.
// Included by fused_cpu.h (inside rotary_cpu.cpp's anonymous namespace).
//
//   rotate_into_cache_scaled(k, v, cos, sin, k_cache, v_cache, slots?, start, k_weight?, eps?, weight_offset,
//                            per_token, block_size, interleaved, k_scale?, v_scale?) -> ()
//
// Each cache is either its input's dtype or FP8 (float8_e4m3fn, float8_e5m2; then its input is float32,
// bfloat16 or float16, and its scale a float32 (kv_heads,) tensor of finite values > 0). Two passes:
// the keys are converted exactly to a float32 copy and rotated (normalised) there in place by the
// float32 row kernels (the same float32 values the bf16/fp16 kernels compute before rounding), then
// each row is stored into its slot, one rounding from float32:
//
//     FP8:     q = Out(clamp(x / scale[head], -max, max))    vLLM's reshape_and_cache_flash convention;
//                                                            NaN stays NaN, c10's conversion (torch's .to())
//     others:  q = Out(x)                                    round to nearest even, as the row kernels
#ifndef ROPEKIT_CACHE_SCALED_H
#define ROPEKIT_CACHE_SCALED_H

template <class Out>
constexpr bool is_fp8_type() {
    return std::is_same<Out, c10::Float8_e4m3fn>::value || std::is_same<Out, c10::Float8_e5m2>::value;
}

// The bits of c10's float32 -> FP8 conversion (c10::detail::fp8e4m3fn_from_fp32_value,
// fp8e5m2_from_fp32_value: what torch's .to() rounds with) of clamp(f, -max, max), NaN kept NaN,
// computed without branches so that the compiler vectorises the store's loop: both of c10's paths
// (the float addition that rounds below the smallest normal, the integer rounding above it) for
// every element, then selects on integer compares of the magnitude's bits. Unsigned arithmetic
// wraps in a path not taken; its result is dropped. Equal to c10's conversion of the clamped value
// for every float32 (tests/test_fp8_cache.py compares a dense sample with torch's clamp and .to()).
inline uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

inline float f32_of(uint32_t u) {
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
}

// Selects as arithmetic, with no branch for the compiler to keep (it keeps one around a float
// addition or compare, which may trap, and then does not vectorise): below(a, b) is all ones where
// a < b, else zero, for a and b below 2**31 (the sign of their difference); pick(m, a, b) is a where m.
inline uint32_t below(uint32_t a, uint32_t b) {
    return static_cast<uint32_t>(static_cast<int32_t>(a - b) >> 31);
}
inline uint32_t pick(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

// bias: 127 - the format's exponent bias; shift: 23 - its mantissa bits; small: the float32 exponent
// of its smallest normal; limit: the float32 bits of its largest finite value, whose code is top.
template <uint32_t bias, uint32_t shift, uint32_t small, uint32_t limit, uint32_t top>
inline uint8_t saturated_bits(float f) {
    const uint32_t bits = f32_bits(f), sign = bits & UINT32_C(0x80000000), a = bits ^ sign;
    constexpr uint32_t denorm = (bias + shift + 1) << 23;
    const uint32_t tiny = f32_bits(f32_of(a) + f32_of(denorm)) - denorm;  // below the smallest normal
    const uint32_t half = (UINT32_C(1) << (shift - 1)) - 1;
    const uint32_t normal = (a - (bias << 23) + half + ((a >> shift) & 1)) >> shift;
    const uint32_t big = top | (UINT32_C(0x7F) & below(UINT32_C(0x7F800000), a));  // NaN: 0x7F; else max
    const uint32_t r = pick(below(limit, a), big, pick(below(a, small << 23), tiny, normal));
    return static_cast<uint8_t>(r | (sign >> 24));
}

template <class Out>
inline uint8_t fp8_saturated(float f) {
    if constexpr (std::is_same<Out, c10::Float8_e4m3fn>::value)
        return saturated_bits<120, 20, 121, UINT32_C(0x43E00000), 0x7E>(f);  // 448
    else
        return saturated_bits<112, 21, 113, UINT32_C(0x47600000), 0x7B>(f);  // 57344
}

// n rows of d float32 channels (src, contiguous) into dst (row stride dst_stride, unit channel stride).
template <class Out>
void store_rows(const float *src, Out *dst, int64_t n, int64_t d, int64_t dst_stride, float scale) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = src + i * d;
        Out *o = dst + i * dst_stride;
        if constexpr (is_fp8_type<Out>()) {
            uint8_t *ob = reinterpret_cast<uint8_t *>(o);
            for (int64_t j = 0; j < d; j++)  // a division, as vLLM (not a product with 1 / scale)
                ob[j] = fp8_saturated<Out>(x[j] / scale);
        } else {
            for (int64_t j = 0; j < d; j++) o[j] = Out(x[j]);
        }
    }
}

// One head's rows of one batch row (contiguous layout) or one token (paged): where they come from and go.
struct StoreTask {
    const float *src;
    void *dst;
    int64_t rows;
    int64_t head;
};

template <class Out>
void run_store(const std::vector<StoreTask> &tasks, int64_t d, int64_t dst_stride, const float *scale) {
    const int64_t per_task = tasks.empty() ? 1 : std::max<int64_t>(tasks[0].rows * d, 1);
    const int64_t grain = std::max<int64_t>(1, (int64_t(64) << 10) / per_task);  // ~64K elements a thread at least
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; i++) {
            const StoreTask &t = tasks[i];
            store_rows<Out>(t.src, static_cast<Out *>(t.dst), t.rows, d, dst_stride, scale ? scale[t.head] : 1.0f);
        }
    });
}

// float32 rows x (k's shape, contiguous) into cache at the checked slots.
void store_into(const Tensor &x, const Tensor &cache, const std::vector<int64_t> &slot, int64_t block_size,
                const Tensor &scale) {
    const bool paged = block_size > 0;
    const int64_t heads = x.size(1), d = x.size(-1), element = cache.element_size();
    const float *src = x.data_ptr<float>();
    char *base = static_cast<char *>(cache.data_ptr());
    std::vector<StoreTask> tasks;
    int64_t dst_stride = 0;
    if (!paged) {  // x (batch, heads, seq, d) -> cache[b, h, start_b + s]
        const int64_t seq = x.size(2);
        dst_stride = cache.stride(2);
        for (int64_t b = 0; b < x.size(0); b++) {
            const int64_t first = slot.size() == 1 ? slot[0] : slot[b];
            for (int64_t h = 0; h < heads; h++)
                tasks.push_back({src + ((b * heads + h) * seq) * d,
                                 base + (b * cache.stride(0) + h * cache.stride(1) + first * cache.stride(2)) * element,
                                 seq, h});
        }
    } else {  // x (tokens, heads, d) -> cache[slot / block_size, slot % block_size, h]; negative: padding
        for (int64_t t = 0; t < x.size(0); t++) {
            if (slot[t] < 0) continue;
            const int64_t block = slot[t] / block_size, row = slot[t] % block_size;
            for (int64_t h = 0; h < heads; h++)
                tasks.push_back({src + (t * heads + h) * d,
                                 base + (block * cache.stride(0) + row * cache.stride(1) + h * cache.stride(2)) * element,
                                 1, h});
        }
    }
    const float *s = scale.defined() ? scale.data_ptr<float>() : nullptr;
    switch (cache.scalar_type()) {
        case at::kFloat8_e4m3fn: run_store<c10::Float8_e4m3fn>(tasks, d, dst_stride, s); break;
        case at::kFloat8_e5m2: run_store<c10::Float8_e5m2>(tasks, d, dst_stride, s); break;
        case at::kBFloat16: run_store<c10::BFloat16>(tasks, d, dst_stride, nullptr); break;
        case at::kHalf: run_store<c10::Half>(tasks, d, dst_stride, nullptr); break;
        case at::kFloat: run_store<float>(tasks, d, dst_stride, nullptr); break;
        default: TORCH_CHECK_TYPE(false, "ropekit_cpu: a scaled cache write takes caches of dtype float8_e4m3fn, "
                                  "float8_e5m2, bfloat16, float16 or float32, got ", cache.scalar_type());
    }
}

bool is_fp8_dtype(at::ScalarType type) { return type == at::kFloat8_e4m3fn || type == at::kFloat8_e5m2; }

// The scale of a cache as the store reads it: for an FP8 cache a float32 CPU (heads,) tensor of finite
// values > 0 (contiguous), otherwise none at all (and the cache of its input's dtype, float32, bfloat16
// or float16: float64 goes to the eager backend, which keeps it in float64).
Tensor checked_scale(const c10::optional<Tensor> &scale, const Tensor &cache, const Tensor &x, int64_t heads,
                     const char *name) {
    const bool given = scale.has_value() && scale->defined();
    if (!is_fp8_dtype(cache.scalar_type())) {
        TORCH_CHECK_VALUE(x.scalar_type() == cache.scalar_type(), "ropekit_cpu: a cache that is not FP8 must have ",
                          "its input's dtype, got ", x.scalar_type(), " into ", cache.scalar_type());
        // checked here, before either cache is written (the store's switch comes after the keys' store)
        TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                         x.scalar_type() == at::kHalf, "ropekit_cpu: a scaled cache write takes caches of dtype "
                         "float8_e4m3fn, float8_e5m2, bfloat16, float16 or float32, got ", cache.scalar_type());
        TORCH_CHECK_VALUE(!given, name, ": a scale is given for a ", cache.scalar_type(), " cache (FP8 caches only)");
        return Tensor();
    }
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                      x.scalar_type() == at::kHalf, "ropekit_cpu: an FP8 cache takes float32, bfloat16 or float16 "
                      "input, got ", x.scalar_type());
    TORCH_CHECK_VALUE(given, name, ": an FP8 cache needs a scale");
    TORCH_CHECK_VALUE(scale->device().is_cpu() && scale->scalar_type() == at::kFloat && scale->dim() == 1 &&
                      scale->size(0) == heads, name, " must be a float32 CPU tensor of shape (kv_heads,) = (", heads,
                      "), got ", scale->scalar_type(), " ", scale->sizes(), " on ", scale->device());
    Tensor s = scale->contiguous();
    const float *p = s.data_ptr<float>();
    for (int64_t h = 0; h < heads; h++)
        TORCH_CHECK_VALUE(std::isfinite(p[h]) && p[h] > 0.0f, name, " must be finite and > 0, got ", p[h],
                          " for kv head ", h);
    return s;
}

void rotate_into_cache_scaled(const Tensor &k, const Tensor &v, const Tensor &cos, const Tensor &sin,
                              const Tensor &k_cache, const Tensor &v_cache, const c10::optional<Tensor> &slots,
                              int64_t start, const c10::optional<Tensor> &k_weight, c10::optional<double> eps,
                              double offset, bool per_token, int64_t block_size, bool interleaved,
                              const c10::optional<Tensor> &k_scale, const c10::optional<Tensor> &v_scale) {
    const std::vector<int64_t> slot = checked_cache_slots(k, v, cos, sin, k_cache, v_cache, slots, start, block_size);
    const int64_t heads = k.size(1);  // (batch, kv_heads, seq, d) and (tokens, kv_heads, d) alike
    const Tensor ks = checked_scale(k_scale, k_cache, k, heads, "k_scale");
    const Tensor vs = checked_scale(v_scale, v_cache, v, heads, "v_scale");
    if (k.numel() == 0) return;
    // the keys in float32 (exact from bfloat16/float16), rotated (normalised) in place
    Tensor k32 = at::empty(k.sizes(), k.options().dtype(at::kFloat));
    k32.copy_(k);
    Norm norm;
    if (eps.has_value()) norm = make_norm(k32, k_weight, *eps, offset, per_token ? 1 : -1);
    Jobs jobs;
    add_jobs(k32, k32, cos, sin, flags_of(interleaved, false, true), jobs, eps.has_value() ? &norm.spec : nullptr);
    run_jobs(jobs);
    Tensor v32 = at::empty(v.sizes(), v.options().dtype(at::kFloat));
    v32.copy_(v);
    for (const auto &[x, cache, scale] : {std::tuple<Tensor, Tensor, Tensor>{k32, k_cache, ks},
                                          std::tuple<Tensor, Tensor, Tensor>{v32, v_cache, vs}}) {
        const Tensor target = unit_channels(cache);  // strided channels: written through a contiguous copy
        store_into(x, target, slot, block_size, scale);
        if (!target.is_same(cache)) cache.copy_(target);
        cache.unsafeGetTensorImpl()->bump_version();
    }
}

#endif  // ROPEKIT_CACHE_SCALED_H
