// ropekit's CPU rotary operators: the row loops of rotary_rows.h, split over torch's own thread
// pool with at::parallel_for (OpenMP, TBB or native: whatever this torch was built with).
//
// Operators (namespace ROPEKIT_CPU_NAMESPACE, "ropekit_cpu" unless the build says otherwise):
//
//   rotate(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> Tensor
//   rotate_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()
//   rotate_pair(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> (Tensor, Tensor)
//   rotate_pair_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()
//
// x (q, k): (..., head_dim) CPU tensors of float32/float64/bfloat16/float16, any strides.
// cos, sin: (..., rotary_dim / 2) tables, right-aligned against x.shape[:-1] with each axis 1 or
// x's size (float32; float64 for float64 x; others are converted). The caller (ropekit.functional)
// has validated shapes; the checks here guard the kernel's memory accesses.
//
// Work: one pass over memory. Rows (head vectors) of q and k together are split over
// at::get_num_threads() threads from 128 KiB on; from 1 MiB on a tensor's rows are visited in
// memory order, a few streams at a time (visiting_order), which lets one core move about as many
// bytes per second as x.mul_(1.0). Every row is computed the same way whatever the order or split,
// so results never depend on either.
//
// The same four entry points are also plain Python functions of this extension module
// (pybind11, PYBIND11_MODULE below): ropekit's eager call path, with nothing to record or
// trace, calls them without the dispatcher (a decode step is a few microseconds, most of it the
// call itself). They run exactly the code the operators run.
#include <torch/csrc/utils/pybind.h>  // first: it includes Python.h

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "rotary_rows.h"

#ifndef ROPEKIT_CPU_NAMESPACE
#define ROPEKIT_CPU_NAMESPACE ropekit_cpu
#endif
// one level of indirection so that the namespace macro is expanded before TORCH_LIBRARY pastes it
#define ROPEKIT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define ROPEKIT_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace {

using at::Tensor;
using RowFn = int (*)(void *, void *, const void *, const void *, const int64_t *, int64_t, int64_t);

constexpr size_t kMaxDims = ROPEKIT_MAX_DIMS;
constexpr int64_t kStreams = 4;  // runs of memory visited round-robin
// From this many bytes of a tensor on, its rows are visited in memory order (visiting_order);
// from this many bytes of q and k together on, rows are split over threads. Tests lower them
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

// A leading axis: its size and the strides of x, out, cos and sin along it.
struct Dim {
    int64_t size;
    std::array<int64_t, 4> stride;
};

// One tensor's share of a call: the row function, the pointers and the kernel's parameter block.
struct Job {
    RowFn fn = nullptr;
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

// Append the jobs rotating x into out (out may be x). More than kMaxDims leading axes that do
// not merge: one job per index of the first axis.
void add_jobs(const Tensor &x, const Tensor &out, const Tensor &cos_in, const Tensor &sin_in, int64_t flags,
              Jobs &jobs) {
    TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "ropekit_cpu: x must be a CPU tensor");
    TORCH_CHECK(cos_in.dim() >= 1 && cos_in.dim() <= x.dim() && sin_in.sizes() == cos_in.sizes(),
                "ropekit_cpu: cos/sin of shape ", cos_in.sizes(), " and ", sin_in.sizes(), " do not fit x ", x.sizes());
    TORCH_CHECK(2 * cos_in.size(-1) <= x.size(-1), "ropekit_cpu: rotary_dim exceeds head_dim");
    TORCH_CHECK(x.stride(-1) == 1 || x.size(-1) <= 1, "ropekit_cpu: x must have unit channel stride");
    if (x.numel() == 0) return;
    const at::ScalarType work = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    const Tensor cos = work_table(cos_in, work), sin = work_table(sin_in, work);
    const int64_t lead = x.dim() - 1, shift = x.dim() - cos.dim();
    Dims dims;
    for (int64_t d = 0; d < lead; d++) {
        Dim dim{x.size(d), {x.stride(d), out.stride(d), 0, 0}};
        const int64_t t = d - shift;
        if (t >= 0 && cos.size(t) != 1) {
            TORCH_CHECK(cos.size(t) == x.size(d), "ropekit_cpu: cos/sin ", cos.sizes(), " do not broadcast to x ",
                        x.sizes());
            dim.stride[2] = cos.stride(t);
            dim.stride[3] = sin.stride(t);
        }
        dims.push_back(dim);
    }
    const int64_t bytes = x.numel() * static_cast<int64_t>(x.element_size());
    Dims order = visiting_order(dims, bytes >= plan_min_bytes.load());
    if (order.size() > kMaxDims) order = visiting_order(dims, false);
    if (order.size() > kMaxDims) {
        for (int64_t i = 0; i < x.size(0); i++) {
            const bool table_axis = shift == 0;
            const Tensor c = table_axis ? cos.select(0, cos.size(0) == 1 ? 0 : i) : cos;
            const Tensor s = table_axis ? sin.select(0, sin.size(0) == 1 ? 0 : i) : sin;
            add_jobs(x.select(0, i), out.select(0, i), c, s, flags, jobs);
        }
        return;
    }
    Job job;
    job.fn = row_function(x.scalar_type());
    job.x = x.data_ptr();
    job.out = out.data_ptr();
    job.cos = cos.data_ptr();
    job.sin = sin.data_ptr();
    job.x_keep = x;
    job.cos_keep = cos;
    job.sin_keep = sin;
    job.rows = x.numel() / x.size(-1);
    job.bytes = bytes;
    const int64_t n = static_cast<int64_t>(order.size());
    job.params = {n, cos.size(-1), x.size(-1), flags, 1, 1, 1, 1};
    for (const Dim &d : order) job.params.push_back(d.size);
    for (int k = 0; k < 4; k++)
        for (const Dim &d : order) job.params.push_back(d.stride[k]);
    jobs.push_back(std::move(job));
}

