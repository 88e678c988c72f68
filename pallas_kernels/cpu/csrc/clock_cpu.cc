// A monotonic clock read inside a compiled CPU program, called from JAX through the XLA FFI.
//
// Why: num_draft="auto" times its own passes while it decodes, with no host round trip. The
// operand passes through to the first result, so the read waits for whatever produced the
// operand and whatever consumes the copy waits for the read: the clock is ordered by data.
//
//   in: int32 [...] (any shape)  ->  out: the same values; now: int32 [2] (seconds, nanoseconds)

#include <cstdint>
#include <cstring>
#include <ctime>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error ClockImpl(ffi::Buffer<ffi::S32> in, ffi::ResultBuffer<ffi::S32> out,
                     ffi::ResultBuffer<ffi::S32> now) {
  if (now->element_count() != 2) {
    return ffi::Error::InvalidArgument("clock_cpu: the time result must have 2 elements");
  }
  std::memcpy(out->typed_data(), in.typed_data(), sizeof(int32_t) * in.element_count());
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  now->typed_data()[0] = static_cast<int32_t>(ts.tv_sec);
  now->typed_data()[1] = static_cast<int32_t>(ts.tv_nsec);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoespecClockCpu, ClockImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
