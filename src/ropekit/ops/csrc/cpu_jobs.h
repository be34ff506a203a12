// ropekit's CPU kernels: how one call's rows become jobs and run on torch's thread pool.
//
// A job is one tensor's share of a call: the row function, the pointers, the parameter block of
// rotary_rows.h (leading sizes and the strides of x, out, cos and sin) and, for the normalising
// kernels of norm_rows.h, the norm's own arguments. run_jobs splits the rows of every job of a
// call over at::get_num_threads() threads from 128 KiB on (at::parallel_for); from 1 MiB on a
// tensor's rows are visited in memory order, a few streams at a time (visiting_order). Every
// row is computed the same way whatever the order or split, so results never depend on either.
// Included by rotary_cpu.cpp inside its anonymous namespace.
#ifndef ROPEKIT_CPU_JOBS_H
#define ROPEKIT_CPU_JOBS_H

using at::Tensor;
using RowFn = int (*)(void *, void *, const void *, const void *, const int64_t *, int64_t, int64_t);
using NormFn = int (*)(void *, void *, const void *, const void *, const NormArgs *, const int64_t *, int64_t,
                       int64_t);

constexpr size_t kMaxDims = ROPEKIT_MAX_DIMS;
constexpr int64_t kStreams = 4;  // runs of memory visited round-robin
// From this many bytes of a tensor on, its rows are visited in memory order (visiting_order);
// from this many bytes of a call on, rows are split over threads. Tests lower them
// (set_thresholds) to run those paths on small tensors.
std::atomic<int64_t> plan_min_bytes{int64_t(1) << 20};
std::atomic<int64_t> parallel_min_bytes{int64_t(128) << 10};

RowFn row_function(at::ScalarType type) {
    switch (type) {
        case at::kFloat: return ropekit_rotate_f32;
        case at::kDouble: return ropekit_rotate_f64;
        case at::kBFloat16: return ropekit_rotate_bf16;
        case at::kHalf: return ropekit_rotate_f16;
        default: TORCH_CHECK_TYPE(false, "ropekit_cpu: x must be float32, float64, bfloat16 or float16, got ", type);
    }
}

NormFn norm_function(at::ScalarType type) {
    switch (type) {
        case at::kFloat: return norm_rotate_rows<float, float>;
        case at::kDouble: return norm_rotate_rows<double, double>;
        case at::kBFloat16: return norm_rotate_rows<bf16_t, float>;
        case at::kHalf: return norm_rotate_rows<f16_t, float>;
        default: TORCH_CHECK_TYPE(false, "ropekit_cpu: x must be float32, float64, bfloat16 or float16, got ", type);
    }
}

// A leading axis: its size and the strides of x, out, cos and sin along it.
struct Dim {
    int64_t size;
    std::array<int64_t, 4> stride;
};

// What a normalising job adds to a rotation: the gains (float32, float64 for float64 x: weight,
// weight_offset + weight, or ones; kept alive by the caller), eps, and for a norm over a token's
// heads (per token) which axis of x is the heads axis (walked inside each row).
struct NormSpec {
    const void *gains = nullptr;
    int64_t n = 0;  // head_dim per head, heads * head_dim per token
    double eps = 0.0;
    int64_t head_axis = -1;  // -1: one norm per row (per head)
};

// One tensor's share of a call: the row function, the pointers and the kernel's parameter block.
struct Job {
    RowFn fn = nullptr;
    NormFn norm_fn = nullptr;  // a normalising job (then norm holds its arguments)
    NormArgs norm{};
    void *x = nullptr;
    void *out = nullptr;
    const void *cos = nullptr;
    const void *sin = nullptr;
    c10::SmallVector<int64_t, 8 + 5 * ROPEKIT_MAX_DIMS> params;
    int64_t rows = 0;
    int64_t bytes = 0;
    Tensor x_keep, cos_keep, sin_keep;  // copies made for the kernel live as long as the job
};

// The order in which the rows are visited (results do not depend on it).
// 1. drop axes of size 1, sort by x's stride (memory order), merge axes that are one run in x,
//    out, cos and sin alike;
// 2. split the next-to-innermost axis (else the innermost) in kStreams blocks visited
//    round-robin: one core keeps several hardware prefetch streams busy, and rows of different
//    heads sharing a table row (tables broadcast over heads) read that row once for all.
// Small tensors keep C order (the kernel merges contiguous axes itself).
using Dims = c10::SmallVector<Dim, ROPEKIT_MAX_DIMS + 1>;
using Jobs = c10::SmallVector<Job, 2>;