// Rows of every job taken together ([0, total) = rows of job 0, then job 1, ...), split over
// torch's threads when there are enough bytes to share.
void run_jobs(const Jobs &jobs) {
    int64_t total = 0, bytes = 0;
    for (const Job &j : jobs) {
        total += j.rows;
        bytes += j.bytes;
    }
    auto body = [&jobs](int64_t begin, int64_t end) {
        int64_t base = 0;
        for (const Job &j : jobs) {
            const int64_t b = std::max<int64_t>(begin - base, 0), e = std::min<int64_t>(end - base, j.rows);
            if (b < e) {
                const int status = j.fn(j.x, j.out, j.cos, j.sin, j.params.data(), b, e);
                TORCH_CHECK(status == 0, "ropekit_cpu: the kernel rejected its parameters (a bug in ropekit)");
            }
            base += j.rows;
        }
    };
    if (total == 0) return;
    if (bytes < parallel_min_bytes.load() || total < 2) {
        body(0, total);
    } else {
        at::parallel_for(0, total, 1, body);
    }
}

int64_t flags_of(bool interleaved, bool conjugate, bool copy_tail) {
    return (interleaved ? FLAG_INTERLEAVED : 0) | (conjugate ? FLAG_CONJUGATE : 0) | (copy_tail ? FLAG_COPY_TAIL : 0);
}

// x itself, or a copy with unit channel stride (what the kernel reads).
Tensor unit_channels(const Tensor &x) {
    return x.stride(-1) == 1 || x.size(-1) <= 1 ? x : x.contiguous();
}

Tensor rotate(const Tensor &x, const Tensor &cos, const Tensor &sin, bool interleaved, bool conjugate) {
    Tensor out = at::empty_like(x);
    Jobs jobs;
    add_jobs(unit_channels(x), out, cos, sin, flags_of(interleaved, conjugate, true), jobs);
    run_jobs(jobs);
    return out;
}

std::tuple<Tensor, Tensor> rotate_pair(const Tensor &q, const Tensor &k, const Tensor &cos, const Tensor &sin,
                                       bool interleaved, bool conjugate) {
    Tensor q_out = at::empty_like(q), k_out = at::empty_like(k);
    const int64_t flags = flags_of(interleaved, conjugate, true);
    Jobs jobs;
    add_jobs(unit_channels(q), q_out, cos, sin, flags, jobs);
    add_jobs(unit_channels(k), k_out, cos, sin, flags, jobs);
    run_jobs(jobs);
    return {q_out, k_out};
}

