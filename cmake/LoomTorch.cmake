# Finds LibTorch and defines the imported target loom::torch (LibTorch plus what Loom needs on
# top of it). Used by Loom's own build and, installed, by LoomSDKConfig.cmake.
#
# Where LibTorch comes from, in order:
#   1. Torch_DIR, or a LibTorch on CMAKE_PREFIX_PATH (a CUDA or CPU LibTorch, a torch wheel's
#      share/cmake folder, ...);
#   2. the Python interpreter LOOM_PYTHON (cache variable or environment) or the venv LOOM_VENV:
#      torch.utils.cmake_prefix_path;
#   3. installed, for a plugin built out of tree: the LibTorch the SDK was built with, where it
#      still is (LOOM_SDK_TORCH_DIR, set by LoomSDKConfig.cmake);
#   4. python3's torch.
#
# A CUDA build of LibTorch needs the CUDA toolkit at configure time even on a machine without a
# GPU; see Note [CUDA LibTorch without a GPU] below.
include_guard(GLOBAL)

macro(loom_find_torch)
  if(NOT TARGET loom::torch)
    _loom_locate_torch()

    # Note [CUDA LibTorch without a GPU]
    # TorchConfig of a CUDA build enables the CUDA language with CMAKE_CUDA_STANDARD set to the
    # C++ standard when it is unset, and CMake 3.25 knows no CUDA20 flags for nvcc; and with no
    # TORCH_CUDA_ARCH_LIST it runs a program to ask the GPU for its architecture. Loom compiles
    # no CUDA sources, so pin both to harmless values unless the user set them.
    if(NOT DEFINED CMAKE_CUDA_STANDARD)
      set(CMAKE_CUDA_STANDARD 17)
    endif()
    if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
      set(TORCH_CUDA_ARCH_LIST "8.0;9.0")
    endif()
    find_package(Torch REQUIRED CONFIG)

    add_library(loom::torch INTERFACE IMPORTED GLOBAL)
    # Note [libstdc++ first]
    # Some torch wheels export copies of libstdc++'s std::filesystem functions without symbol
    # versions (torch 2.11's libtorch.so; 2.15's libtorch_cpu.so). A binary whose references the
    # linker bound to such a copy carries unversioned references, and the dynamic linker then
    # prefers an unversioned definition to libstdc++'s versioned one wherever libstdc++ sits in
    # the load order: torch 2.11's remove_all calls through a null pointer, which crashed every
    # run that pruned a checkpoint, cleaned a work folder or ended a test on the H200 (and the
    # H100 before it). So libstdc++ is named on the link line after the binary's objects and
    # before LibTorch, for every binary that links LibTorch (executables, plugins, the SDK's
    # users): its versioned symbols bind first. An earlier form, a link *option* (placed before
    # the objects), passed here but not on the GPU machine's Ubuntu toolchain.
    # tests/unit/sdk/link_order_test.cpp checks the result; `loom doctor` shows it.
    target_link_libraries(loom::torch INTERFACE "-Wl,--push-state,--no-as-needed,-lstdc++,--pop-state" torch)
    if(TORCH_CUDA_LIBRARIES)
      set(LOOM_TORCH_CUDA 1)
    else()
      set(LOOM_TORCH_CUDA 0)
    endif()
    target_compile_definitions(loom::torch INTERFACE LOOM_TORCH_CUDA=${LOOM_TORCH_CUDA})
    _loom_torch_build_info()
    target_compile_definitions(loom::torch INTERFACE
      "LOOM_TORCH_BUILD=\"${LOOM_TORCH_BUILD}\"" "LOOM_TORCH_GIT=\"${LOOM_TORCH_GIT}\""
      "LOOM_TORCH_CUDA_VERSION=\"${LOOM_TORCH_CUDA_VERSION}\"")

    # A torch wheel keeps the CUDA libraries its libtorch_cuda.so needs (NCCL, cuDNN, cudart)
    # in site-packages/nvidia/*/lib and finds them at run time through its own RUNPATH. The
    # linker does not look there before the system's CUDA toolkit, whose older NCCL lacks
    # symbols the wheel needs: point it at the wheel's folders first.
    get_filename_component(_loom_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
    file(GLOB _loom_nvidia_lib_dirs LIST_DIRECTORIES true "${_loom_torch_lib_dir}/../../nvidia/*/lib")
    if(_loom_nvidia_lib_dirs)
      list(JOIN _loom_nvidia_lib_dirs ":" _loom_rpath_link)
      target_link_options(loom::torch INTERFACE "LINKER:-rpath-link,${_loom_rpath_link}")
    endif()
    message(STATUS "Loom: LibTorch ${LOOM_TORCH_BUILD} (${_loom_torch_lib_dir}), commit ${LOOM_TORCH_GIT}, CUDA: ${LOOM_TORCH_CUDA_VERSION}; "
                   "binaries built here, installed or not, load it from there (their RUNPATH)")
  endif()
endmacro()

macro(_loom_locate_torch)
  if(NOT Torch_DIR)
    find_path(_loom_torch_config_dir TorchConfig.cmake
      PATH_SUFFIXES share/cmake/Torch Torch lib/cmake/Torch
      NO_CACHE)
    if(NOT _loom_torch_config_dir)
      if(NOT LOOM_PYTHON)
        if(DEFINED ENV{LOOM_PYTHON})
          set(LOOM_PYTHON "$ENV{LOOM_PYTHON}")
        elseif(DEFINED ENV{LOOM_VENV} AND EXISTS "$ENV{LOOM_VENV}/bin/python")
          set(LOOM_PYTHON "$ENV{LOOM_VENV}/bin/python")
        elseif(LOOM_SDK_TORCH_DIR AND EXISTS "${LOOM_SDK_TORCH_DIR}/TorchConfig.cmake")
          set(Torch_DIR "${LOOM_SDK_TORCH_DIR}")
          message(STATUS "Loom: the LibTorch this SDK was built with (${LOOM_SDK_TORCH_DIR}); "
                         "CMAKE_PREFIX_PATH, Torch_DIR or LOOM_PYTHON choose another")
        else()
          set(LOOM_PYTHON python3)
        endif()
      endif()
      if(NOT Torch_DIR)  # (else the SDK's own, above)
        execute_process(
          COMMAND "${LOOM_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
          OUTPUT_VARIABLE _loom_torch_prefix
          OUTPUT_STRIP_TRAILING_WHITESPACE
          RESULT_VARIABLE _loom_python_result
          ERROR_QUIET)
        if(NOT _loom_python_result EQUAL 0 OR NOT _loom_torch_prefix)
          message(FATAL_ERROR
            "Loom: no LibTorch found. Either put one on CMAKE_PREFIX_PATH (or set Torch_DIR), "
            "or set LOOM_PYTHON to a Python that has torch installed "
            "(tried '${LOOM_PYTHON}'). scripts/setup.sh makes such a venv.")
        endif()
        list(APPEND CMAKE_PREFIX_PATH "${_loom_torch_prefix}")
      endif()
    endif()
  endif()
endmacro()

# Which build of LibTorch this is, for the build fingerprint (sdk/include/loom/sdk/fingerprint.hpp):
# LOOM_TORCH_BUILD, the full version with its local part ("2.15.0+cu132": a nightly or a custom
# build is not the release of the same number), LOOM_TORCH_GIT, the commit, and
# LOOM_TORCH_CUDA_VERSION ("13.2", "none" for a CPU build). A wheel says them in torch/version.py,
# a LibTorch archive in build-version and build-hash; what neither says is "unknown".
macro(_loom_torch_build_info)
  set(LOOM_TORCH_BUILD "${Torch_VERSION}")
  set(LOOM_TORCH_GIT "unknown")
  if(LOOM_TORCH_CUDA)
    set(LOOM_TORCH_CUDA_VERSION "unknown")
  else()
    set(LOOM_TORCH_CUDA_VERSION "none")
  endif()
  if(EXISTS "${TORCH_INSTALL_PREFIX}/version.py")
    file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _loom_torch_version_py)
    foreach(_line IN LISTS _loom_torch_version_py)
      if(_line MATCHES "^__version__ = '([^']+)'")
        set(LOOM_TORCH_BUILD "${CMAKE_MATCH_1}")
      elseif(_line MATCHES "^git_version = '([0-9a-f]+)'")
        set(LOOM_TORCH_GIT "${CMAKE_MATCH_1}")
      elseif(_line MATCHES "^cuda(: [^=]+)? = '([0-9.]+)'")
        set(LOOM_TORCH_CUDA_VERSION "${CMAKE_MATCH_2}")
      endif()
    endforeach()
  else()
    if(EXISTS "${TORCH_INSTALL_PREFIX}/build-version")
      file(STRINGS "${TORCH_INSTALL_PREFIX}/build-version" LOOM_TORCH_BUILD LIMIT_COUNT 1)
      if(LOOM_TORCH_CUDA AND LOOM_TORCH_BUILD MATCHES "\\+cu([0-9]+)([0-9])$")
        set(LOOM_TORCH_CUDA_VERSION "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
      endif()
    endif()
    if(EXISTS "${TORCH_INSTALL_PREFIX}/build-hash")
      file(STRINGS "${TORCH_INSTALL_PREFIX}/build-hash" LOOM_TORCH_GIT LIMIT_COUNT 1)
    endif()
  endif()
endmacro()
