// jbps_testing: the tests' (and the lab's) hooks into jbps's C++, built for
// them only (CMake option JBPS_BUILD_TESTING; benchmarks/cxx_hooks.py builds and
// loads it), never part of the installed package: the servers' summation
// kernels and the engine's copy on numpy arrays, the engine's scheduling
// policy and fusion of small chunks driven item by item, and the CUDA
// staging copy's timing.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "engine/engine_impl.h"
#include "kernels/stream_copy.h"
#include "kernels/sum_kernels.h"
#ifdef JBPS_HAVE_CUDA
#include "cuda/cuda_copy_bench.h"
#endif

namespace nb = nanobind;

namespace {

using KernelArray = nb::ndarray<nb::c_contig, nb::device::cpu>;
using KernelSource = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

jbps::DType ParseDType(const std::string& name) {
  std::string known;
  for (int i = 0; i < jbps::kNumDTypes; ++i) {
    auto d = static_cast<jbps::DType>(i);
    if (name == jbps::DTypeName(d)) return d;
    known += std::string(known.empty() ? "" : ", ") + jbps::DTypeName(d);
  }
  throw std::invalid_argument("jbps kernels: unknown dtype '" + name + "' (one of " + known + ")");
}

// What a kernel array must hold: a DLPack type, or for 16-bit wire words any
// 2-byte type (numpy has no bfloat16 of its own).
struct KernelDType {
  nb::dlpack::dtype type;
  bool any_16bit;
  const char* name;
};

KernelDType WireDType(jbps::DType d) {
  switch (d) {
    case jbps::DType::kF32: return {nb::dtype<float>(), false, "float32"};
    case jbps::DType::kF64: return {nb::dtype<double>(), false, "float64"};
    case jbps::DType::kI32: return {nb::dtype<int32_t>(), false, "int32"};
    case jbps::DType::kF16:
    case jbps::DType::kBF16: return {nb::dtype<uint16_t>(), true, "a 2-byte dtype"};
    case jbps::DType::kOneBit:
    case jbps::DType::kTopK: break;  // records, not elements: tested through a server
  }
  throw std::invalid_argument(std::string("jbps kernels: no kernel binding for ") + jbps::DTypeName(d));
}

KernelDType AccumulatorDType(jbps::DType d) {
  return jbps::AccumulatorIsWire(d) ? WireDType(d) : KernelDType{nb::dtype<float>(), false, "float32"};
}

using Kernel = void (*)(jbps::DType, uint16_t, void*, const void*, size_t);

// Checks the arrays, then runs one of the server's kernels without the GIL.
// init and add write acc (the accumulator type) from src (the wire type);
// finish writes dst (wire) from acc.
void RunKernel(const char* fn, Kernel kernel, bool finish, const std::string& dtype, KernelArray out, KernelSource in) {
  jbps::DType d = ParseDType(dtype);
  const char* out_name = finish ? "dst" : "acc";
  const char* in_name = finish ? "acc" : "src";
  KernelDType out_type = finish ? WireDType(d) : AccumulatorDType(d);
  KernelDType in_type = finish ? AccumulatorDType(d) : WireDType(d);
  auto matches = [](nb::dlpack::dtype t, KernelDType want) {
    return want.any_16bit ? (t.bits == 16 && t.lanes == 1) : t == want.type;
  };
  std::string where = std::string("jbps.") + fn + "('" + jbps::DTypeName(d) + "'): ";
  if (!matches(out.dtype(), out_type)) throw std::invalid_argument(where + out_name + " must be " + out_type.name);
  if (!matches(in.dtype(), in_type)) throw std::invalid_argument(where + in_name + " must be " + in_type.name);
  if (out.size() != in.size())
    throw std::invalid_argument(where + out_name + " has " + std::to_string(out.size()) + " elements, " + in_name +
                                " " + std::to_string(in.size()));
  // The kernels take restrict pointers: the buffers must not overlap, except
  // that the server finishes a wire-layout accumulator in place.
  auto o = reinterpret_cast<uintptr_t>(out.data()), i = reinterpret_cast<uintptr_t>(in.data());
  bool in_place_ok = finish && jbps::AccumulatorIsWire(d) && o == i;
  if (o < i + in.nbytes() && i < o + out.nbytes() && !in_place_ok)
    throw std::invalid_argument(where + out_name + " and " + in_name + " overlap in memory");
  nb::gil_scoped_release release;
  kernel(d, 0, out.data(), in.data(), out.size());  // no parameter: onebit and topk are not bound
}

// The engine's scheduling policy (CreditQueue with the engine's ChunkOrder),
// driven item by item from the tests: an item is a chunk whose key is its id.
class PyChunkQueue {
 public:
  explicit PyChunkQueue(int credit) { q_.set_credit(credit); }
  void push(uint64_t id, int64_t priority) {
    auto ch = std::make_shared<jbps::Chunk>();
    ch->key = id;
    ch->priority = priority;
    ch->seq = next_seq_++;
    q_.Push(std::move(ch));
  }
  // The next item the engine would send now, taking a credit; -1 when none may go.
  int64_t send() {
    if (!q_.Ready()) return -1;
    jbps::ChunkPtr ch = q_.Pop();
    q_.Take();
    return static_cast<int64_t>(ch->key);
  }
  void ack() { q_.GiveBack(); }
  int out() const { return q_.out(); }
  size_t waiting() const { return q_.waiting(); }

