// jbps._core: the Python face of the C++ engine, server and FFI handler.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine.h"
#include "engine_impl.h"  // the scheduler and fusion, driven by the tests
#include "ffi_casts_cpu.h"
#include "ffi_codecs_cpu.h"
#include "ffi_cpu.h"
#ifdef JBPS_HAVE_CUDA
#include "cuda_copy_bench.h"
#include "ffi_cuda.h"
#endif
#include "dtype.h"
#include "multiversion.h"
#include "server.h"
#include "stream_copy.h"
#include "sum_kernels.h"

namespace nb = nanobind;

namespace {

nb::capsule FfiCapsule(void* fn) { return nb::capsule(fn); }

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

// A dtype by name, with a parameter it can travel with (topk: its keep; else 0).
jbps::DType ParseDTypeWith(const std::string& name, uint16_t param) {
  jbps::DType d = ParseDType(name);
  if (!jbps::DTypeParamValid(d, param))
    throw std::invalid_argument("jbps: parameter " + std::to_string(param) + " out of range for " + name);
  return d;
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

class PyServer {
 public:
  PyServer(std::string bind, int num_workers, uint64_t token, int engine_threads, double timeout_s, bool keep_alive,
           const std::string& role, bool deterministic, bool shm, double join_timeout_s) {
    jbps::ServerOptions o;
    o.bind = std::move(bind);
    o.num_workers = num_workers;
    o.token = token;
    o.engine_threads = engine_threads;
    o.timeout_s = timeout_s;
    o.keep_alive = keep_alive;
    o.join_timeout_s = join_timeout_s;
    if (role == "dedicated") {
      o.role = jbps::ServerRole::kDedicated;
    } else if (role != "colocated") {
      throw std::invalid_argument("jbps.server: role must be 'colocated' or 'dedicated', got '" + role + "'");
    }
    o.deterministic = deterministic;
    if (!shm) o.shm_arena_bytes = 0;
    server_ = std::make_unique<jbps::SummationServer>(o);
    std::string err;
    if (!server_->Start(&err)) throw std::runtime_error("jbps.server: " + err);
  }
  int port() const { return server_->port(); }
  bool wait(double seconds) {
    nb::gil_scoped_release release;
    return server_->WaitFor(seconds);
  }
  void stop() {
    nb::gil_scoped_release release;
    server_->Stop();
  }
  std::string failure() const { return server_->failure(); }
  nb::dict stats() const {
    auto s = server_->stats();
    nb::dict d;
    d["pushes"] = s.pushes;
    d["bytes_received"] = s.bytes_received;
    d["sums_sent"] = s.sums_sent;
    d["rejected"] = s.rejected;
    d["workers_lost"] = s.workers_lost;
    d["bytes_shm"] = s.bytes_shm;
    d["shm_workers"] = s.shm_workers;
    d["thread_bytes"] = s.thread_bytes;
    return d;
  }

 private:
  std::unique_ptr<jbps::SummationServer> server_;
};

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

NB_MODULE(_core, m) {
  m.doc() = "jbps C++ core: worker engine, summation server, XLA FFI handlers";

  m.def("ffi_targets", [] {
    nb::dict d;
    d["jbps_psum"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsPsumCpu));
    d["jbps_join"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsJoinCpu));
    d["jbps_topk_encode"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsTopKEncodeCpu));
    d["jbps_topk_decode"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsTopKDecodeCpu));
    d["jbps_topk_decode_into"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsTopKDecodeIntoCpu));
    d["jbps_topk_encode_added"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsTopKEncodeAddedCpu));
    d["jbps_onebit_encode"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsOneBitEncodeCpu));
    d["jbps_onebit_decode"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsOneBitDecodeCpu));
    d["jbps_onebit_decode_into"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsOneBitDecodeIntoCpu));
    d["jbps_onebit_encode_added"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsOneBitEncodeAddedCpu));
    d["jbps_narrow"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsNarrowCpu));
    d["jbps_widen"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsWidenCpu));
    return d;
  });
  // The same target for platform "CUDA"; empty when built without CUDA.
  m.def("ffi_targets_cuda", [] {
    nb::dict d;
#ifdef JBPS_HAVE_CUDA
    d["jbps_psum"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsPsumCuda));
    d["jbps_join"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsJoinCuda));
#endif
    return d;
  });
  m.def("has_cuda", [] {
#ifdef JBPS_HAVE_CUDA
    return true;
#else
    return false;
#endif
  });
  // Bounds the CUDA handler's own waits (JBPS_CUDA_SYNC, the host-wait fallback).
  m.def(
      "cuda_set_timeout",
      [](double seconds) {
#ifdef JBPS_HAVE_CUDA
        jbps::SetCudaWaitTimeout(seconds);
#else
        (void)seconds;
#endif
      },
      nb::arg("seconds"));
