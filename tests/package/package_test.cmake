# Driver of the package tests (cmake -P). Modes:
#   install  install the build tree BUILD_TREE into a fresh PREFIX (`cmake --install`: copies what
#            is built; compiles nothing)
#   build    configure SOURCE into BINARY against PREFIX (find_package(moe_engine)) and build it;
#            with RUN set, also run the program RUN from BINARY
cmake_minimum_required(VERSION 3.25)

if(MODE STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_TREE}" --prefix "${PREFIX}"
                  OUTPUT_QUIET COMMAND_ERROR_IS_FATAL ANY)
  foreach(f lib/cmake/moe_engine/moe_engineConfig.cmake lib/cmake/moe_engine/moe_engineConfigVersion.cmake
            include/moe/grouped_mlp.h)
    if(NOT EXISTS "${PREFIX}/${f}")
      message(FATAL_ERROR "install: ${PREFIX}/${f} is missing")
    endif()
  endforeach()
  message(STATUS "installed into ${PREFIX}")
elseif(MODE STREQUAL "build")
  file(REMOVE_RECURSE "${BINARY}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${BINARY}" -G "${GENERATOR}"
                          "-DCMAKE_PREFIX_PATH=${PREFIX}" "-DCMAKE_CXX_COMPILER=${CXX}"
                          "-DCMAKE_BUILD_TYPE=Release"
                  COMMAND_ERROR_IS_FATAL ANY)
  execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BINARY}" COMMAND_ERROR_IS_FATAL ANY)
  if(RUN)
    execute_process(COMMAND "${BINARY}/${RUN}" COMMAND_ERROR_IS_FATAL ANY)
  endif()
else()
  message(FATAL_ERROR "package_test.cmake: MODE must be install or build, got '${MODE}'")
endif()
