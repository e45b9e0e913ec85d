// The CUDA backend (issue #55), built with -DDIFFCP_CUDA=ON (scripts/build.sh turns it on where
// nvcc is found): one GPU, one stream, stream-ordered device memory (cudaMallocAsync), copies
// through the stream, GEMMs through cuBLASLt (f32 with f32 compute: no TF32; bf16 operands with f32
// accumulation; dense_linear as a bf16 GEMM plus a bias pass), the block-sparse attention of
// src/cuda/attention.cu (the DFlash mask and the DiT's dense attention, f32 / bf16 storage, f32
// softmax: the products as batched GEMMs over each sample group's key spans with masked-softmax
// kernels between them, forward and backward; or DIFFCP_CUDA_ATTENTION=simt's kernels on the SIMT
// units: a warp per query row, and for dK / dV a warp per key row, no atomics), and row kernels
// for every other op (src/cuda/kernels.cu: fill,
// convert, add, SiLU, GELU, SwiGLU, bias, RMSNorm, RoPE, q/k-norm + RoPE, LayerNorm-modulate,
// gated add, lse merge / rescale / shift, attention's D, gather / scatter rows, L1 distance,
// guidance, cross-entropy, AdamW, gradient scaling, the fp8 codec). Host metadata an op takes (a
// mask's visible ranges, row lists, RoPE table rows, targets) is staged in one copy per op through
// pinned memory. pack_weight keeps the default (no packed layout). Every OpKind is supported in the
// dtypes the CPU supports it. Memory it allocated is its device's (device_of: the pointer's CUDA
// attributes), so communicators stage it through the host without being told. None of it has run
// on a GPU yet: scripts/gpu_check.sh on a lent H200 is the proof (docs/gpu.md).
#pragma once

#include <string>

#include "diffcp/ops/backend.hpp"

namespace diffcp {

// Whether this process can use a CUDA device; when not, `why` (if given) says why (no driver, no
// device, the CUDA error).
bool cuda_device_present(std::string* why = nullptr);
// The device this rank computes on: its node-local rank (comm/mpi_runtime.hpp node_local) modulo
// the devices it sees, so P ranks on a node of P GPUs get one each; device 0 outside MPI.
int cuda_device_ordinal();
// The CUDA backend on cuda_device_ordinal(), registered as "cuda" at the first call; an error
// naming why when cuda_device_present() is false.
Backend& cuda_backend();
// The backend's compute stream, as a cudaStream_t (opens the backend as cuda_backend() does): every
// op of the backend runs on it in issue order; the NCCL communicator orders its own stream against it.
void* cuda_stream();
// Whether p is page-locked host memory (cudaMallocHost / cudaHostRegister): a copy from it runs
// asynchronously, so its source may be reused only after the copy has completed.
bool cuda_page_locked(const void* p);
// Returns the unused memory of the backend's stream-ordered pool to the device (after the stream
// has run): before allocations outside the pool, e.g. an NCCL communicator's buffers.
void cuda_release_cached_memory();

}  // namespace diffcp
