// gmc's group-sparse linear as an ONNX Runtime custom op: libgmc_ort_ops.so, built and loaded by
// gmc.kernels.ort_ops. RegisterCustomOps adds domain "gmc", op GroupSparseLinear (since version 2, CPU
// execution provider):
//
//   inputs   0 x        float32 [..., d_in]
//            1 values   float32 [nnz] | int8 [nnz] | uint8 [bytes] (int4: the layout of gmc.kernels.packed)
//            2 row_idx  int32 [R]             output row of each packed column, ascending inside a block
//            3 row_ptr  int32 [G_in + 1]      G_in = ceil(d_in / g_in): each block's first packed column
//            4 bias     float32 [d_out]       optional
//            5 scales   float32 [R] (int8 values) | float16 [int4_scale_count] (int4 values); optional
//   attrs    d_out, g_in (int)
//   output   y          float32 [..., d_out] = x @ W_hat.T + bias
//
// The compute is group_sparse_core.h's, as the torch op runs it (cpu_group_sparse.cpp) with two
// differences: row_idx is read as int32 (ONNX's index type, no per-call widening), and there is no
// gemm, so float values run the register tiles at every T > STREAM_MAX_TOKENS (int8 and int4 run
// their integer products, as in the torch op). Threads are ONNX Runtime's intra-op pool
// (KernelContext_ParallelFor): no second pool spinning beside ORT's. The split products cut the
// work into one piece per CPU this process may run on (the pool's size is not in the API), so y
// does not depend on intra_op_num_threads: the pieces are the same and are added in one order.
//
// Every call checks its inputs as the torch op does (dtypes, shapes, blocks_ok, then rows_ok as
// the products reach the rows): a layout the core would misread is an error Status of one line
// naming the input, never a read out of bounds. The library takes the API table from
// RegisterCustomOps (ORT_API_VERSION of the headers it was built with, or newer runtimes) and links
// no libonnxruntime.
#define GMC_ROW_INDEX int32_t
#include "group_sparse_core.h"

#include <onnxruntime_c_api.h>
#include <sched.h>

#include <atomic>
#include <climits>
#include <exception>
#include <new>
#include <string>
#include <thread>

namespace {

// The core's host: ONNX Runtime's intra-op thread pool, no gemm.
struct OrtHost {
  static constexpr bool HAS_GEMM = false;
  const OrtApi* api;
  const OrtKernelContext* context;
  int64_t pieces;

  int64_t threads() const { return pieces; }

  // at::parallel_for's split: min(pieces, ceil((end - begin) / grain)) ranges of equal length (the
  // last shorter), each a task of ORT's pool, which runs them on its threads in any order.
  template <class F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    if (begin >= end) return;
    const int64_t n = std::min(pieces, (end - begin + grain - 1) / std::max<int64_t>(grain, 1));
    if (n <= 1) {
      f(begin, end);
      return;
    }
    struct Job {
      const F* f;
      int64_t begin, end, chunk;
      std::atomic<bool> failed{false};
    } job{&f, begin, end, (end - begin + n - 1) / n};
    auto task = [](void* data, size_t i) {
      Job& j = *static_cast<Job*>(data);
      const int64_t b = j.begin + static_cast<int64_t>(i) * j.chunk;
      if (b >= j.end) return;
      try {
        (*j.f)(b, std::min(j.end, b + j.chunk));
      } catch (...) {  // nothing may unwind through ORT's pool: rethrown below, on this thread
        j.failed.store(true);
      }
    };
    if (OrtStatus* status = api->KernelContext_ParallelFor(context, task, static_cast<size_t>(n), 0, &job)) {
      api->ReleaseStatus(status);  // a build without the kernel context API: run on this thread
      for (int64_t i = 0; i < n; ++i) task(&job, static_cast<size_t>(i));
    }
    if (job.failed.load()) throw std::bad_alloc();  // the only exception the core throws
  }
};

// CPUs this process may run on: the pieces of a split product.
int64_t available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

struct Kernel {
  const OrtApi* api;
  int64_t d_out, g_in, pieces;
};

constexpr const char* INPUT_NAMES[6] = {"x", "values", "row_idx", "row_ptr", "bias", "scales"};
constexpr size_t MAX_RANK = 8;

