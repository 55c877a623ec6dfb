// Launchers of the dispatch kernels (plain C++ signatures; the kernels live in dispatch_*.cu).
// moe::Dispatcher (dispatch_dispatcher.cpp) checks every argument before calling these: the
// launchers trust their parameters and only enqueue work on the stream.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/dtype.h"
#include "moe/routing.h"

namespace moe::kernels {

// ---- plan (dispatch_plan.cu) ----

// Slots are walked in chunks of plan_chunk_slots() consecutive slots (flat index t * slots + s),
// one warp per chunk; the per-chunk, per-expert counts make the token order inside each expert
// stable without atomics.
int plan_chunk_slots(RoutingForm form, int E);

struct PlanArgs {
  // Routing (device).
  RoutingForm form = RoutingForm::kTopK;
  int32_t T = 0;
  int E = 0;
  int slots = 0;  // per token: k or E
  const int32_t* indices = nullptr;  // top-k [T, k]
  const uint8_t* map = nullptr;      // map [T, E]
  const float* probs = nullptr;      // [T, slots]
  // Options.
  int32_t R = 0;
  int align = 0;
  bool pre_padded = false;
  // Workspace (device).
  int32_t* chunk_count = nullptr;  // [num_chunks, E]
  int32_t* count32 = nullptr;      // [E]
  int32_t* padded32 = nullptr;     // [E]
  int32_t* offset32 = nullptr;     // [E]
  int64_t* count64 = nullptr;      // [E]
  int64_t* padded64 = nullptr;     // [E]
  int64_t* offset64 = nullptr;     // [E]
  int32_t* group_offsets = nullptr;  // [E + 1]
  int32_t* slot_row = nullptr;     // [T, slots]
  int32_t* row_slot = nullptr;     // [R]
  float* probs_perm = nullptr;     // [R]
  uint32_t* error_word = nullptr;
};

// Number of chunks for T tokens (workspace: chunks * E int32).
int64_t plan_num_chunks(RoutingForm form, int64_t T, int slots, int E);
void launch_plan(const PlanArgs& a, cudaStream_t stream);

// ---- row movement (dispatch_rows.cu) ----

// x [T, row_bytes] -> x_perm [R, row_bytes]: row r <- x[row_slot[r] / slots], zero where
// row_slot[r] < 0. Optional per-row scale block (scale_bytes > 0) moves the same way.
// row_bytes is a multiple of 16 and the row pointers are 16-byte aligned.
void launch_permute_rows(const void* x, void* x_perm, int64_t row_bytes, const void* x_scale, void* x_perm_scale,
                         int64_t scale_bytes, const int32_t* row_slot, int slots, int32_t R, cudaStream_t stream);

// dY [R, H] = w * dy[row_slot[r] / slots] (w when merge: slot_probs[row_slot[r]] if given, else
// probs_perm[r]; 1 otherwise), zero rows where
// row_slot[r] < 0. With dprobs (merge only): dprobs[row_slot[r]] = <Y[r], dy[t]> in fp32; the
// caller zeroes dprobs first (slots without a row keep zero).
void launch_scale_rows_backward(DType dtype, const void* dy, const void* Y, void* dY, int64_t H,
                                const int32_t* row_slot, int slots, int32_t R, const float* probs_perm,
                                const float* slot_probs, bool merge, float* dprobs, cudaStream_t stream);

// ---- gather-combine (dispatch_combine.cu) ----

// y [T, H] = sum over s in slot order of w * Y[slot_row[t, s]] (rows < 0 skipped), fp32
// accumulation, w = slot_probs[t, s] when given, else probs_perm[row] when given, else 1. With dprobs (permute
// backward): dprobs[t, s] = d_probs_perm[row] (0 where row < 0 or d_probs_perm is null).
// prob_row (optional): the rows d_probs_perm is read at, when slot_row holds other rows (a token
// chunk's packed rows); null: slot_row's.
void launch_combine(DType dtype, const void* Y, void* y, int64_t H, const int32_t* slot_row, int slots, int32_t T,
                    const float* probs_perm, const float* slot_probs, const float* d_probs_perm, float* dprobs,
                    cudaStream_t stream, const int32_t* prob_row = nullptr);

// ---- token chunks (dispatch_windows.cu) ----
// Chunk c = tokens [c Tc, min((c + 1) Tc, T)). Each chunk's rows of expert e are one window of e's
// real rows (the plan keeps token order inside an expert): row_begin [chunks][E] its first row,
// offsets [chunks][E + 1] the windows packed in expert order (offsets[c][0] = 0); local_row
// [T, slots] every slot's row in its chunk's packed rows (-1 where slot_row is -1).
struct WindowArgs {
  int chunks = 0;
  int E = 0;
  int slots = 0;
  int32_t T = 0, Tc = 1, R = 0;
  const int32_t* offset32 = nullptr;  // [E] first row of e (may exceed R)
  const int32_t* count32 = nullptr;   // [E] rows of e without padding
  const int32_t* row_slot = nullptr;  // [R]
  const int32_t* slot_row = nullptr;  // [T, slots]
  int32_t* row_begin = nullptr;
  int32_t* offsets = nullptr;
  int32_t* local_row = nullptr;
};
void launch_chunk_windows(const WindowArgs& a, cudaStream_t stream);

}  // namespace moe::kernels
