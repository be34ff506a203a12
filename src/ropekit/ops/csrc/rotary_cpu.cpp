// ropekit's CPU rotary operators: the row loops of rotary_rows.h, split over torch's own thread
// pool with at::parallel_for (OpenMP, TBB or native: whatever this torch was built with).
//
// Operators (namespace ROPEKIT_CPU_NAMESPACE, "ropekit_cpu" unless the build says otherwise):
//
//   apply_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> Tensor
//   apply_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()
//   apply_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> (Tensor, Tensor)
//   apply_rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()
//   rotate_offset(Tensor x, Tensor cos_table, Tensor sin_table, int offset, int seq_axis, bool interleaved,
//                 bool conjugate) -> Tensor, and rotate_offset_, rotate_qk_offset, rotate_qk_offset_: by
//                 position, token t (along seq_axis) rotated by row offset + t of full tables, read in place
//   and the fused forms of fused_cpu.h (RMSNorm + rotation, its backward, rotation into a KV cache)
//
// x (q, k): (..., head_dim) CPU tensors of float32/float64/bfloat16/float16, any strides.
// cos, sin: (..., rotary_dim / 2) tables, right-aligned against x.shape[:-1] with each axis 1 or
// x's size (float32; float64 for float64 x; others are converted). The caller (ropekit.functional)
// has validated shapes; the checks here guard the kernel's memory accesses.
//
// Work: one pass over memory (cpu_jobs.h). Rows (head vectors) of q and k together are split over
// at::get_num_threads() threads from 128 KiB on; from 1 MiB on a tensor's rows are visited in
// memory order, a few streams at a time, which lets one core move about as many bytes per second
// as x.mul_(1.0). Every row is computed the same way whatever the order or split, so results
// never depend on either.
//
// The same entry points are also plain Python functions of this extension module
// (pybind11, PYBIND11_MODULE below): ropekit's eager call path, with nothing to record or
// trace, calls them without the dispatcher (a decode step is a few microseconds, most of it the
// call itself). They run exactly the code the operators run.
#include <torch/csrc/utils/pybind.h>  // first: it includes Python.h

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "rotary_rows.h"

#ifndef ROPEKIT_CPU_NAMESPACE
#define ROPEKIT_CPU_NAMESPACE ropekit_cpu
#endif
// one level of indirection so that the namespace macro is expanded before TORCH_LIBRARY pastes it
#define ROPEKIT_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define ROPEKIT_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

