// ropekit's fused CPU entry points: RMSNorm + rotation of q and k (forward, in place, backward)
// and the rotation of keys straight into a KV cache. Included by rotary_cpu.cpp inside its
// anonymous namespace, after cpu_jobs.h; registered there as operators and Python functions.
//
//   rms_norm_rotary(x, weight?, cos, sin, eps, weight_offset, per_token, interleaved) -> Tensor
//   rms_norm_rotary_(x, ...) -> ()                                       x normalised and rotated in place
//   rms_norm_rotary_qk(q, k, q_weight?, k_weight?, cos, sin, eps, ...) -> (Tensor, Tensor)
//   rms_norm_rotary_qk_(q, k, ...) -> ()
//   rms_norm_rotary_backward(grad, x, weight?, cos, sin, eps, ...) -> (grad_x, grad_weight or empty)
//   rotate_into_cache(k, v, cos, sin, k_cache, v_cache, slots?, start, k_weight?, eps?, weight_offset,
//                     per_token, block_size, interleaved) -> ()
//   rotate_into_cache_scaled(..., same..., k_scale?, v_scale?) -> ()     FP8 caches (cache_scaled.h)
//
// The norm spans the last axis (per head, weight (head_dim,)) or the last two (per token, weight
// (heads, head_dim)); see norm_rows.h for the arithmetic. ropekit.functional_fused validates the
// arguments first; the checks here guard the kernel's memory accesses and the cache slots.
#ifndef ROPEKIT_FUSED_CPU_H
#define ROPEKIT_FUSED_CPU_H

// Shared gains: g = weight_offset + weight, or ones, as float (double for double x).
template <class CT>
std::shared_ptr<std::vector<CT>> gains_of(const c10::optional<Tensor> &weight, double offset, int64_t n) {
    auto g = std::make_shared<std::vector<CT>>(static_cast<size_t>(n), CT(1));
    if (!weight.has_value() || !weight->defined()) return g;
    TORCH_CHECK(weight->numel() == n && weight->device().is_cpu(), "ropekit_cpu: the weight has ", weight->numel(),
                " elements on ", weight->device(), "; the norm needs ", n, " on the CPU");
    const Tensor w = weight->contiguous();
    const CT off = static_cast<CT>(offset);
    CT *dst = g->data();
    switch (w.scalar_type()) {
        case at::kFloat: for (int64_t j = 0; j < n; j++) dst[j] = off + static_cast<CT>(w.data_ptr<float>()[j]); break;
        case at::kDouble: for (int64_t j = 0; j < n; j++) dst[j] = off + static_cast<CT>(w.data_ptr<double>()[j]); break;
        case at::kBFloat16: {
            const uint16_t *p = reinterpret_cast<const uint16_t *>(w.data_ptr());
            for (int64_t j = 0; j < n; j++) dst[j] = off + static_cast<CT>(bf16_load(p[j]));
            break;
        }
        case at::kHalf: {
            const uint16_t *p = reinterpret_cast<const uint16_t *>(w.data_ptr());
            for (int64_t j = 0; j < n; j++) dst[j] = off + static_cast<CT>(f16_load(p[j]));
            break;
        }
        default: TORCH_CHECK_TYPE(false, "ropekit_cpu: the weight must be a float tensor, got ", w.scalar_type());
    }
    return g;
}

// The norm of x (per token: over its axis head_axis and the channels), gains kept alive by the spec.
struct Norm {
    NormSpec spec;
    std::shared_ptr<void> keep;
};

Norm make_norm(const Tensor &x, const c10::optional<Tensor> &weight, double eps, double offset, int64_t head_axis) {
    TORCH_CHECK_VALUE(x.dim() >= 1, "ropekit_cpu: x needs a channel axis");
    int64_t n = x.size(-1);
    TORCH_CHECK_VALUE(head_axis < 0 || !__builtin_mul_overflow(n, x.size(head_axis), &n),
                      "ropekit_cpu: the norm spans more than 2**63 channels: ", x.sizes());
    Norm norm;
    norm.spec.eps = eps;
    norm.spec.head_axis = head_axis;
    if (x.scalar_type() == at::kDouble) {
        auto g = gains_of<double>(weight, offset, n);
        norm.spec.gains = g->data();
        norm.spec.n = n;
        norm.keep = g;
    } else {
        auto g = gains_of<float>(weight, offset, n);
        norm.spec.gains = g->data();
        norm.spec.n = n;
        norm.keep = g;
    }
    return norm;
}

