// The CUDA backend (issue #55), built with -DDIFFCP_CUDA=ON (scripts/build.sh turns it on where
// nvcc is found): one GPU, one stream, stream-ordered device memory (cudaMallocAsync), copies
// through the stream, GEMMs through cuBLASLt (f32 with f32 compute: no TF32; bf16 operands with f32
// accumulation), and element-wise kernels (src/cuda/kernels.cu: fill, convert, add, SiLU, GELU,
// SwiGLU, bias add / backward, RMSNorm forward / backward, lse rescale / shift, attention's D,
// gated add, LayerNorm-modulate, AdamW, the gradient scaling with its sum of squares). It implements the ops listed by supports(); every other op fails with
// "backend 'cuda' does not support <op> on <dtype>", and the op harness (testing/op_harness.hpp)
// skips the cases that use one. Memory it allocated is its device's (device_of: the pointer's CUDA
// attributes), so communicators stage it through the host without being told. The DFlash
// attention, RoPE, the DiT's glue and the NCCL communicator are the next steps. None of it
// has run on a GPU yet: the op harness on a lent H200 (scripts/gpu_check.sh) is the proof.
#pragma once

#include <string>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// Whether this process can use a CUDA device; when not, `why` (if given) says why (no driver, no
// device, the CUDA error).
bool cuda_device_present(std::string* why = nullptr);
// The CUDA backend on device 0, registered as "cuda" at the first call; an error naming why when
// cuda_device_present() is false.
Backend& cuda_backend();

}  // namespace diffcp
