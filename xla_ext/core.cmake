# xla_ext_core: the collectives and their kernels on plain buffers (no XLA, no Python), linked
# into the nanobind module (CMakeLists.txt here) and into the C++ harness (tests/cxx/).
set(XLA_EXT_CORE_SOURCES
  ${CMAKE_CURRENT_LIST_DIR}/rendezvous.cc
  ${CMAKE_CURRENT_LIST_DIR}/thread_wait.cc
  ${CMAKE_CURRENT_LIST_DIR}/reduce_kernels.cc
  ${CMAKE_CURRENT_LIST_DIR}/output_pages.cc
  ${CMAKE_CURRENT_LIST_DIR}/collective_policies.cc
  ${CMAKE_CURRENT_LIST_DIR}/collective_ops.cc
  ${CMAKE_CURRENT_LIST_DIR}/packed_kernels.cc
)
# Our own sources build warning-free; third-party headers (nanobind, XLA FFI) are included as
# SYSTEM so their warnings do not count.
set(XLA_EXT_WARNINGS -Wall -Wextra -Werror)

add_library(xla_ext_core STATIC ${XLA_EXT_CORE_SOURCES})
target_include_directories(xla_ext_core PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_compile_options(xla_ext_core PRIVATE ${XLA_EXT_WARNINGS})
set_target_properties(xla_ext_core PROPERTIES POSITION_INDEPENDENT_CODE ON)
# The reduction kernels are compiled for several ISAs and must give bitwise identical results:
# no contraction of a multiply and an add into an FMA in any of them (reduce_kernels.h).
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/reduce_kernels.cc PROPERTIES
  COMPILE_OPTIONS "-ffp-contract=off;-Wno-psabi")
find_package(Threads REQUIRED)
target_link_libraries(xla_ext_core PUBLIC Threads::Threads)
# The packed-buffer kernels of collectives.compression must round like the jnp kernels they
# match bit for bit (no FMA contraction); -O3, whatever the build type, vectorizes their loops.
set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/packed_kernels.cc PROPERTIES
  COMPILE_OPTIONS "-ffp-contract=off;-O3")