Dims visiting_order(const Dims &all, bool reorder) {
    Dims dims;
    for (const Dim &d : all)
        if (d.size != 1) dims.push_back(d);
    if (!reorder) return dims;
    std::stable_sort(dims.begin(), dims.end(), [](const Dim &a, const Dim &b) {
        return std::llabs(a.stride[0]) > std::llabs(b.stride[0]);
    });
    Dims merged;
    for (const Dim &d : dims) {
        bool merge = !merged.empty();
        for (int k = 0; k < 4 && merge; k++) merge = merged.back().stride[k] == d.stride[k] * d.size;
        if (merge) {
            merged.back().size *= d.size;
            merged.back().stride = d.stride;
        } else {
            merged.push_back(d);
        }
    }
    const size_t n = merged.size();
    if (n == 0) return merged;
    const size_t split = n >= 2 && merged[n - 2].size % kStreams == 0 ? n - 2 : n - 1;
    if (merged[split].size % kStreams == 0 && merged[split].size > kStreams) {
        const int64_t block = merged[split].size / kStreams;
        Dim streams{kStreams, merged[split].stride};
        for (int64_t &s : streams.stride) s *= block;
        merged[split].size = block;
        merged.push_back(streams);
    }
    return merged;
}

Tensor work_table(const Tensor &table, at::ScalarType work) {
    Tensor t = table.scalar_type() == work ? table : table.to(work);
    if (t.size(-1) > 1 && t.stride(-1) != 1) t = t.contiguous();
    return t;
}

// The checks every job's x and out pass (shapes, dtypes, devices; unit channel strides when not empty).
void check_x_out(const Tensor &x, const Tensor &out) {
    TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "ropekit_cpu: x and its output must be CPU tensors");
    TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.sizes() == out.sizes(),
                "ropekit_cpu: the output must have x's shape and dtype");
    TORCH_CHECK_VALUE(x.dim() >= 1, "ropekit_cpu: x needs a channel axis, got a scalar");
    if (x.numel() == 0) return;
    TORCH_CHECK(x.stride(-1) == 1 || x.size(-1) <= 1, "ropekit_cpu: x must have unit channel stride");
    TORCH_CHECK(out.stride(-1) == 1 || out.size(-1) <= 1, "ropekit_cpu: out must have unit channel stride");
}

// The order of x's leading axes (dims: sizes and the strides of x, out, cos and sin) the kernel walks:
// memory order from plan_min_bytes on (when asked for), else C order. False: more than kMaxDims axes
// either way (the caller splits x).
bool walk_order(const Tensor &x, const Dims &dims, bool plan, Dims &order) {
    const int64_t bytes = x.numel() * static_cast<int64_t>(x.element_size());
    order = visiting_order(dims, plan && bytes >= plan_min_bytes.load());
    if (order.size() > kMaxDims) order = visiting_order(dims, false);
    return order.size() <= kMaxDims;
}

// The job of x's rows once the order of its leading axes (walk_order, with the heads axis of a norm over
// a token's heads already taken out into job.norm) and the tables' first elements are known: the row
// function and the kernel's parameter block.
void finish_job(const Tensor &x, const Tensor &out, const Dims &order, const void *cos_data, const void *sin_data,
                int64_t h, const Tensor &cos_keep, const Tensor &sin_keep, int64_t flags, Jobs &jobs,
                const NormSpec *norm, Job &job) {
    const int64_t head_axis = norm ? norm->head_axis : -1;
    const int64_t bytes = x.numel() * static_cast<int64_t>(x.element_size());
    if (norm) {
        // the gains the kernel reads: n of them, n = head_dim (times the heads walked inside a row)
        TORCH_CHECK(norm->n == x.size(-1) * (head_axis >= 0 ? job.norm.heads : 1),
                    "ropekit_cpu: the norm's gains do not fit x (a bug in ropekit)");
        job.norm_fn = norm_function(x.scalar_type());
        job.norm.gains = norm->gains;
        job.norm.eps = norm->eps;
        job.norm.n = norm->n;
        job.norm.gain_head_stride = head_axis >= 0 ? x.size(-1) : 0;
        if (head_axis < 0) job.norm.heads = 1;
    } else {
        job.fn = row_function(x.scalar_type());
    }
    job.x = x.data_ptr();
    job.out = out.data_ptr();
    job.cos = cos_data;
    job.sin = sin_data;
    job.x_keep = x;
    job.cos_keep = cos_keep;
    job.sin_keep = sin_keep;
    job.rows = x.numel() / x.size(-1) / (head_axis >= 0 ? job.norm.heads : 1);
    job.bytes = bytes;
    const int64_t n = static_cast<int64_t>(order.size());
    job.params = {n, h, x.size(-1), flags, 1, 1, 1, 1};
    for (const Dim &d : order) job.params.push_back(d.size);
    for (int k = 0; k < 4; k++)
        for (const Dim &d : order) job.params.push_back(d.stride[k]);
    jobs.push_back(std::move(job));
}

