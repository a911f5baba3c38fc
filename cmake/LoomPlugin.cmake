# loom_add_plugin(NAME <name> KIND <kind> SOURCES <file>... [LINK_LIBRARIES <lib>...]
#                 [OUTPUT_DIRECTORY <dir>])
#
# Builds a Loom plugin: a MODULE library named libloom_<kind>_<name>.so that links the SDK
# (LibTorch and the SDK headers, nothing of the host), compiled with hidden visibility, whose
# only exported symbol is the entry point loom_plugin_entry_v1, and linked with -z defs so an
# unresolved symbol fails the link instead of the load. The same function serves Loom's own
# tree and plugins built out of tree after find_package(LoomSDK).
#
# KIND is one of model, dataset, precision, memory, parallel, optimizer, schedule, callback. OUTPUT_DIRECTORY defaults to
# LOOM_PLUGIN_OUTPUT_DIRECTORY when set (Loom's tree sets it to its plugin folder).
include_guard(GLOBAL)

set(_LOOM_PLUGIN_CMAKE_DIR "${CMAKE_CURRENT_LIST_DIR}")

function(loom_add_plugin)
  cmake_parse_arguments(ARG "" "NAME;KIND;OUTPUT_DIRECTORY" "SOURCES;LINK_LIBRARIES" ${ARGN})
  if(NOT ARG_NAME OR NOT ARG_KIND OR NOT ARG_SOURCES)
    message(FATAL_ERROR "loom_add_plugin: NAME, KIND and SOURCES are required")
  endif()
  set(_kinds model dataset precision memory parallel optimizer schedule callback)
  if(NOT ARG_KIND IN_LIST _kinds)
    message(FATAL_ERROR "loom_add_plugin(${ARG_NAME}): KIND '${ARG_KIND}' is not one of ${_kinds}")
  endif()
  if(NOT ARG_NAME MATCHES "^[a-z][a-z0-9_]*$")
    message(FATAL_ERROR "loom_add_plugin: NAME '${ARG_NAME}' must be lower_snake_case")
  endif()

  set(_target loom_${ARG_KIND}_${ARG_NAME})
  add_library(${_target} MODULE ${ARG_SOURCES})
  target_link_libraries(${_target} PRIVATE loom::sdk ${ARG_LINK_LIBRARIES})
  set_target_properties(${_target} PROPERTIES
    PREFIX "lib"
    OUTPUT_NAME ${_target}
    CXX_VISIBILITY_PRESET hidden
    C_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    LINK_DEPENDS "${_LOOM_PLUGIN_CMAKE_DIR}/loom_plugin.map")
  target_link_options(${_target} PRIVATE
    "LINKER:-z,defs"
    "LINKER:--exclude-libs,ALL"
    "LINKER:--version-script=${_LOOM_PLUGIN_CMAKE_DIR}/loom_plugin.map")
  if(NOT ARG_OUTPUT_DIRECTORY AND LOOM_PLUGIN_OUTPUT_DIRECTORY)
    set(ARG_OUTPUT_DIRECTORY "${LOOM_PLUGIN_OUTPUT_DIRECTORY}")
  endif()
  if(ARG_OUTPUT_DIRECTORY)
    set_target_properties(${_target} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "${ARG_OUTPUT_DIRECTORY}")
  endif()
  set_property(GLOBAL APPEND PROPERTY LOOM_PLUGIN_TARGETS ${_target})
endfunction()
