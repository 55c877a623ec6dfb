// Device tables of pointers (the E matrices or bias rows of a per-expert parameter): uploaded once
// when the parameter is bound, read by kernels through one device array. The upload is synchronous
// (a plain cudaMemcpy), so it must happen outside captured regions, never in forward/backward.
#pragma once

#include <memory>
#include <vector>

namespace moe {

// A device copy of `pointers`, freed when the last reference goes (cudaFree waits for kernels in
// flight that may still read it).
std::shared_ptr<void> upload_pointer_table(const std::vector<const void*>& pointers);

}  // namespace moe