// Append the jobs rotating x into out (out may be x; with norm, normalising first). More than
// kMaxDims leading axes that do not merge: one job per index of the first axis.
void add_jobs(const Tensor &x, const Tensor &out, const Tensor &cos_in, const Tensor &sin_in, int64_t flags,
              Jobs &jobs, const NormSpec *norm = nullptr, bool plan = true) {
    check_x_out(x, out);
    TORCH_CHECK(cos_in.device().is_cpu() && sin_in.device().is_cpu(), "ropekit_cpu: the tables must be CPU tensors");
    TORCH_CHECK_VALUE(cos_in.dim() >= 1 && cos_in.dim() <= x.dim() && sin_in.sizes() == cos_in.sizes(),
                      "ropekit_cpu: cos/sin of shape ", cos_in.sizes(), " and ", sin_in.sizes(), " do not fit x ",
                      x.sizes());
    // h <= head_dim / 2, not 2 * h <= head_dim: a huge (empty) table must not wrap around
    TORCH_CHECK_VALUE(cos_in.size(-1) <= x.size(-1) / 2, "ropekit_cpu: rotary_dim 2 * ", cos_in.size(-1),
                      " exceeds head_dim ", x.size(-1));
    for (int64_t d = x.dim() - cos_in.dim(); d < x.dim() - 1; d++) {  // empty or not, the tables must fit x
        const int64_t t = d - (x.dim() - cos_in.dim());
        TORCH_CHECK_VALUE(cos_in.size(t) == 1 || cos_in.size(t) == x.size(d), "ropekit_cpu: cos/sin ",
                          cos_in.sizes(), " do not broadcast to x ", x.sizes());
    }
    if (x.numel() == 0) return;  // nothing read or written: any strides
    const at::ScalarType work = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const Tensor cos = work_table(cos_in, work), sin = work_table(sin_in, work);
    const int64_t lead = x.dim() - 1, shift = x.dim() - cos.dim();
    const int64_t head_axis = norm ? norm->head_axis : -1;
    Job job;
    Dims dims;
    for (int64_t d = 0; d < lead; d++) {
        Dim dim{x.size(d), {x.stride(d), out.stride(d), 0, 0}};
        const int64_t t = d - shift;
        if (t >= 0 && cos.size(t) != 1) {
            TORCH_CHECK_VALUE(cos.size(t) == x.size(d), "ropekit_cpu: cos/sin ", cos.sizes(), " do not broadcast to x ",
                        x.sizes());
            dim.stride[2] = cos.stride(t);
            dim.stride[3] = sin.stride(t);
        }
        if (d == head_axis) {  // a norm over the token's heads: this axis is walked inside each row
            job.norm.heads = dim.size;
            for (int k = 0; k < 4; k++) job.norm.head_stride[k] = dim.stride[k];
            continue;
        }
        dims.push_back(dim);
    }
    Dims order;
    if (!walk_order(x, dims, plan, order)) {  // too many axes: one job per index of the first axis
        TORCH_CHECK(head_axis != 0, "ropekit_cpu: too many leading axes around the heads axis");
        NormSpec inner;
        if (norm) inner = {norm->gains, norm->n, norm->eps, head_axis < 0 ? -1 : head_axis - 1};
        for (int64_t i = 0; i < x.size(0); i++) {
            const bool table_axis = shift == 0;
            const Tensor c = table_axis ? cos.select(0, cos.size(0) == 1 ? 0 : i) : cos;
            const Tensor s = table_axis ? sin.select(0, sin.size(0) == 1 ? 0 : i) : sin;
            add_jobs(x.select(0, i), out.select(0, i), c, s, flags, jobs, norm ? &inner : nullptr, plan);
        }
        return;
    }
    finish_job(x, out, order, cos.data_ptr(), sin.data_ptr(), cos.size(-1), cos, sin, flags, jobs, norm, job);
}