OrtStatus* fail(const OrtApi* api, const std::string& message) {
  return api->CreateStatus(ORT_INVALID_ARGUMENT, ("gmc GroupSparseLinear: " + message).c_str());
}

// One input as the checks read it (present false: an absent optional input).
struct Input {
  bool present = false;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t rank = 0;
  int64_t dims[MAX_RANK] = {};
  int64_t numel = 0;
  const void* data = nullptr;
};

OrtStatus* read_input(const OrtApi* api, const OrtKernelContext* context, size_t index, Input& in) {
  const OrtValue* value = nullptr;
  if (OrtStatus* status = api->KernelContext_GetInput(context, index, &value)) return status;
  if (value == nullptr) return nullptr;  // absent optional input
  OrtTensorTypeAndShapeInfo* info = nullptr;
  if (OrtStatus* status = api->GetTensorTypeAndShape(value, &info)) return status;
  size_t count = 0;
  OrtStatus* status = api->GetTensorElementType(info, &in.type);
  if (!status) status = api->GetDimensionsCount(info, &in.rank);
  if (!status && in.rank > MAX_RANK) {
    api->ReleaseTensorTypeAndShapeInfo(info);
    return fail(api, "input " + std::to_string(index) + " (" + INPUT_NAMES[index] + ") has " +
                         std::to_string(in.rank) + " dimensions, at most " + std::to_string(MAX_RANK) + " are supported");
  }
  if (!status) status = api->GetDimensions(info, in.dims, in.rank);
  if (!status) status = api->GetTensorShapeElementCount(info, &count);
  api->ReleaseTensorTypeAndShapeInfo(info);
  if (status) return status;
  void* data = nullptr;
  if (OrtStatus* s = api->GetTensorMutableData(const_cast<OrtValue*>(value), &data)) return s;
  in.present = true;
  in.numel = static_cast<int64_t>(count);
  in.data = data;
  return nullptr;
}

const char* type_name(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    default: return "another type";
  }
}

std::string shape_of(const Input& in) {
  std::string s = "[";
  for (size_t i = 0; i < in.rank; ++i) s += (i ? ", " : "") + std::to_string(in.dims[i]);
  return s + "]";
}

std::string described(size_t index, const Input& in) {
  return "input " + std::to_string(index) + " (" + INPUT_NAMES[index] + ") " + type_name(in.type) + " " + shape_of(in);
}

// Why row_ptr and the values (and int4 scales) do not describe one packed layer, after blocks_ok
// refused them: the first rule they break.
std::string layout_problem(const int32_t* ptr, int64_t n_blocks, int64_t R, int64_t n_values, bool int4,
                           int64_t n_scales, int64_t d_in, int64_t g_in) {
  if (ptr[0] != 0) return "input 3 (row_ptr) must start at 0, got " + std::to_string(ptr[0]);
  if (ptr[n_blocks] != R)
    return "input 3 (row_ptr) must end at len(row_idx) = " + std::to_string(R) + ", got " + std::to_string(ptr[n_blocks]);
  int64_t expected = 0, expected_scales = 0;
  for (int64_t v = 0; v < n_blocks; ++v) {
    if (ptr[v + 1] < ptr[v])
      return "input 3 (row_ptr) must not decrease, got " + std::to_string(ptr[v]) + " then " +
             std::to_string(ptr[v + 1]) + " at block " + std::to_string(v);
    const int64_t rows = ptr[v + 1] - ptr[v], w = std::min(g_in, d_in - v * g_in);
    expected += rows * (int4 ? (w + 7) / 8 * 4 : w);
    expected_scales += rows * 2 * ((w + INT4_GROUP - 1) / INT4_GROUP);
  }
  if (expected != n_values)
    return "input 1 (values) holds " + std::to_string(n_values) + (int4 ? " bytes" : " numbers") +
           ", the blocks of row_ptr need " + std::to_string(expected) + " (d_in " + std::to_string(d_in) + ", g_in " +
           std::to_string(g_in) + ")";
  return "input 5 (scales) holds " + std::to_string(n_scales) + " float16 numbers, the int4 blocks of row_ptr need " +
         std::to_string(expected_scales);
}

