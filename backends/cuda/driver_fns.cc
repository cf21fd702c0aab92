#include "backends/cuda/driver_fns.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_status.h"

namespace optimd {
namespace {

// One stream memory operation on `stream` (wait or write of a step flag).
absl::Status StreamValue(StreamValue32Fn fn, cudaStream_t stream,
                         uint32_t* word, uint32_t value, unsigned int flags) {
  const CUresult r = fn(reinterpret_cast<CUstream>(stream),
                        reinterpret_cast<CUdeviceptr>(word), value, flags);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(absl::StrCat(
        "a stream memory operation on the step flags failed (CUresult ", r,
        ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DriverFns> FindDriverFns() {
  DriverFns driver;
  const std::pair<const char*, void**> wanted[] = {
      {"cuMemGetAddressRange",
       reinterpret_cast<void**>(&driver.mem_get_address_range)},
      {"cuStreamWaitValue32",
       reinterpret_cast<void**>(&driver.stream_wait_value32)},
      {"cuStreamWriteValue32",
       reinterpret_cast<void**>(&driver.stream_write_value32)},
      {"cuMemImportFromShareableHandle",
       reinterpret_cast<void**>(&driver.vmm.import_handle)},
      {"cuMemGetAllocationPropertiesFromHandle",
       reinterpret_cast<void**>(&driver.vmm.get_properties)},
      {"cuMemRelease", reinterpret_cast<void**>(&driver.vmm.release)},
      {"cuMemAddressReserve",
       reinterpret_cast<void**>(&driver.vmm.address_reserve)},
      {"cuMemAddressFree", reinterpret_cast<void**>(&driver.vmm.address_free)},
      {"cuMemMap", reinterpret_cast<void**>(&driver.vmm.map)},
      {"cuMemUnmap", reinterpret_cast<void**>(&driver.vmm.unmap)},
      {"cuMemSetAccess", reinterpret_cast<void**>(&driver.vmm.set_access)}};
  for (const auto& [name, fn] : wanted) {
    cudaDriverEntryPointQueryResult found;
    OPTIMD_RETURN_IF_CUDA_ERROR(cudaGetDriverEntryPointByVersion(
        name, fn, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || *fn == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("the CUDA driver has no ", name));
    }
  }
  return driver;
}

absl::Status WaitStepFlag(const DriverFns& driver, cudaStream_t stream,
                          uint32_t* word, uint32_t value) {
  return StreamValue(driver.stream_wait_value32, stream, word, value,
                     CU_STREAM_WAIT_VALUE_GEQ);
}

absl::Status WriteStepFlag(const DriverFns& driver, cudaStream_t stream,
                           uint32_t* word, uint32_t value) {
  return StreamValue(driver.stream_write_value32, stream, word, value,
                     CU_STREAM_WRITE_VALUE_DEFAULT);
}

}  // namespace optimd