int64_t token_head_axis(const Tensor &x, bool per_token) {
    TORCH_CHECK(!per_token || x.dim() >= 2, "ropekit_cpu: a norm per token needs a heads axis");
    return per_token ? x.dim() - 2 : -1;
}

// q (k optional) normalised and rotated into q_out (k_out); out may be the input (in place).
void norm_rotate_into(const Tensor &q, const Tensor &q_out, const c10::optional<Tensor> &q_weight, const Tensor &k,
                      const Tensor &k_out, const c10::optional<Tensor> &k_weight, const Tensor &cos, const Tensor &sin,
                      double eps, double offset, bool per_token, bool interleaved) {
    const int64_t flags = flags_of(interleaved, false, false);
    Jobs jobs;
    const Norm q_norm = make_norm(q, q_weight, eps, offset, token_head_axis(q, per_token));
    add_jobs(q, q_out, cos, sin, flags, jobs, &q_norm.spec);
    Norm k_norm;
    if (k.defined()) {
        k_norm = make_norm(k, k_weight, eps, offset, token_head_axis(k, per_token));
        add_jobs(k, k_out, cos, sin, flags, jobs, &k_norm.spec);
    }
    run_jobs(jobs);
}

Tensor rms_norm_rotary(const Tensor &x, const c10::optional<Tensor> &weight, const Tensor &cos, const Tensor &sin,
                       double eps, double offset, bool per_token, bool interleaved) {
    const Tensor x_in = unit_channels(x);
    Tensor out = fresh_output(x_in);
    norm_rotate_into(x_in, out, weight, Tensor(), Tensor(), c10::nullopt, cos, sin, eps, offset, per_token,
                     interleaved);
    return out;
}

std::tuple<Tensor, Tensor> rms_norm_rotary_qk(const Tensor &q, const Tensor &k, const c10::optional<Tensor> &q_weight,
                                              const c10::optional<Tensor> &k_weight, const Tensor &cos,
                                              const Tensor &sin, double eps, double offset, bool per_token,
                                              bool interleaved) {
    const Tensor q_in = unit_channels(q), k_in = unit_channels(k);
    Tensor q_out = fresh_output(q_in), k_out = fresh_output(k_in);
    norm_rotate_into(q_in, q_out, q_weight, k_in, k_out, k_weight, cos, sin, eps, offset, per_token, interleaved);
    return {q_out, k_out};
}

// In place: tensors with strided channels go through a contiguous copy, written back.
void rms_norm_rotary_qk_(const Tensor &q, const Tensor &k, const c10::optional<Tensor> &q_weight,
                         const c10::optional<Tensor> &k_weight, const Tensor &cos, const Tensor &sin, double eps,
                         double offset, bool per_token, bool interleaved) {
    const Tensor q_work = unit_channels(q), k_work = k.defined() ? unit_channels(k) : k;
    norm_rotate_into(q_work, q_work, q_weight, k_work, k_work, k_weight, cos, sin, eps, offset, per_token,
                     interleaved);
    for (const auto &[target, work] : {std::pair<Tensor, Tensor>{q, q_work}, std::pair<Tensor, Tensor>{k, k_work}}) {
        if (!target.defined()) continue;
        if (!work.is_same(target)) target.copy_(work);
        target.unsafeGetTensorImpl()->bump_version();
    }
}

void rms_norm_rotary_(const Tensor &x, const c10::optional<Tensor> &weight, const Tensor &cos, const Tensor &sin,
                      double eps, double offset, bool per_token, bool interleaved) {
    rms_norm_rotary_qk_(x, Tensor(), weight, c10::nullopt, cos, sin, eps, offset, per_token, interleaved);
}

// ---- backward ----
constexpr int64_t kBackwardChunk = 64;  // rows per partial weight gradient: fixed, so results do not
                                        // depend on the thread count