template <class V>
bool run(const OrtHost& host, const float* x, int64_t T, int64_t d_in, const Input& values, const void* scales,
         const Input& row_idx, const Input& row_ptr, const float* bias, float* y, int64_t d_out, int64_t g_in) {
  // path STREAM: the stream up to STREAM_MAX_TOKENS tokens, then tiles (float) or the integer products
  return run_blocks(host, x, T, d_in, static_cast<const V*>(values.data), values.numel, scales,
                    static_cast<const RowIndex*>(row_idx.data), static_cast<const int32_t*>(row_ptr.data),
                    row_ptr.numel - 1, bias, y, d_out, g_in, STREAM);
}

OrtStatus* compute(const Kernel& k, OrtKernelContext* context) {
  const OrtApi* api = k.api;
  Input in[6];
  for (size_t i = 0; i < 6; ++i)
    if (OrtStatus* status = read_input(api, context, i, in[i])) return status;
  const Input &x = in[0], &values = in[1], &row_idx = in[2], &row_ptr = in[3], &bias = in[4], &scales = in[5];
  if (x.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || x.rank == 0 || x.dims[x.rank - 1] <= 0)
    return fail(api, described(0, x) + ": float32 [..., d_in] with d_in > 0 expected");
  const int64_t d_in = x.dims[x.rank - 1], T = x.numel / d_in, d_out = k.d_out, g_in = k.g_in;
  const auto vt = values.type;
  const bool int8 = vt == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, int4 = vt == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
  if ((vt != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && !int8 && !int4) || values.rank != 1)
    return fail(api, described(1, values) + ": float32, int8 or uint8 (int4) [nnz] expected");
  if (row_idx.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || row_idx.rank != 1)
    return fail(api, described(2, row_idx) + ": int32 [R] expected");
  const int64_t n_blocks = (d_in + g_in - 1) / g_in;
  if (row_ptr.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 || row_ptr.rank != 1 || row_ptr.numel != n_blocks + 1)
    return fail(api, described(3, row_ptr) + ": int32 [" + std::to_string(n_blocks + 1) + "] expected (G_in + 1 for d_in " +
                         std::to_string(d_in) + " in blocks of g_in " + std::to_string(g_in) + ")");
  if (bias.present && (bias.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || bias.rank != 1 || bias.numel != d_out))
    return fail(api, described(4, bias) + ": float32 [" + std::to_string(d_out) + "] (d_out) expected");
  if (int8 && (!scales.present || scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || scales.rank != 1 ||
               scales.numel != row_idx.numel))
    return fail(api, (scales.present ? described(5, scales) : std::string("input 5 (scales) absent")) +
                         ": int8 values need float32 scales [" + std::to_string(row_idx.numel) + "] (one per row_idx entry)");
  if (int4) {
    if (!scales.present || scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 || scales.rank != 1)
      return fail(api, (scales.present ? described(5, scales) : std::string("input 5 (scales) absent")) +
                           ": int4 (uint8) values need float16 scales, 1-D");
    if (g_in % 8 != 0)
      return fail(api, "attribute g_in " + std::to_string(g_in) + ": int4 (uint8) values need a multiple of 8");
  }
  if (!int8 && !int4 && scales.present) return fail(api, described(5, scales) + ": float32 values take no scales");
  const int32_t* ptr = static_cast<const int32_t*>(row_ptr.data);
  if (!blocks_ok(values.numel, row_idx.numel, ptr, n_blocks, d_in, g_in, int4, int4 ? scales.numel : 0))
    return fail(api, layout_problem(ptr, n_blocks, row_idx.numel, values.numel, int4, scales.numel, d_in, g_in));

  int64_t dims[MAX_RANK];
  std::copy(x.dims, x.dims + x.rank, dims);
  dims[x.rank - 1] = d_out;
  OrtValue* output = nullptr;
  if (OrtStatus* status = api->KernelContext_GetOutput(context, 0, dims, x.rank, &output)) return status;
  void* y = nullptr;
  if (OrtStatus* status = api->GetTensorMutableData(output, &y)) return status;
  if (T == 0 || d_out == 0) return nullptr;

  const OrtHost host{api, context, k.pieces};
  const float* xp = static_cast<const float*>(x.data);
  const float* bp = bias.present ? static_cast<const float*>(bias.data) : nullptr;
  float* yp = static_cast<float*>(y);
  bool ok;
  if (int8) ok = run<int8_t>(host, xp, T, d_in, values, scales.data, row_idx, row_ptr, bp, yp, d_out, g_in);
  else if (int4) ok = run<int4x2>(host, xp, T, d_in, values, scales.data, row_idx, row_ptr, bp, yp, d_out, g_in);
  else ok = run<float>(host, xp, T, d_in, values, nullptr, row_idx, row_ptr, bp, yp, d_out, g_in);
  if (!ok)
    return fail(api, "input 2 (row_idx) must rise strictly inside each block of row_ptr and lie in [0, d_out = " +
                         std::to_string(d_out) + ")");
  return nullptr;
}

