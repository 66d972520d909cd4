# Sources of the jbps C++ extension, relative to the repository root, by
# folder in the order a call travels (xla_ext/README.md). The Bazel build
# (bazel/) reads the same lists; keep them in one place.
set(JBPS_CORE_SOURCES
  # ffi/: XLA:CPU's custom calls, which hand a psum's shards to the engine
  ${CMAKE_CURRENT_LIST_DIR}/ffi/ffi_cpu.cc
  ${CMAKE_CURRENT_LIST_DIR}/ffi/ffi_codecs_cpu.cc
  ${CMAKE_CURRENT_LIST_DIR}/ffi/ffi_casts_cpu.cc
  ${CMAKE_CURRENT_LIST_DIR}/ffi/fresh_output.cc
  # engine/: a worker's chunks, their priority queue, credits and completion
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine_chunking.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine_scheduler.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine_link.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine_calls.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine_siblings.cc
  # wire/ and transport/: the messages, and how their bytes travel (TCP, shared memory)
  ${CMAKE_CURRENT_LIST_DIR}/wire/frame.cc
  ${CMAKE_CURRENT_LIST_DIR}/transport/net.cc
  ${CMAKE_CURRENT_LIST_DIR}/transport/shm.cc
  ${CMAKE_CURRENT_LIST_DIR}/transport/tcp_transport.cc
  ${CMAKE_CURRENT_LIST_DIR}/transport/shm_transport.cc
  # server/: the summation server
  ${CMAKE_CURRENT_LIST_DIR}/server/server.cc
  ${CMAKE_CURRENT_LIST_DIR}/server/server_admission.cc
  ${CMAKE_CURRENT_LIST_DIR}/server/server_connection.cc
  ${CMAKE_CURRENT_LIST_DIR}/server/server_rounds.cc
  ${CMAKE_CURRENT_LIST_DIR}/server/server_trees.cc
  ${CMAKE_CURRENT_LIST_DIR}/server/server_memory.cc
  # codecs/, kernels/, common/: what both sides compute with
  ${CMAKE_CURRENT_LIST_DIR}/codecs/onebit.cc
  ${CMAKE_CURRENT_LIST_DIR}/codecs/topk.cc
  ${CMAKE_CURRENT_LIST_DIR}/kernels/sum_kernels.cc
  ${CMAKE_CURRENT_LIST_DIR}/kernels/stream_copy.cc
  ${CMAKE_CURRENT_LIST_DIR}/common/dtype.cc
)
# python/: the extension module jbps._core (nanobind)
set(JBPS_MODULE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/python/module.cc
)
# python/testing_module.cc: jbps_testing, the tests' hooks into the C++ (CMake
# option JBPS_BUILD_TESTING; never in the wheel), with the few sources it needs.
set(JBPS_TESTING_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/python/testing_module.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine/engine_chunking.cc
  ${CMAKE_CURRENT_LIST_DIR}/kernels/sum_kernels.cc
  ${CMAKE_CURRENT_LIST_DIR}/kernels/stream_copy.cc
  ${CMAKE_CURRENT_LIST_DIR}/common/dtype.cc
)
# cuda/: the CUDA FFI handler, built only when the CUDA toolkit is found
# (JBPS_CUDA); compiled with the CUDA runtime headers and linked with cudart_static.
set(JBPS_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/cuda/ffi_cuda.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda/cuda_staging.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda/cuda_stream_wait.cc
)
# The staging benchmark's plain pinned copies, for jbps_testing built with CUDA.
set(JBPS_CUDA_TESTING_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/cuda/cuda_copy_bench.cc
)