template <class T, class CT>
void backward_job(const Tensor &grad, const Tensor &x, const Job &job, std::vector<std::vector<double>> *partials,
                  bool with_gain_grad) {
    const char *grad_base = static_cast<const char *>(grad.data_ptr()) +
                            (static_cast<const char *>(job.x) - static_cast<const char *>(x.data_ptr()));
    const int64_t chunks = (job.rows + kBackwardChunk - 1) / kBackwardChunk, n = job.norm.n;
    std::vector<std::vector<double>> local(static_cast<size_t>(chunks));
    auto body = [&](int64_t begin, int64_t end) {
        std::vector<CT> work(static_cast<size_t>(n)), gain_grad(static_cast<size_t>(with_gain_grad ? n : 0));
        for (int64_t chunk = begin; chunk < end; chunk++) {
            std::fill(gain_grad.begin(), gain_grad.end(), CT(0));
            const int64_t rb = chunk * kBackwardChunk, re = std::min(rb + kBackwardChunk, job.rows);
            const int status = norm_rotate_backward_rows<T, CT>(grad_base, job.x, job.out, job.cos, job.sin, &job.norm,
                                                                job.params.data(), rb, re,
                                                                with_gain_grad ? gain_grad.data() : nullptr, work.data());
            TORCH_CHECK(status == 0, "ropekit_cpu: the kernel rejected its parameters (a bug in ropekit)");
            if (with_gain_grad) local[chunk].assign(gain_grad.begin(), gain_grad.end());
        }
    };
    if (job.bytes < parallel_min_bytes.load() || chunks < 2 || at::get_num_threads() == 1) {
        body(0, chunks);
    } else {
        at::parallel_for(0, chunks, 1, body);
    }
    for (auto &partial : local) partials->push_back(std::move(partial));
}

std::tuple<Tensor, Tensor> rms_norm_rotary_backward(const Tensor &grad, const Tensor &x,
                                                    const c10::optional<Tensor> &weight, const Tensor &cos,
                                                    const Tensor &sin, double eps, double offset, bool per_token,
                                                    bool interleaved) {
    TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
                "ropekit_cpu: grad must have x's shape and dtype");
    const Tensor x_in = unit_channels(x);
    Tensor grad_in = grad;
    if (grad.strides() != x_in.strides()) {  // the kernel reads grad with x's strides
        grad_in = at::empty_strided(x_in.sizes(), x_in.strides(), x_in.options());
        grad_in.copy_(grad);
    }
    Tensor grad_x = fresh_output(x_in);
    const Norm norm = make_norm(x_in, weight, eps, offset, token_head_axis(x_in, per_token));
    Jobs jobs;
    add_jobs(x_in, grad_x, cos, sin, flags_of(interleaved, false, false), jobs, &norm.spec, /*plan=*/false);
    const bool with_gain_grad = weight.has_value() && weight->defined();
    std::vector<std::vector<double>> partials;
    for (const Job &job : jobs) {
        switch (x.scalar_type()) {
            case at::kFloat: backward_job<float, float>(grad_in, x_in, job, &partials, with_gain_grad); break;
            case at::kDouble: backward_job<double, double>(grad_in, x_in, job, &partials, with_gain_grad); break;
            case at::kBFloat16: backward_job<bf16_t, float>(grad_in, x_in, job, &partials, with_gain_grad); break;
            case at::kHalf: backward_job<f16_t, float>(grad_in, x_in, job, &partials, with_gain_grad); break;
            default: TORCH_CHECK_TYPE(false, "ropekit_cpu: x must be float32, float64, bfloat16 or float16");
        }
    }
    if (!with_gain_grad) return {grad_x, at::empty({0}, x.options())};
    Tensor total = at::zeros({norm.spec.n}, x.options().dtype(at::kDouble));
    double *sum = total.data_ptr<double>();
    for (const auto &partial : partials)  // chunk by chunk, in row order
        for (int64_t j = 0; j < norm.spec.n; j++) sum[j] += partial[j];
    return {grad_x, total.view(weight->sizes()).to(weight->scalar_type())};
}

