// jbps._core: the Python face of the C++ engine, server and FFI handler.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>

#include "engine.h"
#include "ffi_cpu.h"
#ifdef JBPS_HAVE_CUDA
#include "cuda_copy_bench.h"
#include "ffi_cuda.h"
#endif
#include "server.h"
#include "sum_kernels.h"

namespace nb = nanobind;

namespace {

nb::capsule FfiCapsule(void* fn) { return nb::capsule(fn); }

class PyServer {
 public:
  PyServer(std::string bind, int num_workers, uint64_t token, int engine_threads, double timeout_s,
           bool keep_alive, const std::string& role, bool deterministic, bool shm) {
    jbps::ServerOptions o;
    o.bind = std::move(bind);
    o.num_workers = num_workers;
    o.token = token;
    o.engine_threads = engine_threads;
    o.timeout_s = timeout_s;
    o.keep_alive = keep_alive;
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

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "jbps C++ core: worker engine, summation server, XLA FFI handlers";

  m.def("ffi_targets", [] {
    nb::dict d;
    d["jbps_psum"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsPsumCpu));
    return d;
  });
  // The same target for platform "CUDA"; empty when built without CUDA.
  m.def("ffi_targets_cuda", [] {
    nb::dict d;
#ifdef JBPS_HAVE_CUDA
    d["jbps_psum"] = FfiCapsule(reinterpret_cast<void*>(jbps::JbpsPsumCuda));
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
      [](std::vector<std::string> servers, uint32_t rank, uint32_t num_workers, uint64_t token,
         int credit, double timeout_s, bool trace, bool shm, size_t shm_slot_bytes) {
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
      nb::arg("shm_slot_bytes") = size_t{4} << 20);

  m.def("engine_stop", [] {
    nb::gil_scoped_release release;
    jbps::Engine::Get().Stop();
  });
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
      out.append(nb::make_tuple(r.tensor, r.key, r.round, r.shard, r.server, r.priority, r.nbytes,
                                r.times.queued, r.times.sent_start, r.times.acked, r.times.sum_arrived,
                                r.times.pulled));
    return out;
  });
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
    return d;
  });
  // The server's f32 add kernel on numpy arrays, for the benchmark (acc += src).
  m.def(
      "accumulate_f32",
      [](nb::ndarray<float, nb::c_contig, nb::device::cpu> acc, nb::ndarray<const float, nb::c_contig, nb::device::cpu> src) {
        if (acc.size() != src.size()) throw std::invalid_argument("acc and src differ in size");
        nb::gil_scoped_release release;
        jbps::AccumulatorAdd(jbps::DType::kF32, acc.data(), src.data(), acc.size());
      },
      nb::arg("acc"), nb::arg("src"));
  m.def("chunk_key", &jbps::ChunkKey, nb::arg("base_key"), nb::arg("shard"), nb::arg("chunk"));

  nb::class_<PyServer>(m, "Server")
      .def(nb::init<std::string, int, uint64_t, int, double, bool, const std::string&, bool, bool>(), nb::arg("bind"),
           nb::arg("num_workers"), nb::arg("token") = 0, nb::arg("engine_threads") = 0, nb::arg("timeout_s") = 60.0,
           nb::arg("keep_alive") = false, nb::arg("role") = "colocated", nb::arg("deterministic") = false,
           nb::arg("shm") = true)
      .def_prop_ro("port", &PyServer::port)
      .def("wait", &PyServer::wait, nb::arg("seconds"))
      .def("stop", &PyServer::stop)
      .def("stats", &PyServer::stats)
      .def("failure", &PyServer::failure);
}