namespace {

#include "norm_rows.h"
#include "cpu_jobs.h"
#include "fused_cpu.h"

// Out of place: the output is allocated like the input the kernel reads (unit channel stride), never
// like a strided x, whose channels the kernel would otherwise write as if they were contiguous.
Tensor apply_rotary(const Tensor &x, const Tensor &cos, const Tensor &sin, bool interleaved, bool conjugate) {
    const Tensor x_in = unit_channels(x);
    Tensor out = fresh_output(x_in);
    Jobs jobs;
    add_jobs(x_in, out, cos, sin, flags_of(interleaved, conjugate, true), jobs);
    run_jobs(jobs);
    return out;
}

std::tuple<Tensor, Tensor> apply_rotary_qk(const Tensor &q, const Tensor &k, const Tensor &cos, const Tensor &sin,
                                           bool interleaved, bool conjugate) {
    const Tensor q_in = unit_channels(q), k_in = unit_channels(k);
    Tensor q_out = fresh_output(q_in), k_out = fresh_output(k_in);
    const int64_t flags = flags_of(interleaved, conjugate, true);
    Jobs jobs;
    add_jobs(q_in, q_out, cos, sin, flags, jobs);
    add_jobs(k_in, k_out, cos, sin, flags, jobs);
    run_jobs(jobs);
    return {q_out, k_out};
}

// In place: tensors with strided channels went through a contiguous copy, written back here.
void write_back(std::initializer_list<std::pair<Tensor, Tensor>> targets_and_work) {
    for (const auto &[target, work] : targets_and_work) {
        if (!target.defined()) continue;
        if (!work.is_same(target)) target.copy_(work);
        target.unsafeGetTensorImpl()->bump_version();  // what torch's in-place ops do: autograd sees the change
    }
}

void apply_rotary_qk_(const Tensor &q, const Tensor &k, const Tensor &cos, const Tensor &sin, bool interleaved,
                      bool conjugate) {
    const int64_t flags = flags_of(interleaved, conjugate, false);
    const Tensor q_work = unit_channels(q), k_work = k.defined() ? unit_channels(k) : k;
    Jobs jobs;
    add_jobs(q_work, q_work, cos, sin, flags, jobs);
    if (k.defined()) add_jobs(k_work, k_work, cos, sin, flags, jobs);
    run_jobs(jobs);
    write_back({{q, q_work}, {k, k_work}});
}

void apply_rotary_(const Tensor &x, const Tensor &cos, const Tensor &sin, bool interleaved, bool conjugate) {
    apply_rotary_qk_(x, Tensor(), cos, sin, interleaved, conjugate);
}

// By position with one int offset: token t (along seq_axis) is rotated by row offset + t of the full
// (max_positions, rotary_dim / 2) tables, which the job reads where they lie (add_offset_jobs): the
// broadcast kernels above with no gather, no view of the rows and no Python between (a decode step by
// offset: RotaryEmbedding's, rotate_qk's). The caller has checked the offset against the tables; the
// checks here guard the memory accesses.
Tensor rotate_offset(const Tensor &x, const Tensor &cos_table, const Tensor &sin_table, int64_t offset,
                     int64_t seq_axis, bool interleaved, bool conjugate) {
    const Tensor x_in = unit_channels(x);
    Tensor out = fresh_output(x_in);
    Jobs jobs;
    add_offset_jobs(x_in, out, cos_table, sin_table, offset, seq_axis, flags_of(interleaved, conjugate, true), jobs);
    run_jobs(jobs);
    return out;
}

std::tuple<Tensor, Tensor> rotate_qk_offset(const Tensor &q, const Tensor &k, const Tensor &cos_table,
                                            const Tensor &sin_table, int64_t offset, int64_t seq_axis,
                                            bool interleaved, bool conjugate) {
    const Tensor q_in = unit_channels(q), k_in = unit_channels(k);
    Tensor q_out = fresh_output(q_in), k_out = fresh_output(k_in);
    const int64_t flags = flags_of(interleaved, conjugate, true);
    Jobs jobs;
    add_offset_jobs(q_in, q_out, cos_table, sin_table, offset, seq_axis, flags, jobs);
    add_offset_jobs(k_in, k_out, cos_table, sin_table, offset, seq_axis, flags, jobs);
    run_jobs(jobs);
    return {q_out, k_out};
}

void rotate_qk_offset_(const Tensor &q, const Tensor &k, const Tensor &cos_table, const Tensor &sin_table,
                       int64_t offset, int64_t seq_axis, bool interleaved, bool conjugate) {
    const int64_t flags = flags_of(interleaved, conjugate, false);
    const Tensor q_work = unit_channels(q), k_work = k.defined() ? unit_channels(k) : k;
    Jobs jobs;
    add_offset_jobs(q_work, q_work, cos_table, sin_table, offset, seq_axis, flags, jobs);
    if (k.defined()) add_offset_jobs(k_work, k_work, cos_table, sin_table, offset, seq_axis, flags, jobs);
    run_jobs(jobs);
    write_back({{q, q_work}, {k, k_work}});
}

void rotate_offset_(const Tensor &x, const Tensor &cos_table, const Tensor &sin_table, int64_t offset,
                    int64_t seq_axis, bool interleaved, bool conjugate) {
    rotate_qk_offset_(x, Tensor(), cos_table, sin_table, offset, seq_axis, interleaved, conjugate);
}

// Test hooks: the thresholds (returns the previous ones; -1 keeps a value), the bytes of fresh
// outputs populated so far and the size from which they are (fresh_output; returns the previous
// one), and the visiting order of rows given sizes and the strides of x, out, cos and sin:
// [n, sizes..., x strides..., ...].
std::vector<int64_t> set_thresholds(int64_t plan_bytes, int64_t parallel_bytes) {
    std::vector<int64_t> previous{plan_min_bytes.load(), parallel_min_bytes.load()};
    if (plan_bytes >= 0) plan_min_bytes = plan_bytes;
    if (parallel_bytes >= 0) parallel_min_bytes = parallel_bytes;
    return previous;
}

int64_t populated_bytes() { return populated_bytes_total.load(); }

int64_t set_populate_bytes(int64_t min_bytes) { return populate_min_bytes.exchange(min_bytes); }

std::vector<int64_t> plan_rows(at::IntArrayRef sizes, at::IntArrayRef x_strides, at::IntArrayRef out_strides,
                               at::IntArrayRef cos_strides, at::IntArrayRef sin_strides) {
    const size_t n = sizes.size();
    TORCH_CHECK_VALUE(x_strides.size() == n && out_strides.size() == n && cos_strides.size() == n &&
                      sin_strides.size() == n, "ropekit_cpu: plan_rows needs one stride per size for each tensor");
    Dims dims;
    for (size_t d = 0; d < n; d++)
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
    m.def("apply_rotary(Tensor x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> Tensor");
    m.def("apply_rotary_(Tensor(a!) x, Tensor cos, Tensor sin, bool interleaved, bool conjugate) -> ()");
    m.def("apply_rotary_qk(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, bool conjugate)"
          " -> (Tensor, Tensor)");
    m.def("apply_rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, bool interleaved, bool conjugate)"
          " -> ()");
    m.def("rotate_offset(Tensor x, Tensor cos_table, Tensor sin_table, int offset, int seq_axis, bool interleaved, "
          "bool conjugate) -> Tensor");
    m.def("rotate_offset_(Tensor(a!) x, Tensor cos_table, Tensor sin_table, int offset, int seq_axis, "
          "bool interleaved, bool conjugate) -> ()");
    m.def("rotate_qk_offset(Tensor q, Tensor k, Tensor cos_table, Tensor sin_table, int offset, int seq_axis, "
          "bool interleaved, bool conjugate) -> (Tensor, Tensor)");
    m.def("rotate_qk_offset_(Tensor(a!) q, Tensor(b!) k, Tensor cos_table, Tensor sin_table, int offset, "
          "int seq_axis, bool interleaved, bool conjugate) -> ()");
    m.def("rms_norm_rotary(Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps, float weight_offset, "
          "bool per_token, bool interleaved) -> Tensor");
    m.def("rms_norm_rotary_(Tensor(a!) x, Tensor? weight, Tensor cos, Tensor sin, float eps, float weight_offset, "
          "bool per_token, bool interleaved) -> ()");
    m.def("rms_norm_rotary_qk(Tensor q, Tensor k, Tensor? q_weight, Tensor? k_weight, Tensor cos, Tensor sin, "
          "float eps, float weight_offset, bool per_token, bool interleaved) -> (Tensor, Tensor)");
    m.def("rms_norm_rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor? q_weight, Tensor? k_weight, Tensor cos, "
          "Tensor sin, float eps, float weight_offset, bool per_token, bool interleaved) -> ()");
    m.def("rms_norm_rotary_backward(Tensor grad, Tensor x, Tensor? weight, Tensor cos, Tensor sin, float eps, "
          "float weight_offset, bool per_token, bool interleaved) -> (Tensor, Tensor)");
    m.def("rotate_into_cache(Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
          "Tensor? slots, int start, Tensor? k_weight, float? eps, float weight_offset, bool per_token, "
          "int block_size, bool interleaved) -> ()");
    m.def("rotate_into_cache_scaled(Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
          "Tensor(b!) v_cache, Tensor? slots, int start, Tensor? k_weight, float? eps, float weight_offset, "
          "bool per_token, int block_size, bool interleaved, Tensor? k_scale, Tensor? v_scale) -> ()");
    m.def("set_thresholds(int plan_bytes, int parallel_bytes) -> int[]", &set_thresholds);
    m.def("populated_bytes() -> int", &populated_bytes);
    m.def("set_populate_bytes(int min_bytes) -> int", &set_populate_bytes);
    m.def("plan_rows(int[] sizes, int[] x_strides, int[] out_strides, int[] cos_strides, int[] sin_strides) -> int[]",
          &plan_rows);
}

// The kernels, registered at the CPU key and, below, at the autograd key.
static void impl_kernels(torch::Library& m) {
    m.impl("rotate_offset", &rotate_offset);
    m.impl("rotate_offset_", &rotate_offset_);
    m.impl("rotate_qk_offset", &rotate_qk_offset);
    m.impl("rotate_qk_offset_", &rotate_qk_offset_);
    m.impl("apply_rotary", &apply_rotary);
    m.impl("apply_rotary_", &apply_rotary_);
    m.impl("apply_rotary_qk", &apply_rotary_qk);
    m.impl("apply_rotary_qk_", &apply_rotary_qk_);
    m.impl("rms_norm_rotary", &rms_norm_rotary);
    m.impl("rms_norm_rotary_", &rms_norm_rotary_);
    m.impl("rms_norm_rotary_qk", &rms_norm_rotary_qk);
    m.impl("rms_norm_rotary_qk_", &rms_norm_rotary_qk_);
    m.impl("rms_norm_rotary_backward", &rms_norm_rotary_backward);
    m.impl("rotate_into_cache", &rotate_into_cache);
    m.impl("rotate_into_cache_scaled", &rotate_into_cache_scaled);
}

ROPEKIT_LIBRARY_IMPL(ROPEKIT_CPU_NAMESPACE, CPU, m) { impl_kernels(m); }

// The same kernels at the autograd key: these operators are not differentiable themselves (the
// ropekit::apply_rotary* operators above them carry the autograd), so a call goes straight to the
// kernel instead of through torch's not-implemented fallback; in-place versions are bumped here.
ROPEKIT_LIBRARY_IMPL(ROPEKIT_CPU_NAMESPACE, AutogradCPU, m) { impl_kernels(m); }

// The kernels as Python functions (see the top of the file), the GIL released while they run
// (as the dispatcher does for operators called from Python).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "ropekit's CPU rotary kernels without the dispatcher (the same code as the operators)";
    const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
    m.def("apply_rotary", &apply_rotary, release);
    m.def("apply_rotary_", &apply_rotary_, release);
    m.def("apply_rotary_qk", &apply_rotary_qk, release);
    m.def("apply_rotary_qk_", &apply_rotary_qk_, release);
    m.def("rotate_offset", &rotate_offset, release);
    m.def("rotate_offset_", &rotate_offset_, release);
    m.def("rotate_qk_offset", &rotate_qk_offset, release);
    m.def("rotate_qk_offset_", &rotate_qk_offset_, release);
    m.def("rms_norm_rotary", &rms_norm_rotary, release);
    m.def("rms_norm_rotary_", &rms_norm_rotary_, release);
    m.def("rms_norm_rotary_qk", &rms_norm_rotary_qk, release);
    m.def("rms_norm_rotary_qk_", &rms_norm_rotary_qk_, release);
    m.def("rms_norm_rotary_backward", &rms_norm_rotary_backward, release);
    m.def("rotate_into_cache", &rotate_into_cache, release);
    m.def("rotate_into_cache_scaled", &rotate_into_cache_scaled, release);
}