// Append the job rotating x into out by rows [offset, offset + tokens) of full (max_positions, h) tables,
// token t along seq_axis by row offset + t: the tables' rows described to the kernel as they lie (a
// stride along seq_axis, 0 elsewhere), no tensor made for them unless they need converting.
void add_offset_jobs(const Tensor &x, const Tensor &out, const Tensor &cos_table, const Tensor &sin_table,
                     int64_t offset, int64_t seq_axis, int64_t flags, Jobs &jobs) {
    check_x_out(x, out);
    TORCH_CHECK(cos_table.device().is_cpu() && sin_table.device().is_cpu(),
                "ropekit_cpu: the tables must be CPU tensors");
    TORCH_CHECK_VALUE(x.dim() >= 2 && x.dim() - 1 <= static_cast<int64_t>(kMaxDims) && seq_axis >= 0 &&
                      seq_axis < x.dim() - 1, "ropekit_cpu: seq_axis ", seq_axis, " is not a leading axis of x ",
                      x.sizes());
    TORCH_CHECK_VALUE(cos_table.dim() == 2 && sin_table.sizes() == cos_table.sizes(),
                      "ropekit_cpu: the tables must be (max_positions, rotary_dim / 2), got ", cos_table.sizes(),
                      " and ", sin_table.sizes());
    TORCH_CHECK_VALUE(cos_table.size(1) <= x.size(-1) / 2, "ropekit_cpu: rotary_dim 2 * ", cos_table.size(1),
                      " exceeds head_dim ", x.size(-1));
    const int64_t tokens = x.size(seq_axis);
    TORCH_CHECK_VALUE(offset >= 0 && offset <= cos_table.size(0) - tokens, "ropekit_cpu: rows [", offset, ", ",
                      offset, " + ", tokens, ") lie outside tables of ", cos_table.size(0), " rows");
    if (x.numel() == 0) return;
    const at::ScalarType work = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    Tensor cos = cos_table, sin = sin_table;
    int64_t first = offset;
    if (cos.scalar_type() != work || sin.scalar_type() != work || (cos.size(1) > 1 && cos.stride(1) != 1) ||
        (sin.size(1) > 1 && sin.stride(1) != 1)) {  // only the rows used are converted
        cos = work_table(cos.narrow(0, offset, tokens), work);
        sin = work_table(sin.narrow(0, offset, tokens), work);
        first = 0;
    }
    Dims dims;
    for (int64_t d = 0; d < x.dim() - 1; d++) {
        Dim dim{x.size(d), {x.stride(d), out.stride(d), 0, 0}};
        if (d == seq_axis && tokens != 1) {
            dim.stride[2] = cos.stride(0);
            dim.stride[3] = sin.stride(0);
        }
        dims.push_back(dim);
    }
    const int64_t element = static_cast<int64_t>(cos.element_size());
    const char *cos_data = static_cast<const char *>(cos.data_ptr()) + first * cos.stride(0) * element;
    const char *sin_data = static_cast<const char *>(sin.data_ptr()) + first * sin.stride(0) * element;
    Dims order;
    TORCH_CHECK(walk_order(x, dims, true, order), "ropekit_cpu: too many leading axes (a bug in ropekit)");
    Job job;
    finish_job(x, out, order, cos_data, sin_data, cos.size(1), cos, sin, flags, jobs, nullptr, job);
}

// Run rows [begin, end) of one job.
inline void run_rows(const Job &j, int64_t begin, int64_t end) {
    const int status = j.norm_fn ? j.norm_fn(j.x, j.out, j.cos, j.sin, &j.norm, j.params.data(), begin, end)
                                 : j.fn(j.x, j.out, j.cos, j.sin, j.params.data(), begin, end);
    TORCH_CHECK(status == 0, "ropekit_cpu: the kernel rejected its parameters (a bug in ropekit)");
}

