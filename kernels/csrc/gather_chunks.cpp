// The retrieval cache's choice of chunks copied out of the full cache in one call (kernels/retrieval.py,
// gather_chunks): every (layer, KV head, chosen chunk) one copy of chunk x D elements, the copies split over the
// threads. Copying, it computes nothing: the chunks' bits are the full cache's.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kCopiesPerTask = 32;  // chunks a thread takes at a time (64 KB for 16 x 64 float16 keys)

// The element offset of head `flat` of t: t's dimensions but its last two, flattened in order.
int64_t head_offset(const at::Tensor& t, int64_t flat) {
  int64_t offset = 0;
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    offset += flat % t.size(d) * t.stride(d);
    flat /= t.size(d);
  }
  return offset;
}

// Whether the bytes from t's first element to its last, for two tensors with nonnegative strides, meet.
bool spans_meet(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const char* first = static_cast<const char*>(t.data_ptr());
    return std::make_pair(first, first + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

// out (..., Hkv, n chunk, D)[..., h, j chunk + t, :] = source (..., Hkv, L, D)[..., h, ids[..., h, j] chunk + t, :]
// for t < chunk, where ids (..., Hkv, n) are chunk indices in [0, L / chunk). In source and out a row of D is
// contiguous and a head's rows lie D apart, so that each chunk is one run of memory.
void gather_chunks(const at::Tensor& source, const at::Tensor& ids, int64_t chunk, at::Tensor out) {
  TORCH_CHECK(source.device().is_cpu() && out.device().is_cpu() && ids.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(source.scalar_type() == out.scalar_type(), "source, out: one dtype");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "ids: int64");
  TORCH_CHECK(source.dim() >= 2 && out.dim() == source.dim() && ids.dim() == source.dim() - 1,
              "source (..., Hkv, L, D), ids (..., Hkv, n), out (..., Hkv, n chunk, D)");
  TORCH_CHECK(chunk > 0, "chunk: positive");
  const int64_t dim = source.size(-1), chunks = source.size(-2) / chunk, n = ids.size(-1);
  for (int64_t d = 0; d + 2 < source.dim(); ++d)
    TORCH_CHECK(source.size(d) == ids.size(d) && out.size(d) == ids.size(d), "source, ids, out: one leading shape");
  TORCH_CHECK(out.size(-2) == n * chunk && out.size(-1) == dim, "out: (..., Hkv, n chunk, D)");
  TORCH_CHECK(source.stride(-1) == 1 && source.stride(-2) == dim && out.stride(-1) == 1 && out.stride(-2) == dim,
              "source, out: rows of D contiguous, D apart");
  TORCH_CHECK(!spans_meet(source, out), "out: memory apart from source's");  // memcpy over what it still reads
  const at::Tensor flat_ids = ids.contiguous();
  const int64_t* id = flat_ids.data_ptr<int64_t>();
  const int64_t copies = flat_ids.numel(), heads = n ? copies / n : 0;
  for (int64_t i = 0; i < copies; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < chunks, "ids: chunk indices in [0, L / chunk)");
  std::vector<int64_t> from(heads), to(heads);  // each head's first element in source and in out
  for (int64_t h = 0; h < heads; ++h) {
    from[h] = head_offset(source, h);
    to[h] = head_offset(out, h);
  }
  const int64_t element = source.element_size(), run = chunk * dim;
  const char* src = static_cast<const char*>(source.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, copies, kCopiesPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / n, j = i % n;
      std::memcpy(dst + (to[h] + j * run) * element, src + (from[h] + id[i] * run) * element, run * element);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(triforce_cpu, lib) {
  lib.def("gather_chunks(Tensor source, Tensor ids, int chunk, Tensor(a!) out) -> ()", &gather_chunks);
}
