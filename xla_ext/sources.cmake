# Sources of the jbps C++ extension, relative to the repository root.
# The Bazel build (bazel/) reads the same lists; keep them in one place.
set(JBPS_CORE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/dtype.cc
  ${CMAKE_CURRENT_LIST_DIR}/sum_kernels.cc
  ${CMAKE_CURRENT_LIST_DIR}/onebit.cc
  ${CMAKE_CURRENT_LIST_DIR}/topk.cc
  ${CMAKE_CURRENT_LIST_DIR}/net.cc
  ${CMAKE_CURRENT_LIST_DIR}/frame.cc
  ${CMAKE_CURRENT_LIST_DIR}/shm.cc
  ${CMAKE_CURRENT_LIST_DIR}/stream_copy.cc
  ${CMAKE_CURRENT_LIST_DIR}/fresh_output.cc
  ${CMAKE_CURRENT_LIST_DIR}/server.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_admission.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_connection.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_rounds.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_trees.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_memory.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_chunking.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_scheduler.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_link.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_calls.cc
  ${CMAKE_CURRENT_LIST_DIR}/ffi_cpu.cc
  ${CMAKE_CURRENT_LIST_DIR}/ffi_codecs_cpu.cc
  ${CMAKE_CURRENT_LIST_DIR}/ffi_casts_cpu.cc
)
set(JBPS_MODULE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/module.cc
)
# The CUDA FFI handler, built only when the CUDA toolkit is found (JBPS_CUDA);
# compiled with the CUDA runtime headers and linked with cudart_static.
set(JBPS_CUDA_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/ffi_cuda.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_staging.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_stream_wait.cc
  ${CMAKE_CURRENT_LIST_DIR}/cuda_copy_bench.cc
)