#ifdef JBPS_HAVE_CUDA
  // Median seconds of a plain pinned cudaMemcpy each way, for the benchmark.
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

  m.def(
      "engine_start",
      [](std::vector<std::string> servers, uint32_t rank, uint32_t num_workers, uint64_t token, int credit,
         double timeout_s, bool trace, bool shm, size_t shm_slot_bytes, bool huge_pages) {
        jbps::EngineOptions o;
        o.servers = std::move(servers);
        o.rank = rank;
        o.num_workers = num_workers;
        o.token = token;
        o.credit = credit;
        o.timeout_s = timeout_s;
        o.trace = trace;
        o.shm = shm;
        o.shm_slot_bytes = shm_slot_bytes;
        o.huge_pages = huge_pages;
        std::string err;
        bool ok;
        {
          nb::gil_scoped_release release;
          ok = jbps::Engine::Get().Start(o, &err);
        }
        if (!ok) throw std::runtime_error(err);
      },
      nb::arg("servers"), nb::arg("rank"), nb::arg("num_workers"), nb::arg("token"), nb::arg("credit"),
      nb::arg("timeout_s"), nb::arg("trace") = false, nb::arg("shm") = true,
      nb::arg("shm_slot_bytes") = size_t{4} << 20, nb::arg("huge_pages") = true);

  m.def(
      "engine_set_credit",
      [](int credit) {
        std::string err;
        if (!jbps::Engine::Get().SetCredit(credit, &err)) throw std::runtime_error(err);
      },
      nb::arg("credit"));
  m.def(
      "engine_stop",
      [](const std::string& reason) {
        nb::gil_scoped_release release;
        jbps::Engine::Get().Stop(reason);
      },
      nb::arg("reason") = "");
  m.def("engine_server_roles", [] {
    std::vector<std::string> out;
    for (auto r : jbps::Engine::Get().server_roles())
      out.push_back(r == jbps::ServerRole::kDedicated ? "dedicated" : "colocated");
    return out;
  });
  // Chunks traced since the last call: (tensor, key, round, shard, server,
  // priority, bytes, queued, sent_start, acked, sum_arrived, pulled) with times
  // in microseconds since the Unix epoch.
  m.def("engine_take_trace", [] {
    std::vector<jbps::TraceRecord> records;
    {
      nb::gil_scoped_release release;
      records = jbps::Engine::Get().TakeTrace();
    }
    nb::list out;
    for (auto& r : records)
      out.append(nb::make_tuple(r.tensor, r.key, r.round, r.shard, r.server, r.priority, r.nbytes, r.times.queued,
                                r.times.sent_start, r.times.acked, r.times.sum_arrived, r.times.pulled));
    return out;
  });
  // Whether the hand-written AVX2 kernels run (multiversion.h; JBPS_CPU_BASELINE=1 turns them off).
  m.def("hand_written_avx2", [] { return jbps::CpuHasAvx2(); });
  m.def("engine_set_stage_timing", [](bool on) { jbps::Engine::Get().SetStageTiming(on); }, nb::arg("on"));
  // Calls completed with stage timing on since the last call: dicts of the
  // StageRecord fields, times in nanoseconds of time.perf_counter_ns()'s clock.
  m.def("engine_take_stages", [] {
    std::vector<jbps::StageRecord> records;
    {
      nb::gil_scoped_release release;
      records = jbps::Engine::Get().TakeStages();
    }
    nb::list out;
    for (auto& r : records) {
      nb::dict d;
      d["name"] = r.name;
      d["bytes"] = r.bytes;
      d["submitted"] = r.submitted;
      d["pushed"] = r.pushed;
      d["sum_arrived"] = r.sum_arrived;
      d["pulled"] = r.pulled;
      d["tree_checked"] = r.tree_checked;
      d["done"] = r.done;
      d["server_ns"] = r.server_ns;
      d["peer_wait_ns"] = r.peer_wait_ns;
      d["failed"] = r.failed;
      out.append(d);
    }
    return out;
  });
  // One psum of a float32 host array outside XLA, for jbps.init's link probe
  // (jbps/link_rate.py): the sum replaces the values, and the answer is the
  // seconds from submit to sum. The plan's routing, tree and keys come from
  // Python as a jbps_psum call's attributes do (Submit fails a call whose
  // routes and chunks disagree). The engine works on its own copy, so a call
  // the backstop gives up on never writes a freed array.
  m.def(
      "engine_psum_host",
      [](nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu> values, int64_t key, const std::string& name,
         int64_t partition_bytes, bool ramp, std::vector<int32_t> servers, const std::string& tree, int64_t tree_key,
         double wait_s) {
        if (partition_bytes < 1) throw std::invalid_argument("engine_psum_host: partition_bytes must be positive");
        const size_t nbytes = values.size() * sizeof(float);
        auto copy = std::make_shared<std::vector<float>>(values.data(), values.data() + values.size());
        jbps::CallSpec spec;
        spec.names = name;
        spec.tree = tree;
        spec.tree_key = static_cast<uint64_t>(tree_key);
        spec.partition_bytes = static_cast<size_t>(partition_bytes);
        spec.ramp = ramp;
        spec.servers = std::move(servers);
        jbps::Operand op;
        op.in = op.out = copy->data();
        op.nbytes = nbytes;
        op.dtype = jbps::DType::kF32;
        op.base_key = static_cast<uint64_t>(key);
        spec.operands.push_back(op);
        auto result = std::make_shared<std::promise<std::string>>();
        std::future<std::string> answer = result->get_future();
        std::string error;
        double seconds = 0;
        {
          nb::gil_scoped_release release;
          const auto start = std::chrono::steady_clock::now();
          jbps::Engine::Get().Submit(std::move(spec), [result, copy](const std::string& e) { result->set_value(e); });
          // The engine fails a call after its own timeout; this bound is a backstop.
          if (answer.wait_for(std::chrono::duration<double>(wait_s)) != std::future_status::ready) {
            error = "engine_psum_host: no answer in " + std::to_string(wait_s) + " s";
          } else {
            seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            error = answer.get();
          }
        }
        if (!error.empty()) throw std::runtime_error(error);
        std::copy(copy->begin(), copy->end(), values.data());
        return seconds;
      },
      nb::arg("values"), nb::arg("key"), nb::arg("name"), nb::arg("partition_bytes"), nb::arg("ramp"),
      nb::arg("servers"), nb::arg("tree"), nb::arg("tree_key"), nb::arg("wait_s"));
  m.def("engine_running", [] { return jbps::Engine::Get().running(); });
  m.def("engine_fault", [] { return jbps::Engine::Get().fault(); });
  m.def("engine_stats", [] {
    auto s = jbps::Engine::Get().stats();
    nb::dict d;
    d["calls"] = s.calls;
    d["calls_failed"] = s.calls_failed;
    d["chunks_pushed"] = s.chunks_pushed;
    d["bytes_pushed"] = s.bytes_pushed;
    d["bytes_pulled"] = s.bytes_pulled;
    d["busy_seconds"] = s.busy_seconds;
    d["bytes_shm"] = s.bytes_shm;
    d["chunks_fused"] = s.chunks_fused;
    d["shm_servers"] = s.shm_servers;
    d["server_bytes_pushed"] = s.server_bytes_pushed;
    return d;
  });
  // The server's summation kernels (sum_kernels.h) on numpy arrays, for the
  // benchmark and the tests: acc holds the accumulator type (float32 for the
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
  // How the engine cuts a shard into chunks, for the test that the plan
  // (jbps/partition/plan.py) cuts it the same way.
  m.def(
      "engine_chunk_bytes",
      [](const std::string& dtype, size_t partition_bytes, uint16_t param) {
        return jbps::Engine::ChunkBytes(ParseDTypeWith(dtype, param), param, partition_bytes);
      },
      nb::arg("dtype"), nb::arg("partition_bytes"), nb::arg("param") = 0);
  m.def(
      "engine_chunk_sizes",
      [](size_t nbytes, const std::string& dtype, size_t partition_bytes, uint16_t param, bool ramp) {
        // (offset, bytes) of each chunk, as the engine cuts an operand.
        const jbps::ChunkLayout layout(nbytes, ParseDTypeWith(dtype, param), param, partition_bytes, ramp);
        std::vector<std::pair<size_t, size_t>> out(layout.count());
        for (size_t c = 0; c < out.size(); ++c) layout.At(c, &out[c].first, &out[c].second);
        return out;
      },
      nb::arg("nbytes"), nb::arg("dtype"), nb::arg("partition_bytes"), nb::arg("param") = 0, nb::arg("ramp") = false);

  nb::class_<PyChunkQueue>(m, "ChunkQueue")
      .def(nb::init<int>(), nb::arg("credit"))
      .def("push", &PyChunkQueue::push, nb::arg("id"), nb::arg("priority"))
      .def("send", &PyChunkQueue::send)
      .def("ack", &PyChunkQueue::ack)
      .def_prop_ro("out", &PyChunkQueue::out)
      .def_prop_ro("waiting", &PyChunkQueue::waiting);
  m.def("fuse_small_chunks", &FuseForTest, nb::arg("nbytes"), nb::arg("dtypes"), nb::arg("servers"),
        nb::arg("priorities"), nb::arg("partition"));

  nb::class_<PyServer>(m, "Server")
      .def(nb::init<std::string, int, uint64_t, int, double, bool, const std::string&, bool, bool, double>(),
           nb::arg("bind"), nb::arg("num_workers"), nb::arg("token") = 0, nb::arg("engine_threads") = 0,
           nb::arg("timeout_s") = 60.0, nb::arg("keep_alive") = false, nb::arg("role") = "colocated",
           nb::arg("deterministic") = false, nb::arg("shm") = true, nb::arg("join_timeout_s") = 0.0)
      .def_prop_ro("port", &PyServer::port)
      .def("wait", &PyServer::wait, nb::arg("seconds"))
      .def("stop", &PyServer::stop)
      .def("stats", &PyServer::stats)
      .def("failure", &PyServer::failure);
}