// ---- rotation into a KV cache ----

// cos/sin for batch row b of a contiguous-layout call: tables right-aligned against k (4 dims).
Tensor batch_rows(const Tensor &table, int64_t b) {
    return table.dim() == 4 ? table.select(0, table.size(0) == 1 ? 0 : b) : table;
}

// cos/sin for tokens [t0, t0 + n) of a paged call: tables right-aligned against k (tokens, heads).
Tensor token_rows(const Tensor &table, int64_t t0, int64_t n) {
    return table.dim() == 3 && table.size(0) != 1 ? table.narrow(0, t0, n) : table;
}

std::vector<int64_t> slot_values(const Tensor &slots) {
    TORCH_CHECK_VALUE(slots.device().is_cpu(), "ropekit_cpu: slots must be a CPU tensor, got one on ", slots.device());
    TORCH_CHECK_TYPE(at::isIntegralType(slots.scalar_type(), /*includeBool=*/false),
                     "ropekit_cpu: slots must be an integer tensor, got ", slots.scalar_type());
    const Tensor values = slots.scalar_type() == at::kLong ? slots.contiguous() : slots.to(at::kLong).contiguous();
    const int64_t *p = values.data_ptr<int64_t>();
    return std::vector<int64_t>(p, p + values.numel());
}

// Keys (normalised when eps is given) rotated, and values copied, into their cache slots in one
// pass. Contiguous layout (block_size 0): k, v (batch, kv_heads, seq, head_dim) written at
// [start_b, start_b + seq) of the caches' axis 2, start_b = slots[b] (one start for all rows when
// slots is absent (then `start`) or has one element). Paged (block_size > 0): k, v (tokens,
// kv_heads, head_dim), caches (blocks, block_size, kv_heads, head_dim), token t written at slot
// slots[t] (block slots[t] / block_size, row slots[t] % block_size); negative slots are skipped.
//
// Every size and slot the writes and the table reads depend on is checked here, without integer
// overflow (these operators are reachable directly through torch.ops): starts in [0, length - seq],
// slots below blocks * block_size, tables whose batch (tokens) axis is 1 or k's. Caches with
// strided channels are written through a contiguous copy, copied back (bit for bit the same).
void rotate_into_checked(const Tensor &k, const Tensor &v, const Tensor &cos, const Tensor &sin, const Tensor &k_cache,
                         const Tensor &v_cache, const std::vector<int64_t> &slot,
                         const c10::optional<Tensor> &k_weight, c10::optional<double> eps, double offset,
                         bool per_token, int64_t block_size, bool interleaved);

