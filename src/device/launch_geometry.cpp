#include "device/launch_geometry.h"

#include <algorithm>

#include <cuda_runtime_api.h>

#include "device/cuda_check.h"

namespace moe {

unsigned one_wave_grid_x(const void* kernel, int threads, int64_t work, int64_t per_cta, int64_t B) {
  int dev = 0, sms = 0, per_sm = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t resident = std::max<int64_t>(1, static_cast<int64_t>(per_sm) * sms);
  const int64_t want = (work + per_cta - 1) / per_cta;
  const int64_t cap = std::max<int64_t>(1, (resident + B - 1) / B);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(want, cap)));
}

unsigned one_pass_grid_x(int64_t work, int64_t per_cta) {
  const int64_t want = (work + per_cta - 1) / per_cta;
  return static_cast<unsigned>(std::clamp<int64_t>(want, 1, 0x7FFFFFFF));
}

}  // namespace moe