// In place: tensors with strided channels go through a contiguous copy, written back.
void rotate_pair_(const Tensor &q, const Tensor &k, const Tensor &cos, const Tensor &sin, bool interleaved,
                  bool conjugate) {
    const int64_t flags = flags_of(interleaved, conjugate, false);
    const Tensor q_work = unit_channels(q), k_work = k.defined() ? unit_channels(k) : k;
    Jobs jobs;
    add_jobs(q_work, q_work, cos, sin, flags, jobs);
    if (k.defined()) add_jobs(k_work, k_work, cos, sin, flags, jobs);
    run_jobs(jobs);
    for (const auto &[target, work] : {std::pair<Tensor, Tensor>{q, q_work}, std::pair<Tensor, Tensor>{k, k_work}}) {
        if (!target.defined()) continue;
        if (!work.is_same(target)) target.copy_(work);
        target.unsafeGetTensorImpl()->bump_version();  // what torch's in-place ops do: autograd sees the change
    }
}

void rotate_(const Tensor &x, const Tensor &cos, const Tensor &sin, bool interleaved, bool conjugate) {
    rotate_pair_(x, Tensor(), cos, sin, interleaved, conjugate);
}

// Test hooks: the thresholds (returns the previous ones; -1 keeps a value) and the visiting order
// of rows given sizes and the strides of x, out, cos and sin: [n, sizes..., x strides..., ...].
std::vector<int64_t> set_thresholds(int64_t plan_bytes, int64_t parallel_bytes) {
    std::vector<int64_t> previous{plan_min_bytes.load(), parallel_min_bytes.load()};
    if (plan_bytes >= 0) plan_min_bytes = plan_bytes;
    if (parallel_bytes >= 0) parallel_min_bytes = parallel_bytes;
    return previous;
}

std::vector<int64_t> plan_rows(at::IntArrayRef sizes, at::IntArrayRef x_strides, at::IntArrayRef out_strides,
                               at::IntArrayRef cos_strides, at::IntArrayRef sin_strides) {
    Dims dims;
    for (size_t d = 0; d < sizes.size(); d++)
        dims.push_back(Dim{sizes[d], {x_strides[d], out_strides[d], cos_strides[d], sin_strides[d]}});
    const Dims order = visiting_order(dims, true);
    std::vector<int64_t> result{static_cast<int64_t>(order.size())};
    for (const Dim &d : order) result.push_back(d.size);
    for (int k = 0; k < 4; k++)
        for (const Dim &d : order) result.push_back(d.stride[k]);
    return result;
}

}  // namespace

ROPEKIT_LIBRARY(ROPEKIT_CPU_NAMESPACE, m) {
    m.def("rotate(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> Tensor");
    m.def("rotate_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()");
    m.def("rotate_pair(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, bool conjugate)"
          " -> (Tensor, Tensor)");
    m.def("rotate_pair_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()");
    m.def("set_thresholds(int plan_bytes, int parallel_bytes) -> int[]", &set_thresholds);
    m.def("plan_rows(int[] sizes, int[] x_strides, int[] out_strides, int[] cos_strides, int[] sin_strides) -> int[]",
          &plan_rows);
}

ROPEKIT_LIBRARY_IMPL(ROPEKIT_CPU_NAMESPACE, CPU, m) {
    m.impl("rotate", &rotate);
    m.impl("rotate_", &rotate_);
    m.impl("rotate_pair", &rotate_pair);
    m.impl("rotate_pair_", &rotate_pair_);
}

// The same kernels at the autograd key: these operators are not differentiable themselves (the
// ropekit::rotate* operators above them carry the autograd), so a call goes straight to the
// kernel instead of through torch's not-implemented fallback; in-place versions are bumped here.
ROPEKIT_LIBRARY_IMPL(ROPEKIT_CPU_NAMESPACE, AutogradCPU, m) {
    m.impl("rotate", &rotate);
    m.impl("rotate_", &rotate_);
    m.impl("rotate_pair", &rotate_pair);
    m.impl("rotate_pair_", &rotate_pair_);
}

// The kernels as Python functions (see the top of the file), the GIL released while they run
// (as the dispatcher does for operators called from Python).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ropekit's CPU rotary kernels without the dispatcher (the same code as the operators)";
    const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
    m.def("rotate", &rotate, release);
    m.def("rotate_", &rotate_, release);
    m.def("rotate_pair", &rotate_pair, release);
    m.def("rotate_pair_", &rotate_pair_, release);
}
