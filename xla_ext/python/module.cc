// jbps._core: the Python face of the C++ engine, server and FFI handlers:
// what the installed package needs. The tests' hooks into the C++ are
// jbps_testing (testing_module.cc), built for the tests only.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
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

#include "engine/engine.h"
#include "ffi/ffi_casts_cpu.h"
#include "ffi/ffi_codecs_cpu.h"
#include "ffi/ffi_cpu.h"
#ifdef JBPS_HAVE_CUDA
#include "cuda/ffi_cuda.h"
#endif
#include "common/dtype.h"
#include "kernels/multiversion.h"
#include "server/server.h"

namespace nb = nanobind;

namespace {

nb::capsule FfiCapsule(void* fn) { return nb::capsule(fn); }

class PyServer {
 public:
  PyServer(std::string bind, int num_workers, uint64_t token, int sum_threads, double timeout_s, bool keep_alive,
           const std::string& role, bool deterministic, bool shm, double join_timeout_s) {
    jbps::ServerOptions o;
    o.bind = std::move(bind);
    o.num_workers = num_workers;
    o.token = token;
    o.sum_threads = sum_threads;
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

// engine_psum_host's body for float32 (the link probe) and int32 values (a
// host broadcast's words: x + 0 is x for integers, whatever their bits mean).
template <typename T, jbps::DType kDType>
double PsumHost(nb::ndarray<T, nb::ndim<1>, nb::c_contig, nb::device::cpu> values, int64_t key, const std::string& name,
                int64_t partition_bytes, std::vector<uint64_t> chunk_bytes, std::vector<uint8_t> chunk_alone,
                std::vector<int32_t> servers, const std::string& tree, int64_t tree_key, double wait_s,
                bool fixed_routes, int64_t priority, uint32_t shard, uint32_t slots) {
  if (partition_bytes < 1) throw std::invalid_argument("engine_psum_host: partition_bytes must be positive");
  const size_t nbytes = values.size() * sizeof(T);
  auto copy = std::make_shared<std::vector<T>>(values.data(), values.data() + values.size());
  jbps::CallSpec spec;
  spec.names = name;
  spec.tree = tree;
  spec.tree_key = static_cast<uint64_t>(tree_key);
  spec.partition_bytes = static_cast<size_t>(partition_bytes);
  spec.chunk_counts = {static_cast<uint32_t>(chunk_bytes.size())};
  spec.chunk_bytes = std::move(chunk_bytes);
  spec.chunk_alone = std::move(chunk_alone);
  spec.servers = std::move(servers);
  spec.fixed_routes = fixed_routes;
  spec.shard = shard;
  spec.slots = slots;
  jbps::Operand op;
  op.in = op.out = copy->data();
  op.nbytes = nbytes;
  op.dtype = kDType;
  op.base_key = static_cast<uint64_t>(key);
  op.priority = priority;
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
}

template <typename T, jbps::DType kDType>
void DefPsumHost(nb::module_& m) {
  m.def("engine_psum_host", &PsumHost<T, kDType>, nb::arg("values"), nb::arg("key"), nb::arg("name"),
        nb::arg("partition_bytes"), nb::arg("chunk_bytes"), nb::arg("chunk_alone"), nb::arg("servers"), nb::arg("tree"),
        nb::arg("tree_key"), nb::arg("wait_s"), nb::arg("fixed_routes") = false, nb::arg("priority") = 0,
        nb::arg("shard") = 0, nb::arg("slots") = 1);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "jbps C++ core: worker engine, summation server, XLA FFI handlers";

  m.def("ffi_targets", [] {
    nb::dict d;
    d["jbps_psum"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsPsumCpu));
    d["jbps_join"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsJoinCpu));
    d["jbps_workers"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsWorkersCpu));
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

  m.def(
      "engine_start",
      [](std::vector<std::string> servers, uint32_t rank, uint32_t num_workers, uint64_t token, int credit,
         double timeout_s, bool trace, bool shm, size_t shm_slot_bytes, bool huge_pages, bool routes_can_change) {
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
        o.routes_can_change = routes_can_change;
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
      nb::arg("shm_slot_bytes") = size_t{4} << 20, nb::arg("huge_pages") = true, nb::arg("routes_can_change") = false);

  m.def(
      "engine_set_dealt_split",
      [](std::vector<double> fractions) {
        std::string err;
        if (!jbps::Engine::Get().SetDealtSplit(fractions, &err)) throw std::invalid_argument("jbps: the split: " + err);
      },
      nb::arg("fractions"));

  m.def(
      "engine_set_routes",
      [](std::vector<double> fractions) {
        std::string err;
        uint32_t epoch;
        {
          nb::gil_scoped_release release;
          epoch = jbps::Engine::Get().SetRoutes(fractions, &err);
        }
        if (epoch == 0) throw std::invalid_argument("jbps: a new split: " + err);
        return epoch;
      },
      nb::arg("fractions"));

  m.def(
      "engine_set_credit",
      [](int credit) {
        std::string err;
        if (!jbps::Engine::Get().SetCredit(credit, &err)) throw std::runtime_error(err);
      },
      nb::arg("credit"));
  // A warm-up's rehearsal of the step (Engine::SetRehearsal): its psums return their operands; 0 ends it.
  m.def(
      "engine_set_rehearsal",
      [](uint32_t workers) {
        std::string err;
        if (!jbps::Engine::Get().SetRehearsal(workers, &err)) throw std::runtime_error(err);
      },
      nb::arg("workers"));
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
  // (jbps/link_rate.py), or of an int32 one (jbps/host_broadcast.py): the sum replaces the values, and the answer is
  // the seconds from submit to sum. The plan's routing, tree and keys come from Python as a jbps_psum call's attributes
  // do (Submit fails a call whose chunk table does not add up); fixed_routes keeps them whatever split the rate
  // follower announced since; priority orders its chunks among the job's (larger is sent sooner); shard and slots make
  // it one device's call of a step (CallSpec::slots). The engine works on its own copy, so a call the backstop gives up
  // on never writes a freed array.
  DefPsumHost<float, jbps::DType::kF32>(m);
  DefPsumHost<int32_t, jbps::DType::kI32>(m);
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
    d["server_bytes_pulled"] = s.server_bytes_pulled;
    d["server_bytes_acked"] = s.server_bytes_acked;
    d["server_chunks_acked"] = s.server_chunks_acked;
    d["server_unacked_seconds"] = s.server_unacked_seconds;
    d["server_shared_memory"] = std::vector<bool>(s.server_shared_memory.begin(), s.server_shared_memory.end());
    d["routes_announced"] = s.routes_announced;
    d["routes_used"] = s.routes_used;
    return d;
  });
  nb::class_<PyServer>(m, "Server")
      .def(nb::init<std::string, int, uint64_t, int, double, bool, const std::string&, bool, bool, double>(),
           nb::arg("bind"), nb::arg("num_workers"), nb::arg("token") = 0, nb::arg("sum_threads") = 0,
           nb::arg("timeout_s") = 60.0, nb::arg("keep_alive") = false, nb::arg("role") = "colocated",
           nb::arg("deterministic") = false, nb::arg("shm") = true, nb::arg("join_timeout_s") = 0.0)
      .def_prop_ro("port", &PyServer::port)
      .def("wait", &PyServer::wait, nb::arg("seconds"))
      .def("stop", &PyServer::stop)
      .def("stats", &PyServer::stats)
      .def("failure", &PyServer::failure);
}
