// The fake accelerator's one kernel: `contiguous` (a strided view made contiguous: a transpose when the
// view is transposed), registered for `fakedev` through Paddle's plugin-kernel API. Built into its own
// library (libfakedev_kernels.so, linked against the process's libpaddle.so) and loaded only from the
// `kernels/` folder beside the plugin: the default fake device keeps failing on `contiguous`, which the
// tests use to show that an export does not compute on the device.
//
// Device memory is host memory here, so the kernel reads the input's bytes directly; its output is
// allocated through the device context (Paddle's allocator statistics count it). Each call adds one to
// `fakedev_contiguous_calls` and the output's size to `fakedev_contiguous_bytes` (read with ctypes).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paddle/phi/backends/custom/custom_context.h"
#include "paddle/phi/core/dense_tensor.h"
#include "paddle/phi/core/kernel_registry.h"

extern "C" {
std::atomic<int64_t> fakedev_contiguous_calls{0};
std::atomic<int64_t> fakedev_contiguous_bytes{0};
}

namespace fakedev {

template <typename T>
static void strided_copy(T* dst, const T* src, const std::vector<int64_t>& dims, const std::vector<int64_t>& strides) {
  const int nd = static_cast<int>(dims.size());
  if (nd == 0) {
    dst[0] = src[0];
    return;
  }
  int64_t outer = 1;
  for (int d = 0; d < nd - 1; ++d) outer *= dims[d];
  const int64_t inner = dims[nd - 1], step = strides[nd - 1];
  std::vector<int64_t> idx(nd > 1 ? nd - 1 : 1, 0);
  for (int64_t o = 0; o < outer; ++o) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * strides[d];
    const T* s = src + off;
    for (int64_t i = 0; i < inner; ++i) dst[i] = s[i * step];
    dst += inner;
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < dims[d]) break;
      idx[d] = 0;
    }
  }
}

template <typename T, typename Context>
void ContiguousKernel(const Context& dev_ctx, const phi::DenseTensor& input, phi::DenseTensor* out) {
  phi::DenseTensorMeta meta = input.meta();
  meta.strides = meta.calc_strides(meta.dims);
  meta.offset = 0;
  out->set_meta(meta);
  T* dst = dev_ctx.template Alloc<T>(out);
  const int64_t n = input.numel();
  if (n > 0) {
    const T* src = reinterpret_cast<const T*>(static_cast<const char*>(input.Holder()->ptr()) + input.meta().offset);
    std::vector<int64_t> dims, strides;
    for (int d = 0; d < input.dims().size(); ++d) {
      dims.push_back(input.dims()[d]);
      strides.push_back(input.strides()[d]);
    }
    strided_copy(dst, src, dims, strides);
  }
  fakedev_contiguous_calls.fetch_add(1);
  fakedev_contiguous_bytes.fetch_add(n * static_cast<int64_t>(sizeof(T)));
}

}  // namespace fakedev

PD_REGISTER_PLUGIN_KERNEL(contiguous, fakedev, ALL_LAYOUT, fakedev::ContiguousKernel, float, double, int8_t, uint8_t,
                          int16_t, int32_t, int64_t, bool, phi::dtype::float16, phi::dtype::bfloat16) {}