// The checks of a cache write but the dtypes' (shapes, devices, tables, every slot); returns the
// starts (contiguous) or one slot per token (paged).
std::vector<int64_t> checked_cache_slots(const Tensor &k, const Tensor &v, const Tensor &cos, const Tensor &sin,
                                         const Tensor &k_cache, const Tensor &v_cache,
                                         const c10::optional<Tensor> &slots, int64_t start, int64_t block_size) {
    TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "ropekit_cpu: k and v must have the same shape, got ", k.sizes(),
                      " and ", v.sizes());
    TORCH_CHECK_VALUE(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() &&
                      v_cache.device().is_cpu(), "ropekit_cpu: k, v and the caches must be CPU tensors");
    const bool paged = block_size > 0;
    TORCH_CHECK_VALUE(k.dim() == (paged ? 3 : 4) && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
                      "ropekit_cpu: k, v and the caches do not have the shapes of the ", paged ? "paged" : "contiguous",
                      " layout: k ", k.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
    TORCH_CHECK_VALUE(cos.sizes() == sin.sizes() && cos.dim() >= 1 && cos.dim() <= k.dim(),
                      "ropekit_cpu: cos/sin of shape ", cos.sizes(), " and ", sin.sizes(), " do not fit k ", k.sizes());
    // the first axis of 4-D (contiguous) or 3-D (paged) tables is read per batch row (token)
    TORCH_CHECK_VALUE(cos.dim() < k.dim() || cos.size(0) == 1 || cos.size(0) == k.size(0), "ropekit_cpu: cos/sin ",
                      cos.sizes(), " do not broadcast against k ", k.sizes(), " (axis 0)");
    if (paged) {
        TORCH_CHECK_VALUE(k_cache.size(1) == block_size && k_cache.size(2) == k.size(1) &&
                          k_cache.size(3) == k.size(2), "ropekit_cpu: the paged caches ", k_cache.sizes(),
                          " do not fit k ", k.sizes(), " and block_size ", block_size);
    } else {
        TORCH_CHECK_VALUE(k_cache.size(0) == k.size(0) && k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(3),
                          "ropekit_cpu: the caches ", k_cache.sizes(), " do not fit k ", k.sizes());
    }
    // the slots (checked whatever k holds)
    std::vector<int64_t> slot;
    if (slots.has_value() && slots->defined()) {
        slot = slot_values(*slots);
    } else {
        TORCH_CHECK_VALUE(!paged, "ropekit_cpu: the paged layout needs a slot mapping");
        slot = {start};
    }
    if (paged) {
        int64_t capacity = 0;
        TORCH_CHECK_VALUE(!__builtin_mul_overflow(k_cache.size(0), block_size, &capacity),
                          "ropekit_cpu: the paged caches hold more than 2**63 slots");
        TORCH_CHECK_VALUE(static_cast<int64_t>(slot.size()) == k.size(0), "ropekit_cpu: slots must hold one slot per "
                          "token (", k.size(0), "), got ", slot.size());
        for (size_t t = 0; t < slot.size(); t++)
            TORCH_CHECK_VALUE(slot[t] < capacity, "slots: slot ", slot[t], " of token ", t, " is outside a cache of ",
                              capacity, " slots");
    } else {
        const int64_t seq = k.size(2), length = k_cache.size(2);
        TORCH_CHECK_VALUE(slot.size() == 1 || static_cast<int64_t>(slot.size()) == k.size(0),
                          "ropekit_cpu: slots must hold one start or one per batch row (", k.size(0), "), got ",
                          slot.size());
        for (int64_t first : slot)  // first + seq <= length, written so that it cannot overflow
            TORCH_CHECK_VALUE(first >= 0 && seq <= length && first <= length - seq, "slots: tokens [", first,
                              ", ", first, " + ", seq, ") do not fit in a cache of length ", length);
    }
    return slot;
}

void rotate_into_cache(const Tensor &k, const Tensor &v, const Tensor &cos, const Tensor &sin, const Tensor &k_cache,
                       const Tensor &v_cache, const c10::optional<Tensor> &slots, int64_t start,
                       const c10::optional<Tensor> &k_weight, c10::optional<double> eps, double offset, bool per_token,
                       int64_t block_size, bool interleaved) {
    TORCH_CHECK_VALUE(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
                      "ropekit_cpu: the caches must have the dtypes of k and v");
    const std::vector<int64_t> slot = checked_cache_slots(k, v, cos, sin, k_cache, v_cache, slots, start, block_size);
    if (k.numel() == 0) return;
    // caches with strided channels: the kernel writes a contiguous copy, copied back below
    const Tensor k_target = unit_channels(k_cache), v_target = unit_channels(v_cache);
    rotate_into_checked(k, v, cos, sin, k_target, v_target, slot, k_weight, eps, offset, per_token, block_size,
                        interleaved);
    for (const auto &[cache, target] : {std::pair<Tensor, Tensor>{k_cache, k_target},
                                        std::pair<Tensor, Tensor>{v_cache, v_target}}) {
        if (!target.is_same(cache)) cache.copy_(target);
        cache.unsafeGetTensorImpl()->bump_version();
    }
}