 private:
  jbps::CreditQueue<jbps::ChunkPtr, jbps::ChunkOrder> q_;
  uint64_t next_seq_ = 0;
};

// The engine's fusion of small chunks (FuseSmallChunks) on chunks described by
// lists: the result's chunks in send order, each as the indices it carries.
std::vector<std::vector<int>> FuseForTest(const std::vector<uint64_t>& nbytes, const std::vector<std::string>& dtypes,
                                          const std::vector<int>& servers, const std::vector<int64_t>& priorities,
                                          size_t partition) {
  const size_t n = nbytes.size();
  if (dtypes.size() != n || servers.size() != n || priorities.size() != n)
    throw std::invalid_argument("fuse_small_chunks: nbytes, dtypes, servers and priorities differ in length");
  std::vector<jbps::ChunkPtr> chunks;
  for (size_t i = 0; i < n; ++i) {
    auto ch = std::make_shared<jbps::Chunk>();
    ch->op = static_cast<int>(i);
    ch->nbytes = nbytes[i];
    ch->parts.push_back(jbps::Part{ch->op, 0, ch->nbytes});
    ch->dtype = ParseDType(dtypes[i]);
    ch->server = servers[i];
    ch->priority = priorities[i];
    ch->key = jbps::ChunkKey(i + 1, 0, 0);
    chunks.push_back(std::move(ch));
  }
  uint64_t fused = 0;
  std::vector<std::vector<int>> out;
  for (const auto& ch : jbps::FuseSmallChunks(std::move(chunks), partition, 0, &fused)) {
    out.emplace_back();
    for (const jbps::Part& p : ch->parts) out.back().push_back(p.op);
  }
  return out;
}

}  // namespace

NB_MODULE(jbps_testing, m) {
  m.doc() = "jbps's C++ hooks for the tests and benchmarks (not part of the installed package)";
  // The server's summation kernels (sum_kernels.h) on numpy arrays: acc holds the accumulator type (float32 for the
  // 16-bit floats), src/dst the wire type; any 2-byte dtype carries 16-bit
  // wire words (float16, uint16; nanobind does not take ml_dtypes' bfloat16
  // arrays, so pass those as .view(numpy.uint16)).
  m.def(
      "accumulator_init",
      [](const std::string& dtype, KernelArray acc, KernelSource src) {
        RunKernel("accumulator_init", jbps::AccumulatorInit, false, dtype, acc, src);
      },
      nb::arg("dtype"), nb::arg("acc"), nb::arg("src"), "acc = widen(src): the server's AccumulatorInit.");
  m.def(
      "accumulate",
      [](const std::string& dtype, KernelArray acc, KernelSource src) {
        RunKernel("accumulate", jbps::AccumulatorAdd, false, dtype, acc, src);
      },
      nb::arg("dtype"), nb::arg("acc"), nb::arg("src"), "acc += widen(src): the server's AccumulatorAdd.");
  m.def(
      "accumulator_finish",
      [](const std::string& dtype, KernelArray dst, KernelSource acc) {
        RunKernel("accumulator_finish", jbps::AccumulatorFinish, true, dtype, dst, acc);
      },
      nb::arg("dtype"), nb::arg("dst"), nb::arg("acc"), "dst = narrow(acc): the server's AccumulatorFinish.");
  m.def(
      "accumulator_init_sum",
      [](const std::string& dtype, KernelArray acc, KernelSource a, KernelSource b) {
        // The checks of init, for each source (the sources may overlap each other: both are only read).
        Kernel check_only = [](jbps::DType, uint16_t, void*, const void*, size_t) {};
        RunKernel("accumulator_init_sum", check_only, false, dtype, acc, a);
        RunKernel("accumulator_init_sum", check_only, false, dtype, acc, b);
        nb::gil_scoped_release release;
        jbps::AccumulatorInitSum(ParseDType(dtype), 0, acc.data(), a.data(), b.data(), acc.size());
      },
      nb::arg("dtype"), nb::arg("acc"), nb::arg("a"), nb::arg("b"),
      "acc = widen(a) + widen(b): the server's AccumulatorInitSum (its first two pushes in one pass).");
  // The engine's copy of a shared-memory sum into XLA's output, for the tests.
  m.def(
      "stream_copy",
      [](nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> dst,
         nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> src) {
        if (dst.size() != src.size()) throw std::invalid_argument("stream_copy: dst and src differ in size");
        nb::gil_scoped_release release;
        jbps::StreamCopy(dst.data(), src.data(), dst.size());
      },
      nb::arg("dst"), nb::arg("src"));
  m.def("chunk_key", &jbps::ChunkKey, nb::arg("base_key"), nb::arg("shard"), nb::arg("chunk"));
  nb::class_<PyChunkQueue>(m, "ChunkQueue")
      .def(nb::init<int>(), nb::arg("credit"))
      .def("push", &PyChunkQueue::push, nb::arg("id"), nb::arg("priority"))
      .def("send", &PyChunkQueue::send)
      .def("ack", &PyChunkQueue::ack)
      .def_prop_ro("out", &PyChunkQueue::out)
      .def_prop_ro("waiting", &PyChunkQueue::waiting);
  m.def("fuse_small_chunks", &FuseForTest, nb::arg("nbytes"), nb::arg("dtypes"), nb::arg("servers"),
        nb::arg("priorities"), nb::arg("partition"));

#ifdef JBPS_HAVE_CUDA
  // Median seconds of a plain pinned cudaMemcpy each way, for the staging benchmark.
  m.def(
      "cuda_pinned_copy_seconds",
      [](size_t bytes, int iters) {
        jbps::CopyTimes t;
        std::string err;
        bool ok;
        {
          nb::gil_scoped_release release;
          ok = jbps::TimePinnedCopies(bytes, iters, &t, &err);
        }
        if (!ok) throw std::runtime_error(err);
        return nb::make_tuple(t.d2h_seconds, t.h2d_seconds);
      },
      nb::arg("bytes"), nb::arg("iters"));
#endif
}
