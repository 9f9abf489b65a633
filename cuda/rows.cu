// Row copies between a table and a compact set of rows, with the table possibly in pinned host
// memory read or written by the GPU directly (zero-copy over PCIe): recall's page gather from
// the history in the CPU tier, and its per-step append, without a copy of the index to the host
// (a host synchronisation) or a staging copy of the rows.
//   gather:  dst[i] = table[index[i]]        scatter: table[index[i]] = src[i]
// An entry outside [0, table rows) moves nothing: a negative index leaves dst[i] as it is
// (recall's pages that stay in place are not read again).
// Rows are `row_bytes` bytes; the kernel moves them in the widest words that divide the row and
// both base addresses, one thread per word, so a row's words are read by neighbouring threads.
#include "common.cuh"

namespace {

constexpr int kRowThreads = 256;

template <typename W>
__global__ void rows_kernel(const W* from, W* to, const int64_t* index, int64_t n,
                            int64_t words_per_row, int64_t table_rows, bool scatter) {
  const int64_t id = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (id >= n * words_per_row) return;
  const int64_t i = id / words_per_row, w = id % words_per_row;
  const int64_t at = index[i];
  if (at < 0 || at >= table_rows) return;             // the caller's contract; never a wild access
  const int64_t src = (scatter ? i : at) * words_per_row + w;
  const int64_t dst = (scatter ? at : i) * words_per_row + w;
  to[dst] = from[src];
}

// The address the GPU uses for p: itself for device memory, the mapped address for pinned or
// registered host memory; nullptr for pageable host memory (the GPU cannot reach it).
void* device_address(void* p) {
  cudaPointerAttributes a;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();                               // clear the sticky error of the query
    return nullptr;
  }
  if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) return p;
  if (a.type == cudaMemoryTypeHost) return a.devicePointer;
  return nullptr;
}

template <typename W>
const char* launch(const void* from, void* to, const int64_t* index, int64_t n, int64_t row_bytes,
                   int64_t table_rows, bool scatter, cudaStream_t stream) {
  const int64_t words = row_bytes / sizeof(W), threads = n * words;
  const unsigned blocks = (unsigned)((threads + kRowThreads - 1) / kRowThreads);
  rows_kernel<W><<<blocks, kRowThreads, 0, stream>>>(static_cast<const W*>(from),
                                                      static_cast<W*>(to), index, n, words,
                                                      table_rows, scatter);
  return fe::launch_status();
}

}  // namespace

extern "C" const char* fe_copy_rows(void* table, int64_t table_rows, void* rows,
                                    const int64_t* index, int64_t n, int64_t row_bytes,
                                    bool scatter, cudaStream_t stream) {
  if (n == 0 || row_bytes == 0) return nullptr;
  void* t = device_address(table);
  if (t == nullptr) return "flexevict: the table is in pageable host memory; pin it first";
  const void* from = scatter ? rows : t;
  void* to = scatter ? t : rows;
  const uintptr_t align = (uintptr_t)t | (uintptr_t)rows | (uintptr_t)row_bytes;
  if (align % 16 == 0) return launch<uint4>(from, to, index, n, row_bytes, table_rows, scatter, stream);
  if (align % 8 == 0) return launch<uint2>(from, to, index, n, row_bytes, table_rows, scatter, stream);
  if (align % 4 == 0) return launch<uint32_t>(from, to, index, n, row_bytes, table_rows, scatter, stream);
  if (align % 2 == 0) return launch<uint16_t>(from, to, index, n, row_bytes, table_rows, scatter, stream);
  return launch<uint8_t>(from, to, index, n, row_bytes, table_rows, scatter, stream);
}
