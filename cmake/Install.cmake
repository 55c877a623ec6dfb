# Installation and the CMake package: `cmake --install build --prefix P` puts the static libraries
# in P/lib, the public headers in P/include/moe, the moe-engine tool in P/bin and a package config
# in P/lib/cmake/moe_engine, so that another project can write
#
#   find_package(moe_engine CONFIG REQUIRED)      # with -DCMAKE_PREFIX_PATH=P
#   target_link_libraries(app PRIVATE moe_engine::moe_engine)
#
# moe_engine::moe_engine is the whole library (every static library below, linked in dependency
# order); it carries CUDA::cudart, which the package config finds with find_dependency(CUDAToolkit).
include(CMakePackageConfigHelpers)

set(MOE_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/moe_engine" CACHE STRING
    "Where the moe_engine package config is installed, relative to the prefix")

install(TARGETS ${MOE_LIBRARIES} moe_engine EXPORT moe_engineTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")

# Public headers; those of the checkpoint library only when it is built.
set(_moe_checkpoint_headers checkpoint.h checkpoint_convert.h checkpoint_fp8.h checkpoint_hf.h checkpoint_hf_fp8.h
                            checkpoint_quant.h safetensors.h safetensors_index.h state_dict.h)
set(_moe_header_excludes "")
if(NOT TARGET moe_checkpoint)
  foreach(h ${_moe_checkpoint_headers})
    list(APPEND _moe_header_excludes PATTERN "${h}" EXCLUDE)
  endforeach()
endif()
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/moe" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.h" ${_moe_header_excludes})

install(EXPORT moe_engineTargets NAMESPACE moe_engine:: DESTINATION "${MOE_INSTALL_CMAKEDIR}")
configure_package_config_file("${CMAKE_CURRENT_LIST_DIR}/moe_engineConfig.cmake.in"
                              "${PROJECT_BINARY_DIR}/moe_engineConfig.cmake"
                              INSTALL_DESTINATION "${MOE_INSTALL_CMAKEDIR}")
# 0.x releases: only the same minor version is compatible.
write_basic_package_version_file("${PROJECT_BINARY_DIR}/moe_engineConfigVersion.cmake"
                                 VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/moe_engineConfig.cmake" "${PROJECT_BINARY_DIR}/moe_engineConfigVersion.cmake"
        DESTINATION "${MOE_INSTALL_CMAKEDIR}")