OrtStatus* create_kernel(const OrtApi* api, const OrtKernelInfo* info, void** out) {
  int64_t d_out = 0, g_in = 0;
  if (OrtStatus* status = api->KernelInfoGetAttribute_int64(info, "d_out", &d_out)) {
    api->ReleaseStatus(status);
    return fail(api, "attribute d_out (int) is required");
  }
  if (OrtStatus* status = api->KernelInfoGetAttribute_int64(info, "g_in", &g_in)) {
    api->ReleaseStatus(status);
    return fail(api, "attribute g_in (int) is required");
  }
  if (d_out < 0 || g_in <= 0 || d_out > INT32_MAX)
    return fail(api, "attributes d_out " + std::to_string(d_out) + " and g_in " + std::to_string(g_in) +
                         ": d_out in [0, 2^31) and g_in positive expected");
  *out = new Kernel{api, d_out, g_in, available_cpus()};
  return nullptr;
}

// The op's description for ORT: input and output types (values and scales: any, checked per call),
// optional bias and scales, and the kernel's entry points. Exceptions never cross into ORT.
struct GroupSparseLinearOp : OrtCustomOp {
  GroupSparseLinearOp() : OrtCustomOp{} {
    version = ORT_API_VERSION;
    GetName = [](const OrtCustomOp*) { return "GroupSparseLinear"; };
    GetExecutionProviderType = [](const OrtCustomOp*) { return "CPUExecutionProvider"; };
    GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 6; };
    GetInputType = [](const OrtCustomOp*, size_t i) {
      switch (i) {
        case 0: case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
        case 2: case 3: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
        default: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // values, scales: by the values' kind
      }
    };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t i) {
      return i >= 4 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
    };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
    GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
    GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
    GetStartVersion = [](const OrtCustomOp*) { return 2; };  // version 1: int8 values row-major
    GetEndVersion = [](const OrtCustomOp*) { return INT_MAX; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi* api, const OrtKernelInfo* info, void** kernel) {
      try {
        return create_kernel(api, info, kernel);
      } catch (const std::exception& error) {
        return api->CreateStatus(ORT_FAIL, (std::string("gmc GroupSparseLinear: ") + error.what()).c_str());
      }
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      const Kernel& k = *static_cast<const Kernel*>(kernel);
      try {
        return compute(k, context);
      } catch (const std::exception& error) {
        return k.api->CreateStatus(ORT_FAIL, (std::string("gmc GroupSparseLinear: ") + error.what()).c_str());
      }
    };
    KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  }
};

}  // namespace

// The library's entry point (onnxruntime's register_custom_ops_library): adds domain "gmc" with
// GroupSparseLinear to `options`. One domain serves every session; ORT reads it and never frees it.
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr)  // an older runtime: its first API table can still say so
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, ("gmc: libgmc_ort_ops.so needs ONNX Runtime API " + std::to_string(ORT_API_VERSION) +
                   " or newer, this runtime is " + api_base->GetVersionString())
                      .c_str());
  static GroupSparseLinearOp op;
  static OrtCustomOpDomain* domain = nullptr;
  static OrtStatus* made = [&]() -> OrtStatus* {
    if (OrtStatus* status = api->CreateCustomOpDomain("gmc", &domain)) return status;
    return api->CustomOpDomain_Add(domain, &op);
  }();
  if (made != nullptr) return api->CreateStatus(ORT_FAIL, api->GetErrorMessage(made));
  return api->AddCustomOpDomain(options, domain);
}