// Every job's rows, split over torch's threads when there are enough bytes to share: the rows of
// all jobs taken together ([0, total) = rows of job 0, then job 1, ...) cut into contiguous
// ranges, one per thread. With each_job (jobs whose rows cost unlike amounts: keys rotated beside
// values copied), a few jobs are instead each cut in equal shares, one per thread, so that no
// thread is left with all the dearer rows.
void run_jobs(const Jobs &jobs, bool each_job = false) {
    int64_t total = 0, bytes = 0;
    for (const Job &j : jobs) {
        total += j.rows;
        bytes += j.bytes;
    }
    if (total == 0) return;
    const int64_t threads = at::get_num_threads();
    if (bytes < parallel_min_bytes.load() || total < 2 || threads == 1) {  // no team to wake
        for (const Job &j : jobs)
            if (j.rows > 0) run_rows(j, 0, j.rows);
        return;
    }
    if (each_job && static_cast<int64_t>(jobs.size()) < 2 * threads) {
        at::parallel_for(0, threads, 1, [&jobs, threads](int64_t first, int64_t last) {
            for (int64_t t = first; t < last; t++)
                for (const Job &j : jobs) {
                    const int64_t b = j.rows * t / threads, e = j.rows * (t + 1) / threads;
                    if (b < e) run_rows(j, b, e);
                }
        });
        return;
    }
    at::parallel_for(0, total, 1, [&jobs](int64_t begin, int64_t end) {
        int64_t base = 0;
        for (const Job &j : jobs) {
            const int64_t b = std::max<int64_t>(begin - base, 0), e = std::min<int64_t>(end - base, j.rows);
            if (b < e) run_rows(j, b, e);
            base += j.rows;
        }
    });
}

// An output like x (what the out-of-place kernels write). From populate_min_bytes on, an output
// the allocator has just mapped (its middle page not yet in memory: glibc maps every allocation
// over 32 MiB afresh) gets its pages in one madvise(MADV_POPULATE_WRITE) per thread before the
// kernel writes it. Otherwise the kernel's row streams take one page fault per 4 KiB page as they
// reach it (16,384 for a 64 MiB output), 4-5 ms more at one thread than the one call (bfloat16
// q and k of (1, 32, 4096, 128): 37 ms against 32 ms; benchmarks/fused.py). Memory the allocator
// reuses is already in place and is left alone; a kernel before Linux 5.14 refuses the call and
// the pages fault as before. Either way the contents are the kernel's to write: only when the
// pages arrive changes.
#if defined(__linux__) && !defined(MADV_POPULATE_WRITE)
#define MADV_POPULATE_WRITE 23
#endif
std::atomic<int64_t> populate_min_bytes{int64_t(4) << 20};
std::atomic<int64_t> populated_bytes_total{0};  // bytes populated so far (a test hook reads it)

Tensor fresh_output(const Tensor &like) {
    // a dense x: its strides, allocated directly (what empty_like gives it, without the dispatcher, which
    // costs more than the rest of a small decode step's allocation); any other x: empty_like's dense strides
    Tensor out = like.is_non_overlapping_and_dense()
                     ? Tensor(at::detail::empty_strided_cpu(like.sizes(), like.strides(), like.scalar_type()))
                     : at::empty_like(like);
#ifdef __linux__
    const int64_t bytes = out.numel() * static_cast<int64_t>(out.element_size());
    if (bytes < populate_min_bytes.load() || !out.is_contiguous()) return out;
    const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data_ptr());
    const uintptr_t first = (begin + page - 1) & ~(page - 1), last = (begin + bytes) & ~(page - 1);
    if (last <= first + page) return out;
    const int64_t pages = static_cast<int64_t>((last - first) / page);
    unsigned char resident = 0;
    void *middle = reinterpret_cast<void *>(first + static_cast<uintptr_t>(pages / 2) * page);
    if (mincore(middle, page, &resident) != 0 || (resident & 1)) return out;
    auto populate = [first, page](int64_t p0, int64_t p1) {
        const size_t length = static_cast<size_t>(p1 - p0) * page;
        if (madvise(reinterpret_cast<void *>(first + static_cast<uintptr_t>(p0) * page), length,
                    MADV_POPULATE_WRITE) == 0)  // refused: the pages fault as before
            populated_bytes_total += static_cast<int64_t>(length);
    };
    if (at::get_num_threads() == 1) {
        populate(0, pages);
    } else {
        at::parallel_for(0, pages, 256, populate);
    }
#endif
    return out;
}

int64_t flags_of(bool interleaved, bool conjugate, bool copy_tail) {
    return (interleaved ? FLAG_INTERLEAVED : 0) | (conjugate ? FLAG_CONJUGATE : 0) | (copy_tail ? FLAG_COPY_TAIL : 0);
}

// x itself, or a copy with unit channel stride (what the kernel reads).
Tensor unit_channels(const Tensor &x) {
    return x.stride(-1) == 1 || x.size(-1) <= 1 ? x : x.contiguous();
}

#endif  // ROPEKIT_CPU_JOBS_H
