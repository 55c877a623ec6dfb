# Third-party dependencies. scripts/setup.sh stages them in .deps/; each location is a cache
# variable so a user can point at their own copy (e.g. -DMOE_CUTLASS_DIR=/path/to/cutlass).
set(MOE_DEPS_DIR "${PROJECT_SOURCE_DIR}/.deps" CACHE PATH "Staged third-party dependencies")

# CUTLASS 4.2 / CuTe (header-only). Accepts either a CUTLASS checkout (include/ and
# tools/util/include/) or the layout scripts/setup.sh stages (include/ and util_include/).
set(MOE_CUTLASS_DIR "${MOE_DEPS_DIR}/cutlass" CACHE PATH "CUTLASS root (checkout or staged)")
if(EXISTS "${MOE_CUTLASS_DIR}/tools/util/include")
  set(_moe_cutlass_util "${MOE_CUTLASS_DIR}/tools/util/include")
else()
  set(_moe_cutlass_util "${MOE_CUTLASS_DIR}/util_include")
endif()
if(NOT EXISTS "${MOE_CUTLASS_DIR}/include/cutlass/cutlass.h")
  message(FATAL_ERROR "CUTLASS not found at MOE_CUTLASS_DIR=${MOE_CUTLASS_DIR}: run scripts/setup.sh "
                      "or pass -DMOE_CUTLASS_DIR=<cutlass checkout>")
endif()
add_library(moe_cutlass INTERFACE)
target_include_directories(moe_cutlass SYSTEM INTERFACE "${MOE_CUTLASS_DIR}/include" "${_moe_cutlass_util}")
message(STATUS "moe-engine: CUTLASS from ${MOE_CUTLASS_DIR}")

# Header-only JSON parser (checkpoint library, tool, benchmarks) and CLI parser (tool, benchmarks):
# staged copy first, then the system. Only required by the parts that use them.
if(MOE_BUILD_CHECKPOINT OR MOE_BUILD_TOOLS OR MOE_BUILD_BENCH)
  find_path(MOE_JSON_INCLUDE nlohmann/json.hpp HINTS "${MOE_DEPS_DIR}/include" REQUIRED)
  add_library(moe_json INTERFACE)
  target_include_directories(moe_json SYSTEM INTERFACE "${MOE_JSON_INCLUDE}")
endif()
if(MOE_BUILD_TOOLS OR MOE_BUILD_BENCH)
  find_path(MOE_CLI11_INCLUDE CLI/CLI.hpp HINTS "${MOE_DEPS_DIR}/include" REQUIRED)
  add_library(moe_cli11 INTERFACE)
  target_include_directories(moe_cli11 SYSTEM INTERFACE "${MOE_CLI11_INCLUDE}")
endif()
# zlib compresses the PNG charts of the tool and the benchmarks (bench/support/png_writer.cpp).
if(MOE_BUILD_TOOLS OR MOE_BUILD_BENCH OR MOE_BUILD_TESTS)
  # The system's zlib, else the copy scripts/setup.sh stages in .deps/zlib.
  if(NOT ZLIB_ROOT AND NOT EXISTS /usr/include/zlib.h AND EXISTS "${MOE_DEPS_DIR}/zlib/include/zlib.h")
    set(ZLIB_ROOT "${MOE_DEPS_DIR}/zlib")
  endif()
  find_package(ZLIB REQUIRED)
endif()

# GoogleTest: the staged sources (so a GPU machine without packages can build), else the system.
if(MOE_BUILD_TESTS)
  if(EXISTS "${MOE_DEPS_DIR}/googletest/CMakeLists.txt")
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
    add_subdirectory("${MOE_DEPS_DIR}/googletest" "${CMAKE_BINARY_DIR}/_deps/googletest" EXCLUDE_FROM_ALL)
    if(NOT TARGET GTest::gtest)  # GoogleTest >= 1.11 defines these aliases itself
      add_library(GTest::gtest ALIAS gtest)
      add_library(GTest::gtest_main ALIAS gtest_main)
    endif()
  else()
    find_package(GTest REQUIRED)
  endif()
endif()