// rotate_into_cache once its arguments are checked (slot: the starts, or one slot per token).
void rotate_into_checked(const Tensor &k, const Tensor &v, const Tensor &cos, const Tensor &sin, const Tensor &k_cache,
                         const Tensor &v_cache, const std::vector<int64_t> &slot,
                         const c10::optional<Tensor> &k_weight, c10::optional<double> eps, double offset,
                         bool per_token, int64_t block_size, bool interleaved) {
    const bool paged = block_size > 0;
    const Tensor k_in = unit_channels(k), v_in = unit_channels(v);
    const int64_t flags = flags_of(interleaved, false, true) | FLAG_STREAM;  // slots far apart: streamed
    Norm norm;  // per token: over the kv_heads axis (1 of k) and the channels
    if (eps.has_value()) norm = make_norm(k_in, k_weight, *eps, offset, per_token ? 1 : -1);
    Jobs jobs;
    // the keys kk into kc (axis: their kv_heads axis), the values vv copied into vc (rotary_dim 0)
    auto add = [&](const Tensor &kk, const Tensor &vv, const Tensor &kc, const Tensor &vc, const Tensor &c,
                   const Tensor &s, int64_t axis) {
        NormSpec spec = norm.spec;
        spec.head_axis = per_token ? axis : -1;
        add_jobs(kk, kc, c, s, flags, jobs, eps.has_value() ? &spec : nullptr);
        const Tensor no_table = c.narrow(-1, 0, 0);
        add_jobs(vv, vc, no_table, no_table, flags, jobs);
    };
    if (!paged) {
        const int64_t batch = k.size(0), seq = k.size(2);
        const std::vector<int64_t> &starts = slot;
        if (starts.size() == 1) {
            add(k_in, v_in, k_cache.narrow(2, starts[0], seq), v_cache.narrow(2, starts[0], seq), cos, sin, 1);
        } else {  // the jobs of row 0 at slot 0, then copies moved to each row and its start (no views)
            const at::ScalarType work = k.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
            const Tensor cos_w = work_table(cos, work), sin_w = work_table(sin, work);
            const Tensor c0 = batch_rows(cos_w, 0), s0 = batch_rows(sin_w, 0);
            NormSpec spec = norm.spec;
            spec.head_axis = per_token ? 0 : -1;
            Jobs proto;
            add_jobs(k_in.select(0, 0), k_cache.select(0, 0).narrow(1, 0, seq), c0, s0, flags, proto,
                     eps.has_value() ? &spec : nullptr);
            const size_t key_jobs = proto.size();
            add_jobs(v_in.select(0, 0), v_cache.select(0, 0).narrow(1, 0, seq), c0.narrow(-1, 0, 0),
                     s0.narrow(-1, 0, 0), flags, proto);
            const bool table_rows = cos_w.dim() == 4 && cos_w.size(0) != 1;
            for (int64_t b = 0; b < batch; b++) {
                for (size_t i = 0; i < proto.size(); i++) {
                    const bool key = i < key_jobs;
                    const Tensor &src = key ? k_in : v_in, &dst = key ? k_cache : v_cache;
                    const int64_t size = src.element_size();
                    Job job = proto[i];
                    job.x = static_cast<char *>(job.x) + b * src.stride(0) * size;
                    job.out = static_cast<char *>(job.out) + (b * dst.stride(0) + starts[b] * dst.stride(2)) * size;
                    if (key && table_rows) {
                        job.cos = static_cast<const char *>(job.cos) + b * cos_w.stride(0) * cos_w.element_size();
                        job.sin = static_cast<const char *>(job.sin) + b * sin_w.stride(0) * sin_w.element_size();
                    }
                    jobs.push_back(std::move(job));
                }
            }
        }
    } else {
        const int64_t tokens = k.size(0);
        for (int64_t t = 0; t < tokens;) {
            if (slot[t] < 0) {  // padding: nothing written
                t++;
                continue;
            }
            const int64_t block = slot[t] / block_size, row = slot[t] % block_size;
            int64_t n = 1;  // a run of tokens in consecutive slots of one block: one job
            while (t + n < tokens && row + n < block_size && slot[t + n] == slot[t] + n) n++;
            add(k_in.narrow(0, t, n), v_in.narrow(0, t, n), k_cache.select(0, block).narrow(0, row, n),
                v_cache.select(0, block).narrow(0, row, n), token_rows(cos, t, n), token_rows(sin, t, n), 1);
            t += n;
        }
    }
    run_jobs(jobs, /*each_job=*/true);  // keys cost more per row than values
}

#include "cache_scaled.h"

#endif  // ROPEKIT_FUSED_CPU_H
