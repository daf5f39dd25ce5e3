# The CUDA module _xla_ext_cuda (included by xla_ext/CMakeLists.txt once a CUDA compiler is
# found). Hopper (sm_90) machine code plus its PTX, which the driver JIT-compiles for later GPUs.
# The kernels (.cu, nvcc) are a static library; the handlers and the nanobind module are host C++
# (no XLA FFI templates go through nvcc) linked with the static CUDA runtime, so importing the
# module needs the driver (libcuda) only, which jax's GPU backend has loaded already.
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
message(STATUS "CUDA handlers: ${CMAKE_CUDA_COMPILER} ${CMAKE_CUDA_COMPILER_VERSION}, "
               "architectures ${CMAKE_CUDA_ARCHITECTURES}")

set(XLA_EXT_CUDA_KERNELS
  ${CMAKE_CURRENT_LIST_DIR}/packed_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/reduce_kernels.cu
  ${CMAKE_CURRENT_LIST_DIR}/fingerprint.cu
)
set(XLA_EXT_CUDA_MODULE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/module.cc
  ${CMAKE_CURRENT_LIST_DIR}/handlers.cc
  ${CMAKE_CURRENT_LIST_DIR}/../handler_checks.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_api.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_comms.cc
  ${CMAKE_CURRENT_LIST_DIR}/nccl_handlers.cc
)

add_library(xla_ext_cuda_kernels STATIC ${XLA_EXT_CUDA_KERNELS})
target_include_directories(xla_ext_cuda_kernels PUBLIC ${CMAKE_CURRENT_LIST_DIR}/..
                                                       ${CMAKE_CURRENT_LIST_DIR})
# No FMA contraction, like the CPU kernels (-ffp-contract=off): the results agree bit for bit.
target_compile_options(xla_ext_cuda_kernels PRIVATE --fmad=false
                       "SHELL:-Xcompiler -Wall,-Wextra,-Werror" -Werror=all-warnings)
set_target_properties(xla_ext_cuda_kernels PROPERTIES POSITION_INDEPENDENT_CODE ON)

nanobind_add_module(_xla_ext_cuda NB_STATIC ${XLA_EXT_CUDA_MODULE_SOURCES})
target_include_directories(_xla_ext_cuda SYSTEM PRIVATE ${XLA_FFI_INCLUDE_DIR})
target_compile_definitions(_xla_ext_cuda PRIVATE TRAINSPEC_JAXLIB_VERSION="${JAXLIB_VERSION}")
target_compile_options(_xla_ext_cuda PRIVATE ${XLA_EXT_WARNINGS})
target_link_libraries(_xla_ext_cuda PRIVATE xla_ext_cuda_kernels CUDA::cudart_static
                      ${CMAKE_DL_LIBS})
# NCCL is loaded at run time (nccl_api.h); its header, where the nvidia-nccl wheel in the building
# environment ships one, only checks our declarations against NCCL's at compile time.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import importlib.metadata as m; d = m.distribution('nvidia-nccl-cu13'); print(d.locate_file('nvidia/nccl/include'))"
  OUTPUT_VARIABLE NCCL_INCLUDE_DIR OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  message(STATUS "NCCL declarations checked against ${NCCL_INCLUDE_DIR}/nccl.h")
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/nccl_api.cc PROPERTIES
    COMPILE_DEFINITIONS TRAINSPEC_HAVE_NCCL_H INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()

install(TARGETS _xla_ext_cuda LIBRARY DESTINATION trainspec/jax)
